"""How the loop calls the step: one step a call, or many in one call.

Every step of the command line is a call of a compiled `tf.function`; for
a small model the Python call costs more than the step (D2L's LeNet is
slower on 2 GPUs than on 1). `--steps_per_loop=N` runs N steps in one call
(`InALoop`: a `tf.while_loop` over the input's iterator, as Orbit's loops
and Keras's `steps_per_execution` do); the loop ends its calls at every
step where something must happen on the host (a progress line, a
checkpoint, an epoch's end, a profile's bounds), so those, the non-finite
stop and signals act at call boundaries, exactly where they would have.

Each call runs the trainer's own compiled step (`Trainer.loop_step` calls
its `step_function`), traced once and shared by every call: the same
kernels, the same bits as one step a call. The loop itself
(`steps_in_a_loop`) is the one Keras's `steps_per_execution` runs under
`TowersModel` too (`fit.step_loop`). Every call of `InALoop` is a
call of the loop, one step ones too: the run's first call traces the loop
(and the step inside it), and nothing is built later (on LeNet, a loop
built after single-step calls was a second build of 0.28 s).
`steps_per_loop='auto'` times the first steps one a call and picks N for
about `TARGET_SECONDS` a call, at most the steps between progress lines
(`Plan`).
"""

import dataclasses
import math

from absl import logging
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import trainer as trainer_lib

AUTO = 'auto'
RAN_OUT = ('the input ran out before the steps the job counted in it; '
           'check the data set\'s size (train_examples)')
TARGET_SECONDS = 0.05  # A call's length under 'auto': dispatch is hidden.
TIMED_STEPS = 3  # Steps 'auto' times one a call, after the traced first.


def check_shares(name, steps, options):
  """Refuses `steps` (N of the option `name`) > 1 a call with measured
  clone shares (`options.auto_shares`): the balancer times the clones
  between steps."""
  if options.auto_shares and steps not in (1, AUTO):
    raise errors.ConfigError(
        f'{name}={steps} with clone_shares=auto: the balancer times the '
        f'clones between steps, one step a call; set {name}=1, or give '
        'fixed clone shares.')


class OneACall:
  """Each step one Python call of the trainer's step (`train_step_outputs`)."""

  def __init__(self, trainer):
    self._trainer = trainer

  def iterator(self, batches):
    """An iterator over `batches` (`Trainer.distribute_dataset`'s)."""
    return iter(batches)

  def run(self, iterator, num_steps):
    """Runs `num_steps` steps, a call each: (their total losses, a list of
    scalar tensors; the last step's `StepOutputs`)."""
    totals = []
    for _ in range(num_steps):
      outputs = self._trainer.train_step_outputs(*next(iterator))
      totals.append(outputs.total)
    return totals, outputs


def steps_in_a_loop(step, iterator, num_steps, fits=None):
  """The one compiled loop of N steps, under both doors (the command
  line's `--steps_per_loop` through `InALoop`, Keras's
  `steps_per_execution` through `fit.step_loop`): in a graph, a
  `tf.while_loop` that reads `iterator` and runs `step` on its elements
  while fewer than `num_steps` ran and `fits(element)` (a scalar bool
  tensor; None: every element fits). It reads no element past the call's
  last step, as Keras's own loop.

  The last step's results ride the loop in an Optional whose structure the
  body's one trace of the step gives (Keras's own loop does so), so the
  loop holds the step once, not a first step peeled off besides.

  Args:
    step: `step(element)` -> (its total loss, the results to return): the
      trainer's compiled step (and, under `fit`, the metrics).
    iterator: a tf.data or tf.distribute iterator.
    num_steps: at most this many steps (a tensor or an int).
    fits: `fits(element)`: whether the loop runs it; an element that does
      not ends the call and comes back unrun.

  Returns:
    (steps run, their total losses stacked (float32), an Optional of the
    last step's results, an Optional of the element read but not run).
  """
  last = tf.experimental.Optional.empty(None)

  def runs(i, batch):
    if fits is None:
      return tf.logical_and(i < num_steps, batch.has_value())
    return tf.logical_and(i < num_steps, tf.cond(
        batch.has_value(), lambda: fits(batch.get_value()),
        lambda: tf.constant(False)))

  def body(i, totals, _, batch):
    total, results = step(_as_read(batch.get_value(), iterator.element_spec))
    value = tf.experimental.Optional.from_value(results)
    keras_internals.set_element_spec(last, value.element_spec)
    after = tf.cond(i + 1 < num_steps, iterator.get_next_as_optional,
                    lambda: tf.experimental.Optional.empty(
                        iterator.element_spec))
    return (i + 1, totals.write(i, tf.cast(total, tf.float32)), value,
            after)
  ran, totals, carried, other = tf.while_loop(
      lambda i, totals, _, batch: runs(i, batch), body,
      (tf.constant(0), tf.TensorArray(tf.float32, size=0, dynamic_size=True,
                                      element_shape=[]),
       last, iterator.get_next_as_optional()))
  keras_internals.set_element_spec(carried, last.element_spec)
  keras_internals.set_element_spec(other, iterator.element_spec)
  return ran, totals.stack(), carried, other


