"""Checkpoints that resume a run where it stopped.

A checkpoint `<model_dir>/ckpt-<step>` holds the model, the optimizer (its
slots and iteration count), the global step and the input position (the
epoch in progress and how many of its examples were trained on): the one
content of both doors (`contents`), so Keras's `fit` restores it and the
command line restores what `fit`'s backup writes.
Variables are saved once, in one layout, whichever path trained them: a
checkpoint written by 2 clones restores into the mirrored path, into one
device or into 4 clones.

What is guaranteed (each tested in tests/engine/test_checkpoints.py):
  * The latest *intact* checkpoint is found even when the `checkpoint` index
    file is damaged or names a missing checkpoint: the `ckpt-*` files are
    scanned newest first and each is read in full before it is trusted. A
    damaged one is skipped with a warning naming it, never deleted and never
    a reason to start over; if none can be read, the run stops.
  * No checkpoint holds a non-finite weight or slot: that is checked before
    writing, and the run stops naming the last good checkpoint.
  * A kill at any moment leaves the previous or the new checkpoint complete
    (the files are written first, the index last), and the partial files of
    an interrupted write are removed by the next run.
  * A failed write (disk full, directory gone) stops the run with one line
    and keeps the last good checkpoint as the latest.

Written in the background (`Writer(in_background=True)`, the command
line's `--async_checkpoint`): `save` takes a snapshot of the values (one
compiled call; the steps after it cannot touch it) and a thread writes
it while the steps go on (one compiled call, `keras_internals.
checkpoint_io`), then names it in the index; the files are the ones
`tf.train.Checkpoint.write` writes, whole before the index names them,
so every guarantee above holds. A failed background write stops the run
at the next save or at the end (`wait`), naming that checkpoint.
"""

import contextlib
import glob
import os
import re
import shutil
import threading

from absl import logging
import numpy as np
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti.engine import contents

CHECKPOINT_NAME = 'ckpt'
_NUMBERED = re.compile(r'ckpt-(\d+)\.index$')
# What a damaged file raises when TensorFlow reads it: a short or garbled
# index (OpError, ValueError), a truncated data file (IndexError).
_DAMAGE = (tf.errors.OpError, ValueError, IndexError, OSError)

# Where a run stands (`contents.Position`, the one resume position of both
# doors): `step` global steps done; `epoch` (0-based) is in progress and
# `epoch_examples` of its examples have been trained on.
Position = contents.Position


def numbered_checkpoints(directory):
  """[(step, path prefix)] of the `ckpt-<step>` files in `directory`, newest
  first, whatever the index file says."""
  found = []
  for index in glob.glob(os.path.join(glob.escape(directory), 'ckpt-*.index')):
    match = _NUMBERED.search(os.path.basename(index))
    if match:
      found.append((int(match.group(1)), index[:-len('.index')]))
  return sorted(found, reverse=True)


def check_intact(path):
  """Reads every tensor of checkpoint `path`; raises what a damaged file
  raises (see `_DAMAGE`), or `ValueError` for a non-finite float."""
  reader = tf.train.load_checkpoint(path)
  for key in reader.get_variable_to_shape_map():
    value = np.asarray(reader.get_tensor(key))
    if np.issubdtype(value.dtype, np.floating) and not np.isfinite(
        value).all():
      raise ValueError(f'{key} holds a non-finite value')


def latest_intact(directory):
  """The newest readable checkpoint in `directory`: (step, path), or None.

  Damaged ones are skipped with a warning naming them.

  Raises:
    errors.CheckpointDamagedError: checkpoints exist, none can be read.
  """
  damaged = []
  for step, path in numbered_checkpoints(directory):
    try:
      check_intact(path)
    except _DAMAGE as e:
      logging.warning('skipping damaged checkpoint %s (%s); it stays on disk '
                      'until this run saves step %d again', path,
                      errors.first_line(e), step)
      damaged.append(f'{os.path.basename(path)}: {errors.first_line(e)}')
      continue
    return step, path
  if damaged:
    raise errors.CheckpointDamagedError(
        f'no checkpoint in {directory} can be read ({"; ".join(damaged)}); '
        'move them away to start over, or pass a new --model_dir.')
  return None


