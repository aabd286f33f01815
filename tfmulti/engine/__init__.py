"""What both front doors run: the command line's job and Keras's `fit`.

The trainer each path builds, how many steps a call runs, and what a
checkpoint holds exist once, here, below both doors: `train/` (the
command line's job) and `fit/` (`TowersModel`) import them and never each
other.

  registry     strategy name -> the builder of its trainer; the option gate
  step_calls   one step a call, or many in one compiled call
  checkpoints  the checkpoint writer: whole, intact, in the background
  contents     what a checkpoint holds, the same under both doors
  exported     the model both doors export, for one device
  readings     a step's time, rows, memory and MFU, read alike by both doors
"""
