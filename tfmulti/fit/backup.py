"""Preemption inside Keras's `fit`: BackupAndRestore, made exact.

Keras's `BackupAndRestore` resumes whole epochs: a job stopped mid-epoch
trains that epoch's first steps again, and array inputs are shuffled anew
by the restarted process, so the resumed run is not the one that stopped.
With a `BackupAndRestore` among its callbacks, `TowersModel.fit` uses this
module's `Backup` instead, in the same `backup_dir`:

* Array inputs are fed by tfmulti: epoch e's rows in the order
  `stateless_shuffle(seed=(shuffle_seed, e))` (in order with
  `shuffle=False`), one dataset over the epochs that Keras reads across
  them, so any epoch's batches are rebuilt after a restart, alike on every
  worker. A `tf.data` input must give the same batches each time it is
  iterated (no reshuffling), or the resumed epoch differs.
* SIGTERM or Ctrl-C (to any worker: they agree on the step,
  `distribute.preemption`) saves, after that step, the checkpoint content
  the command line writes too (`engine.contents`: the model, the
  optimizer's state, the random generators and the position) with the
  metrics' state, and the process exits with the signal's status. A
  `--model_dir` of the command line restores here, and the command line
  resumes from a backup. The chief
  alone writes, through the command line's checkpoint writer
  (`engine.checkpoints.Writer`: `ckpt-<step>` written whole before the
  index names it, the newest intact one found by a scan); every worker
  reads. `save_freq` ('epoch' or N steps) saves
  on the way too; `delete_checkpoint` removes the backup when `fit` ends.
* The next run restores them and passes over the steps already done
  (their batches read, nothing trained), so it ends with the weights of an
  uninterrupted run: bit for bit with `reproducible_rows`.
"""

import math
import shutil

from absl import logging
import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import stops
from tfmulti.engine import checkpoints
from tfmulti.engine import contents


def read_position(directory):
  """(the `contents.Position`, checkpoint path) of the newest intact
  checkpoint in `directory` (a backup's, or the command line's
  `--model_dir`: the content is one), or None."""
  found = checkpoints.latest_intact(directory)
  if found is None:
    return None
  return contents.position_of(found[1]), found[1]


def restore(model, directory):
  """Restores the newest intact checkpoint in `directory` (the command
  line's `--model_dir`, or a backup's: the content is one,
  `engine.contents`) into `model`, a compiled `TowersModel`: the weights,
  the optimizer's state, the random generators (and the metrics' running
  figures, where a backup holds them).

  Returns:
    The checkpoint's `contents.Position`, or None where there is none.

  Raises:
    errors.CheckpointMismatchError: the checkpoint holds another model or
      optimizer.
  """
  found = read_position(directory)
  if found is None:
    return None
  return _restored(contents.Contents(
      model.model, model.optimizer, device='CPU:0',
      metrics=model.metrics_variables), found[1], model.model)


def _restored(held, path, model):
  """`held` (a `contents.Contents`) restored from `path`; its `Position`.
  Raises `CheckpointMismatchError` for a checkpoint of another model or
  optimizer."""
  try:
    return held.restore(path)
  except (AssertionError, ValueError, tf.errors.OpError) as e:
    raise errors.CheckpointMismatchError(
        f'checkpoint {path} does not fit model {model.name!r} and its '
        f'optimizer ({errors.first_line(e)}); build the model and the '
        'optimizer that wrote it.') from e


def epochs_of_arrays(arrays, *, batch_size, shuffle, seed, first_epoch,
                     epochs):
  """Batches of `arrays` (a nest, rows first) for epochs [first_epoch,
  epochs): epoch e's rows shuffled by the seed (seed, e), its last batch
  short when the rows do not fill it, as Keras's own."""
  rows = tf.nest.flatten(arrays)[0].shape[0]
  tensors = tf.nest.map_structure(tf.convert_to_tensor, arrays)

  def epoch(e):
    order = tf.range(rows, dtype=tf.int64)
    if shuffle:
      order = tf.random.experimental.stateless_shuffle(
          order, seed=tf.stack([tf.constant(seed, tf.int64), e]))
    return tf.data.Dataset.from_tensor_slices(order).batch(batch_size).map(
        lambda index: tf.nest.map_structure(
            lambda t: tf.gather(t, index), tensors))
  return tf.data.Dataset.range(first_epoch, epochs).flat_map(epoch)


