"""What a checkpoint adds to the steps: written in the background, in the
foreground, or none, side by side.

  python -m tfmulti.bench.checkpoint_stall --model=resnet20 --rounds=5

Deploys the model once on 2 clones of logical CPUs (momentum SGD, so the
checkpoint holds a slot a weight) and times, in each round and in an
order that alternates by round, `--steps` steps with a checkpoint every
`--checkpoint_steps` through the command line's `checkpoints.Checkpointer`:
written in the background (`--async_checkpoint`), in the foreground, and
no checkpoint. Each checkpointer saves twice before the rounds (its first
saves build its copies). A round's stall is its extra wall time over the
round without checkpoints, a checkpoint, as a share of that round's mean
step; the report gives the medians over rounds.
"""

import argparse
import statistics
import sys
import tempfile
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
from tfmulti.engine import checkpoints

NUM_CLONES = 2
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
VARIANTS = ('none', 'foreground', 'background')


def _deployed(name):
  config = placement.DeploymentConfig(num_clones=NUM_CLONES,
                                      clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = models.get_any_model(name, input_shape=IMAGE_SHAPE,
                                 num_classes=NUM_CLASSES)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
  loss = keras.losses.SparseCategoricalCrossentropy(
      from_logits=models.ends_in_logits(name))
  return config, towers_lib.deploy(config, model, loss, optimizer)


class _Stretch:
  """Runs stretches of steps, each saving through one checkpointer."""

  def __init__(self, config, towers, rows, directory):
    rng = np.random.default_rng(0)
    self._towers = towers
    self._batch = (tf.constant(rng.normal(size=(rows, *IMAGE_SHAPE)),
                               tf.float32),
                   tf.constant(rng.integers(0, NUM_CLASSES, size=rows),
                               tf.int32))
    self._step = 0
    self.checkpointers = {
        variant: checkpoints.Checkpointer(
            f'{directory}/{variant}', model=towers.model,
            optimizer=towers.optimizer, max_to_keep=2,
            device=config.summaries_device(),
            in_background=variant == 'background')
        for variant in VARIANTS[1:]}
    for checkpointer in self.checkpointers.values():
      for _ in range(2):
        self.run(2, 1, checkpointer)

  def run(self, steps, every, checkpointer):
    """Seconds of `steps` steps, saving every `every` through
    `checkpointer` (None: never), until the last write is whole."""
    float(self._towers.train_step(*self._batch))  # Nothing in flight.
    start = time.perf_counter()
    for k in range(1, steps + 1):
      loss = self._towers.train_step(*self._batch)
      self._step += 1
      if checkpointer is not None and k % every == 0:
        checkpointer.save(checkpoints.Position(self._step, 0, 0))
    float(loss)
    if checkpointer is not None:
      checkpointer.wait()
    return time.perf_counter() - start


def run(name, rows, steps, every, rounds):
  """The report: each variant's seconds a round, and each checkpoint's
  stall as a share of a step (medians over rounds)."""
  config, towers = _deployed(name)
  with tempfile.TemporaryDirectory() as directory:
    stretch = _Stretch(config, towers, rows, directory)
    seconds = {variant: [] for variant in VARIANTS}
    for round_index in range(rounds):
      order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
      for variant in order:
        seconds[variant].append(stretch.run(
            steps, every, stretch.checkpointers.get(variant)))
  saves = steps // every
  stalls = {variant: [(s - none) / saves / (none / steps)
                      for s, none in zip(seconds[variant], seconds['none'])]
            for variant in VARIANTS[1:]}
  return {'environment': bench.environment(), 'model': name, 'rows': rows,
          'num_clones': NUM_CLONES, 'steps': steps, 'checkpoint_steps': every,
          'rounds': rounds, 'seconds': seconds,
          'step_seconds': statistics.median(seconds['none']) / steps,
          'checkpoint_bytes': _bytes(towers),
          'stall_of_a_step': {variant: statistics.median(values)
                              for variant, values in stalls.items()},
          'stalls': stalls}


def _bytes(towers):
  return int(sum(np.prod(v.shape) * tf.as_dtype(v.dtype).size
                 for v in towers.model.variables + towers.optimizer.variables))


def format_report(report):
  lines = [f"{report['model']}, {report['rows']} rows a step on "
           f"{NUM_CLONES} clones (logical CPUs), {report['steps']} steps a "
           f"round, a checkpoint ({report['checkpoint_bytes'] / 1e6:.1f} MB) "
           f"every {report['checkpoint_steps']}; medians of "
           f"{report['rounds']} round(s), alternating",
           f"step without checkpoints: {report['step_seconds'] * 1e3:.1f} ms"]
  for variant, stall in report['stall_of_a_step'].items():
    lines.append(f'{variant:<11} a checkpoint adds {stall:6.1%} of a step')
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.checkpoint_stall',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model='resnet20', model_names=flags.APPLICATIONS)])
  p.add_argument('--rows', type=int, default=64,
                 help='rows of a step, over both clones')
  p.add_argument('--steps', type=int, default=30)
  p.add_argument('--checkpoint_steps', type=int, default=10)
  p.add_argument('--rounds', type=int, default=5)
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  try:
    for name in ('rows', 'steps', 'checkpoint_steps', 'rounds'):
      errors.check_count(name, getattr(args, name), 1)
    if args.checkpoint_steps > args.steps:
      raise errors.ConfigError(
          f'--checkpoint_steps={args.checkpoint_steps} leaves no checkpoint '
          f'in --steps={args.steps}; give at most {args.steps}.')
    models.check_any(args.model)
    devices.create_logical_cpus(NUM_CLONES)
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.checkpoint_stall: error: {e}')
  report = run(args.model, args.rows, args.steps, args.checkpoint_steps,
               args.rounds)
  bench.emit(report, format_report(report), args.output)


if __name__ == '__main__':
  main()
