"""The training loop: steps, progress, summaries, checkpoints, evaluation.

It drives any `trainer.Trainer` (every path implements it; tests use a fake
one) from a checkpoint position to the last global step. Step losses are
read back to the host once per progress line or checkpoint, not once per
step, so the host does not wait for every step; the loss of each step is
still checked, and a NaN or Inf stops training before any checkpoint holds
it.
"""

import collections
import contextlib
import dataclasses
import time
from typing import Callable, Optional, Union

from absl import logging
import numpy as np
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import phases
from tfmulti import stops
from tfmulti import trainer as trainer_lib
from tfmulti.data import batches as batches_lib
from tfmulti.distribute import preemption
from tfmulti.engine import checkpoints
from tfmulti.engine import readings
from tfmulti.engine import step_calls
from tfmulti.train import epochs
from tfmulti.train import profiling
from tfmulti.train import summaries as summaries_lib

# The first step's phase: its call traces the step before it runs.
TRACING = 'tracing the step (its first call builds the graph)'
# What `train` ends with: the final `checkpoints.Position`, the last
# evaluation ({'accuracy', 'loss'}), the run's `Progress` (timing)
# and the steps a call it ran (`step_calls`: N, or 'auto' if it never chose).
Outcome = collections.namedtuple(
    'Outcome', ['position', 'evaluation', 'progress', 'steps_per_loop'])


class TrainingInterrupted(Exception):
  """A signal stopped training after a checkpoint.

  Attributes: `signal_name` (in a multi-worker job, with the worker it
  reached), `step`, `checkpoint` (its path), `exit_code` (the shell's code
  for death by that signal).
  """

  def __init__(self, signal_name, step, checkpoint, exit_code):
    super().__init__(f'{signal_name} at step {step}: saved {checkpoint}; run '
                     'the same command again to resume.')
    self.signal_name = signal_name
    self.step = step
    self.checkpoint = checkpoint
    self.exit_code = exit_code


class Evaluation:
  """{'accuracy', 'loss'} over every test example, by the one evaluation
  rule (`Trainer.evaluate_outputs`, Keras's): the loss is the data loss
  plus the model's losses (weight penalties, `add_loss` terms), as
  Keras's `evaluate` reports it.

  Each batch is one compiled call (the outputs, their loss and the
  correct rows, traced once a batch shape: the full one and the last); the
  sums stay tensors until the end: one host read, not two a batch.
  """

  def __init__(self, trainer, loss_fn):
    self._trainer = trainer
    self._loss_fn = loss_fn
    self._batch = tf.function(self._batch_graph, autograph=False)

  def _batch_graph(self, images, labels):
    logits, regularization = self._trainer.evaluate_outputs(images)
    rows = tf.shape(labels)[0]
    loss = self._loss_fn(labels, logits) + tf.cast(regularization,
                                                   tf.float32)
    loss_sum = loss * tf.cast(rows, tf.float32)
    correct = tf.reduce_sum(tf.cast(
        tf.argmax(logits, axis=-1, output_type=tf.int32) == labels,
        tf.int32))
    return loss_sum, correct, rows

  def __call__(self, dataset):
    batches = int(dataset.cardinality())
    with phases.phase('evaluating', batches if batches > 0 else None) as (
        shown):
      sums = []
      for images, labels in dataset:
        sums.append(self._batch(images, labels))
        shown.advance()
    loss_sum, correct, count = (float(tf.add_n([tf.cast(s[k], tf.float64)
                                                for s in sums]))
                                for k in range(3))
    return {'accuracy': correct / count, 'loss': loss_sum / count}


