"""Input pipelines: every dataset through TensorFlow Datasets.

`load()` returns batched train and test pipelines for a global batch:
decode, scale to [0, 1], cache, shuffle, batch, prefetch. Call it under
`tf.device(config.inputs_device())`. Epoch e is shuffled with the seed
(seed, e), so an interrupted run rebuilds the same epoch and skips the
batches it already trained on (`Data.train_epoch`).

`mnist`, `fashion_mnist` and `cifar10` are TFDS's own datasets: read from
`data_dir` when prepared there, else downloaded when their servers can be
reached, else a `DatasetUnavailableError` within seconds (TFDS itself would
retry for minutes). `digits` prepares offline from scikit-learn (see
`tfmulti.digits`); `synthetic` is one random batch made once and repeated,
for throughput without an input pipeline; `folder:PATH` reads a folder of
class subfolders of images (`tfmulti.image_folder`).
"""

import dataclasses
import socket
from typing import Callable
from urllib import parse

import tensorflow as tf
import tensorflow_datasets as tfds

from tfmulti import digits  # noqa: F401  (registers the TFDS builder)
from tfmulti import errors
from tfmulti import image_folder

DOWNLOADABLE = ('mnist', 'fashion_mnist', 'cifar10')
DATASETS = ('digits',) + DOWNLOADABLE + ('synthetic',)
_PROBE_TIMEOUT_S = 3.0  # Seconds to wait for a download server to answer.
_SHUFFLE_BUFFER = 10_000  # Examples; at least a whole epoch of digits/mnist.
_PIXEL_MAX = 255.0
# Synthetic data: CIFAR-10's shape, and examples per epoch.
SYNTHETIC_SHAPE = (32, 32, 3)
SYNTHETIC_CLASSES = 10
SYNTHETIC_TRAIN_EXAMPLES = 10_240
SYNTHETIC_TEST_EXAMPLES = 1_024


@dataclasses.dataclass(frozen=True)
class Data:
  """Batched pipelines and what the model needs to know about them.

  Attributes:
    train_epoch: `train_epoch(epoch, skip_batches=0)` -> the batches of
      exactly `global_batch_size` (image, label) of epoch `epoch` (0-based),
      in an order fixed by (seed, epoch), without the first `skip_batches`.
    test: batches in order; the last one may be short.
    input_shape: (height, width, channels) of one image.
    num_classes: number of labels.
    train_examples: examples in the train split.
    test_examples: examples in the test split.
  """
  train_epoch: Callable[..., tf.data.Dataset]
  test: tf.data.Dataset
  input_shape: tuple
  num_classes: int
  train_examples: int
  test_examples: int


def _check_reachable(name, data_dir):
  """Raises `DatasetUnavailableError` if a download server cannot be reached."""
  builder = tfds.builder(name, data_dir=data_dir)
  for url in sorted(builder.url_infos or ()):
    parts = parse.urlparse(url)
    port = parts.port or (443 if parts.scheme == 'https' else 80)
    try:
      socket.create_connection((parts.hostname, port),
                               timeout=_PROBE_TIMEOUT_S).close()
    except OSError as e:
      raise errors.DatasetUnavailableError(
          f'dataset {name!r} is not prepared in {builder.data_dir} and its '
          f'server {parts.hostname}:{port} cannot be reached ({e}). On a '
          f'machine with network run `tfds build {name} --data_dir=DIR`, '
          'copy DIR here and pass --data_dir=DIR (or use --dataset=digits, '
          'which needs no network).') from e


def _tfds_split(name, split, data_dir, seed):
  """(dataset of (uint8 image, label), info) for one split."""
  kwargs = dict(split=split, data_dir=data_dir, as_supervised=True,
                with_info=True, shuffle_files=split == 'train',
                read_config=tfds.ReadConfig(shuffle_seed=seed))
  try:
    return tfds.load(name, download=False, **kwargs)
  except AssertionError:  # TFDS's answer when data_dir has no prepared copy.
    _check_reachable(name, data_dir)
  try:
    return tfds.load(name, download=True, **kwargs)
  except OSError as e:  # Disk full, or the directory vanished or is locked.
    raise errors.DatasetUnavailableError(
        f'dataset {name!r} cannot be prepared in '
        f'{data_dir or "~/tensorflow_datasets"} ({e.strerror or e}); free '
        'some space or pass another --data_dir.') from e


def _normalise(image, label):
  return tf.cast(image, tf.float32) / _PIXEL_MAX, tf.cast(label, tf.int32)


def _epoch_seed(seed, epoch):
  """A shuffle seed for each (seed, epoch) pair; distinct for epochs < 2**20."""
  return seed * 2**20 + epoch


def _num_examples(dataset):
  count = int(dataset.cardinality())
  if count < 0:  # Unknown: count once (the datasets here are small).
    count = int(dataset.reduce(0, lambda n, _: n + 1))
  return count