def _remove_partial_writes(directory):
  """Removes what an interrupted save leaves: `ckpt-N_temp/` directories
  (a sharded save's) and `ckpt-N.*.tempstate*` files (one write's)."""
  pattern = os.path.join(glob.escape(directory), f'{CHECKPOINT_NAME}-*')
  for partial in glob.glob(pattern + '_temp') + glob.glob(
      pattern + '.tempstate*'):
    logging.info('removing %s, left by an interrupted save', partial)
    if os.path.isdir(partial):
      shutil.rmtree(partial, ignore_errors=True)
    else:
      os.remove(partial)


def _repair_index(directory, latest):
  """Points the `checkpoint` index at `latest` if it is unreadable or names
  another checkpoint; returns nothing."""
  try:
    named = tf.train.latest_checkpoint(directory)
  except _DAMAGE as e:
    named = f'unreadable ({errors.first_line(e)})'
  if latest is None or named == latest[1]:
    return
  logging.warning('the checkpoint index in %s names %s; resuming from %s, '
                  'the newest intact checkpoint', directory, named, latest[1])
  kept = [path for step, path in reversed(numbered_checkpoints(directory))
          if step <= latest[0]]
  write_index(directory, latest[1], kept)


def write_index(directory, latest, kept):
  """Writes the `checkpoint` index of `directory`: `latest` and the `kept`
  checkpoints (paths, oldest first), by name, as `CheckpointManager`
  writes it; atomically (a temporary file renamed over it)."""
  lines = [f'model_checkpoint_path: "{os.path.basename(latest)}"'] + [
      f'all_model_checkpoint_paths: "{os.path.basename(path)}"'
      for path in kept]
  index = os.path.join(directory, 'checkpoint')
  with tf.io.gfile.GFile(index + '.tmp', 'w') as f:
    f.write('\n'.join(lines) + '\n')
  tf.io.gfile.rename(index + '.tmp', index, overwrite=True)


def all_finite(values):
  """Whether every float tensor or variable of `values` holds only finite
  values (a bool tensor): what every value a checkpoint holds must be."""
  return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values
                        if tf.as_dtype(v.dtype).is_floating] or [True])


def finite_check(variables):
  """A compiled call of `all_finite(variables)`: one call and one host
  read a save, not two ops a variable (a ResNet-20's took 15-24 ms
  eagerly)."""
  check = tf.function(lambda: all_finite(variables), autograph=False)
  return lambda: bool(check())