def _as_read(element, spec):
  """`element`, read through an Optional, with the static shapes the
  iterator's `spec` gives (a tf.distribute iterator's Optional forgets a
  batch's rows, which a step's layout is cut by)."""
  def shaped(tensor, tensor_spec):
    if isinstance(tensor, tf.Tensor) and isinstance(tensor_spec,
                                                    tf.TensorSpec):
      return tf.ensure_shape(tensor, tensor_spec.shape)
    return tensor
  return tf.nest.map_structure(shaped, element, spec, expand_composites=True)


class InALoop:
  """Many steps in one compiled call: `steps_in_a_loop` over the input's
  iterator, each step the trainer's (`Trainer.loop_step`).

  One trace serves every call (the step count is a tensor); the trainer's
  `clone_shares` key the trace, so new shares trace a loop of their own.
  """

  def __init__(self, trainer):
    self._trainer = trainer
    self.function = tf.function(self._graph, autograph=False)

  def iterator(self, batches):
    """The trainer's `loop_iterator`: a tf.data or tf.distribute iterator,
    which the compiled loop reads (a Python iterator it cannot)."""
    iterator = self._trainer.loop_iterator(batches)
    if not isinstance(iterator, (tf.data.Iterator,
                                 tf.distribute.DistributedIterator)):
      raise TypeError(
          f'{type(self._trainer).__name__}.loop_iterator gave a '
          f'{type(iterator).__name__}, which a compiled loop cannot read; '
          'give a tf.data or tf.distribute iterator, or run one step a call '
          '(steps_per_loop=1).')
    return iterator

  def run(self, iterator, num_steps):
    """As `OneACall.run`, every call through the loop."""
    totals, (total, regularization, clones, gradients) = self.function(
        iterator, tf.constant(num_steps, tf.int32),
        self._trainer.clone_shares)
    return [totals], trainer_lib.StepOutputs(total, regularization, clones,
                                             gradients)

  def _graph(self, iterator, num_steps, shares):
    del shares  # Only keys the trace.

    def step(element):
      outputs = tuple(self._trainer.loop_step(element))[:4]  # No outputs.
      return outputs[0], outputs
    ran, totals, carried, _ = steps_in_a_loop(step, iterator, num_steps)
    # The job counted the input's batches: fewer would misplace every
    # position after (next(iterator) raised here before the loop was one).
    ran_all = tf.debugging.assert_equal(ran, num_steps, message=RAN_OUT)
    with tf.control_dependencies([ran_all]):
      return tf.identity(totals), carried.get_value()


@dataclasses.dataclass
class Plan:
  """How many steps each call runs.

  Attributes:
    steps_per_loop: N, or 'auto' until the first steps were timed.
    log_every_steps: a call never runs past a progress line.
    timed: seconds of the steps timed one a call under 'auto'.
  """
  steps_per_loop: object
  log_every_steps: int
  timed: list = dataclasses.field(default_factory=list)

  def count(self, bound):
    """Steps of the next call: at most `bound` (the steps to the next
    host event), one a call while 'auto' is timing."""
    if self.steps_per_loop == AUTO:
      return 1
    return max(1, min(self.steps_per_loop, bound))

  def timing(self, steps_run):
    """Whether the next call is timed (under 'auto', after the first)."""
    return self.steps_per_loop == AUTO and steps_run >= 1

  def record(self, seconds):
    """Takes a timed one-step call's seconds; picks N after enough."""
    self.timed.append(seconds)
    if len(self.timed) < TIMED_STEPS:
      return
    step_seconds = min(self.timed)  # The least disturbed of them.
    self.steps_per_loop = int(min(self.log_every_steps, max(
        1, math.ceil(TARGET_SECONDS / max(step_seconds, 1e-6)))))
    logging.info('steps_per_loop auto: a step takes %.2f ms, so %d steps '
                 'a call (about %.0f ms, at most a progress line\'s %d)',
                 step_seconds * 1e3, self.steps_per_loop,
                 step_seconds * self.steps_per_loop * 1e3,
                 self.log_every_steps)


@dataclasses.dataclass(frozen=True)
class Calls:
  """The loop's way of calling the step: `runner` (`OneACall` or
  `InALoop`) and its `Plan`."""
  runner: object
  plan: Plan


def calls(trainer, steps_per_loop, log_every_steps):
  """`Calls` for `steps_per_loop` (N or 'auto'): `OneACall` for 1, else
  `InALoop` ('auto' times its first steps one a call through the loop)."""
  return Calls(
      OneACall(trainer) if steps_per_loop == 1 else InALoop(trainer),
      Plan(steps_per_loop, log_every_steps))
