"""Tests for tfmulti.data: digits offline, TFDS copies, clear errors."""

import errno
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from tests.data import tfds_store
from tests.helpers import REPO
from tfmulti import data
from tfmulti import digits
from tfmulti import errors
from tfmulti import layouts
from tfmulti import rows


def _labels(dataset):
  return np.concatenate([y.numpy() for _, y in dataset])


def test_digits_is_real_and_offline(digits_dir):
  loaded = data.load('digits', global_batch_size=100, data_dir=digits_dir)
  assert (loaded.train_examples, loaded.test_examples) == (1437, 360)
  assert loaded.input_shape == (28, 28, 1)
  assert loaded.num_classes == 10
  images, labels = next(iter(loaded.train_epoch(0)))
  assert images.shape == (100, 28, 28, 1)
  # Float pixels in [0, 255], as Keras's loaders give them.
  assert 0.0 <= float(np.min(images)) and float(np.max(images)) == 255.0
  # The 24x24 digit sits in a 2-pixel frame of background, as in MNIST.
  assert float(np.max(images[:, :2])) == 0.0
  test_labels = _labels(loaded.test)
  assert len(test_labels) == 360  # The short last batch is kept.
  assert np.bincount(test_labels).min() >= 35  # Stratified: ~36 per class.


@pytest.mark.slow
def test_train_batches_are_full_and_shuffled_by_seed_and_epoch(digits_dir):
  def first_labels(seed, epoch=0):
    loaded = data.load('digits', global_batch_size=64, data_dir=digits_dir,
                       seed=seed)
    batches = list(loaded.train_epoch(epoch))
    assert len(batches) == 1437 // 64  # drop_remainder=True.
    assert {int(x.shape[0]) for x, _ in batches} == {64}
    return batches[0][1].numpy()
  np.testing.assert_array_equal(first_labels(1), first_labels(1))
  assert not np.array_equal(first_labels(1), first_labels(2))
  assert not np.array_equal(first_labels(1, epoch=0), first_labels(1, 1))


def test_an_epoch_resumes_after_the_batches_trained_on(digits_dir):
  loaded = data.load('digits', global_batch_size=64, data_dir=digits_dir,
                     seed=3)
  whole = [y.numpy() for _, y in loaded.train_epoch(2)]
  rest = [y.numpy() for _, y in loaded.train_epoch(2, skip_batches=5)]
  assert len(rest) == len(whole) - 5
  np.testing.assert_array_equal(np.concatenate(whole[5:]),
                                np.concatenate(rest))


@pytest.mark.parametrize('name, shape', [
    ('mnist', (28, 28, 1)), ('fashion_mnist', (28, 28, 1)),
    ('cifar10', (32, 32, 3))])
def test_downloadable_datasets_through_tfds(tmp_path, name, shape):
  """TFDS's own builders read a copy prepared in data_dir (written here
  with their features, 24 and 8 rows)."""
  builder = tfds.builder(name)
  tfds_store.store(name, tmp_path, features=builder.info.features,
                   version=builder.version, rows={'train': 24, 'test': 8})
  loaded = data.load(name, global_batch_size=8, data_dir=str(tmp_path))
  images, labels = next(iter(loaded.train_epoch(0)))
  assert loaded.input_shape == shape and loaded.num_classes == 10
  assert (loaded.train_examples, loaded.test_examples) == (24, 8)
  assert images.shape == (8, *shape) and images.dtype == np.float32
  assert float(np.max(images)) <= 255.0
  assert labels.dtype == np.int32


def test_unprepared_dataset_without_network_fails_fast(tmp_path, monkeypatch):
  probed = []

  def unreachable(address, timeout):
    probed.append((address, timeout))
    raise OSError('network is unreachable (made so by the test)')
  # The probe fails here whatever this machine's network: nothing leaves it.
  monkeypatch.setattr(socket, 'create_connection', unreachable)
  with pytest.raises(errors.DatasetUnavailableError,
                     match=r"'mnist' is not prepared.*made so by the "
                     r'test.*tfds build mnist'):
    data.load('mnist', global_batch_size=8, data_dir=str(tmp_path))
  # One short probe of the download server, not TFDS's minutes of retries.
  assert len(probed) == 1 and probed[0][1] <= 5


def test_synthetic_is_one_batch_repeated():
  loaded = data.load('synthetic', global_batch_size=512)
  batches = list(loaded.train_epoch(0))
  assert len(batches) == data.SYNTHETIC_TRAIN_EXAMPLES // 512
  assert len(list(loaded.train_epoch(1, skip_batches=3))) == len(batches) - 3
  np.testing.assert_array_equal(batches[0][0], batches[-1][0])
  assert batches[0][0].shape == (512, *data.SYNTHETIC_SHAPE)


