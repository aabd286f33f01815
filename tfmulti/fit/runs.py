"""A `TowersModel.fit` run: its arguments, its backup and its exits.

`fit` binds Keras's arguments once, refuses what its workers or its
layout cannot run before anything trains, puts the exact backup
(`backup.Backup`) in place of a `keras.callbacks.BackupAndRestore`, and
ends a preempted run, a lost peer or workers that read different batches
with one line and the command line's statuses (`errors.exit_for`).
"""

import inspect
import sys

from absl import logging
import keras

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti.engine import readings
from tfmulti.fit import across_workers
from tfmulti.fit import backup as backup_lib
from tfmulti.fit import readings as fit_readings

_FIT = inspect.signature(keras.Model.fit)


def run(model, keras_fit, args, kwargs):
  """`keras_fit` (Keras's own `fit` of `model`, a `TowersModel`) on
  `args` and `kwargs` as `fit` takes them (see `TowersModel.fit`)."""
  arguments = fit_arguments(model, args, kwargs)
  model.door.check_input(arguments)
  check_batches(model, arguments)
  model.batches.rows = 0  # The fit's first step fixes them again.
  _shuffle_seeded(model, arguments)
  arguments['callbacks'] = [fit_readings.Readings(
      model, **model.device_figures)] + (
      _with_backup(model, arguments))
  try:
    with model.door.guard(
        lambda: int(model.optimizer.iterations.value.numpy()) + 1):
      return keras_fit(**model.door.for_this_worker(arguments))
  except backup_lib.Preempted as e:
    logging.warning('%s: the job saved it in %s; run the same script '
                    'again to resume.', e, model.passes.backup.directory)
    sys.exit(e.stop.exit_code)
  except errors.ClusterError as e:
    # A peer lost mid-step, or one that missed the agreed stop: one
    # line, not TensorFlow's pages of traceback.
    raise errors.exit_for(e) from e
  finally:
    model.passes.close()


def fit_arguments(model, args, kwargs):
  """`fit`'s arguments by name (a dict), as Keras's `fit` binds them."""
  arguments = _FIT.bind(model, *args, **kwargs).arguments
  del arguments['self']
  arguments.update(arguments.pop('kwargs', {}))
  return arguments


def _shuffle_seeded(model, arguments):
  """With `reproducible_rows` op determinism is on, under which Keras's
  default shuffle of arrays (an unseeded random op, unless
  `keras.utils.set_random_seed` seeded the process) would fail: such
  arrays are fed in each epoch's order from `shuffle_seed` instead
  (`backup.feed_arrays`, as a backup feeds them), the same on every
  layout and every run."""
  if (model.options.reproducible_rows
      and backup_lib.are_arrays(arguments.get('x'))
      and arguments.get('shuffle', True)
      and not _seeded()
      and not any(isinstance(c, keras.callbacks.BackupAndRestore)
                  for c in arguments.get('callbacks') or ())):
    backup_lib.feed_arrays(arguments, seed=model.shuffle_seed,
                           first_epoch=arguments.get('initial_epoch', 0))


def _seeded():
  """Whether TensorFlow's random ops draw from a global seed (asked
  without drawing an op seed, which would move later draws)."""
  return keras_internals.global_seed_set()


def _with_backup(model, arguments):
  """`fit`'s callbacks, a `BackupAndRestore` among them replaced by the
  exact `backup.Backup` (which `model.passes` consults each step)."""
  callbacks = list(arguments.get('callbacks') or ())
  originals = [c for c in callbacks
               if isinstance(c, keras.callbacks.BackupAndRestore)]
  if not originals:
    return callbacks
  model.passes.backup = backup_lib.Backup(
      originals[0], **backup_lib.fed(arguments, originals[0].backup_dir,
                                     seed=model.shuffle_seed),
      is_chief=model.config.worker_index == 0,
      agreed_stop=model.door.agreed_stop())
  return [model.passes.backup if c is originals[0] else c
          for c in callbacks]


def check_batches(model, arguments):
  """Cuts the full and the last batch of array inputs before the first
  step: a last batch the layout refuses (not whole atoms, clones in
  lockstep) would otherwise stop `fit` after a whole epoch."""
  x = arguments.get('x')
  if model.towers is None or not backup_lib.are_arrays(x):
    return
  _, full, last = across_workers.fit_batches(arguments)
  for batch, partial in ((full, False), (last, 0 < last < full)):
    if batch:
      model.towers.check_batch(batch, partial)


class FullRows:
  """The rows of a fit's full global batches: the most a batch of this
  fit had (its first step sets them); a batch of fewer is its last,
  partial one (Keras's), which the step cuts as plain `fit` trains it.
  Its token positions a row too, where the inputs are tokens."""

  def __init__(self):
    self.rows = 0
    self.tokens_per_row = None  # Where the inputs are tokens (`readings`).

  def note(self, inputs):
    """Notes a batch's inputs' token positions a row, if tokens."""
    self.tokens_per_row = readings.tokens_per_row(inputs)

  def partial(self, rows):
    """Whether a batch of `rows` rows is a partial one."""
    self.rows = max(self.rows, rows)
    return rows < self.rows
