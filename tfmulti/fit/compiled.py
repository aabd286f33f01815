"""Keras's side of a `TowersModel` step: its compiled loss and metrics.

The trainer computes the step; Keras's compiled loss is the loss it
minimises (`CompiledLoss`: several outputs, their losses, `loss_weights`,
sample and class weights, each a mean over rows, which the trainer
weights by each piece's rows, exactly), and Keras's metrics read the
step's outputs of the whole global batch (`record`), as plain `fit`
computes them. Evaluation follows the one rule of every door
(`Trainer.evaluate_outputs`): the data loss plus the model's losses.
"""

import functools

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import trainer
from tfmulti.deploy import batch_norm
from tfmulti.engine import step_calls


def checked_options(model, options):
  """`options` as `fit` runs them on `model`: its own synchronized
  BatchNorm honoured (`batch_norm.honoured`); refuses those `fit` cannot
  honour (`check_options`)."""
  check_options(options)
  return batch_norm.honoured(model, options)


def check_options(options):
  """Refuses step options `fit` cannot honour: gradient summaries, which
  reach no file under `fit`."""
  if options.summarize_gradients:
    raise errors.UnsupportedError(
        'summarize_gradients=True: fit writes no gradient summaries (the '
        "command line's --summarize_gradients does); drop it, or log the "
        'weights with keras.callbacks.TensorBoard(histogram_freq=1).')


def check_compile(options, loss, kwargs):
  """Refuses, in `compile`, what the towers cannot run: Keras's graph
  step (`run_eagerly=False`: the trainer's step is compiled, Keras's runs
  around it; taken out of `kwargs`), a loss that is not a mean, and N steps
  a call with measured clone shares (`step_calls.check_shares`)."""
  if kwargs.pop('run_eagerly', None) is False:
    raise errors.ConfigError(
        'run_eagerly=False: TowersModel runs Keras\'s step eagerly around '
        "the towers' compiled step; leave run_eagerly unset.")
  for each in tf.nest.flatten(loss):
    if isinstance(each, keras.losses.Loss):
      trainer.check_loss(each)
  step_calls.check_shares('steps_per_execution',
                          kwargs.get('steps_per_execution', 1), options)


class CompiledLoss:
  """Keras's compiled loss as the towers' `loss_fn(targets, outputs)`, with
  targets = `targets(labels, sample_weight)`: several outputs, their
  losses, `loss_weights` and sample (or class) weights, each a mean over the
  rows that the towers weight by a piece's rows, which is exact. A call
  leaves the per-output loss metrics alone: the step adds the whole
  batch's (`record`)."""

  def __init__(self, model):
    self.model = model

  def __call__(self, targets, outputs):
    return self.with_output_losses(targets, outputs)[0]

  def with_output_losses(self, targets, outputs):
    """(The loss, each output's unweighted loss for its metric)."""
    labels, sample_weight = (*targets, None)[:2]
    loss, output_losses = keras_internals.compiled_loss(
        self.model, labels, outputs, sample_weight)
    if loss is None:  # The model's own add_loss terms alone.
      return tf.zeros([]), output_losses
    # A mean-reduced Keras loss divides by the replica count in the
    # clones' lockstep; the towers weight by rows themselves.
    return keras_internals.unscale_for_replicas(loss), output_losses


def targets(labels, sample_weight):
  """What the towers split with the inputs: (labels,) or (labels,
  sample_weight), a nest of tensors (None is no row-major tensor)."""
  return (labels,) if sample_weight is None else (labels, sample_weight)


def record(model, images, whole_targets, total, outputs):
  """Keras's metrics of a training step (in a graph): the loss tracker
  takes the step's total loss weighted by the global batch's rows, each
  output's loss and the compiled metrics read the whole batch's outputs.
  Returns the logs, as Keras's `train_step` does."""
  labels, sample_weight = (*whole_targets, None)[:2]
  rows = tf.shape(tf.nest.flatten(images)[0])[0]
  keras_internals.loss_tracker(model).update_state(total,
                                                   sample_weight=rows)
  _, output_losses = CompiledLoss(model).with_output_losses(whole_targets,
                                                            outputs)
  keras_internals.track_output_losses(model, output_losses)
  return model.compute_metrics(images, labels, outputs,
                               sample_weight=sample_weight)


def evaluate(model, images, labels, sample_weight):
  """Keras's evaluation loss and metrics of a batch (in a graph), by the
  one evaluation rule: the compiled loss of the outputs of `model`'s
  trainer plus the model's losses (`Trainer.evaluate_outputs`)."""
  outputs, regularization = model.towers.evaluate_outputs(images)
  loss, output_losses = CompiledLoss(model).with_output_losses(
      targets(labels, sample_weight), outputs)
  keras_internals.track_output_losses(model, output_losses)
  loss += tf.cast(regularization, loss.dtype)
  rows = tf.shape(tf.nest.flatten(images)[0])[0]
  keras_internals.loss_tracker(model).update_state(loss, sample_weight=rows)
  return model.compute_metrics(images, labels, outputs,
                               sample_weight=sample_weight)


def traced_record(model):
  """`record` as one compiled call of its own (Keras runs the towers'
  step eagerly), called with the same arguments: the outputs cross into
  it as a `keras_internals.with_logits` nest, so the logits Keras keeps
  on a sigmoid's or softmax's outputs reach its cross-entropy. The
  compiled call is the returned function's `function`."""
  graph = traced(lambda model, images, targets, total, carried: record(
      model, images, targets, total, keras_internals.logits_kept(carried)),
                 model)

  def call(images, targets, total, outputs):
    return graph(images, targets, total, keras_internals.with_logits(outputs))
  call.function = graph  # Its traces, for those who count them.
  return call


def traced(graph, model):
  """`graph(model, ...)` as one compiled call (as Keras traces its own
  steps: no autograph)."""
  return tf.function(functools.partial(graph, model), autograph=False)


def unpack(data):
  """(images, labels, sample_weight) of a batch, as Keras unpacks it."""
  return keras.utils.unpack_x_y_sample_weight(data)