def test_unknown_dataset():
  with pytest.raises(errors.ConfigError, match="dataset='imagenet'.*digits"):
    data.load('imagenet', global_batch_size=8)


def test_batch_larger_than_the_data(digits_dir):
  with pytest.raises(errors.ConfigError, match='global batch of 2048'):
    data.load('digits', global_batch_size=2048, data_dir=digits_dir)


def test_a_dataset_that_cannot_be_prepared_says_so(tmp_path, monkeypatch):
  def disk_full(self, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(digits.Digits, 'download_and_prepare', disk_full)
  with pytest.raises(errors.DatasetUnavailableError,
                     match=r"'digits' cannot be prepared in .* \(No space "
                     'left on device\\); free some space or pass another '
                     '--data_dir'):
    data.load('digits', global_batch_size=8, data_dir=str(tmp_path))


_PREPARE = (
    'import sys; from tfmulti import data; '
    "loaded = data.load('digits', global_batch_size=8, data_dir=sys.argv[1]); "
    'print(loaded.train_examples)')


@pytest.mark.slow
def test_workers_starting_together_prepare_a_dataset_once(tmp_path):
  """Two processes (a job's workers, started together) on one empty
  data_dir: the first prepares digits, the other waits and reads it."""
  starts = [subprocess.Popen(
      [sys.executable, '-c', _PREPARE, str(tmp_path)], cwd=REPO,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
  for start in starts:
    out, err = start.communicate(timeout=240)
    assert start.returncode == 0, err[-2000:]
    assert out.split()[-1] == str(1797 - digits.TEST_EXAMPLES)  # TFDS talks.


@pytest.mark.slow
@pytest.mark.parametrize('num_workers, shards_per_worker', [(2, 1), (4, 2)])
def test_workers_read_every_row_of_an_epoch_once_between_them(
    digits_dir, num_workers, shards_per_worker):
  """The exact mode of multi-worker input: every worker reads the same
  pipeline and takes its block of each global batch, so in an epoch the
  workers train, between them, exactly the rows one process trains (its
  whole batches), none twice; each worker's block is consecutive."""
  loaded = data.load('digits', global_batch_size=64, data_dir=digits_dir,
                     seed=3)

  def rows_of(dataset):
    return [image.numpy().tobytes() for images, _ in dataset
            for image in images]
  one_process = rows_of(loaded.train_epoch(1))
  assert len(one_process) == loaded.train_examples // 64 * 64
  per_worker = [rows_of(rows.worker_shards(
      loaded.train_epoch(1), worker=w, num_workers=num_workers,
      shards_per_worker=shards_per_worker)) for w in range(num_workers)]
  block = 64 // num_workers
  rebuilt = [row for step in range(len(one_process) // 64)
             for w in range(num_workers)
             for row in per_worker[w][step * block:(step + 1) * block]]
  assert rebuilt == one_process


@pytest.mark.slow
def test_workers_with_parts_of_their_own_read_every_row_once(digits_dir):
  """48-row global batches on 5 workers, in atoms of 4 (an elastic start):
  each worker takes its part of each, in worker order, and together they
  read what one process reads."""
  loaded = data.load('digits', global_batch_size=48, data_dir=digits_dir,
                     seed=3)
  parts = layouts.worker_parts(48, 5, 4)

  def batches(dataset):
    return [images.numpy() for images, _ in dataset]
  one_process = batches(loaded.train_epoch(0))
  per_worker = [batches(rows.worker_shards(
      loaded.train_epoch(0), worker=w, num_workers=5, shards_per_worker=1,
      parts=parts)) for w in range(5)]
  for step, whole in enumerate(one_process):
    assert [len(per_worker[w][step]) for w in range(5)] == list(parts)
    np.testing.assert_array_equal(
        np.concatenate([per_worker[w][step] for w in range(5)]), whole)


def test_an_image_size_resizes_every_image(digits_dir):
  loaded = data.load('digits', global_batch_size=8, data_dir=digits_dir,
                     options=data.InputOptions(image_size=(16, 12)))
  assert loaded.input_shape == (16, 12, 1)
  images, _ = next(iter(loaded.train_epoch(0)))
  test_images, _ = next(iter(loaded.test))
  assert images.shape == (8, 16, 12, 1) and test_images.shape[1:] == (
      16, 12, 1)
  assert 0.0 <= float(np.min(images)) and float(np.max(images)) <= 255.0
  synthetic = data.load('synthetic', global_batch_size=8,
                        options=data.InputOptions(image_size=(8, 8)))
  assert synthetic.input_shape == (8, 8, 3)
