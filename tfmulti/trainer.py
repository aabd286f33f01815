"""The trainer contract every path implements, and the rules they share.

The training loop (`tfmulti.loop`) drives any `Trainer`: the towers
(`deploy.DeployedModel`), the tf.distribute paths
(`distribute.DistributedModel`) and the towers inside a strategy
(`towers_in_strategy.WorkerTowers`). They share the step record
(`StepOutputs`) and the loss rules written here once: each shard's mean loss
weighted by its share of the global batch (`shard_loss`), a Keras loss that
does not divide by the replica count (`mean_loss`), and the float16 loss
scale (`loss_scale_of`), and each worker's block of a global batch
(`worker_blocks`).
"""

import abc
import collections

import keras
import tensorflow as tf

from tfmulti import errors

# What one training step reports: `total` is the loss that was minimised,
# `regularization` its regularization part, `clones` each clone's (or
# tf.distribute replica's) share of `total` (they sum to it); `gradients`
# maps each variable's path to its combined gradient, when asked for (else
# {}).
StepOutputs = collections.namedtuple(
    'StepOutputs', ['total', 'regularization', 'clones', 'gradients'])


class Trainer(abc.ABC):
  """What the training loop may call, whichever path runs the step.

  Attributes:
    model: the `keras.Model` being trained (checkpointed, evaluated).
    optimizer: its Keras optimizer (checkpointed with its slots).
  Subclasses keep their compiled step in `self._step` (a `tf.function`), so
  `trace_count` can tell a retrace.
  """

  model: keras.Model
  optimizer: keras.optimizers.Optimizer
  _step: tf.types.experimental.PolymorphicFunction

  @abc.abstractmethod
  def distribute_dataset(self, dataset):
    """`dataset`'s batches as `train_step_outputs` takes them.

    Args:
      dataset: a `tf.data.Dataset` of (images, labels) global batches.

    Returns:
      An iterable of (images, labels), split as this path needs.
    """

  @abc.abstractmethod
  def train_step_outputs(self, images, labels):
    """Runs one step on one element of `distribute_dataset`.

    Returns:
      The step's `StepOutputs`.
    """

  @abc.abstractmethod
  def predict(self, images):
    """Inference logits of `images` (any number of rows)."""

  def train_step(self, images, labels):
    """One step; returns the total loss (a scalar tensor)."""
    return self.train_step_outputs(images, labels).total

  @property
  def trace_count(self):
    """How many times the training step has been traced."""
    return self._step.experimental_get_tracing_count()


def shard_loss(shard_mean, shard_rows, global_rows):
  """One shard's part of the mean loss over the global batch.

  Args:
    shard_mean: the mean loss over the shard's rows.
    shard_rows: rows in the shard.
    global_rows: rows in the whole job's global batch.

  Returns:
    shard_mean * shard_rows / global_rows.
  """
  # Gradients are summed over shards (the towers' central sum, or
  # tf.distribute's all-reduce), not averaged, so each shard's mean loss is
  # weighted by its share of the global batch (1 / num_clones for equal
  # shards): the sum is then the mean over the global batch, exactly as one
  # device would compute it.
  dtype = shard_mean.dtype
  return shard_mean * tf.cast(shard_rows, dtype) / tf.cast(global_rows, dtype)


def mean_loss(loss_fn, labels, outputs):
  """`loss_fn`'s mean over these examples, in a replica context too.

  A `keras.losses.Loss` with mean reduction also divides by the number of
  replicas when called in a tf.distribute replica context (Keras 3's
  `scale_loss_for_distribution`), which would count the replica scaling
  twice here; its `call()` gives the unreduced per-example losses.
  """
  if isinstance(loss_fn, keras.losses.Loss):
    return tf.reduce_mean(loss_fn.call(labels, outputs))
  return loss_fn(labels, outputs)


def loss_scale_of(optimizer):
  """The dynamic loss scale of a `LossScaleOptimizer`; None for others."""
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    return optimizer.dynamic_scale
  return None


def gradients_by_path(grads_and_vars, scale=None):
  """{variable path: gradient}, divided by the loss `scale` if given."""
  return {variable.path: gradient if scale is None else gradient / scale
          for gradient, variable in grads_and_vars}


def split_rows(rows, shares):
  """`rows` split in proportion to `shares`, by largest remainder.

  Each part gets the floor of its quota rows * share / sum(shares); the
  rows left over go one each to the parts with the largest remainders (the
  first part on a tie). Equal shares give parts that differ by one row at
  most, the longer ones first.
  """
  total = sum(shares)
  quotas = [rows * share / total for share in shares]
  sizes = [int(quota) for quota in quotas]
  by_remainder = sorted(range(len(shares)),
                        key=lambda i: (sizes[i] - quotas[i], i))
  for i in by_remainder[:rows - sum(sizes)]:
    sizes[i] += 1
  return sizes


