"""Keras's own front door: the towers behind `compile` / `fit`.

`from tfmulti.fit import TowersModel` wraps a user's Keras model in a
`keras.Model` whose steps drive the trainer the command line builds too
(`engine.registry`), through the one trainer contract, in one process or
across workers. It imports nothing of the command line's job (`train/`).

  towers_model    TowersModel: Keras's compile / fit / evaluate / predict
  across_workers  how fit runs: in one process, or on every worker
  compiled        Keras's side of a step: its compiled loss and metrics
  runs            a fit's run: its arguments, its backup, its exits
  backup          BackupAndRestore made exact: resume at the step
  readings        each step's time, rows, memory and MFU in fit's logs
  step_loop       steps_per_execution on the one compiled N-step loop
  keras_steps     Keras's steps on the trainer: compile, train, evaluate
  own_steps       a model's own train_step / test_step / compute_loss,
                  run once a batch, as one device runs it
  rows_split      the layers an own step calls, computed by rows on the
                  clones (forward and backward), gradients summed once
  planned         a dry run: a compiled TowersModel planned for GPUs
"""

from tfmulti.fit.towers_model import TowersModel  # noqa: F401