class Writer:
  """Numbered checkpoints of one `tf.train.Checkpoint` in a directory:
  the files written whole before the index names them, so a kill leaves
  the last whole; the newest intact one found by a scan (`latest_intact`),
  not by trusting the index; partial writes removed and a damaged index
  repaired. The command line's `Checkpointer` and `fit`'s backup
  (`fit.backup`) both write through it.

  Attributes:
    manager: the `tf.train.CheckpointManager` over `directory`.
    latest_intact: (step, path) of the newest intact checkpoint found when
      it was made (in `restore_directory`), or None.
    in_background: whether `write` returns once the values are copied,
      the files written by a thread while the steps go on.
  """

  def __init__(self, directory, checkpoint, *, max_to_keep,
               restore_directory=None, in_background=False):
    """Finds the latest intact checkpoint in `restore_directory` (default:
    `directory`); where the two are one, cleans and repairs it.

    Raises:
      errors.CheckpointDamagedError: checkpoints exist and none is readable.
    """
    restore_directory = restore_directory or directory
    self.latest_intact = latest_intact(restore_directory)
    if restore_directory == directory:
      _remove_partial_writes(directory)
      _repair_index(directory, self.latest_intact)
    self.manager = tf.train.CheckpointManager(
        checkpoint, directory, max_to_keep=max_to_keep,
        checkpoint_name=CHECKPOINT_NAME)
    self.in_background = in_background
    self._directory, self._max_to_keep = directory, max_to_keep
    self._background = (_BackgroundWrite(checkpoint, self._record)
                        if in_background else None)
    self._writing = None  # The step being written in the background.
    self._written = None  # The last checkpoint written in the background.

  @property
  def latest(self):
    """Path of the latest good checkpoint, or None."""
    return self._written or self.manager.latest_checkpoint or (
        self.latest_intact and self.latest_intact[1])

  def describe_latest(self):
    """The latest good checkpoint, for a message a user reads: once the
    write in progress, if any, has ended (whole, or failed: then the one
    before it)."""
    try:
      self.wait()
    except errors.CheckpointWriteError:
      pass  # The message that asked says why the run stops.
    return self.latest or 'none yet: the run starts from its initial weights'

  def write(self, step, finite_only=False):
    """Writes checkpoint `ckpt-<step>` (in the background: starts writing
    it, once the one before is written); returns its path. In the
    background with `finite_only`, writes nothing and returns None where
    the snapshot holds a value that is not finite (the snapshot checks
    them in the same call).

    Raises:
      errors.CheckpointWriteError: the write failed (disk full, no access),
        this one's or the background write's before it.
    """
    self.wait()
    with self._failing(step):
      if not self.in_background:
        return self.manager.save(checkpoint_number=step)
      tf.io.gfile.makedirs(self._directory)
      path = os.path.join(self._directory, f'{CHECKPOINT_NAME}-{step}')
      if not self._background.start(path, finite_only):
        return None
    self._writing = step
    return path

  def wait(self):
    """Returns once no write is in progress.

    Raises:
      errors.CheckpointWriteError: the background write failed.
    """
    if self._writing is None:
      return
    step, self._writing = self._writing, None
    with self._failing(step):
      self._background.join()

  def _record(self, path):
    """Names `path`, written whole, in the index, and removes the oldest
    beyond `max_to_keep` (as `CheckpointManager.save` does)."""
    kept = [p for _, p in reversed(numbered_checkpoints(self._directory))]
    for old in kept[:-self._max_to_keep]:
      for name in tf.io.gfile.glob(old + '.*'):
        tf.io.gfile.remove(name)
    write_index(self._directory, path, kept[-self._max_to_keep:])
    self._written = path

  @contextlib.contextmanager
  def _failing(self, step):
    """Turns a failed write of `ckpt-<step>` into one line."""
    try:
      yield
    except (OSError, tf.errors.OpError) as e:
      raise errors.CheckpointWriteError(
          f'cannot write checkpoint {CHECKPOINT_NAME}-{step} in '
          f'{self.manager.directory} ({errors.tf_reason(e)}); free some '
          'space or fix the directory, then run the same command again: the '
          f'latest good checkpoint is {self.describe_latest()}.') from e


class _BackgroundWrite:
  """One background write at a time: the snapshot on the caller's
  thread, the files and `record(path)` on a thread of its own."""

  def __init__(self, checkpoint, record):
    # Made now (reading it makes it): the manager's saves write it too,
    # so every file has it.
    _ = checkpoint.save_counter
    self._snapshot, self._write = keras_internals.checkpoint_io(checkpoint,
                                                                all_finite)
    self._record = record
    self._thread = self._error = None

  def start(self, path, finite_only=False):
    """Snapshots the values now; writes them to `path` on the thread;
    returns True. With `finite_only`, returns False, writing nothing,
    where a float value is not finite."""
    finite, tensors = self._snapshot()
    if finite_only and not bool(finite):
      return False
    prefix = tf.constant(path)
    self._write.get_concrete_function(prefix, tensors)  # Traced here.
    self._thread = threading.Thread(target=self._run,
                                    args=(prefix, tensors, path))
    self._thread.start()
    return True

  def _run(self, prefix, tensors, path):
    if hasattr(os, 'setpriority'):  # Behind the steps' threads (Linux).
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    try:
      self._write(prefix, tensors)
      self._record(path)
    except Exception as e:  # pylint: disable=broad-except
      self._error = e  # Raised by `join`, on the caller's thread.

  def join(self):
    """Waits for the write; raises what it raised."""
    if self._thread is not None:
      self._thread.join()
    error, self._thread, self._error = self._error, None, None
    if error is not None:
      raise error