class Progress:
  """Progress lines: loss over the window, the steps' `readings` (or
  images/sec) and ETA.

  The clock starts after this run's first step (which traces the step
  function) and stops during evaluation, so images/sec is the steady-state
  throughput of the step, its input and its checkpoints.
  """

  def __init__(self, total_steps, global_batch_size, log_every_steps,
               meter=None):
    self.total_steps = total_steps
    self.global_batch_size = global_batch_size
    self.log_every_steps = log_every_steps
    self.meter = meter  # An `engine.readings.Meter`, or None.
    self.reading = None  # The last line's `readings.Reading`.
    self._line_timed = (0.0, 0)  # (seconds, timed steps) at the last line.
    self.window = []  # Total losses since the last progress line.
    self.last_window_loss = float('nan')
    self.first_window_loss = float('nan')  # This run's first logged one.
    self.train_seconds = 0.0
    self.timed_steps = 0
    self.steps_run = 0
    self._started = None
    # Where the time went (seconds; perf_counter for `first_step_started`).
    self.first_step_started = None
    self.first_step_seconds = float('nan')
    self.evaluation_seconds = 0.0
    self.checkpoint_seconds = 0.0

  @contextlib.contextmanager
  def paused(self):
    """Leaves what runs inside (evaluation) out of the training time."""
    running = self._started is not None
    paused_at = time.perf_counter()
    if running:
      self.train_seconds += paused_at - self._started
      self._started = None
    try:
      yield
    finally:
      self.evaluation_seconds += time.perf_counter() - paused_at
      if running:
        self._started = time.perf_counter()

  def _seconds(self):
    """Seconds of timed training so far."""
    running = self._started is not None
    return self.train_seconds + (
        time.perf_counter() - self._started if running else 0.0)

  @property
  def images_per_sec(self):
    seconds = self._seconds()
    if not seconds or not self.timed_steps:
      return float('nan')
    return self.timed_steps * self.global_batch_size / seconds

  def _read(self):
    """The `Reading` of the steps timed since the last line (None: none
    were, or no meter); the text the line shows of it."""
    seconds, timed = self._seconds(), self.timed_steps
    last_seconds, last_timed = self._line_timed
    self._line_timed = (seconds, timed)
    if self.meter is None or timed == last_timed:
      return None
    return self.meter.reading(seconds - last_seconds, timed - last_timed)

  def record(self, step, losses, epoch):
    """Records the total losses (floats) of the steps up to `step`."""
    self.window.extend(losses)
    timed = len(losses)
    if not self.steps_run:  # The first step traced the function: untimed.
      if self.meter is not None:
        self.meter.count()  # Before the clock starts.
      self._started = time.perf_counter()
      self.first_step_seconds = self._started - self.first_step_started
      timed -= 1
    self.steps_run += len(losses)
    self.timed_steps += timed
    if step % self.log_every_steps and step != self.total_steps:
      return
    self.last_window_loss = float(np.mean(self.window))
    if np.isnan(self.first_window_loss):
      self.first_window_loss = self.last_window_loss
    self.window = []
    speed, eta = 'not timed yet (the first step traces)', '?'
    self.reading = self._read()
    if self.timed_steps:
      rate = self.images_per_sec
      speed = (self.reading.text() if self.reading
               else f'{rate:.0f} images/sec')
      eta = time.strftime('%H:%M:%S', time.gmtime(
          (self.total_steps - step) * self.global_batch_size / rate))
    logging.info('step %d/%d (epoch %d) loss %.4f | %s | ETA %s', step,
                 self.total_steps, epoch + 1, self.last_window_loss, speed,
                 eta)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
  """What the loop works with, built once per run by `train.job`.

  Attributes:
    trainer: any `trainer.Trainer`.
    dataset: the `data.Data` to train and evaluate on.
    loss_fn: `loss_fn(labels, logits)`, for evaluation.
    schedule: the learning rate of a 0-based step (for the summaries).
    checkpointer: saves and restores the run.
    summaries: TensorBoard writer.
    global_batch_size: rows per step, of the whole job.
    total_steps: the last global step.
    log_every_steps: steps between progress lines and summaries.
    checkpoint_steps: steps between checkpoints.
    profile_steps: (first, last) global steps to profile, or None.
    profile_dir: where the profile goes (the run's output directory).
    agreed_stop: a multi-worker job's `preemption.AgreedStop`: a signal to
      any worker stops every worker after the same step. None: a signal
      stops this process after the current step.
    steps_per_loop: steps a compiled call runs (`step_calls`): N, or
      'auto'. Progress lines, summaries, checkpoints, the non-finite stop
      and signals act between calls, at the steps they act at with 1.
    meter: what each progress line reads of the steps since the last
      (`engine.readings`): time, rows, memory, MFU; None: images/sec.
  """
  trainer: trainer_lib.Trainer
  dataset: batches_lib.Data
  loss_fn: Callable
  schedule: Callable
  checkpointer: checkpoints.Checkpointer
  summaries: summaries_lib.Summaries
  global_batch_size: int
  total_steps: int
  log_every_steps: int
  checkpoint_steps: int
  profile_steps: Optional[tuple] = None
  profile_dir: Optional[str] = None
  agreed_stop: Optional[preemption.AgreedStop] = None
  steps_per_loop: Union[int, str] = 1
  meter: Optional[readings.Meter] = None