def _resized(image_size):
  """A map that resizes each image to `image_size` (bilinear)."""
  return lambda image, label: (tf.image.resize(image, image_size), label)


def _from_tfds(name, global_batch_size, data_dir, seed, image_size):
  splits = {}
  for split in ('train', 'test'):
    splits[split], info = _tfds_split(name, split, data_dir, seed)
  return _batched(splits['train'], splits['test'],
                  info.features['label'].num_classes,
                  global_batch_size=global_batch_size, seed=seed,
                  image_size=image_size)


def _batched(train, test, num_classes, *, global_batch_size, seed,
             image_size):
  """`Data` of (uint8 image, label) splits: scaled to [0, 1], resized to
  `image_size` if given, cached, epoch e shuffled with the seed (seed, e)."""
  splits = {}
  for split, dataset in (('train', train), ('test', test)):
    dataset = dataset.map(_normalise, tf.data.AUTOTUNE)
    if image_size is not None:
      dataset = dataset.map(_resized(image_size), tf.data.AUTOTUNE)
    splits[split] = dataset.cache()
  train_examples = _num_examples(splits['train'])

  def train_epoch(epoch, skip_batches=0):
    # One seed per epoch (not reshuffle_each_iteration), so any epoch's order
    # can be rebuilt after a restart.
    shuffled = splits['train'].shuffle(
        min(train_examples, _SHUFFLE_BUFFER), seed=_epoch_seed(seed, epoch),
        reshuffle_each_iteration=False)
    return shuffled.batch(global_batch_size, drop_remainder=True).skip(
        skip_batches).prefetch(tf.data.AUTOTUNE)
  return Data(
      train_epoch=train_epoch,
      test=splits['test'].batch(global_batch_size).prefetch(tf.data.AUTOTUNE),
      input_shape=tuple(splits['train'].element_spec[0].shape),
      num_classes=num_classes,
      train_examples=train_examples,
      test_examples=_num_examples(splits['test']))


def _synthetic(global_batch_size, seed, image_size):
  """One random batch, made once on the current device and repeated."""
  shape = (*(image_size or SYNTHETIC_SHAPE[:2]), SYNTHETIC_SHAPE[2])

  def batch(stream):
    images = tf.random.stateless_uniform(
        (global_batch_size, *shape), seed=[seed, stream])
    labels = tf.random.stateless_uniform(
        (global_batch_size,), seed=[seed, stream + 1], maxval=SYNTHETIC_CLASSES,
        dtype=tf.int32)
    return tf.data.Dataset.from_tensors((images, labels))
  train_batches = SYNTHETIC_TRAIN_EXAMPLES // global_batch_size
  test_batches = max(1, SYNTHETIC_TEST_EXAMPLES // global_batch_size)
  train = batch(0)
  return Data(train_epoch=lambda epoch, skip_batches=0: train.repeat(
                  max(0, train_batches - skip_batches)),
              test=batch(2).repeat(test_batches),
              input_shape=shape, num_classes=SYNTHETIC_CLASSES,
              train_examples=train_batches * global_batch_size,
              test_examples=test_batches * global_batch_size)


def check_name(name):
  """Raises `ConfigError` unless `name` is one of `DATASETS` or
  `folder:PATH`."""
  if not name.startswith(image_folder.PREFIX):
    errors.check_choice('dataset', name, DATASETS)


def load(name, *, global_batch_size, data_dir=None, seed=0, image_size=None,
         validation_fraction=0.2):
  """The train and test pipelines of dataset `name`.

  Args:
    name: one of `DATASETS`, or `folder:PATH` (`image_folder`).
    global_batch_size: rows per training batch, `batch_size * num_clones`.
    data_dir: TFDS data directory; None for TFDS's default.
    seed: shuffling seed.
    image_size: (height, width) every image is resized to (bilinear, after
      scaling to [0, 1]); None keeps the data's own.
    validation_fraction: for `folder:PATH` without train and test
      folders, the share of each class held out for evaluation.

  Returns:
    A `Data`.

  Raises:
    errors.ConfigError: unknown `name`, or a batch larger than the train
      split.
    errors.DatasetUnavailableError: not prepared and not downloadable here.
  """
  check_name(name)
  if name == 'synthetic':
    data = _synthetic(global_batch_size, seed, image_size)
  elif name.startswith(image_folder.PREFIX):
    train, test, num_classes = image_folder.read(
        name[len(image_folder.PREFIX):], image_size=image_size,
        validation_fraction=validation_fraction, seed=seed)
    data = _batched(train, test, num_classes,
                    global_batch_size=global_batch_size, seed=seed,
                    image_size=image_size)
  else:
    data = _from_tfds(name, global_batch_size, data_dir, seed, image_size)
  if data.train_examples < global_batch_size:
    raise errors.ConfigError(
        f'the global batch of {global_batch_size} is larger than the '
        f'{data.train_examples} training examples of {name!r}; lower '
        'batch_size or num_clones.')
  return data
