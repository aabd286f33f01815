"""The trainer contract every path implements, and the loss rules they share.

The training loop (`train.loop`) drives any `Trainer`: the towers
(`deploy.DeployedModel`), the tf.distribute paths
(`distribute.DistributedModel`) and the towers inside a strategy
(`deploy.towers_in_strategy.WorkerTowers`). They share the step record
(`StepOutputs`) and one objective, written here once (`objective`): each
shard's mean loss weighted by its rows of the global batch (`shard_loss`),
with a Keras loss that does not divide by the replica count (`mean_loss`),
the regularization penalty counted once over the job (`penalty`), and the
float16 loss scale (`loss_scale_of`). How rows are cut is `rows`'s.
Every path refuses a loss over a Keras mask (`check_no_mask`) and runs a
piece's forward pass off the root name scope (`off_the_root`).
"""

import abc
import collections
import contextlib

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals

# What one training step reports: `total` is the loss that was minimised,
# `regularization` its regularization part, `clones` each clone's (or
# tf.distribute replica's) share of `total` (they sum to it); `gradients`
# maps each variable's path to its combined gradient, when asked for (else
# {}); `outputs` are the model's training outputs for the batch's rows, in
# order, when asked for (for Keras's compiled metrics; else None).
StepOutputs = collections.namedtuple(
    'StepOutputs', ['total', 'regularization', 'clones', 'gradients',
                    'outputs'], defaults=(None,))


class Trainer(abc.ABC):
  """What a front door may call, whichever path runs the step.

  The command line's loop (`train.loop`) and Keras's `fit`
  (`fit.TowersModel`) drive every path through these methods alone: a
  feature that crosses the doors is written once, below them.

  Attributes:
    model: the `keras.Model` being trained (checkpointed, evaluated).
    optimizer: its Keras optimizer (checkpointed with its slots).
    step_function: the compiled step (a `tf.function`), whose traces
      `trace_count` counts.
  """

  model: keras.Model
  optimizer: keras.optimizers.Optimizer
  step_function: tf.types.experimental.PolymorphicFunction

  @abc.abstractmethod
  def distribute_dataset(self, dataset):
    """`dataset`'s batches as `train_step_outputs` takes them.

    Args:
      dataset: a `tf.data.Dataset` of (images, labels) global batches.

    Returns:
      An iterable of (images, labels), split as this path needs.
    """

  @abc.abstractmethod
  def train_step_outputs(self, images, labels, *, partial=False,
                         with_outputs=False, whole_batch=False):
    """Runs one step on one element of `distribute_dataset`.

    Args:
      images, labels: the element (nests of tensors).
      partial: a short last batch (Keras's `fit`), which may leave clones
        or micro-batches empty, as plain `fit` trains it.
      with_outputs: also return the training outputs of the job's rows,
        in row order (for Keras's compiled metrics).
      whole_batch: `images` and `labels` are the job's whole global batch
        (Keras's `fit` reads it on every worker): each worker takes its
        rows, after the workers agree that they read the same batch.

    Returns:
      The step's `StepOutputs`.
    """

  @abc.abstractmethod
  def predict(self, images):
    """Inference logits of `images` (any number of rows)."""

  @abc.abstractmethod
  def evaluate_outputs(self, images):
    """(inference outputs of `images`, the model's losses on them): the
    one evaluation rule, Keras's: the loss `evaluate` reports is the data
    loss plus these (the weight penalties and the `add_loss` terms, as one
    device counts them). Across workers, each evaluates its rows and every
    worker gets the whole batch's (call it on every worker)."""

  def check_batch(self, global_rows, partial=False):
    """Raises `ConfigError` for a global batch of `global_rows` rows that
    this path's step cannot cut (before training starts)."""
    del global_rows, partial  # Any batch, unless a path says otherwise.

  def train_step(self, images, labels):
    """One step; returns the total loss (a scalar tensor)."""
    return self.train_step_outputs(images, labels).total

  def loop_iterator(self, batches):
    """An iterator over `batches` (`distribute_dataset`'s) that a compiled
    loop of steps reads (`engine.step_calls.InALoop`)."""
    return iter(batches)

  def loop_step(self, element, with_outputs=False, whole_batch=False):
    """One step on an element of `loop_iterator`, inside a compiled loop:
    a call of `step_function` (traced once for every loop), returning its
    `StepOutputs` (`train_step_outputs`' arguments)."""
    return self.train_step_outputs(*element, with_outputs=with_outputs,
                                   whole_batch=whole_batch)

  @property
  def trace_count(self):
    """How many times the training step has been traced."""
    return self.step_function.experimental_get_tracing_count()

  @property
  def clone_shares(self):
    """Each clone's (or replica's) share of a step's rows, as the last
    step cut them; None for equal shares. Read-only: a path sets its own
    (from the step options, or measured)."""
    return None


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
  twice here; its `call()` gives the unreduced per-example losses. A plain
  function may return one value a row (`keras.losses.mse`) or their mean:
  the mean of either is the mean over the rows.
  """
  if isinstance(loss_fn, keras.losses.Loss):
    return tf.reduce_mean(loss_fn.call(labels, outputs))
  return tf.reduce_mean(loss_fn(labels, outputs))


# The one reduction the towers reproduce: the mean over the global batch.
_MEAN_REDUCTION = 'sum_over_batch_size'


def check_loss(loss_fn):
  """Raises `ConfigError` for a loss whose reduction is not the mean: the
  towers weight each shard's mean by its rows, which only a mean keeps."""
  reduction = getattr(loss_fn, 'reduction', _MEAN_REDUCTION)
  if isinstance(loss_fn, keras.losses.Loss) and reduction != _MEAN_REDUCTION:
    raise errors.ConfigError(
        f'loss {loss_fn.name!r} has reduction={reduction!r}: the towers '
        "compute the mean over the global batch; use reduction="
        f"'{_MEAN_REDUCTION}' (Keras's default).")