def check_shares(shares, num_shards, shard_word='num_clones'):
  """Raises `ConfigError` unless `shares` is one positive number a shard."""
  if shares is None:
    return
  text = ','.join(str(share) for share in shares)
  if len(shares) != num_shards:
    raise errors.ConfigError(
        f'clone_shares={text}: give one share per clone ({shard_word}='
        f'{num_shards}), e.g. --clone_shares={",".join(["1"] * num_shards)}.')
  for share in shares:
    if (isinstance(share, bool) or not isinstance(share, (int, float))
        or not 0 < share < float('inf')):
      raise errors.ConfigError(
          f'clone_shares={text}: every share must be a number > 0, e.g. '
          '--clone_shares=3,1.')


def shard_rows(rows, shares, num_shards):
  """The rows of each shard of a batch of `rows`: by `shares` (largest
  remainder), or equal (`shares` None; the batch must split evenly).

  Raises:
    errors.ConfigError: a shard would get no rows.
  """
  if shares is None:
    return None  # tf.split's even split.
  sizes = split_rows(rows, shares)
  if not all(sizes):
    empty = sizes.index(0)
    raise errors.ConfigError(
        f'clone_shares={",".join(map(str, shares))} leaves clone {empty} no '
        f'rows of a batch of {rows}; raise its share or the batch size.')
  return tuple(sizes)


def sum_microsteps(microstep, images, labels, steps, device):
  """Gradient accumulation: `steps` micro-steps of the batch, summed.

  The batch's rows are cut into `steps` equal consecutive blocks; block k
  is micro-step k. Micro-step 0 runs first, and the others in a
  `tf.while_loop`, so only one micro-step's activations live at a time;
  their gradients and scalars are summed on `device`.

  Args:
    microstep: `microstep(images, labels, first)` -> (gradients, scalars):
      a list of gradients (None where a variable is not reached) and a list
      of scalar tensors; `first` (a Python bool) is True for micro-step 0,
      which counts the regularization.
    images, labels: the batch of all micro-steps.
    steps: how many micro-steps.
    device: where the sums live.

  Returns:
    (summed gradients, summed scalars).
  """
  if steps == 1:
    return microstep(images, labels, True)
  rows = images.shape[0] // steps
  with tf.device(device), tf.name_scope('accumulate'):
    images = tf.reshape(images, [steps, rows, *images.shape[1:]])
    labels = tf.reshape(labels, [steps, rows, *labels.shape[1:]])
  gradients, scalars = microstep(images[0], labels[0], True)
  reached = [g is not None for g in gradients]

  def body(k, sums, totals):
    grads, values = microstep(images[k], labels[k], False)
    with tf.device(device), tf.name_scope('accumulate'):
      grads = [g for g, r in zip(grads, reached) if r]
      return (k + 1, [a + g for a, g in zip(sums, grads)],
              [a + v for a, v in zip(totals, values)])
  _, sums, scalars = tf.while_loop(
      lambda k, *_: k < steps, body,
      (tf.constant(1), [g for g in gradients if g is not None], scalars))
  sums = iter(sums)
  return [next(sums) if r else None for r in reached], scalars


def check_batch(images, labels, num_shards, shard_word='num_clones'):
  """Raises `ConfigError` unless the batch splits evenly into `num_shards`."""
  rows, label_rows = images.shape[0], labels.shape[0]
  if rows is None or rows != label_rows:
    raise errors.ConfigError(
        f'images have {rows} rows and labels {label_rows}; pass a batch with '
        'as many labels as images.')
  if rows % num_shards:
    raise errors.ConfigError(
        f'a batch of {rows} rows does not split evenly over '
        f'{shard_word}={num_shards}; pass batch_size * {shard_word} rows '
        '(batch the dataset with drop_remainder=True).')


def worker_blocks(dataset, *, worker, num_workers, pieces):
  """Worker `worker`'s rows of each global batch, in `pieces` blocks.

  A global batch of B rows is cut into num_workers * pieces equal blocks;
  the worker gets blocks [worker * pieces, (worker + 1) * pieces), one
  dataset element each. Every worker reads the same pipeline (same seed),
  so a step of the whole job sees exactly the global batch one process
  would, split as one process's clones would split it.
  """
  def blocks(images, labels):
    rows = tf.shape(labels)[0] // (num_workers * pieces)
    first = worker * pieces * rows

    def block(k):
      start = first + tf.cast(k, tf.int32) * rows
      return images[start:start + rows], labels[start:start + rows]
    return tf.data.Dataset.range(pieces).map(block)
  return dataset.flat_map(blocks)