def _read_losses(run, last_step, pending):
  """The pending steps' total losses as floats; raises at the first NaN."""
  losses = [float(v) for v in tf.concat(  # One host read.
      [tf.reshape(totals, [-1]) for totals in pending], 0).numpy()]
  for offset, loss in enumerate(losses):
    if not np.isfinite(loss):
      step = last_step - len(losses) + 1 + offset
      raise errors.NonFiniteError(
          f'the loss is {loss} at step {step}; training stopped without '
          'saving it. The latest checkpoint '
          f'({run.checkpointer.describe_latest()}) '
          'holds the last good state; lower --learning_rate or add '
          '--warmup_steps, then run again.')
  return losses


def _stop_after(run, signals, step):
  """The `stops.Stop` that ends the run after `step`, or None."""
  if run.agreed_stop is not None:
    return run.agreed_stop.stop_after(step, signals.received, run.total_steps)
  return signals.stop()


def _to_next_event(run, step, last):
  """Steps from `step` to the next one the host acts after (a progress
  line, a checkpoint, the epoch's `last` step, a profile's bounds): a
  call of many steps ends there."""
  events = [last, step + run.log_every_steps - step % run.log_every_steps,
            step + run.checkpoint_steps - step % run.checkpoint_steps]
  if run.profile_steps:
    events += [s for s in (run.profile_steps[0] - 1, run.profile_steps[1])
               if s > step]
  return min(events) - step


def _call(calls, iterator, steps, progress):
  """Runs the next call's steps (one, while the first traces or 'auto'
  times them; else the plan's count, at most `steps`): (their total
  losses, the last step's `StepOutputs`, steps)."""
  timing = calls.plan.timing(progress.steps_run)
  count = calls.plan.count(steps) if progress.steps_run else 1
  started = time.perf_counter()
  totals, outputs = calls.runner.run(iterator, count)
  if timing:
    float(outputs.total)  # The host waits for the step to finish.
    calls.plan.record(time.perf_counter() - started)
  return totals, outputs, count