class Checkpointer:
  """Saves and restores a run through `tf.train.CheckpointManager`.

  Attributes:
    manager: the `tf.train.CheckpointManager` over `directory`.
  """

  def __init__(self, directory, *, model, optimizer, max_to_keep, device,
               restore_directory=None, in_background=False):
    """Tracks `model` and `optimizer`; the position lives on `device`.

    Saves into `directory`; restores from `restore_directory` (default: the
    same). A non-chief worker saves into its own temporary directory and
    restores from the chief's. Finds the latest intact checkpoint now (and
    repairs the index of `directory` to name it). `in_background`: write
    in the background (`Writer`).

    Raises:
      errors.CheckpointDamagedError: checkpoints exist and none is readable.
    """
    self._contents = contents.Contents(model, optimizer, device=device)
    self._all_finite = finite_check(model.variables + optimizer.variables)
    self._writer = Writer(directory, self._contents.checkpoint,
                          max_to_keep=max_to_keep,
                          restore_directory=restore_directory,
                          in_background=in_background)
    self.manager = self._writer.manager
    self._saved_step = None  # Step of the checkpoint on disk, if known.

  @property
  def latest(self):
    """Path of the latest good checkpoint of this run, or None (one
    written in the background counts once it is whole)."""
    return self._writer.latest

  @property
  def in_background(self):
    """Whether checkpoints are written in the background."""
    return self._writer.in_background

  def wait(self):
    """Returns once the checkpoint being written is whole.

    Raises:
      errors.CheckpointWriteError: its background write failed.
    """
    self._writer.wait()

  def describe_latest(self):
    """The latest good checkpoint, for a message a user reads."""
    return self._writer.describe_latest()

  def _non_finite(self, step):
    return errors.NonFiniteError(
        f'the weights are not finite after step {step}; training stopped '
        'without saving them. The latest checkpoint '
        f'({self.describe_latest()}) holds the last good state; lower '
        '--learning_rate or add --warmup_steps, then run again.')

  def restore_latest(self):
    """Restores the latest intact checkpoint; returns its `Position` or None.

    Raises:
      errors.CheckpointMismatchError: the checkpoint holds a different model
        or optimizer (another model, dataset or optimizer flag).
    """
    if self._writer.latest_intact is None:
      return None
    path = self._writer.latest_intact[1]
    try:
      position = self._contents.restore(path)
    except (AssertionError, ValueError, tf.errors.OpError) as e:
      raise errors.CheckpointMismatchError(
          f'checkpoint {path} does not fit this model and optimizer '
          f'({errors.first_line(e)}). Resume with the flags that wrote it, '
          'or pass a new --model_dir.') from e
    logging.info('restored %s: step %d, epoch %d after %d examples', path,
                 *position)
    self._saved_step = position.step
    return position

  def save(self, position):
    """Writes checkpoint `ckpt-<step>` at `position`; returns its path.

    A step already saved (or restored) is not written again.

    Raises:
      errors.NonFiniteError: a weight or slot is not finite (nothing is
        written).
      errors.CheckpointWriteError: the write failed (disk full, no access).
    """
    if position.step == self._saved_step:
      return self.latest
    # In the background, the snapshot checks its own values (one call).
    if not self.in_background and not self._all_finite():
      raise self._non_finite(position.step)
    self._contents.set(position)
    path = self._writer.write(position.step, finite_only=True)
    if path is None:
      raise self._non_finite(position.step)
    self._saved_step = position.step
    logging.info('%s %s', 'writing in the background' if self.in_background
                 else 'saved', path)
    return path
