"""Keras's own steps through the towers: the part `TowersModel` runs for a
model that brings no step of its own.

`compile` builds the trainer from the registry (`engine.registry`, the
door's gate) with the user's optimizer, made at home beside the
variables; `train_step` runs the trainer's step on the batch's real rows
(a partial last batch split as evenly as it goes, a resumed fit's passed
steps read and skipped) and records Keras's compiled metrics of its
outputs; `test_step` evaluates a batch on the clones. A model's own steps
are the other part (`own_steps.OwnSteps`), chosen once when the
`TowersModel` is made.
"""

import dataclasses

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import rows
from tfmulti.engine import registry
from tfmulti.fit import compiled
from tfmulti.fit import step_loop


class KerasSteps:
  """Keras's steps of `towers` (a `TowersModel`) on its trainer."""

  metrics = None  # Keras's compiled metrics, as a plain model's.

  def __init__(self, towers):
    self.towers = towers

  def compile(self, optimizer='rmsprop', loss=None, metrics=None, *,
              jit_compile='auto', **kwargs):
    """Keras's `compile`, then the trainer, from the registry: the
    optimizer built beside the variables and every variable checked.
    `jit_compile` is the step option `xla`: True compiles each clone with
    XLA, 'auto' (the default) follows `xla_rule`."""
    towers = self.towers
    compiled.check_compile(towers.options, loss, kwargs)
    if jit_compile in (True, False):  # 'auto' leaves the rule to decide.
      towers.options = registry.check_options(
          towers.door.gate, dataclasses.replace(towers.options,
                                                xla=jit_compile),
          towers.config)
    with tf.device(towers.config.optimizer_variables_device()):
      with towers.door.scope():  # Its variables, the workers' too.
        optimizer = at_home(optimizer)
      keras.Model.compile(towers, optimizer=optimizer, loss=loss,
                          metrics=metrics, jit_compile=False,
                          run_eagerly=True, **kwargs)
    towers.compile_args = dict(loss=loss, metrics=metrics, **kwargs)
    towers.towers = towers.door.build(towers.model,
                                      compiled.CompiledLoss(towers),
                                      towers.optimizer, towers.options)
    # Keras's metrics of a step, and an evaluation batch: a compiled call
    # each (eager, the metrics cost more than a small model's step).
    self._record = compiled.traced_record(towers)
    self._evaluate = compiled.traced(compiled.evaluate, towers)

  def train_step(self, data):
    towers = self.towers
    images, labels, sample_weight = compiled.unpack(data)
    # The compiled loss and metrics, built once before a step is traced.
    keras_internals.build_compiled(towers, (images, labels, sample_weight))
    targets = compiled.targets(labels, sample_weight)
    rows_ = rows.batch_rows(images, targets)
    if towers.passes.take(rows_):  # Trained before the restart: read only.
      return towers.get_metrics_result()
    partial = towers.batches.partial(rows_)
    towers.batches.note(images)
    result = towers.towers.train_step_outputs(
        images, targets, partial=partial, with_outputs=True,
        whole_batch=True)
    return self._record(images, targets, result.total, result.outputs)

  def test_step(self, data):
    images, labels, sample_weight = compiled.unpack(data)
    keras_internals.build_compiled(self.towers,
                                   (images, labels, sample_weight))
    return self._evaluate(images, labels, sample_weight)

  @property
  def step_function(self):
    """The compiled step a train step runs (the trainer's)."""
    return self.towers.towers.step_function

  def train_function(self, keras_function):
    """Keras's train function, or N steps a compiled call where
    `steps_per_execution` > 1 (`step_loop`)."""
    return step_loop.wrap(self.towers, keras_function)

  @staticmethod
  def check_fit(callbacks):
    """Every callback `fit` takes serves Keras's steps."""
    del callbacks


def at_home(optimizer):
  """`optimizer` itself, its own variables and strategy made again in the
  current device and strategy scope (`keras_internals`): one made
  elsewhere would keep them there. Nothing is rebuilt from its config, so
  its schedule, exclusions and a subclass's own state stay as given."""
  if not isinstance(optimizer, keras.optimizers.Optimizer):
    return optimizer  # A name: Keras makes it here.
  if optimizer.built:
    raise errors.ConfigError(
        f'optimizer {optimizer.name!r} is already built (it has slots for '
        'other variables); pass a new optimizer to compile.')
  keras_internals.remake_optimizer_state(optimizer)
  return optimizer