def _train_epoch(run, position, signals, progress, profiler, calls,
                 iterator):
  """Trains on the rest of epoch `position.epoch`, read from `iterator`
  (`epochs.chain`'s); returns the new position."""
  step, epoch, examples = position
  steps_per_epoch = run.dataset.train_examples // run.global_batch_size
  last = step + min(run.total_steps - step,
                    steps_per_epoch - examples // run.global_batch_size)
  pending = []  # Total losses of the steps not yet read back.
  while step < last:
    tracing = progress.first_step_started is None
    if tracing:
      progress.first_step_started = time.perf_counter()
    profiler.before(step + 1)
    with (phases.phase(TRACING) if tracing else contextlib.nullcontext()):
      totals, outputs, count = _call(
          calls, iterator, _to_next_event(run, step, last), progress)
    step += count
    profiler.after(step, outputs)
    examples += count * run.global_batch_size
    pending.extend(totals)
    stop = _stop_after(run, signals, step)
    log = step % run.log_every_steps == 0 or step == run.total_steps
    save = step % run.checkpoint_steps == 0 or stop
    if not (log or save or progress.steps_run == 0):
      continue
    progress.record(step, _read_losses(run, step, pending), epoch)
    pending = []
    if log:
      run.summaries.train(step, outputs,
                          learning_rate=run.schedule(step - 1),
                          images_per_sec=progress.images_per_sec,
                          reading=progress.reading)
      if outputs.gradients:
        run.summaries.gradients(step, outputs.gradients)
    if save:
      saving = time.perf_counter()
      run.checkpointer.save(checkpoints.Position(step, epoch, examples))
      progress.checkpoint_seconds += time.perf_counter() - saving
    if stop:
      run.checkpointer.wait()
      raise TrainingInterrupted(stop.label, step, run.checkpointer.latest,
                                stop.exit_code)
  if pending:
    progress.record(step, _read_losses(run, step, pending), epoch)
  if examples >= steps_per_epoch * run.global_batch_size:
    return checkpoints.Position(step, epoch + 1, 0)
  return checkpoints.Position(step, epoch, examples)


def _evaluate(run, step, progress, evaluate):
  with progress.paused():
    evaluation = evaluate(run.dataset.test)
  run.summaries.evaluation(step, evaluation)
  logging.info('step %d: eval accuracy %.4f, eval loss %.4f', step,
               evaluation['accuracy'], evaluation['loss'])
  if _at_chance_while_learning(run, evaluation, progress):
    logging.warning(
        'eval accuracy %.4f is chance (%d classes) while the training loss '
        'fell from %.4f to %.4f: %s', evaluation['accuracy'],
        run.dataset.num_classes, progress.first_window_loss,
        progress.last_window_loss, batch_norm_hint(run.trainer.model))
  return evaluation


def batch_norm_hint(model):
  """What to try when evaluation sits at chance while a model with
  BatchNorm learns, from its layers' largest momentum: a smaller one (the
  moving statistics lag the weights by about 1 / (1 - momentum) steps),
  or, where they already follow within a few steps, the rows."""
  momentum = max(layer.momentum for layer in keras_internals.batch_norms(
      model))
  if momentum > 0.5:
    smaller = 0.9 if momentum > 0.9 else 0.5
    return (f'the BatchNormalization moving statistics (momentum '
            f'{momentum:g}) lag the weights; a smaller --batch_norm_momentum '
            f'(e.g. {smaller:g}) lets them follow')
  return (f'the BatchNormalization moving statistics (momentum '
          f'{momentum:g}) follow within a few steps; look at what differs '
          'between the training and evaluation rows (their preprocessing)')


def _at_chance_while_learning(run, evaluation, progress):
  """Whether evaluation sits at chance while training learns, on a model
  with BatchNorm: its moving statistics, not its weights, are behind."""
  return (evaluation['accuracy'] <= 1.5 / run.dataset.num_classes
          and progress.last_window_loss < 0.7 * progress.first_window_loss
          and bool(keras_internals.batch_norms(run.trainer.model)))


def train(run, position):
  """Trains from `position` to `run.total_steps`, evaluating every epoch.

  SIGTERM or SIGINT stops it after the current call (a step, or a loop of
  `run.steps_per_loop`) with a checkpoint (in a multi-worker job, every
  worker after the same step: `run.agreed_stop`).

  Returns:
    An `Outcome`.

  Raises:
    TrainingInterrupted: after the checkpoint a signal asked for.
    errors.NonFiniteError: a step's loss, or the weights at a checkpoint,
      were NaN or infinite.
  """
  progress = Progress(run.total_steps, run.global_batch_size,
                      run.log_every_steps, run.meter)
  profiler = profiling.StepProfiler(run.profile_steps, run.profile_dir)
  calls = step_calls.calls(run.trainer, run.steps_per_loop,
                           run.log_every_steps)
  evaluate = Evaluation(run.trainer, run.loss_fn)
  evaluation = chained = None
  with stops.StopSignals() as signals, (
      run.agreed_stop or contextlib.nullcontext()):
    try:
      while position.step < run.total_steps:
        if chained is None or not chained.serves(position.epoch,
                                                 run.trainer):
          chained = epochs.chain(run, position, calls.runner)
        position = _train_epoch(run, position, signals, progress, profiler,
                                calls, chained.iterator)
        evaluation = _evaluate(run, position.step, progress, evaluate)
    finally:
      profiler.close()
  run.checkpointer.save(position)
  run.checkpointer.wait()
  return Outcome(position, evaluation or _evaluate(
      run, position.step, progress, evaluate), progress,
                 calls.plan.steps_per_loop)
