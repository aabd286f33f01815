"""tfmulti: multi-device Keras training with model_deploy's towers.

Run as a module command (`python -m tfmulti.bench`, `python -m
tfmulti.train.export`, ...), the package starts as quietly as the command
line: TensorFlow's C++ start-up lines are held back (`native_logs`).
The launcher (`python -m tfmulti.launch`) imports no TensorFlow at all.
"""

import sys

if (sys.argv[:1] == ['-m']  # Python is locating a module to run as main.
    and 'tfmulti.launch' not in sys.orig_argv):
  from tfmulti import native_logs
  native_logs.quiet_start(sys.argv)
