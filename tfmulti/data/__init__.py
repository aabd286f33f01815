"""Input pipelines: TFDS datasets, folders of images, TFRecords.

`load()` returns batched train and test pipelines for a global batch (a
`Data`): each source gives its two splits in a fixed order
(`batches.Splits`), and `batches.batched` scales, resizes, caches,
shuffles epoch e with the seed (seed, e), augments, batches and prefetches
them. Call it under `tf.device(config.inputs_device())`. An interrupted run
rebuilds the same epoch and skips the batches it already trained on
(`Data.train_epoch`).

Sources, by `--dataset`:
  digits                  scikit-learn's 8x8 digits as a TFDS dataset,
                          offline (`tfmulti.digits`);
  mnist, fashion_mnist, cifar10, tfds:NAME[/CONFIG][:VERSION]
                          TFDS (`tfds_source`);
  folder:PATH             class subfolders of images (`image_folder`);
  tfrecord:GLOB           image-classification TFRecords (`tfrecords`);
  synthetic               one random batch made once and repeated, for
                          throughput without an input pipeline.
How they are read (sizes, augmentation, held-out shares, labels) is one
`InputOptions`.
"""

import dataclasses

import tensorflow as tf

from tfmulti import digits  # noqa: F401  (registers the TFDS builder)
from tfmulti import errors
from tfmulti.data import batches
from tfmulti.data import image_folder
from tfmulti.data import tfds_source
from tfmulti.data import tfrecords
from tfmulti.data.batches import Data  # noqa: F401
from tfmulti.data.options import DEFAULTS
from tfmulti.data.options import InputOptions  # noqa: F401

DOWNLOADABLE = ('mnist', 'fashion_mnist', 'cifar10')
DATASETS = ('digits',) + DOWNLOADABLE + ('synthetic',)
PREFIXES = (tfds_source.PREFIX, image_folder.PREFIX, tfrecords.PREFIX)
# Synthetic data: CIFAR-10's shape, and examples per epoch.
SYNTHETIC_SHAPE = (32, 32, 3)
SYNTHETIC_CLASSES = 10
SYNTHETIC_TRAIN_EXAMPLES = 10_240
SYNTHETIC_TEST_EXAMPLES = 1_024


def _synthetic(global_batch_size, seed, image_size):
  """One random batch, made once on the current device and repeated."""
  shape = (*(image_size or SYNTHETIC_SHAPE[:2]), SYNTHETIC_SHAPE[2])

  def batch(stream):
    images = tf.random.stateless_uniform(  # Pixels in [0, 255].
        (global_batch_size, *shape), seed=[seed, stream], maxval=255.0)
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
  """Raises `ConfigError` unless `name` is one of `DATASETS` or starts with
  one of `PREFIXES`."""
  if not name.startswith(PREFIXES):
    errors.check_choice('dataset', name, DATASETS + tuple(
        f'{prefix}...' for prefix in PREFIXES))
  elif name in PREFIXES:
    examples = {tfds_source.PREFIX: 'tf_flowers',
                image_folder.PREFIX: '/data/pets',
                tfrecords.PREFIX: '/data/imagenet/train-*'}
    raise errors.ConfigError(
        f'--dataset={name} names nothing after the colon; name what to '
        'read, e.g. '
        f'--dataset={name}{examples[name]}.')


SHARDABLE = (image_folder.PREFIX, tfrecords.PREFIX)


def _splits(name, *, data_dir, seed, options, known, shard):
  """The source's `batches.Splits`."""
  if name.startswith(image_folder.PREFIX):
    return image_folder.read(
        name[len(image_folder.PREFIX):], image_size=options.image_size,
        validation_fraction=options.validation_fraction, seed=seed,
        shard=shard)
  if name.startswith(tfrecords.PREFIX):
    return tfrecords.read(name[len(tfrecords.PREFIX):], options=options,
                          seed=seed, known=None if shard else known,
                          shard=shard)
  tfds_name = name[len(tfds_source.PREFIX):] if name.startswith(
      tfds_source.PREFIX) else name
  return tfds_source.read(tfds_name, data_dir=data_dir, seed=seed,
                          validation_fraction=options.validation_fraction)


def load(name, *, global_batch_size, data_dir=None, seed=0,
         options=DEFAULTS, known=None, worker=None):
  """The train and test pipelines of dataset `name`.

  Args:
    name: one of `DATASETS`, or a name starting with one of `PREFIXES`.
    global_batch_size: rows per training step of the whole job.
    data_dir: TFDS data directory; None for TFDS's default.
    seed: shuffling, held-out and augmentation seed.
    options: the `InputOptions`.
    known: for `tfrecord:`, (num_classes, image shape, train rows, test
      rows) a previous run of the job recorded; None reads them.
    worker: (this worker's index, workers) of a multi-worker job; with
      `options.shard_files`, the worker reads its share of the files and
      its batches hold its rows of each step (`Data.per_worker`).

  Returns:
    A `Data`.

  Raises:
    errors.ConfigError: unknown `name`, bad data, a batch larger than the
      train split, or files that cannot be shared out.
    errors.DatasetUnavailableError: not prepared and not downloadable here.
  """
  check_name(name)
  shard = worker if options.shard_files else None
  if shard and not name.startswith(SHARDABLE):
    raise errors.ConfigError(
        f'--shard_files shares out files: --dataset={name} has none to '
        'share; use it with folder:PATH or tfrecord:GLOB, or drop it.')
  if name == 'synthetic':
    data = _synthetic(global_batch_size, seed, options.image_size)
  else:
    splits = _splits(name, data_dir=data_dir, seed=seed, options=options,
                     known=known, shard=shard)
    batch = global_batch_size // shard[1] if shard else global_batch_size
    data = batches.batched(splits, global_batch_size=batch, seed=seed,
                            options=options)
    if data.input_shape[0] is None:
      raise errors.ConfigError(
          f'--dataset={name} holds images of several sizes; pass '
          '--image_size=HEIGHT,WIDTH to resize them all.')
    if shard:
      data = _equal_steps(name, data, splits.worker_rows, batch)
  if data.train_examples < global_batch_size:
    raise errors.ConfigError(
        f'the global batch of {global_batch_size} is larger than the '
        f'{data.train_examples} training examples of {name!r}; lower '
        'batch_size or num_clones.')
  return data


def _equal_steps(name, data, worker_rows, batch):
  """`data` of one worker's files, cut to the steps of the worker with the
  fewest rows, so no worker waits in a collective at an epoch's end."""
  steps = min(worker_rows) // batch
  if not steps:
    raise errors.ConfigError(
        f'--shard_files: a worker\'s files of {name} hold '
        f'{min(worker_rows)} rows, fewer than its {batch} rows a step; '
        'lower batch_size, or drop --shard_files.')
  whole = data.train_epoch

  def train_epoch(epoch, skip_batches=0):
    return whole(epoch, skip_batches).take(max(0, steps - skip_batches))
  return dataclasses.replace(data, train_epoch=train_epoch,
                             train_examples=steps * batch * len(worker_rows),
                             per_worker=True)
