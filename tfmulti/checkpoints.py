"""Checkpoints that resume a run where it stopped, and clean stops on signals.

A checkpoint `<model_dir>/ckpt-<step>` holds the model, the optimizer (its
slots and iteration count), the global step and the input position (the
epoch in progress and how many of its examples were trained on).
Variables are saved once, in one layout, whichever path trained them: a
checkpoint written by 2 clones restores into the mirrored path, into one
device or into 4 clones.

`tf.train.CheckpointManager` writes the files first and then replaces the
`checkpoint` index that names the latest one, so a crash mid-write leaves
the previous checkpoint as the latest.
"""

import collections
import signal
import threading

import tensorflow as tf
from absl import logging

from tfmulti import errors

CHECKPOINT_NAME = 'ckpt'

# Where a run stands: `step` global steps done; `epoch` (0-based) is in
# progress and `epoch_examples` of its examples have been trained on.
Position = collections.namedtuple('Position',
                                  ['step', 'epoch', 'epoch_examples'])


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
    restores from the chief's.
    """
    self._restore_directory = restore_directory or directory
    with tf.device(device):
      self._step = tf.Variable(0, dtype=tf.int64, trainable=False)
      self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
      self._epoch_examples = tf.Variable(0, dtype=tf.int64, trainable=False)
    self._checkpoint = tf.train.Checkpoint(
        model=model, optimizer=optimizer, step=self._step, epoch=self._epoch,
        epoch_examples=self._epoch_examples)
    self.manager = tf.train.CheckpointManager(
        self._checkpoint, directory, max_to_keep=max_to_keep,
        checkpoint_name=CHECKPOINT_NAME)
    self._saved_step = None  # Step of the checkpoint on disk, if known.

  @property
  def latest(self):
    """Path of the latest complete checkpoint written here, or None."""
    return self.manager.latest_checkpoint

  def restore_latest(self):
    """Restores the latest checkpoint; returns its `Position` (or None).

    Raises:
      errors.CheckpointMismatchError: the checkpoint holds a different model or
        optimizer (another model, dataset or optimizer flag).
    """
    path = tf.train.latest_checkpoint(self._restore_directory)
    if path is None:
      return None
    try:
      self._checkpoint.restore(path).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
      raise errors.CheckpointMismatchError(
          f'checkpoint {path} does not fit this model and optimizer ({e}). '
          'Resume with the flags that wrote it, or pass a new --model_dir.'
      ) from e
    position = Position(int(self._step.numpy()), int(self._epoch.numpy()),
                        int(self._epoch_examples.numpy()))
    logging.info('restored %s: step %d, epoch %d after %d examples', path,
                 *position)
    self._saved_step = position.step
    return position

  def save(self, position):
    """Writes checkpoint `ckpt-<step>` at `position`; returns its path.

    A step already saved (or restored) is not written again.
    """
    if position.step == self._saved_step:
      return self.latest
    self._step.assign(position.step)
    self._epoch.assign(position.epoch)
    self._epoch_examples.assign(position.epoch_examples)
    path = self.manager.save(checkpoint_number=position.step)
    self._saved_step = position.step
    logging.info('saved %s', path)
    return path


class StopSignals:
  """While entered, SIGTERM and SIGINT ask the training loop to stop.

  The first signal sets `received` (its name); the loop finishes the current
  step, saves a checkpoint and stops. A second signal stops at once
  (KeyboardInterrupt), for a user who presses Ctrl-C twice. Outside the main
  thread Python cannot install handlers, and signals keep their defaults.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received = None
    self._previous = {}

  def _handle(self, signum, frame):
    del frame  # Unused.
    if self.received:
      raise KeyboardInterrupt(f'second signal ({self.received} first)')
    self.received = signal.Signals(signum).name
    logging.warning('%s received: stopping after this step with a checkpoint '
                    '(send it again to stop at once)', self.received)

  @property
  def exit_code(self):
    """The shell's code for death by the signal received (128 + number)."""
    return 128 + signal.Signals[self.received].value

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}
