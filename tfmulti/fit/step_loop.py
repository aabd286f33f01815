"""Keras's `steps_per_execution` on the towers: N steps in one compiled call.

`TowersModel` runs Keras's step eagerly around the towers' compiled step,
so Keras's own multi-step loop would still make one Python call a step.
`StepLoop` is the train function `fit` calls with its iterator instead:
a `tf.while_loop` that reads the iterator and runs the towers' compiled
step (the one `TowersModel.train_step` calls) up to N times, as Keras's
`TensorFlowTrainer` loop does. Keras's callbacks and the progress bar see
the steps at call boundaries, as with Keras's own `steps_per_execution`.

The loop runs batches of the full batch's rows, with the layout of the
last full step (across workers, each worker trains its rows of each): a
batch of other rows (an epoch's last partial batch) ends the call, which
runs it as one step of its own (its own layout).
Keras's eager steps run instead where a step needs the host: a fit's
first step (it builds the compiled metrics and fixes the full layout),
steps a resumed `BackupAndRestore` run passes over, and inputs that are
not a tf.data iterator (`train_on_batch`).
"""

from absl import logging
import keras
import tensorflow as tf

from tfmulti import keras_internals


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
    function: the compiled loop, traced once for each full layout.
  """

  def __init__(self, towers_model, keras_function):
    """`keras_function`: Keras's own train function, for eager steps."""
    self._model = towers_model
    self._keras_function = keras_function
    self.function = tf.function(self._graph, autograph=False)

  def __call__(self, iterator):
    full = self._model.full_batch()
    if full is None or not isinstance(iterator, tf.data.Iterator):
      return self._keras_function(iterator)
    ran, logs, other = self.function(iterator, *full)
    if other.has_value():  # A batch of other rows: a step of its own.
      return self._model.train_step(_no_optionals(other.get_value()))
    if not ran:
      raise StopIteration  # As Keras's own: the epoch's input ran out.
    return logs

  def _graph(self, iterator, rows, layout):
    model = self._model
    steps = model.steps_per_execution
    logging.info('steps_per_execution=%d: up to %d steps of %d rows a '
                 'compiled call', steps, steps, rows)

    def fits(batch):  # A batch the loop runs: another ends the call.
      return tf.cond(
          batch.has_value(),
          lambda: tf.equal(_rows(batch.get_value()), rows),
          lambda: tf.constant(False))

    def body(i, _, batch):
      # The static rows the eager steps' trace has: the same graph.
      data = keras.tree.map_structure(
          lambda t: t if t is None else tf.ensure_shape(
              t, [rows] + t.shape[1:]), _no_optionals(batch.get_value()))
      logs = model.loop_step(data, layout)
      # Not read past the call's last step (Keras's own loop neither).
      after = tf.cond(i + 1 < steps, iterator.get_next_as_optional,
                      lambda: tf.experimental.Optional.empty(
                          iterator.element_spec))
      return i + 1, logs, after

    # The structure a step's logs have: the metrics' results, read now.
    logs = model.get_metrics_result()
    ran, logs, other = tf.while_loop(
        lambda i, logs, batch: fits(batch), body,
        (tf.constant(0), logs, iterator.get_next_as_optional()))
    keras_internals.set_element_spec(other, iterator.element_spec)
    return ran, logs, other


def _rows(data):
  return tf.shape(tf.nest.flatten(data)[0])[0]


def _no_optionals(data):
  """`data` with Keras's empty parts (Optionals) as None, as Keras's own
  train function passes it to `train_step`."""
  return keras.tree.map_structure(
      lambda t: None if isinstance(t, tf.experimental.Optional) else t, data)
