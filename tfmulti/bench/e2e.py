"""The whole main job against plain Keras `model.fit`, side by side.

  python -m tfmulti.bench.e2e --model=lenet --epochs=40 --rounds=3

Runs, in one process and in interleaved rounds (the order rotates each
round), the same work several ways: tfmulti's main job (`train_and_evaluate`:
input pipeline, evaluation every epoch, summaries, checkpoints; the export
at the end is off, as the `model.fit` script has none) with 2 clones on
logical CPUs and with 1 clone, each with `--xla`'s default (`auto`) and
with XLA on, and with `--steps_per_loop`'s default (`auto`) and one step
a call; and the plain Keras equivalent (`compile` + `fit` with
`validation_data`, the same model, data pipeline, global batch, optimizer
and epochs) on one device with its defaults (`jit_compile='auto'`) and
with `jit_compile=True`, under `MirroredStrategy` on the two logical CPUs,
and as `fit.TowersModel` (the towers behind `fit`) on them; plain `fit`
and `TowersModel` again with `steps_per_execution=8`. Each job is
timed whole (wall and process CPU seconds) and by phase: start-up to the
first step, the first step (tracing), training after it, evaluation.
`--variants` picks some.
"""

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time

from absl import logging
import keras
import tensorflow as tf

from tfmulti import data
from tfmulti import devices
from tfmulti import errors
from tfmulti import fit
from tfmulti import step_options
from tfmulti.bench import flags
from tfmulti.deploy import placement
from tfmulti.engine import step_calls
from tfmulti.train import build
from tfmulti.train import config as config_lib
from tfmulti.train import job

NUM_LOGICAL_CPUS = 2
FIT_VARIANTS = ('fit_one_device', 'fit_one_device_jit', 'fit_mirrored',
                'towers_fit_2clones', 'fit_one_device_8_a_call',
                'towers_fit_2clones_8_a_call')
TFMULTI_VARIANTS = ('tfmulti_2clones', 'tfmulti_1clone',
                    'tfmulti_2clones_xla', 'tfmulti_1clone_xla',
                    'tfmulti_2clones_no_xla', 'tfmulti_1clone_no_xla',
                    'tfmulti_2clones_one_a_call', 'tfmulti_1clone_one_a_call')


@dataclasses.dataclass(frozen=True)
class E2EConfig:
  """What to run.

  Attributes:
    model: a registered model name.
    global_batch_size: rows per step on every variant.
    epochs: passes over digits' train split, with an evaluation after each.
    optimizer: one of `build.OPTIMIZERS`.
    learning_rate: its rate.
    rounds: whole jobs per variant (medians over them).
    data_dir: TFDS data directory (digits is prepared there offline).
  """
  model: str = 'lenet'
  global_batch_size: int = 128
  epochs: int = 40
  optimizer: str = 'adam'
  learning_rate: float = 1e-3
  rounds: int = 3
  data_dir: str = None

  def __post_init__(self):
    for name in ('global_batch_size', 'epochs', 'rounds'):
      errors.check_count(name, getattr(self, name), 1)
    if self.global_batch_size % NUM_LOGICAL_CPUS:
      raise errors.ConfigError(
          f'global_batch_size={self.global_batch_size}: must split over '
          f'{NUM_LOGICAL_CPUS} clones; pass an even number.')


def _timed(job):
  """(result, wall seconds, process CPU seconds) of `job()`."""
  wall, cpu = time.perf_counter(), time.process_time()
  result = job()
  return result, time.perf_counter() - wall, time.process_time() - cpu


def _tfmulti(e2e, num_clones, xla=step_options.AUTO,
             steps_per_loop=step_calls.AUTO):
  """The main job, with `xla` its step option and `steps_per_loop` its
  steps a call; returns its phases."""
  model_dir = tempfile.mkdtemp(prefix='tfmulti-e2e-')
  try:
    metrics = job.train_and_evaluate(
        config_lib.TrainConfig(
            model=e2e.model, model_dir=model_dir, data_dir=e2e.data_dir,
            batch_size=e2e.global_batch_size // num_clones,
            epochs=e2e.epochs, optimizer=e2e.optimizer,
            learning_rate=e2e.learning_rate, export=False,
            steps_per_loop=steps_per_loop,
            step_options=step_options.StepOptions(xla=xla)),
        placement.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True))
  finally:
    shutil.rmtree(model_dir, ignore_errors=True)
  phases = metrics['phases_seconds']
  return {'startup': phases['startup'], 'first_step': phases['first_step'],
          'train_after_first_step': phases['train_after_first_step'],
          'evaluation': phases['evaluation'],
          'images_per_sec': metrics['images_per_sec'],
          'eval_accuracy': metrics['eval_accuracy'],
          'steps_per_loop': metrics['steps_per_loop']}


