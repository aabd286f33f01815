"""How a stage's backward pass meets the loss: fused, or split into B and W.

`Stages` picks one when it cuts the model, from the schedule, and its
passes ask it; they never ask the schedule:

  Fused  (GPipe, 1F1B, interleaved 1F1B) the last part's tape records the
         loss too, and one backward pass takes the input and the weight
         gradients together.
  Split  (ZB-H1) the loss is taken on a tape of its own, so that B starts
         from the model outputs' gradients and W, later, walks each part's
         tape (kept: persistent) for the weight gradients alone, never the
         loss's again.
"""

import keras
import tensorflow as tf

from tfmulti.pipeline import schedules

# Layers whose weight gradients B takes even where W is split off: their
# scale's and offset's gradients are the reductions (of the output gradient,
# and of it times the normalised input) that their input gradient is made
# of, so W would run them again.
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


class Fused:
  """One backward pass a stage and micro-batch (see the module)."""

  persistent = False  # A part's tape is asked once.

  def defers(self, operation):
    """Whether W, not B, takes `operation`'s weight gradients: never."""
    del operation
    return False

  def parts(self, stages, weight_parts):
    """What each stage's passes run, each under a tape: the stage whole
    (`weight_parts()` would cut it where W takes weights)."""
    del weight_parts
    return [[stage] for stage in stages]

  def loss_on_part_tape(self, loss_part):
    """Whether the part's own tape records the loss: the last part's."""
    return loss_part

  def take_loss(self, stages, context, flight, values, results, tapes):
    """Nothing more: the last part's tape holds the loss already."""
    del stages, context, flight, values, results, tapes

  def output_gradients(self, stages, kept, scale):
    """The model outputs' gradients the last stage starts from: none, its
    last part's tape starts from the loss."""
    del stages, kept, scale
    return {}

  def loss_targets(self, result, scale):
    """(targets, output gradients) a part's backward pass adds for the
    loss: the loss itself, scaled, where the part computed it."""
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

  persistent = True  # B and W ask a part's tape apart.
  defers = staticmethod(defers_weights)

  def parts(self, stages, weight_parts):
    """The stages cut where W takes weights: `weight_parts()`."""
    del stages
    return weight_parts()

  def loss_on_part_tape(self, loss_part):
    del loss_part  # The loss goes on a tape of its own (`take_loss`).
    return False

  def take_loss(self, stages, context, flight, values, results, tapes):
    """The micro-batch's loss on a tape of its own, from the model outputs
    among `values`, set on the last part's result."""
    with tf.GradientTape() as loss_tape:
      loss_tape.watch([values[k] for k in stages.output_keys])
      results[-1] = results[-1]._replace(
          loss=stages.loss_of(context, flight, values))
    tapes.append(loss_tape)

  def output_gradients(self, stages, kept, scale):
    """The model outputs' gradients, from the loss's own tape (zeros for
    an output the loss does not read)."""
    outputs = [kept.values[k] for k in stages.output_keys]
    grads = kept.tapes[-1].gradient(kept.results[-1].loss, outputs,
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