def fed(arguments, backup_dir, *, seed):
  """Rewrites `fit`'s arguments (a dict) so that a backup can resume
  mid-epoch: the first epoch the backup's, array inputs fed by
  `epochs_of_arrays` (split first as Keras splits `validation_split`: the
  last rows). Returns the `Backup`'s `steps_per_epoch` and `epochs`."""
  position = read_position(backup_dir)
  epochs = arguments.get('epochs', 1)
  first = position[0].epoch if position else arguments.get('initial_epoch',
                                                          0)
  arguments['initial_epoch'] = first
  x = arguments.get('x')
  if isinstance(x, tf.data.Dataset):
    steps = arguments.get('steps_per_epoch') or int(x.cardinality())
    if steps < 1:
      raise errors.ConfigError(
          'BackupAndRestore on a tf.data input of unknown length: the '
          'backup counts steps in an epoch; pass steps_per_epoch.')
    return dict(steps_per_epoch=steps, epochs=epochs)
  if not are_arrays(x):
    raise errors.ConfigError(
        f'BackupAndRestore cannot rebuild a step of a {type(x).__name__} '
        'input; pass arrays or a tf.data.Dataset that gives the same '
        'batches each time it is read.')
  return feed_arrays(arguments, seed=seed, first_epoch=first)


def are_arrays(x):
  """Whether `fit`'s `x` is arrays (a nest of them), rows first."""
  return x is not None and not isinstance(x, tf.data.Dataset) and all(
      hasattr(a, 'shape') for a in tf.nest.flatten(x))


def feed_arrays(arguments, *, seed, first_epoch):
  """Rewrites `fit`'s arguments (a dict) with array inputs so that their
  batches come from `epochs_of_arrays`: each epoch's order from the seed
  (seed, epoch), not from Keras's random generator, so every worker of a
  job, and every restart, reads the same global batches. Returns
  `steps_per_epoch` and `epochs`."""
  epochs = arguments.get('epochs', 1)
  x = arguments.get('x')
  arrays = tuple(a for a in (x, arguments.pop('y', None),
                             arguments.pop('sample_weight', None))
                 if a is not None)
  split = arguments.pop('validation_split', 0.0)
  if split:
    at = int(tf.nest.flatten(arrays)[0].shape[0] * (1.0 - split))
    arguments['validation_data'] = tf.nest.map_structure(lambda a: a[at:],
                                                         arrays)
    arrays = tf.nest.map_structure(lambda a: a[:at], arrays)
  batch_size = arguments.pop('batch_size', None) or 32
  steps = math.ceil(tf.nest.flatten(arrays)[0].shape[0] / batch_size)
  arguments.update(
      x=epochs_of_arrays(arrays, batch_size=batch_size,
                         shuffle=arguments.pop('shuffle', True), seed=seed,
                         first_epoch=first_epoch, epochs=epochs),
      steps_per_epoch=steps, shuffle=False)  # Shuffled here, if asked.
  return dict(steps_per_epoch=steps, epochs=epochs)


class Preempted(Exception):
  """A signal stopped `fit` after a backup of global step `step`; `stop`
  says which signal."""

  def __init__(self, stop, step):
    super().__init__(f'{stop.label} at step {step}')
    self.stop = stop
    self.step = step


