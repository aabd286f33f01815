"""Tests for `--dataset=tfds:NAME`: any TFDS image classification dataset
prepared in data_dir (written here), its splits and clear refusals."""

import json
import re
import socket

import numpy as np
import pytest
import tensorflow_datasets as tfds

from tests.data import tfds_store
from tfmulti import data
from tfmulti import errors

_SHAPES = tfds.features.FeaturesDict({
    'picture': tfds.features.Image(shape=(8, 8, 3)),
    'kind': tfds.features.ClassLabel(num_classes=3)})


@pytest.fixture(autouse=True)
def offline(monkeypatch):
  """Nothing leaves the machine: a download attempt fails the test."""
  def no_network(*args, **kwargs):
    raise AssertionError('a test reached for the network')
  monkeypatch.setattr(socket, 'create_connection', no_network)
  monkeypatch.setattr(socket, 'getaddrinfo', no_network)


def test_a_dataset_of_its_own_name_trains_from_data_dir(tmp_path):
  tfds_store.store('tiny_shapes', tmp_path, features=_SHAPES,
                   rows={'train': 30, 'validation': 9})
  loaded = data.load('tfds:tiny_shapes', global_batch_size=6,
                     data_dir=str(tmp_path))
  assert (loaded.input_shape, loaded.num_classes) == ((8, 8, 3), 3)
  # No test split: evaluation reads `validation`.
  assert (loaded.train_examples, loaded.test_examples) == (30, 9)
  labels = np.concatenate([y for _, y in loaded.train_epoch(0)])
  assert sorted(np.bincount(labels)) == [10, 10, 10]


def test_a_train_split_alone_holds_out_its_last_share(tmp_path):
  tfds_store.store('train_only', tmp_path, features=_SHAPES,
                   rows={'train': 40})
  loaded = data.load('tfds:train_only', global_batch_size=4,
                     data_dir=str(tmp_path),
                     options=data.InputOptions(validation_fraction=0.25))
  assert (loaded.train_examples, loaded.test_examples) == (30, 10)


def test_a_dataset_without_an_image_and_a_class_label_is_refused(tmp_path):
  features = tfds.features.FeaturesDict({
      'picture': tfds.features.Image(shape=(8, 8, 3)),
      'score': tfds.features.Tensor(shape=(), dtype=np.float32)})
  tfds_store.store('regression', tmp_path, features=features,
                   rows={'train': 4})
  with pytest.raises(errors.ConfigError, match=r'tfds:regression: its '
                     r'features .* hold no \(image, class label\) pair'):
    data.load('tfds:regression', global_batch_size=2, data_dir=str(tmp_path))


def test_an_unknown_name_says_where_it_looked(tmp_path):
  with pytest.raises(errors.DatasetUnavailableError,
                     match=r"tfds:no_such_set: TFDS has no dataset "
                     r"'no_such_set' .* prepared in " + str(tmp_path)):
    data.load('tfds:no_such_set', global_batch_size=2,
              data_dir=str(tmp_path))


def test_an_empty_name_is_refused_before_any_read():
  with pytest.raises(errors.ConfigError, match='--dataset=tfds: names '
                     'nothing after the colon; name what to read, e.g. '
                     '--dataset=tfds:tf_flowers'):
    data.check_name('tfds:')


@pytest.mark.slow
def test_the_command_line_trains_a_dataset_prepared_in_data_dir(
    run_train, tmp_path):
  tfds_store.store('tiny_shapes', tmp_path / 'tfds', features=_SHAPES,
                   rows={'train': 48, 'test': 12})
  model_dir = tmp_path / 'run'
  run_train(dataset='tfds:tiny_shapes', data_dir=str(tmp_path / 'tfds'),
            image_size=['28', '28'], num_clones=2, model_dir=str(model_dir))
  job = json.loads((model_dir / 'job.json').read_text())['job']
  assert (job['num_classes'], job['input_shape']) == (3, [28, 28, 3])
  assert (job['train_examples'], job['test_examples']) == (48, 12)


def test_the_first_preparation_of_digits_is_quiet(tmp_path, capfd, caplog):
  """No download text, no progress bar's escape codes where stderr is no
  terminal, and no warning about TFDS's own folders: one log line says
  the dataset is prepared, once."""
  import tfmulti.digits  # noqa: F401  Registers the builder.
  caplog.set_level('INFO', logger='absl')
  data.load('digits', global_batch_size=8, data_dir=str(tmp_path))
  out, err = capfd.readouterr()
  for said in (out + err, caplog.text):
    assert 'Downloading and preparing' not in said
    assert '\x1b[' not in said
    assert 'Variant folder' not in said
  # One line as it starts, one with its time as it ends (`phases`).
  assert caplog.text.count("preparing dataset 'digits'") == 2
  assert re.search(r"preparing dataset 'digits' in .* \(once\): done in "
                   r'\d+\.\d s', caplog.text)
