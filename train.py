"""Trains an image model over clones: the tfmulti command line.

  python train.py --num_clones=2 --clone_on_cpu

A shim, so the command works from a checkout; the program is
`tfmulti/cli.py` (installed as `tfmulti-train`).
"""

from tfmulti import cli

if __name__ == '__main__':
  cli.run()
