"""From a source's two splits to batched, shuffled, prefetched pipelines.

Every source (TFDS, a folder, TFRecords) gives a `Splits`: its train and
evaluation examples in a fixed order, with their counts and classes.
`batched` gives each image as float32 pixels in [0, 255] (as Keras's own
loaders do; `models.pixels` says who scales them), resizes it when asked,
caches the
decoded split in memory when it fits (`CACHE_BYTES`; larger ones are
decoded again each epoch, in parallel), shuffles epoch e with the seed
(seed, e), augments training rows (`augment`), batches and prefetches.
Decoding runs on a private thread pool of the machine's cores, apart from
the threads that run the step, as tf_cnn_benchmarks did for its towers.
"""

import dataclasses
import os
from typing import Callable, Optional, Tuple

from absl import logging
import numpy as np
import tensorflow as tf

from tfmulti.data import augment as augment_lib

_SHUFFLE_BUFFER = 10_000  # Examples; at least a whole epoch of digits/mnist.
CACHE_BYTES = 2 * 2**30  # Decoded float32 pixels of a split kept in memory.


@dataclasses.dataclass(frozen=True)
class Splits:
  """A source's examples before batching.

  Attributes:
    train: (image, label) in a fixed order; images uint8 or float in
      [0, 255], labels integers in [0, num_classes).
    test: the same, for evaluation.
    num_classes: number of labels.
    train_examples: rows in `train`.
    test_examples: rows in `test`.
    worker_rows: with `shard_files`, the training rows of every worker's
      share of the files (`train` is this worker's); else None.
  """
  train: tf.data.Dataset
  test: tf.data.Dataset
  num_classes: int
  train_examples: int
  test_examples: int
  worker_rows: Optional[Tuple[int, ...]] = None


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
    train_examples: examples in the train split (with `per_worker`, the
      rows the job trains an epoch, over every worker).
    test_examples: examples in the test split.
    per_worker: each training batch holds this worker's rows only
      (`shard_files`), not the global batch.
  """
  train_epoch: Callable[..., tf.data.Dataset]
  test: tf.data.Dataset
  input_shape: tuple
  num_classes: int
  train_examples: int
  test_examples: int
  per_worker: bool = False


def epoch_seed(seed, epoch):
  """A seed for each (seed, epoch) pair; distinct for epochs < 2**20."""
  return seed * 2**20 + epoch


def _private_threads(dataset):
  """`dataset` decoding on its own pool of the machine's cores."""
  options = tf.data.Options()
  options.threading.private_threadpool_size = max(2, os.cpu_count() or 2)
  return dataset.with_options(options)


def _scaled(dataset, image_size):
  """Images as float32 pixels in [0, 255], resized to `image_size` if
  given; labels as int32."""
  def scale(image, label):
    image = tf.cast(image, tf.float32)
    if image_size is not None:
      image = tf.image.resize(image, image_size)
    return image, tf.cast(label, tf.int32)
  return dataset.map(scale, tf.data.AUTOTUNE)


def _cached_if_small(dataset, examples, split):
  """`dataset` cached in memory if its float32 pixels fit `CACHE_BYTES`."""
  shape = dataset.element_spec[0].shape
  size = examples * int(np.prod(shape)) * 4
  if size <= CACHE_BYTES:
    return dataset.cache()
  logging.info('%s split: %.1f GiB decoded, more than the %.0f GiB kept in '
               'memory; decoding it again each epoch.', split, size / 2**30,
               CACHE_BYTES / 2**30)
  return dataset


def batched(splits, *, global_batch_size, seed, options):
  """`Data` of `splits` (see the module's docstring); `options` is the
  `InputOptions`."""
  train, test = [
      _private_threads(_cached_if_small(
          _scaled(dataset, options.image_size), examples, split))
      for dataset, examples, split in (
          (splits.train, splits.train_examples, 'train'),
          (splits.test, splits.test_examples, 'test'))]

  def train_epoch(epoch, skip_batches=0):
    # One seed per epoch (not reshuffle_each_iteration), so any epoch's order
    # can be rebuilt after a restart.
    rows = train.shuffle(
        min(splits.train_examples, _SHUFFLE_BUFFER),
        seed=epoch_seed(seed, epoch), reshuffle_each_iteration=False)
    if options.augment:
      rows = rows.enumerate().map(
          augment_lib.augmenter(options.augment, epoch_seed(seed, epoch)),
          tf.data.AUTOTUNE)
    return rows.batch(global_batch_size, drop_remainder=True).skip(
        skip_batches).prefetch(tf.data.AUTOTUNE)
  return Data(
      train_epoch=train_epoch,
      test=test.batch(global_batch_size).prefetch(tf.data.AUTOTUNE),
      input_shape=tuple(train.element_spec[0].shape),
      num_classes=splits.num_classes,
      train_examples=splits.train_examples,
      test_examples=splits.test_examples)


def count(dataset):
  """Examples in `dataset`: its cardinality, or one pass when unknown."""
  examples = int(dataset.cardinality())
  if examples < 0:
    examples = int(dataset.reduce(0, lambda n, _: n + 1))
  return examples
