"""Keras's `steps_per_execution` on the towers: N steps in one compiled call.

`TowersModel` runs Keras's step eagerly around the trainer's compiled
step, so Keras's own multi-step loop would still make one Python call a
step. `StepLoop` is the train function `fit` calls with its iterator
instead: the one compiled loop of N steps (`engine.step_calls.
steps_in_a_loop`, which the command line's `--steps_per_loop` runs too),
each step the trainer's (`loop_step`: its compiled step and Keras's
metrics). Keras's callbacks and the progress bar see the steps at
call boundaries, as with Keras's own `steps_per_execution`.

The loop runs batches of the full batch's rows (across workers, each
worker trains its rows of each): a batch of other rows (an epoch's last
partial batch) ends the call, which runs it as one step of its own.
Keras's eager steps run instead where a step needs the host: a fit's
first step (it builds the compiled metrics and fixes the full batch's
rows), steps a resumed `BackupAndRestore` run passes over, and inputs
that are not a tf.data iterator (`train_on_batch`).
"""

from absl import logging
import keras
import tensorflow as tf

from tfmulti.engine import step_calls
from tfmulti.fit import compiled


def wrap(model, keras_function):
  """The train function of `model` (a `TowersModel`): a `StepLoop` around
  Keras's own `keras_function` where `steps_per_execution` > 1, else
  Keras's."""
  if model.steps_per_execution > 1:
    return StepLoop(model, keras_function)
  return keras_function


class StepLoop:
  """The train function of a `TowersModel` with `steps_per_execution` > 1,
  in one process or on each worker (every worker's calls end at the same
  steps): `__call__(iterator)` returns the logs of the call's last step,
  as Keras's own.

  Attributes:
    function: the compiled loop, traced once for each full batch's rows.
  """

  def __init__(self, towers_model, keras_function):
    """`keras_function`: Keras's own train function, for eager steps."""
    self._model = towers_model
    self._keras_function = keras_function
    self.function = tf.function(self._graph, autograph=False)

  def __call__(self, iterator):
    rows = self._model.full_rows()
    if rows is None or not isinstance(iterator, tf.data.Iterator):
      return self._keras_function(iterator)
    ran, logs, other = self.function(iterator, rows)
    if other.has_value():  # A batch of other rows: a step of its own.
      return self._model.train_step(_no_optionals(other.get_value()))
    if not ran:
      raise StopIteration  # As Keras's own: the epoch's input ran out.
    return logs.get_value()

  def _graph(self, iterator, rows):
    steps = self._model.steps_per_execution
    logging.info('steps_per_execution=%d: up to %d steps of %d rows a '
                 'compiled call', steps, steps, rows)

    def step(batch):
      # The static rows the eager steps' trace has: the same graph.
      data = keras.tree.map_structure(
          lambda t: t if t is None else tf.ensure_shape(
              t, [rows] + t.shape[1:]), _no_optionals(batch))
      return loop_step(self._model, data)
    ran, _, logs, other = step_calls.steps_in_a_loop(
        step, iterator, steps,
        fits=lambda batch: tf.equal(_rows(batch), rows))
    return ran, logs, other


def loop_step(model, data):
  """One step of a compiled loop on a full global batch: the trainer's
  step (`Trainer.loop_step`) and Keras's metrics of its outputs (`model`
  a `TowersModel`): (its total loss, the logs)."""
  images, labels, sample_weight = compiled.unpack(data)
  targets = compiled.targets(labels, sample_weight)
  result = model.towers.loop_step((images, targets), with_outputs=True,
                                  whole_batch=True)
  return result.total, compiled.record(model, images, targets, result.total,
                                       result.outputs)


def _rows(data):
  return tf.shape(tf.nest.flatten(data)[0])[0]


def _no_optionals(data):
  """`data` with Keras's empty parts (Optionals) as None, as Keras's own
  train function passes it to `train_step`."""
  return keras.tree.map_structure(
      lambda t: None if isinstance(t, tf.experimental.Optional) else t, data)
