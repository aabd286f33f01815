"""Checkpoints that resume a run where it stopped.

A checkpoint `<model_dir>/ckpt-<step>` holds the model, the optimizer (its
slots and iteration count), the global step and the input position (the
epoch in progress and how many of its examples were trained on).
Variables are saved once, in one layout, whichever path trained them: a
checkpoint written by 2 clones restores into the mirrored path, into one
device or into 4 clones.

What is guaranteed (each tested in tests/test_checkpoints.py):
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
"""

import collections
import glob
import os
import re
import shutil

from absl import logging
import numpy as np
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals

CHECKPOINT_NAME = 'ckpt'
_NUMBERED = re.compile(r'ckpt-(\d+)\.index$')
# What a damaged file raises when TensorFlow reads it: a short or garbled
# index (OpError, ValueError), a truncated data file (IndexError).
_DAMAGE = (tf.errors.OpError, ValueError, IndexError, OSError)

# Where a run stands: `step` global steps done; `epoch` (0-based) is in
# progress and `epoch_examples` of its examples have been trained on.
Position = collections.namedtuple('Position',
                                  ['step', 'epoch', 'epoch_examples'])


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
  """Removes what an interrupted save leaves: `ckpt-N_temp/` directories."""
  for partial in glob.glob(os.path.join(glob.escape(directory),
                                        f'{CHECKPOINT_NAME}-*_temp')):
    logging.info('removing %s, left by an interrupted save', partial)
    shutil.rmtree(partial, ignore_errors=True)


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
  tf.compat.v1.train.update_checkpoint_state(
      directory, latest[1], all_model_checkpoint_paths=kept)


def _all_finite(variables):
  """Whether every float variable holds only finite values (one host read)."""
  checks = [tf.reduce_all(tf.math.is_finite(v)) for v in variables
            if tf.as_dtype(v.dtype).is_floating]
  return bool(tf.reduce_all(checks)) if checks else True


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
  """

  def __init__(self, directory, checkpoint, *, max_to_keep,
               restore_directory=None):
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

  @property
  def latest(self):
    """Path of the latest good checkpoint, or None."""
    return self.manager.latest_checkpoint or (
        self.latest_intact and self.latest_intact[1])

  def describe_latest(self):
    """The latest good checkpoint, for a message a user reads."""
    return self.latest or 'none yet: the run starts from its initial weights'

  def write(self, step):
    """Writes checkpoint `ckpt-<step>`; returns its path.

    Raises:
      errors.CheckpointWriteError: the write failed (disk full, no access).
    """
    try:
      return self.manager.save(checkpoint_number=step)
    except (OSError, tf.errors.OpError) as e:
      raise errors.CheckpointWriteError(
          f'cannot write checkpoint {CHECKPOINT_NAME}-{step} in '
          f'{self.manager.directory} ({errors.first_line(e)}); free some '
          'space or fix the directory, then run the same command again: the '
          f'latest good checkpoint is {self.describe_latest()}.') from e


class Checkpointer:
  """Saves and restores a run through `tf.train.CheckpointManager`.

  Attributes:
    manager: the `tf.train.CheckpointManager` over `directory`.
  """

  def __init__(self, directory, *, model, optimizer, max_to_keep, device,
               restore_directory=None):
    """Tracks `model` and `optimizer`; the position lives on `device`.

    Saves into `directory`; restores from `restore_directory` (default: the
    same). A non-chief worker saves into its own temporary directory and
    restores from the chief's. Finds the latest intact checkpoint now (and
    repairs the index of `directory` to name it).

    Raises:
      errors.CheckpointDamagedError: checkpoints exist and none is readable.
    """
    with tf.device(device):
      self._step = tf.Variable(0, dtype=tf.int64, trainable=False)
      self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
      self._epoch_examples = tf.Variable(0, dtype=tf.int64, trainable=False)
    self._variables = model.variables + optimizer.variables
    # The random layers' generators too: Keras leaves them out of the
    # model's checkpoint, and a resumed run must draw what it would have.
    self._checkpoint = tf.train.Checkpoint(
        model=model, optimizer=optimizer, step=self._step, epoch=self._epoch,
        epoch_examples=self._epoch_examples,
        random=keras_internals.seed_states(model))
    self._writer = Writer(directory, self._checkpoint,
                          max_to_keep=max_to_keep,
                          restore_directory=restore_directory)
    self.manager = self._writer.manager
    self._saved_step = None  # Step of the checkpoint on disk, if known.

  @property
  def latest(self):
    """Path of the latest good checkpoint of this run, or None."""
    return self._writer.latest

  def describe_latest(self):
    """The latest good checkpoint, for a message a user reads."""
    return self._writer.describe_latest()

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
      self._checkpoint.restore(path).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
      raise errors.CheckpointMismatchError(
          f'checkpoint {path} does not fit this model and optimizer '
          f'({errors.first_line(e)}). Resume with the flags that wrote it, '
          'or pass a new --model_dir.') from e
    position = Position(int(self._step.numpy()), int(self._epoch.numpy()),
                        int(self._epoch_examples.numpy()))
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
    if not _all_finite(self._variables):
      raise errors.NonFiniteError(
          f'the weights are not finite after step {position.step}; training '
          'stopped without saving them. The latest checkpoint '
          f'({self.describe_latest()}) holds the last good state; lower '
          '--learning_rate or add --warmup_steps, then run again.')
    self._step.assign(position.step)
    self._epoch.assign(position.epoch)
    self._epoch_examples.assign(position.epoch_examples)
    path = self._writer.write(position.step)
    self._saved_step = position.step
    logging.info('saved %s', path)
    return path
