"""A folder of class subfolders of images (`--dataset=folder:PATH`).

  PATH/cat/0001.jpg, PATH/cat/0002.png, PATH/dog/0001.jpg, ...

as `keras.utils.image_dataset_from_directory` reads it: a class a
subfolder (sorted by name: the first is label 0), PNG or JPEG files. When
`PATH/train` and `PATH/test` both exist they are the splits (with the same
classes); otherwise a fixed share of each class (`validation_fraction`,
drawn with the seed) is held out for evaluation. Every file is checked
before training (its header says PNG or JPEG, it decodes, its size
matches the others unless an image size is given), so a bad file stops
the run in one line instead of in the middle of an epoch.
"""

import os
import random

import tensorflow as tf

from tfmulti import errors
from tfmulti.data import batches
from tfmulti.data import images

PREFIX = 'folder:'
_EXTENSIONS = ('.png', '.jpg', '.jpeg')
_CHECK_BATCH = 1024  # Files whose shapes are read back at once.


def read(path, *, image_size, validation_fraction, seed, shard=None):
  """`batches.Splits` of the folder's (uint8 image, label) files; with
  `shard`, (worker, workers), this worker's training files are every
  workers-th from the worker-th (`shard_files`).

  Raises:
    errors.DatasetUnavailableError: no such folder.
    errors.ConfigError: fewer than 2 classes, a class without images, a
      file that is not a PNG or JPEG or does not decode, images of several
      sizes without `image_size`, splits with other classes.
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
  return batches.Splits(_decoded(train, known), _decoded(test, known),
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
  """The images' (height, width, channels), each file decoded once; raises
  for a file that is not a PNG or JPEG or does not decode, or sizes that
  differ when no `image_size` is given."""
  shapes = {}
  for file, shape in zip([f for f, _ in files], _decoded_shapes(files)):
    if shape is None:
      raise errors.ConfigError(
          f'{file} does not decode as an image ({_reason(file)}); re-save '
          'it as a PNG or JPEG, or remove it.')
    if not shape:
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


def _decoded_shapes(files):
  """Each file's decoded (height, width, channels), in order: () for one
  that is neither PNG nor JPEG, None for one that does not decode.

  The files are decoded in parallel, as training decodes them, so a
  truncated or corrupt file stops the run now and not mid-epoch; a file
  whose decoding fails is dropped from the stream and found by its
  position.
  """
  found = tf.data.Dataset.from_tensor_slices(
      (tf.range(len(files), dtype=tf.int64), [f for f, _ in files])).map(
          lambda index, file: (index, images.shape(tf.io.read_file(file))),
          tf.data.AUTOTUNE).ignore_errors().batch(_CHECK_BATCH)
  shapes = [None] * len(files)
  for indices, sizes in found.as_numpy_iterator():
    for index, size in zip(indices, sizes):
      shapes[index] = tuple(int(d) for d in size) if size.all() else ()
  return shapes


def _reason(file):
  """Why `file` does not decode (or cannot be read)."""
  try:
    with open(file, 'rb') as f:
      data = f.read()
  except OSError as e:
    return e.strerror or str(e)
  return images.why_not_decoded(data) or 'reading it failed'


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
