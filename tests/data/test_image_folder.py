"""Tests for `--dataset=folder:PATH` (tfmulti.data.image_folder): a folder of
class subfolders of PNGs, written here from the offline digits."""

import os

import numpy as np
import pytest
from sklearn import datasets
import tensorflow as tf

from tfmulti import data
from tfmulti import errors


def _write_digits(folder, per_class=None, size=None):
  """The digits as PNGs, one subfolder a class; returns {path: pixels}."""
  loaded = datasets.load_digits()
  written, counts = {}, {}
  for index, (image, label) in enumerate(zip(loaded.images, loaded.target)):
    if per_class and counts.get(label, 0) >= per_class:
      continue
    counts[label] = counts.get(label, 0) + 1
    pixels = np.round(image * 255 / 16).astype(np.uint8)[..., None]
    if size and index % 2:
      pixels = np.repeat(np.repeat(pixels, 2, axis=0), 2, axis=1)
    os.makedirs(folder / f'digit{label}', exist_ok=True)
    path = folder / f'digit{label}' / f'{index:04d}.png'
    path.write_bytes(tf.io.encode_png(pixels).numpy())
    written[str(path)] = pixels
  return written


def test_a_folder_trains_its_classes_and_holds_out_a_share(tmp_path):
  written = _write_digits(tmp_path / 'digits', per_class=20)
  loaded = data.load(f'folder:{tmp_path / "digits"}', global_batch_size=16,
                     seed=1,
                     options=data.InputOptions(validation_fraction=0.25))
  assert (loaded.num_classes, loaded.input_shape) == (10, (8, 8, 1))
  assert (loaded.train_examples, loaded.test_examples) == (150, 50)
  train = np.concatenate([x for x, _ in loaded.train_epoch(0)])
  test_labels = np.concatenate([y for _, y in loaded.test])
  assert sorted(np.bincount(test_labels)) == [5] * 10  # A share a class.
  # Float pixels in [0, 255], as Keras's loaders give them.
  assert train.shape == (144, 8, 8, 1) and 1.0 < train.max() <= 255.0
  # Pixels arrive as written.
  every = {tuple(p.ravel()) for p in written.values()}
  assert all(tuple(x.astype(np.uint8).ravel()) in every for x in train)


def test_train_and_test_folders_are_the_splits(tmp_path):
  _write_digits(tmp_path / 'd' / 'train', per_class=6)
  _write_digits(tmp_path / 'd' / 'test', per_class=2)
  loaded = data.load(f'folder:{tmp_path / "d"}', global_batch_size=4)
  assert (loaded.train_examples, loaded.test_examples) == (60, 20)


def test_mixed_sizes_need_an_image_size(tmp_path):
  _write_digits(tmp_path / 'd', per_class=4, size='mixed')
  with pytest.raises(errors.ConfigError, match='holds images of several '
                     'sizes.*pass --image_size=HEIGHT,WIDTH'):
    data.load(f'folder:{tmp_path / "d"}', global_batch_size=4)
  loaded = data.load(f'folder:{tmp_path / "d"}', global_batch_size=4,
                     options=data.InputOptions(image_size=(12, 12)))
  assert loaded.input_shape == (12, 12, 1)


@pytest.mark.parametrize('damage, error, message', [
    ('missing', errors.DatasetUnavailableError, 'no such folder'),
    ('one_class', errors.ConfigError, r"has 1 class folder\(s\) \['digit0'\]"),
    ('not_an_image', errors.ConfigError, 'is not a PNG or JPEG image'),
    # A PNG's header over half its pixels: the header alone passes.
    ('truncated_png', errors.ConfigError, r'digit3/\d+.png does not decode '
     r'as an image \(Invalid PNG data, size \d+\); re-save it'),
    ('jpeg_garbage', errors.ConfigError, r'digit3/bad.jpg does not decode as '
     r'an image \(Invalid JPEG data, size 82\)'),
    ('empty_class', errors.ConfigError, 'holds no .png, .jpg or .jpeg file'),
])
def test_a_bad_folder_is_one_line(tmp_path, damage, error, message):
  folder = tmp_path / 'd'
  if damage != 'missing':
    _write_digits(folder, per_class=3)
  if damage == 'one_class':
    for name in os.listdir(folder):
      if name != 'digit0':
        for f in os.listdir(folder / name):
          os.remove(folder / name / f)
        os.rmdir(folder / name)
  if damage == 'not_an_image':
    (folder / 'digit3' / 'notes.png').write_text('not an image')
  if damage == 'truncated_png':
    image = folder / 'digit3' / sorted(os.listdir(folder / 'digit3'))[-1]
    image.write_bytes(image.read_bytes()[:-30])
  if damage == 'jpeg_garbage':
    (folder / 'digit3' / 'bad.jpg').write_bytes(b'\xff\xd8' + b'junk' * 20)
  if damage == 'empty_class':
    os.makedirs(folder / 'digit_none')
  with pytest.raises(error, match=message) as refused:
    data.load(f'folder:{folder}', global_batch_size=4)
  assert '\n' not in str(refused.value)


@pytest.mark.slow
def test_the_command_line_learns_a_folder_of_images(run_train, tmp_path):
  _write_digits(tmp_path / 'digits')
  folder = f'folder:{tmp_path / "digits"}'
  with pytest.raises(SystemExit, match=r"model='lenet' cannot take images "
                     r'of shape \(8, 8, 1\).*pass --image_size'):
    run_train(dataset=folder)
  assert not (tmp_path / 'run1').exists()  # The refused run left nothing.
  metrics = run_train(dataset=folder, image_size=['28', '28'], num_clones=2,
                      batch_size=32, train_steps=300, log_every_steps=100)
  assert metrics['eval_accuracy'] >= 0.9


def test_shard_files_gives_each_worker_every_other_file(tmp_path):
  _write_digits(tmp_path / 'd', per_class=12)
  options = data.InputOptions(shard_files=True, validation_fraction=0.25)
  workers = [data.load(f'folder:{tmp_path / "d"}', global_batch_size=8,
                       options=options, worker=(w, 2)) for w in range(2)]
  rows = [{x.numpy().tobytes() for batch, _ in loaded.train_epoch(0)
           for x in batch} for loaded in workers]
  assert not rows[0] & rows[1]
  # 90 training images: 45 a worker, 11 steps of 4 rows each.
  assert all(loaded.per_worker and loaded.train_examples == 11 * 8
             for loaded in workers)
  with pytest.raises(errors.ConfigError, match='--shard_files shares out '
                     'files: --dataset=digits has none to share'):
    data.load('digits', global_batch_size=8, options=options, worker=(0, 2))
