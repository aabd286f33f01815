"""One piece's pass: the body every path runs on its rows of a step.

A piece (a clone's shard, an atom, a tf.distribute replica's rows, a stage's
micro-batch) runs the model with `stateless_call`, so nothing is
assigned while the step is traced: its random layers' generators folded
with the piece's first row (no two pieces repeat a mask, and a piece draws
the same wherever it runs) and handed back advanced from the unfolded
state, the model's losses split into `add_loss` terms and weight
penalties. `forward` is that pass; `Body` adds the piece's part of the
objective and its gradient, under a tape of its own. The towers' clones,
the lockstep clones, the tf.distribute replicas and (through `forward`,
under their own tapes) the stages all run these, and nothing else.
"""

import contextlib
from typing import NamedTuple

import tensorflow as tf

from tfmulti import keras_internals
from tfmulti import trainer


class StepTerms(NamedTuple):
  """What every piece of a step counts by.

  Attributes:
    global_rows: rows of the whole job's batch of this update; each
      piece's loss is a mean over its rows weighted by rows / global_rows.
    loss_scale: the float16 loss scale the gradient is taken of `loss`
      times (1.0, or a tensor).
    shift: rows added to every piece's offset (0, or a tensor inside the
      accumulation loop, which runs one accumulation step's pieces again).
  """
  global_rows: int
  loss_scale: object = 1.0
  shift: object = 0


def forward(model, trainable, non_trainable, inputs, offset):
  """`model` on a piece's `inputs` in training, from the variables' values.

  Returns:
    (outputs, the new non-trainable values, the `add_loss` terms, the
    weight penalties); the random generators' states in the new values
    advanced from their unfolded state.
  """
  seeds = keras_internals.seed_indices(model)
  folded = keras_internals.fold_seeds(non_trainable, seeds, offset)
  outputs, new_non_trainable, losses = keras_internals.stateless_run(
      model, trainable, folded, inputs, training=True)
  model_losses, penalties = keras_internals.split_losses(model, losses)
  return (outputs, keras_internals.unfold_seeds(
      new_non_trainable, folded, non_trainable, seeds), model_losses,
          penalties)


def whole(trainable, watch):
  """`Body`'s reading of the model's own values: watched, and the
  gradients theirs."""
  watch(trainable)
  return trainable, trainable, contextlib.nullcontext()


class Body:
  """A piece's forward and backward pass; changes no variable.

  Called as `body(trainable, non_trainable, images, labels, penalty_weight,
  offset, terms)`: the variables' values as tensors (so XLA can compile the
  pass apart from variables that live on another device), the piece's rows
  (nests), its part of the weight penalties and its first row in the
  global batch (`layouts.Piece`), and the step's `StepTerms`. Returns
  (outputs, loss, regularization, gradients, new non-trainable values),
  the outputs as a `keras_internals.with_logits` nest:
  the loss is the piece's part of the job's (its regularization
  included); the gradients are of the loss times the loss scale.
  """

  def __init__(self, model, loss_fn, scope='clone', read=None):
    """`scope`: the name scope the pass opens where it is traced at the
    root (lockstep replica 0, an XLA function; `trainer.off_the_root`);
    `read(trainable, watch)`: the storage's reading of `trainable` for the
    pass, under its tape's `watch` (`mesh.sharding`): (the model's
    trainable values, what the gradients are taken of, a context the
    pass runs in); None: `trainable` are the model's values and the
    gradients theirs."""
    self.model = model
    self.loss_fn = loss_fn
    self.scope = scope
    self.read = read or whole

  def __call__(self, trainable, non_trainable, images, labels,
               penalty_weight, offset, terms):
    with trainer.off_the_root(self.scope):
      with tf.GradientTape() as tape:
        values, sources, context = self.read(trainable, tape.watch)
        with context:
          outputs, new_non_trainable, model_losses, penalties = forward(
              self.model, values, non_trainable, images, offset)
        loss, regularization, scaled_loss = trainer.objective(
            self.loss_fn, labels, outputs, global_rows=terms.global_rows,
            model_losses=model_losses, penalties=penalties,
            penalty_weight=penalty_weight, loss_scale=terms.loss_scale)
    gradients = tape.gradient(scaled_loss, sources)
    return (keras_internals.with_logits(outputs), loss, regularization,
            gradients, new_non_trainable)
