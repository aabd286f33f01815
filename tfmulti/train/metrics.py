"""`<model_dir>/metrics.json`: what a run reached, as strict JSON.

Strict JSON has no NaN or Infinity (readers refuse them): a value that is
not a finite number is written as null, and `nulls` says why.
"""

import hashlib
import json
import math
import os

from absl import logging
import numpy as np

from tfmulti import errors
from tfmulti.deploy import placement
from tfmulti.train import build

METRICS_FILE = 'metrics.json'
# Measured over the steps this session trained; none when nothing was left.
TIMED = ('train_loss', 'images_per_sec')
NO_STEP_RAN = 'no step ran in this session (nothing was left to train)'


def process_age():
  """Seconds since this process started (Linux's /proc), or NaN where that
  cannot be read: what a process spent before the job (imports, most of
  them TensorFlow's)."""
  try:
    with open('/proc/self/stat') as f:  # Field 22, after the command's ')'.
      start_ticks = int(f.read().rsplit(')', 1)[1].split()[19])
    with open('/proc/uptime') as f:
      uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError):
    return float('nan')


def phases(progress, started, imports=float('nan')):
  """Where a run's time went, in seconds: the process before the job
  (`imports`: `process_age` when the job started), start-up (from
  `started`, a perf_counter reading, to the first step), the first step
  (tracing), training after it, evaluation and checkpoints (part of
  training); the job adds its export."""
  first = progress.first_step_started
  return {'imports': imports,
          'startup': first - started if first else float('nan'),
          'first_step': progress.first_step_seconds,
          'train_after_first_step': progress.train_seconds,
          'evaluation': progress.evaluation_seconds,
          'checkpoints': progress.checkpoint_seconds}


# The phases that do not overlap (checkpoints are part of training).
WHOLE_PHASES = ('imports', 'startup', 'first_step', 'train_after_first_step',
                'evaluation', 'export')


def with_the_rest(phases):
  """`phases` with 'other': the process's age now less the phases that do
  not overlap (the job's end: the last checkpoint's write, the summaries'
  close; the gaps between phases), so that they add up to the process's
  wall time until metrics.json is written. Only the exit comes after.
  None where the process's age cannot be read."""
  age = process_age()
  covered = sum(phases.get(name) or 0.0 for name in WHOLE_PHASES)
  return dict(phases, other=age - covered if math.isfinite(age) else None)


def collect(config, deploy_config, run, outcome, restored, started,
            imports=float('nan')):
  """The metrics of a finished `loop.Run` and its `loop.Outcome`."""
  steps_per_epoch = run.dataset.train_examples // run.global_batch_size
  return {
      'phases_seconds': strict(phases(outcome.progress, started, imports)),
      'eval_accuracy': outcome.evaluation['accuracy'],
      'eval_loss': outcome.evaluation['loss'],
      'train_loss': outcome.progress.last_window_loss,
      'steps': outcome.position.step,
      'resumed_from_step': restored.step if restored else None,
      'epochs': outcome.position.step / steps_per_epoch,
      'images_per_sec': outcome.progress.images_per_sec,
      'train_seconds': outcome.progress.train_seconds,
      'strategy': config.strategy,
      'num_clones': deploy_config.num_clones,
      'num_workers': deploy_config.num_workers,
      'batch_size': config.batch_size,
      'global_batch_size': run.global_batch_size,
      'variables_device': (deploy_config.variables_device()
                           or placement.SPREAD),
      'clone_devices': deploy_config.clone_devices(),
      'num_stages': deploy_config.num_stages,
      'num_microbatches': config.step_options.num_microbatches,
      'accumulation_steps': config.step_options.accumulation_steps,
      # Steps a compiled call ran: N, or 'auto' where it chose none.
      'steps_per_loop': outcome.steps_per_loop,
      'clone_shares': _shares(run.trainer),
      'model': config.model,
      'dataset': config.dataset,
      'optimizer': config.optimizer,
      'learning_rate': config.learning_rate,
      'peak_learning_rate': run.schedule.peak,
      'lr_schedule': config.lr_schedule,
      'mixed_precision': build.dtype_policy(config.mixed_precision,
                                            deploy_config.clone_on_cpu),
      'seed': config.seed,
      'checkpoint': run.checkpointer.latest,
      'async_checkpoint': run.checkpointer.in_background,
      'elastic_restarts': config.elastic_start,
  }


def _shares(trainer):
  """The clones' shares at the end (measured ones with 'auto'), or None."""
  shares = trainer.clone_shares
  return list(shares) if shares else None


def strict(metrics):
  """`metrics` with each non-finite float as None, and why under 'nulls'."""
  out, nulls = {}, {}
  for key, value in metrics.items():
    if isinstance(value, float) and not math.isfinite(value):
      out[key] = None
      nulls[key] = (NO_STEP_RAN if key in TIMED
                    else f'not a finite number ({value})')
    else:
      out[key] = value
  if nulls:
    out['nulls'] = nulls
  return out


def _shown(value, spec):
  return format(value, spec) if math.isfinite(value) else 'n/a'


def read(model_dir):
  """The metrics.json in `model_dir`, or None if there is none to read."""
  try:
    with open(os.path.join(model_dir, METRICS_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write(model_dir, metrics):
  """Writes metrics.json atomically (a reader never sees half a file).

  Raises:
    errors.RunDirError: it cannot be written.
  """
  path = os.path.join(model_dir, METRICS_FILE)
  try:
    with open(path + '.tmp', 'w') as f:
      json.dump(strict(metrics), f, indent=2, sort_keys=True, allow_nan=False)
    os.replace(path + '.tmp', path)
  except OSError as e:
    raise errors.RunDirError(
        f'cannot write {path} ({e.strerror or e}); free some space or fix '
        'the directory (the checkpoints are saved).') from e
  logging.info('done: %d steps, eval accuracy %.4f, train loss %s, %s '
               'images/sec; metrics in %s', metrics['steps'],
               metrics['eval_accuracy'], _shown(metrics['train_loss'], '.4f'),
               _shown(metrics['images_per_sec'], '.0f'), path)
  return path


def fingerprint(model):
  """A digest of every weight, to compare workers' copies in the log."""
  digest = hashlib.sha256()
  for weight in model.get_weights():
    digest.update(np.ascontiguousarray(weight).tobytes())
  return digest.hexdigest()[:16]