def check_no_mask(model):
  """Raises `ConfigError` for a model whose output carries a Keras mask: a
  masked loss is a mean over each piece's valid entries, not its rows, so
  weighting pieces by rows (every path here does) would train wrong."""
  for output in getattr(model, 'outputs', None) or ():
    if keras_internals.mask_of(output) is not None:
      raise errors.ConfigError(
          f'model {model.name!r} outputs a Keras mask (from '
          f'{output.name!r}), whose loss is a mean over valid entries, not '
          'rows, so its pieces cannot be weighted by rows; drop the mask '
          'from the output or train with plain Keras fit.')


@contextlib.contextmanager
def off_the_root(name):
  """Opens name scope `name` where the current scope is the root, else
  nothing.

  Keras opens a scope named after each layer it calls, and TensorFlow
  refuses a root scope name with a leading '_' (a class `_Scale` is named
  '__scale'), which any enclosing scope takes. A piece's forward pass may
  be traced at the root: in replica 0 of a tf.distribute strategy (the
  others run under 'replica_<i>') or in a function of its own (XLA's).
  """
  if tf.get_current_name_scope():
    yield
  else:
    with tf.name_scope(name):
      yield


def loss_scale_of(optimizer):
  """The dynamic loss scale of a `LossScaleOptimizer`; 1.0 for others (a
  product with it is exact), so a step scales its loss alike under both."""
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    return optimizer.dynamic_scale
  return 1.0


def gradients_by_path(grads_and_vars, scale=1.0):
  """{variable path: gradient}, divided by the loss `scale` (each
  `IndexedSlices` made dense: a summary reads the whole gradient)."""
  return {variable.path:
          tf.convert_to_tensor(gradient) / tf.cast(scale, gradient.dtype)
          for gradient, variable in grads_and_vars}


def penalty(losses, weight, dtype=tf.float32):
  """The weight penalties' sum times `weight`, as `dtype`.

  The variables are shared, so a penalty counts once over the job: each
  piece of the step passes its part of it as `weight` (1 on one device; a
  Python 0 where it counts elsewhere, which adds no op).
  """
  if not losses or (isinstance(weight, (int, float)) and weight == 0):
    return tf.zeros([], dtype)
  return (tf.add_n([tf.cast(loss, dtype) for loss in losses]) *
          tf.cast(weight, dtype))


def model_loss(losses, rows, global_rows, dtype=tf.float32):
  """A piece's part of the model's `add_loss` terms (activity
  regularizers, a layer's own): their sum on the piece's rows, weighted by
  its rows of the global batch, as the data loss is (`shard_loss`).

  Keras reads such a term as a mean over the batch's rows (it divides an
  activity penalty by them), as tf.distribute does (it scales it by
  1 / replicas); the pieces' parts then sum to the term on the whole batch.
  """
  if not losses:
    return tf.zeros([], dtype)
  return shard_loss(tf.add_n([tf.cast(loss, dtype) for loss in losses]),
                    rows, global_rows)


def objective(loss_fn, labels, outputs, *, global_rows, model_losses=(),
              penalties=(), penalty_weight=0, loss_scale=None):
  """A piece's part of the job's loss, and what its gradient is taken of.

  Args:
    loss_fn: `loss_fn(labels, outputs)` -> mean loss over those rows.
    labels, outputs: the piece's rows (nests).
    global_rows: rows of the whole job's batch of this update.
    model_losses: the `add_loss` terms the piece's forward pass produced.
    penalties: the weight penalties it produced.
    penalty_weight: this piece's part of the penalties (see `penalty`).
    loss_scale: the float16 loss scale, or None.

  Returns:
    (loss, regularization, scaled_loss): the piece's part of the total loss
    (its regularization included), the regularization alone (the weight
    penalties and the model's losses), and the loss times the loss scale.
  """
  rows = tf.shape(tf.nest.flatten(outputs)[0])[0]
  loss = shard_loss(mean_loss(loss_fn, labels, outputs), rows, global_rows)
  regularization = (penalty(penalties, penalty_weight, loss.dtype) +
                    model_loss(model_losses, rows, global_rows, loss.dtype))
  loss += regularization
  return loss, regularization, scaled(loss, loss_scale)


def scaled(loss, loss_scale):
  """`loss` times the float16 loss scale (None: unscaled)."""
  return loss if loss_scale is None else loss * tf.cast(loss_scale,
                                                        loss.dtype)
