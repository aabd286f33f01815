"""How a stage's backward pass meets the loss: fused, or split into B and W.

`Stages` picks one when it cuts the model, from the schedule, and its
passes ask it; they never ask the schedule:

  Fused  (GPipe, 1F1B, interleaved 1F1B) the last stage's tape records the
         loss too, and one backward pass takes the input and the weight
         gradients together.
  Split  (ZB-H1, ZB-V) the loss is taken on a tape of its own, so that B
         starts from the model outputs' gradients. B asks the stage's tape
         for every gradient at once, and the ops that only the deferred
         weights' gradients need (`held_back`: a Dense layer's
         MatMul(input, output gradient), its BiasAddGrad) wait for W's
         turn (`release`). No gradient op is built twice, and from B to W
         a stage keeps just what those ops read: each deferred layer's
         input and the gradient of its output (before its activation,
         whose gradient B took).
"""

import keras
import tensorflow as tf

from tfmulti import keras_internals
from tfmulti import slices
from tfmulti.pipeline import schedules

# Layers whose weight gradients B takes even where W is split off: their
# scale's and offset's gradients are the reductions (of the output gradient,
# and of it times the normalised input) that their input gradient is made
# of, so there is nothing of them to hold back.
_NORMALIZATIONS = (keras.layers.BatchNormalization,
                   keras.layers.LayerNormalization,
                   keras.layers.GroupNormalization)


def for_schedule(name):
  """The backward pass schedule `name` runs: `Split` where it splits B
  from W (`schedules.splits_backward`), else `Fused`."""
  return Split() if schedules.splits_backward(name) else Fused()


def defers_weights(operation):
  """Whether a split backward pass leaves `operation`'s weight gradients
  to W: a layer with trainable weights, not a normalization."""
  return bool(getattr(operation, 'trainable_variables', ())) and not isinstance(
      operation, _NORMALIZATIONS)


def mark():
  """Where the graph being traced stands: the ops made after it are new to
  `held_back` (None when running eagerly: nothing can wait then)."""
  if tf.executing_eagerly():
    return None
  return len(tf.compat.v1.get_default_graph().get_operations())


def held_back(start, later, others):
  """The ops to hold until W among those made since `start` (`mark`): the
  first of those that the gradients `later` need and `others` do not (the
  rest follow them). Stateful ops and what they read stay in B:
  tf.function chains stateful ops in the order they were made, and one
  held until W would hold the passes between. [] when eager."""
  if start is None:
    return []
  new = tf.compat.v1.get_default_graph().get_operations()[start:]
  new_names = {op.name for op in new}

  def upstream(gradients, ops=()):
    seen, todo = set(), list(ops) + [t.op for t in slices.components(
        [g for g in gradients if g is not None])]
    while todo:
      op = todo.pop()
      if op.name in new_names and op.name not in seen:
        seen.add(op.name)
        todo += [t.op for t in op.inputs] + list(op.control_inputs)
    return seen
  only_w = upstream(later) - upstream(
      others, [op for op in new if op.op_def.is_stateful])
  return [op for op in new if op.name in only_w and not any(
      t.op.name in only_w for t in op.inputs) and not any(
          c.name in only_w for c in op.control_inputs)]


def release(held, after):
  """Lets the `held` ops (`held_back`) run once the ops making `after`
  (the device's previous pass) are done; returns the gate they wait on
  (what W's pass made waits on it too, whatever B held)."""
  with tf.control_dependencies(after):
    gate = tf.no_op(name='pass_gate')
  for op in held:
    keras_internals.wait_for(op, gate)
  return gate


class Fused:
  """One backward pass a stage and micro-batch (see the module)."""

  def defers(self, operation):
    """Whether W, not B, takes `operation`'s weight gradients: never."""
    del operation
    return False

  def loss_on_stage_tape(self, last):
    """Whether the stage's own tape records the loss: the last stage's."""
    return last

  def take_loss(self, stages, context, flight, values, result):
    """The last stage's (result, loss tape): its tape holds the loss
    already, and there is no other."""
    del stages, context, flight, values
    return result, None

  def output_gradients(self, stages, kept, scale):
    """The model outputs' gradients the last stage starts from: none, its
    tape starts from the loss."""
    del stages, kept, scale
    return {}

  def loss_targets(self, result, scale):
    """(targets, output gradients) a backward pass adds for the loss: the
    loss itself, scaled, where the stage computed it."""
    if result.loss is None:
      return [], []
    return [result.loss], [scale]

  def handed_on(self, through, output_keys):
    """What the last stage's B hands its next pass beyond its gradients:
    nothing."""
    del through, output_keys
    return []


class Split(Fused):
  """B and W apart (see the module)."""

  defers = staticmethod(defers_weights)

  def loss_on_stage_tape(self, last):
    del last  # The loss goes on a tape of its own (`take_loss`).
    return False

  def take_loss(self, stages, context, flight, values, result):
    """The micro-batch's loss on a tape of its own, from the model outputs
    among `values`: (the last stage's result with it, that tape)."""
    with tf.GradientTape() as loss_tape:
      loss_tape.watch([values[k] for k in stages.output_keys])
      result = result._replace(loss=stages.loss_of(context, flight, values))
    return result, loss_tape

  def output_gradients(self, stages, kept, scale):
    """The model outputs' gradients, from the loss's own tape (zeros for
    an output the loss does not read)."""
    outputs = [kept.values[k] for k in stages.output_keys]
    grads = kept.loss_tape.gradient(kept.result.loss, outputs,
                                    output_gradients=scale)
    return {k: tf.zeros_like(x) if g is None else g
            for k, x, g in zip(stages.output_keys, outputs, grads)}

  def loss_targets(self, result, scale):
    del result, scale  # The loss's gradients come through its own tape.
    return [], []

  def handed_on(self, through, output_keys):
    """The model outputs' gradients too: a first stage whose weights wait
    for W has no other gradient to hand on."""
    return [through[k] for k in output_keys if k in through]
