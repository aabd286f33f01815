"""A dry run from Keras's door: a `TowersModel`'s step planned for GPUs.

    with tfmulti.plans.planning():
      with config.variables_scope():
        model = make_model()
      towers = TowersModel(model, config)       # GPU:0..N-1 need not exist
      towers.compile(optimizer='adam', loss=...)
      report = planned.plan(towers, x[:256], y[:256])

Inside `plans.planning()` the variables the towers would place on absent
GPUs are made on the host with their device planned; `plan` traces one step
of the compiled towers on a batch of `x`'s and `y`'s shapes (nothing runs)
and reads it as the command line's `--dry_run` does (`plan.dry_run`).
"""

import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import plans
from tfmulti.deploy import towers as towers_lib
from tfmulti.fit import compiled
from tfmulti.plan import dry_run


def plan(towers, x, y, sample_weight=None):
  """The `dry_run.Plan` of one step of `towers` (a `TowersModel` made and
  compiled inside `plans.planning()`) on a batch like `x`, `y`.

  Raises:
    errors.ConfigError: outside `plans.planning()`, towers not compiled
      yet, or run across workers
      (each worker plans its own devices: plan one in one process).
  """
  if not plans.active():
    raise errors.ConfigError(
        'plan a TowersModel inside the plans.planning() block it was made '
        'and compiled in: outside it, its variables read as on the host.')
  if towers.towers is None:
    raise errors.ConfigError(
        'the TowersModel is not compiled: call compile(optimizer, loss) '
        'inside plans.planning(), then plan it.')
  if not isinstance(towers.towers, towers_lib.DeployedModel):
    raise errors.ConfigError(
        'a TowersModel across workers: plan one worker\'s towers in one '
        'process (workers=None; every worker runs the same).')
  images, labels, weights = tf.nest.map_structure(
      lambda t: None if t is None else tf.convert_to_tensor(t),
      (x, y, sample_weight))
  keras_internals.build_compiled(towers, (images, labels, weights))
  return dry_run.read(towers.towers, images,
                      compiled.targets(labels, weights))
