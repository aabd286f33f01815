"""The first step with synchronized BatchNorm against without, side by side.

  python -m tfmulti.bench.sync_batch_norm --model=applications:ResNet50

Deploys a fresh copy of the model on 2 clones of logical CPUs twice a
round, with `sync_batch_norm=True` (the clones run in lockstep as the
replicas of a `MirroredStrategy`, every BatchNormalization synchronized)
and without, in an order that alternates by round, and times each one's
first step in its phases: tracing the step (`traced_step`), its first run
(graph optimisation and the step itself) and a second step. A model is a
registered name (`resnet20`) or `applications:NAME` for
`keras.applications.NAME(weights=None, input_shape=(32, 32, 3),
classes=10)`, as a user brings it.
"""

import argparse
import statistics
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import models
from tfmulti.bench import designs as bench
from tfmulti.bench import flags
from tfmulti.deploy import placement
from tfmulti.deploy import towers as towers_lib

NUM_CLONES = 2
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
VARIANTS = ('unsynchronized', 'synchronized')
PHASES = ('trace_s', 'first_run_s', 'second_step_s')


def _model(name):
  """A fresh copy of the model `name` (see the module's docstring)."""
  return models.get_any_model(name, input_shape=IMAGE_SHAPE,
                              num_classes=NUM_CLASSES)


def _loss(name):
  return keras.losses.SparseCategoricalCrossentropy(
      from_logits=models.ends_in_logits(name))


def time_first_steps(name, synchronized, rows):
  """Seconds of each phase of a fresh deployment's first steps."""
  config = placement.DeploymentConfig(num_clones=NUM_CLONES, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = _model(name)
    optimizer = keras.optimizers.SGD(0.01)
  towers = towers_lib.deploy(config, model, _loss(name), optimizer,
                             sync_batch_norm=synchronized)
  rng = np.random.default_rng(0)
  images = rng.normal(size=(rows, *IMAGE_SHAPE)).astype(np.float32)
  labels = rng.integers(0, NUM_CLASSES, size=rows).astype(np.int32)
  start = time.perf_counter()
  towers.traced_step(images, labels)
  traced = time.perf_counter()
  float(towers.train_step(images, labels))
  first = time.perf_counter()
  float(towers.train_step(images, labels))
  return dict(zip(PHASES, (traced - start, first - traced,
                           time.perf_counter() - first)))


def run(name, rows, rounds):
  """The report: each variant's phases (medians over rounds) and the
  synchronized / unsynchronized ratio of the first step (trace + run)."""
  times = {variant: [] for variant in VARIANTS}
  for round_index in range(rounds):
    order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
    for variant in order:
      times[variant].append(time_first_steps(
          name, variant == 'synchronized', rows))
  medians = {variant: {phase: statistics.median(t[phase] for t in runs)
                       for phase in PHASES}
             for variant, runs in times.items()}
  first = {variant: m['trace_s'] + m['first_run_s']
           for variant, m in medians.items()}
  return {'environment': bench.environment(), 'model': name, 'rows': rows,
          'num_clones': NUM_CLONES, 'rounds': rounds, 'medians': medians,
          'runs': times,
          'first_step_ratio': first['synchronized'] / first['unsynchronized']}


def format_report(report):
  lines = [f"{report['model']}, {report['rows']} rows on {NUM_CLONES} "
           f"clones (logical CPUs), medians of {report['rounds']} round(s)",
           f"{'variant':<16}" + ''.join(f'{p:>15}' for p in PHASES)]
  for variant, medians in report['medians'].items():
    lines.append(f'{variant:<16}' + ''.join(
        f'{medians[p]:>15.1f}' for p in PHASES))
  lines.append(f"first step (trace + run), synchronized / unsynchronized: "
               f"{report['first_step_ratio']:.2f}")
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.sync_batch_norm',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model='resnet20', model_names=flags.APPLICATIONS)])
  p.add_argument('--rows', type=int, default=16,
                 help='rows of the step, over both clones')
  p.add_argument('--rounds', type=int, default=1)
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  try:
    for name in ('rows', 'rounds'):
      errors.check_count(name, getattr(args, name), 1)
    models.check_any(args.model)
    devices.create_logical_cpus(NUM_CLONES)
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.sync_batch_norm: error: {e}')
  report = run(args.model, args.rows, args.rounds)
  bench.emit(report, format_report(report), args.output)


if __name__ == '__main__':
  main()
