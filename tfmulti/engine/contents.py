"""What a checkpoint holds: one content under both doors.

The command line (`checkpoints.Checkpointer`, into `--model_dir`) and
Keras's `fit` (`fit.backup.Backup`, into a `BackupAndRestore`'s directory)
write the same objects, so a checkpoint either writes restores under the
other: the model (its layers' variables, by Keras's object graph), the
optimizer (its slots and iteration count), the random layers' generators
(Keras leaves them out of the model's checkpoint, and a resumed run must
draw what it would have), and the one resume position (`Position`). `fit`
adds its metrics' running figures; a checkpoint without them restores
into `fit` with fresh ones.
"""

import collections

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti.mesh import shard_views


class Position(collections.namedtuple(
    'Position', ['step', 'epoch', 'epoch_examples'])):
  """Where a run stands: `step` global steps done; `epoch` (0-based) is in
  progress and `epoch_examples` of its examples have been trained on.
  Both doors resume from it (`steps_done`)."""

  def steps_done(self, rows):
    """The steps of its epoch done, in batches of `rows` rows (the global
    batch's: a resumed run may batch otherwise than the one that saved):
    the command line's dataset skips them, `fit` reads them and trains
    nothing (Keras's loop counts every step of an epoch)."""
    return self.epoch_examples // rows
_FIELDS = Position._fields
_METRICS = 'metrics'


def _key(name):
  """A top-level variable's key in a checkpoint."""
  return f'{name}/.ATTRIBUTES/VARIABLE_VALUE'


def position_of(path):
  """The `Position` a checkpoint at `path` (a prefix) holds.

  Raises:
    errors.CheckpointMismatchError: a checkpoint without one (a `fit`
      backup of tfmulti before the content was one).
  """
  reader = tf.train.load_checkpoint(path)
  if not reader.has_tensor(_key('step')):
    raise errors.CheckpointMismatchError(
        f'checkpoint {path} holds no step (a fit backup written before '
        'tfmulti kept one checkpoint content); finish that run with the '
        'tfmulti that wrote it, or move its directory away to start again.')
  return Position(*(int(reader.get_tensor(_key(f))) for f in _FIELDS))


class Contents:
  """The objects a checkpoint of either door holds (see the module).

  Attributes:
    checkpoint: the `tf.train.Checkpoint` of them all, which a `Writer`
      writes.
  """

  def __init__(self, model, optimizer, *, device, metrics=()):
    """`model` and `optimizer`: the Keras model trained and its optimizer;
    the position lives on `device`; `metrics`: Keras variables of `fit`'s
    metrics (none on the command line)."""
    with tf.device(device):
      self._position = [tf.Variable(0, dtype=tf.int64, trainable=False)
                        for _ in _FIELDS]
    self._objects = dict(
        model=model, optimizer=shard_views.checkpointed(optimizer),
        random=keras_internals.seed_states(model),
        **dict(zip(_FIELDS, self._position)))
    self._metrics = [v.value if isinstance(v, keras.Variable) else v
                     for v in metrics]
    self.checkpoint = self._checkpoint(with_metrics=bool(self._metrics))

  def _checkpoint(self, with_metrics):
    extra = {_METRICS: self._metrics} if with_metrics else {}
    return tf.train.Checkpoint(**self._objects, **extra)

  def set(self, position):
    """Records `position` (a `Position`) for the next write."""
    for variable, value in zip(self._position, position):
      variable.assign(value)

  def position(self):
    """The `Position` last recorded or restored."""
    return Position(*(int(v.numpy()) for v in self._position))

  def restore(self, path):
    """Restores the checkpoint at `path` (either door's) into these
    objects; returns its `Position`. `fit`'s metrics are restored where
    the checkpoint has them (a command line's has none: fresh ones).

    Raises:
      AssertionError, ValueError, tf.errors.OpError: a checkpoint of
        another model or optimizer.
    """
    keys = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    held = any(key.startswith(f'{_METRICS}/') for key in keys)
    self._checkpoint(with_metrics=held and bool(self._metrics)).restore(
        path).assert_existing_objects_matched().expect_partial()
    return self.position()
