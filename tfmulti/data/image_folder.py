"""A folder of class subfolders of images (`--dataset=folder:PATH`).

  PATH/cat/0001.jpg, PATH/cat/0002.png, PATH/dog/0001.jpg, ...

as `keras.utils.image_dataset_from_directory` reads it: a class a
subfolder (sorted by name: the first is label 0), PNG or JPEG files. When
`PATH/train` and `PATH/test` both exist they are the splits (with the same
classes); otherwise a fixed share of each class (`validation_fraction`,
drawn with the seed) is held out for evaluation. Every file is checked
before training (its header says PNG or JPEG, its size matches the others
unless an image size is given), so a bad file stops the run in one line
instead of in the middle of an epoch.
"""

import os
import random
import struct

import tensorflow as tf

from tfmulti import errors
from tfmulti.data import pipeline

PREFIX = 'folder:'
_EXTENSIONS = ('.png', '.jpg', '.jpeg')
_PNG = b'\x89PNG\r\n\x1a\n'
_JPEG = b'\xff\xd8'


def read(path, *, image_size, validation_fraction, seed, shard=None):
  """`pipeline.Splits` of the folder's (uint8 image, label) files; with
  `shard`, (worker, workers), this worker's training files are every
  workers-th from the worker-th (`shard_files`).

  Raises:
    errors.DatasetUnavailableError: no such folder.
    errors.ConfigError: fewer than 2 classes, a class without images, a
      file that is not a PNG or JPEG, images of several sizes without
      `image_size`, splits with other classes.
  """
  if not os.path.isdir(path):
    raise errors.DatasetUnavailableError(
        f'--dataset={PREFIX}{path}: no such folder; give a folder of class '
        'subfolders of images.')
  splits = [os.path.join(path, s) for s in ('train', 'test')]
  if all(os.path.isdir(s) for s in splits):
    (train, classes), (test, test_classes) = [_files(s) for s in splits]
    if test_classes != classes:
      raise errors.ConfigError(
          f'{splits[1]} has classes {test_classes}, {splits[0]} {classes}; '
          'give both splits the same class folders.')
  else:
    files, classes = _files(path)
    train, test = _held_out(files, validation_fraction, seed)
  shape = _check_images(path, train + test, image_size)
  known = shape if image_size is None else (None, None, shape[-1])
  worker_rows = None
  if shard:
    worker, workers = shard
    worker_rows = tuple(len(train[w::workers]) for w in range(workers))
    train = train[worker::workers]
  return pipeline.Splits(_decoded(train, known), _decoded(test, known),
                         len(classes), len(train), len(test), worker_rows)


def _files(folder):
  """([(file, label)], class names) of a folder of class subfolders."""
  classes = sorted(c for c in os.listdir(folder)
                   if os.path.isdir(os.path.join(folder, c)))
  if len(classes) < 2:
    raise errors.ConfigError(
        f'{folder} has {len(classes)} class folder(s) {classes}; a '
        'classifier needs at least 2: one subfolder of images a class.')
  found = []
  for label, name in enumerate(classes):
    images = sorted(f for f in os.listdir(os.path.join(folder, name))
                    if f.lower().endswith(_EXTENSIONS))
    if not images:
      raise errors.ConfigError(
          f'class folder {os.path.join(folder, name)} holds no .png, .jpg '
          'or .jpeg file; add its images or remove it.')
    found += [(os.path.join(folder, name, f), label) for f in images]
  return found, classes


def _held_out(files, fraction, seed):
  """(train, test): `fraction` of each class's files, drawn with `seed`."""
  train, test = [], []
  for label in sorted({label for _, label in files}):
    mine = [f for f in files if f[1] == label]
    random.Random(seed * 1009 + label).shuffle(mine)
    cut = max(1, round(len(mine) * fraction))
    test += mine[:cut]
    train += mine[cut:]
  return train, test


def _check_images(path, files, image_size):
  """The images' (height, width, channels); raises for a file that is not
  a PNG or JPEG, or sizes that differ when no `image_size` is given."""
  shapes = {}
  for file, _ in files:
    with open(file, 'rb') as f:
      head = f.read(32)
    if head.startswith(_PNG):
      width, height = struct.unpack('>II', head[16:24])
      channels = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}.get(head[25], 3)
      shape = (height, width, channels)
    elif head.startswith(_JPEG):
      shape = tuple(int(d) for d in tf.io.extract_jpeg_shape(
          tf.io.read_file(file)))
    else:
      raise errors.ConfigError(
          f'{file} is not a PNG or JPEG image; remove it from {path}.')
    shapes.setdefault(shape if image_size is None else shape[2:], file)
  channels = {s[-1] for s in shapes}
  if len(channels) > 1:
    raise errors.ConfigError(
        f'{path} mixes images of {sorted(channels)} channels (e.g. '
        f'{list(shapes.values())[:2]}); give it images of one kind.')
  if len(shapes) > 1:
    raise errors.ConfigError(
        f'{path} holds images of several sizes ({sorted(shapes)[:3]}, ...); '
        'pass --image_size=HEIGHT,WIDTH to resize them all.')
  shape = next(iter(shapes))
  return shape if image_size is None else (*image_size, shape[-1])


def _decoded(files, shape):
  """(uint8 image, label) of each file, in order, of `shape` (None where
  the caller resizes); the caller scales them."""
  paths = tf.constant([f for f, _ in files])
  labels = tf.constant([label for _, label in files], tf.int64)

  def decode(path, label):
    image = tf.io.decode_image(tf.io.read_file(path), channels=shape[-1],
                               expand_animations=False)
    image.set_shape(shape)
    return image, label
  return tf.data.Dataset.from_tensor_slices((paths, labels)).map(
      decode, tf.data.AUTOTUNE)