class _Phases(keras.callbacks.Callback):
  """The same phases as the main job's, from `fit`'s callbacks."""

  def __init__(self, started):
    super().__init__()
    self.started, self.times = started, {'evaluation': 0.0}
    self._first = self._test = None

  def on_train_batch_begin(self, batch, logs=None):
    if self._first is None:
      self._first = time.perf_counter()
      self.times['startup'] = self._first - self.started

  def on_train_batch_end(self, batch, logs=None):
    if 'first_step' not in self.times:
      self.times['first_step'] = time.perf_counter() - self._first
      self._after_first = time.perf_counter()

  def on_test_begin(self, logs=None):
    self._test = time.perf_counter()

  def on_test_end(self, logs=None):
    self.times['evaluation'] += time.perf_counter() - self._test

  def on_train_end(self, logs=None):
    self.times['train_after_first_step'] = (
        time.perf_counter() - self._after_first - self.times['evaluation'])


def _fit(e2e, kind, jit_compile='auto', steps_per_execution=1):
  """The plain Keras script: build, compile, fit with validation; `kind`
  'one_device', 'mirrored' (MirroredStrategy) or 'towers' (TowersModel on
  the two logical CPUs); `jit_compile` and `steps_per_execution` as
  `compile` takes them."""
  started = time.perf_counter()
  keras.utils.set_random_seed(0)
  loaded = data.load('digits', global_batch_size=e2e.global_batch_size,
                     data_dir=e2e.data_dir)
  towers = placement.DeploymentConfig(num_clones=NUM_LOGICAL_CPUS,
                                      clone_on_cpu=True)
  scope = {'one_device': lambda: tf.device('/cpu:0'),
           'towers': lambda: tf.device(towers.variables_device()),
           'mirrored': lambda: tf.distribute.MirroredStrategy(
               ['/cpu:0', '/cpu:1'],
               cross_device_ops=tf.distribute.ReductionToOneDevice()).scope()}
  with scope[kind]():
    model, optimizer = build.model_and_optimizer(
        config_lib.TrainConfig(model=e2e.model, optimizer=e2e.optimizer,
                               learning_rate=e2e.learning_rate),
        placement.DeploymentConfig(), input_shape=loaded.input_shape,
        num_classes=loaded.num_classes, learning_rate=e2e.learning_rate)()
    if kind == 'towers':
      model = fit.TowersModel(model, towers)
    model.compile(optimizer=optimizer, loss=build.make_loss(),
                  metrics=['accuracy'], jit_compile=jit_compile,
                  steps_per_execution=steps_per_execution)
  phases = _Phases(started)
  history = model.fit(loaded.train_epoch(0), epochs=e2e.epochs,
                      validation_data=loaded.test, callbacks=[phases],
                      verbose=0)
  steps = e2e.epochs * (loaded.train_examples // e2e.global_batch_size)
  return dict(phases.times, eval_accuracy=history.history['val_accuracy'][-1],
              # The first call runs `steps_per_execution` steps.
              images_per_sec=(steps - steps_per_execution) * (
                  e2e.global_batch_size) / (
                  phases.times['train_after_first_step']))


def run(e2e, variants=TFMULTI_VARIANTS + FIT_VARIANTS):
  """{variant: [per-round dicts with wall, cpu and the phases]}."""
  jobs = {'tfmulti_2clones': lambda: _tfmulti(e2e, 2),
          'tfmulti_1clone': lambda: _tfmulti(e2e, 1),
          'tfmulti_2clones_xla': lambda: _tfmulti(e2e, 2, xla=True),
          'tfmulti_1clone_xla': lambda: _tfmulti(e2e, 1, xla=True),
          'tfmulti_2clones_no_xla': lambda: _tfmulti(e2e, 2, xla=False),
          'tfmulti_1clone_no_xla': lambda: _tfmulti(e2e, 1, xla=False),
          'tfmulti_2clones_one_a_call': lambda: _tfmulti(
              e2e, 2, steps_per_loop=1),
          'tfmulti_1clone_one_a_call': lambda: _tfmulti(
              e2e, 1, steps_per_loop=1),
          'fit_one_device': lambda: _fit(e2e, 'one_device'),
          'fit_one_device_jit': lambda: _fit(e2e, 'one_device', True),
          'fit_mirrored': lambda: _fit(e2e, 'mirrored'),
          'towers_fit_2clones': lambda: _fit(e2e, 'towers'),
          'fit_one_device_8_a_call': lambda: _fit(
              e2e, 'one_device', steps_per_execution=8),
          'towers_fit_2clones_8_a_call': lambda: _fit(
              e2e, 'towers', steps_per_execution=8)}
  names = [name for name in jobs if name in variants]
  rounds = {name: [] for name in names}
  for k in range(e2e.rounds):
    for name in names[k % len(names):] + names[:k % len(names)]:
      phases, wall, cpu = _timed(jobs[name])
      rounds[name].append(dict(phases, wall=wall, cpu=cpu))
      logging.info('round %d %s: %.1f s wall', k + 1, name, wall)
  return rounds


def summarize(rounds):
  """Medians per variant, and each variant's wall and CPU time over
  one-device `fit`'s."""
  medians = {name: {key: statistics.median(r[key] for r in runs)
                    for key in runs[0]}
             for name, runs in rounds.items()}
  reference = medians['fit_one_device']
  for entry in medians.values():
    entry['wall_vs_fit'] = entry['wall'] / reference['wall']
    entry['cpu_vs_fit'] = entry['cpu'] / reference['cpu']
  return medians


def format_table(medians):
  keys = ('wall', 'cpu', 'wall_vs_fit', 'cpu_vs_fit', 'startup',
          'first_step', 'train_after_first_step', 'evaluation',
          'images_per_sec', 'eval_accuracy')
  lines = ['variant'.ljust(18) + ''.join(k[:12].rjust(13) for k in keys)]
  for name, entry in medians.items():
    lines.append(name.ljust(18) + ''.join(
        f'{entry[k]:13.3f}' if k.endswith(('fit', 'accuracy'))
        else f'{entry[k]:13.2f}' for k in keys))
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.e2e', description=__doc__.split('\n')[0],
      parents=[flags.shared(model='lenet', model_names=flags.TRAINABLE)])
  p.add_argument('--global_batch_size', type=int, default=128)
  p.add_argument('--epochs', type=int, default=40)
  p.add_argument('--optimizer', default='adam')
  p.add_argument('--learning_rate', type=float, default=1e-3)
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--data_dir')
  p.add_argument('--variants', default=','.join(
      TFMULTI_VARIANTS + FIT_VARIANTS), help='comma-separated; '
      'fit_one_device (the reference) always runs')
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  variants = set(args.variants.split(',')) | {'fit_one_device'}
  unknown = variants - set(TFMULTI_VARIANTS + FIT_VARIANTS)
  if unknown:
    sys.exit(f'tfmulti.bench.e2e: error: --variants={args.variants}: no '
             f'variant {sorted(unknown)}; choose from '
             f'{",".join(TFMULTI_VARIANTS + FIT_VARIANTS)}.')
  try:
    e2e = E2EConfig(model=args.model,
                    global_batch_size=args.global_batch_size,
                    epochs=args.epochs, optimizer=args.optimizer,
                    learning_rate=args.learning_rate, rounds=args.rounds,
                    data_dir=args.data_dir)
    config_lib.TrainConfig(model=e2e.model, optimizer=e2e.optimizer)
    devices.create_logical_cpus(NUM_LOGICAL_CPUS)
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.e2e: error: {e}')
  rounds = run(e2e, variants)
  medians = summarize(rounds)
  print(format_table(medians))
  if args.output:
    with open(args.output, 'w') as f:
      json.dump({'config': dataclasses.asdict(e2e), 'rounds': rounds,
                 'medians': medians}, f, indent=2)


if __name__ == '__main__':
  main()