class Backup(keras.callbacks.Callback):
  """Saves and restores a `TowersModel`'s whole state at a step (above)."""

  def __init__(self, original, *, steps_per_epoch, epochs, is_chief,
               agreed_stop):
    """`original`: the user's `BackupAndRestore` (its directory and
    frequency). `agreed_stop`: the workers' `AgreedStop`, None alone."""
    super().__init__()
    self.directory = original.backup_dir
    self.save_freq = original.save_freq
    self.delete_checkpoint = original.delete_checkpoint
    self.steps_per_epoch = steps_per_epoch
    self.last_step = steps_per_epoch * epochs
    self.is_chief = is_chief
    self.agreed_stop = agreed_stop
    self.position = read_position(self.directory)
    self.signals = stops.StopSignals()
    self._contents = None  # The model's `contents.Contents`, once used.
    self._writer = None  # The chief's `checkpoints.Writer`, at a save.
    self._epoch = 0
    self._pending = None  # The position to restore at the first step.
    self._open = False  # Between on_train_begin and close.

  def steps_to_pass(self, rows):
    """Restores the backup (once, at the first step, when the compiled
    metrics exist) and returns how many of the epoch's steps of `rows`
    rows (the global batch's) it holds: its examples of the epoch, in
    this fit's batches (a command line's checkpoint counts its own)."""
    if self._pending is None:
      return 0
    position, prefix = self._pending
    self._pending = None
    _restored(self._held(), prefix, self.model.model)
    steps = min(position.steps_done(rows), self.steps_per_epoch)
    logging.info('restored %s: epoch %d, %d steps done in it', prefix,
                 self._epoch + 1, steps)
    return steps

  def on_train_begin(self, logs=None):
    self._pending = self.position
    self._open = True
    self.signals.__enter__()
    if self.agreed_stop is not None:
      self.agreed_stop.__enter__()

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    # Keras ends an epoch's last call of `steps_per_execution` steps at a
    # multiple of them, past the epoch's steps when they are not one.
    done = min(batch + 1, self.steps_per_epoch)
    step = self._epoch * self.steps_per_epoch + done
    if self.model.passes.passed:
      return
    stop = (self.agreed_stop.stop_after(step, self.signals.received,
                                        self.last_step)
            if self.agreed_stop is not None else self.signals.stop())
    if stop or (isinstance(self.save_freq, int)
                and step % self.save_freq == 0):
      self._save(self._epoch, done)
    if stop:
      raise Preempted(stop, step)

  def on_epoch_end(self, epoch, logs=None):
    if self.save_freq == 'epoch':
      self._save(epoch + 1, 0)

  def on_train_end(self, logs=None):
    self.close()
    if self.delete_checkpoint and self.is_chief:
      shutil.rmtree(self.directory, ignore_errors=True)

  def close(self):
    """Restores the signal handlers and ends the workers' agreement (once,
    and only if training began)."""
    if not self._open:
      return
    self._open = False
    if self.agreed_stop is not None:
      self.agreed_stop.__exit__(None, None, None)
    self.signals.__exit__(None, None, None)

  def _save(self, epoch, steps):
    """The chief writes the state at its position (`steps` done in
    `epoch`) through the writer, which keeps the newest whole checkpoint."""
    if not self.is_chief:
      return
    if self._writer is None:
      self._writer = checkpoints.Writer(self.directory,
                                        self._held().checkpoint,
                                        max_to_keep=1)
    step = epoch * self.steps_per_epoch + steps
    self._held().set(contents.Position(
        step, epoch, steps * self.model.batches.rows))
    self._writer.write(step)

  def _held(self):
    """The `contents.Contents` of everything a step changes, the one
    content of both doors: the wrapped model, the optimizer's variables,
    the random generators, the position, and the metrics' running figures
    of the epoch."""
    if self._contents is None:
      model = self.model
      self._contents = contents.Contents(
          model.model, model.optimizer, device='CPU:0',
          metrics=model.metrics_variables)
    return self._contents


class Passes:
  """The steps a resumed `fit` passes over: the backup's steps of its
  epoch, read and not trained, so the run goes on at the step it saved.

  Attributes:
    backup: the `Backup` of the running `fit`, or None.
    passed: whether the last step was one passed over.
  """

  def __init__(self):
    self.backup = None
    self.passed = False
    self._to_pass = 0

  def take(self, rows):
    """Whether this step, of a global batch of `rows` rows, is passed
    over (the backup restored at the first step, when the compiled
    metrics exist)."""
    if self.backup is not None:
      self._to_pass += self.backup.steps_to_pass(rows)
    self.passed = self._to_pass > 0
    self._to_pass -= self.passed
    return self.passed

  def none_left(self):
    """Whether every step to pass over was; the steps after train."""
    self.passed = False  # A compiled loop's steps train.
    return not self._to_pass

  def close(self):
    """At the end of `fit`: the backup's signal handlers restored."""
    if self.backup is not None:
      self.backup.close()
    self.backup, self._to_pass = None, 0
