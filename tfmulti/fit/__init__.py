"""Keras's own front door: the towers behind `compile` / `fit`.

`from tfmulti.fit import TowersModel` wraps a user's Keras model in a
`keras.Model` whose steps run the towers' step (`deploy()`'s, the one the
command line runs too), in one process or across workers.

  towers_model    TowersModel: Keras's compile / fit / evaluate / predict
  across_workers  how its steps run: in one process, or on every worker
  backup          BackupAndRestore made exact: resume at the step
  step_loop       steps_per_execution: N steps in one compiled call
"""

from tfmulti.fit.towers_model import TowersModel  # noqa: F401
