"""The flags benchmarks share: --model, --num_clones, --clone_on_cpu, --output.

Each benchmark's parser declares only its own flags and takes these from
`shared(...)`, a parent parser (argparse's `parents=[...]`), so a shared
flag has one spelling, type and help. A benchmark picks the shared flags
it takes and gives their defaults, which differ (LeNet for the quick
ones, ResNet-50 for the transfers, 4 clones where the spread shows).
`on_logical_cpus` checks a graph-reading benchmark's counts and makes its
devices, in that order.
"""

import argparse
import sys

import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import models

# What a benchmark's --model takes, and so how it is checked.
REGISTERED = 'registered'  # tfmulti.models' names; argparse refuses others.
TRAINABLE = 'trainable'  # What train.py takes; the benchmark's config checks.
APPLICATIONS = 'applications'  # Those or applications:NAME (check_any).
_MODEL_HELP = {
    REGISTERED: 'a model of tfmulti.models',
    TRAINABLE: 'a model as train.py takes it: a registered name, '
               'keras.applications.NAME or MODULE:FUNCTION',
    APPLICATIONS: 'a registered model, or applications:NAME '
                  '(keras.applications.NAME, as a user brings it)',
}
# The flags `shared` declares, by the name each fills in the parsed args.
NAMES = ('model', 'num_clones', 'clone_on_cpu', 'output')


def shared(*, model=None, model_names=REGISTERED, num_clones=None,
           clone_on_cpu=False, output=True):
  """The parent parser of the shared flags a benchmark takes.

  Args:
    model: --model's default, or None for a benchmark without --model.
    model_names: what --model takes: REGISTERED, TRAINABLE or
      APPLICATIONS.
    num_clones: --num_clones's default, or None for no --num_clones.
    clone_on_cpu: whether the benchmark takes --clone_on_cpu.
    output: whether the benchmark takes --output.

  Returns:
    An `argparse.ArgumentParser` without -h, for `parents=[...]`.
  """
  parent = argparse.ArgumentParser(add_help=False)
  if model is not None:
    choices = models.names() if model_names == REGISTERED else None
    parent.add_argument('--model', default=model, choices=choices,
                        help=_MODEL_HELP[model_names] +
                        ' (default: %(default)s)')
  if num_clones is not None:
    parent.add_argument('--num_clones', type=int, default=num_clones,
                        help='copies of the model, one a device, that '
                        "split each step's rows (default: %(default)s)")
  if clone_on_cpu:
    parent.add_argument('--clone_on_cpu', action='store_true',
                        help='put the clones (a pipeline: its stages) on '
                        'logical CPUs, created here, not on GPUs')
  if output:
    parent.add_argument('--output', help='write the report here as JSON')
  return parent


def on_logical_cpus(prog, args, counts, cpus, check=None):
  """Checks `args` before any device is made (each flag named in `counts`
  an integer of at least 1, then `check(args)`, which raises
  `errors.UserError`), then makes `cpus` logical CPUs with soft placement
  off. A bad value exits with one line: 'PROG: error: ...'."""
  try:
    for name in counts:
      errors.check_count(name, getattr(args, name), 1)
    if check is not None:
      check(args)
    devices.create_logical_cpus(cpus)
    tf.config.set_soft_device_placement(False)
  except errors.UserError as e:
    sys.exit(f'{prog}: error: {e}')
