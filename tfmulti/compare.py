"""Two runs compared: `python -m tfmulti.compare RUN_A RUN_B`.

  python -m tfmulti.compare runs/a runs/b
  python -m tfmulti.compare runs/a runs/b --rtol=1e-4
  python -m tfmulti.compare runs/a --golden=tests/golden/readme.json
  python -m tfmulti.compare runs/a --golden=... --first_steps=1

Compares what two command-line runs (their `--model_dir`s) logged and
kept: the total loss of each step both logged (TensorBoard's
`losses/total`) and the final state (each run's newest intact
checkpoint: the weights, the optimizer's state, the position). Bit for
bit where both trained under the same `reproducible_rows` (its promise:
the same bits on every layout), else to `--rtol` and `--atol`. Prints
one line a difference, then a summary; exits 1 where the runs differ, 2
on a folder that holds no run, 0 where they agree: torchtitan's
`loss_compare.py --assert-equal`, for layouts that should agree. One
run against a golden file (`--golden`, its losses a step, written from a
run by `--write_golden`) compares the logged losses alone.
"""

import argparse
import json
import os
import sys

import numpy as np
import tensorflow as tf

from tfmulti import errors
from tfmulti.engine import checkpoints
from tfmulti.train import run_dir
from tfmulti.train import summaries

PROGRAM = 'python -m tfmulti.compare'
# A checkpoint's bookkeeping, not what a run trained.
_BOOKKEEPING = ('_CHECKPOINTABLE_OBJECT_GRAPH', 'save_counter/')


def losses(model_dir):
  """{step: total loss} of the steps `model_dir`'s run logged."""
  found = {}
  for name in sorted(os.listdir(model_dir)):
    if name.startswith('events.out.tfevents.'):
      for record in tf.data.TFRecordDataset(os.path.join(model_dir, name)):
        event = tf.compat.v1.Event.FromString(record.numpy())
        for value in event.summary.value:
          if value.tag == summaries.TOTAL_LOSS:
            found[event.step] = float(tf.make_ndarray(value.tensor))
  return found


def weights(model_dir):
  """(step, {key: array}) of `model_dir`'s newest intact checkpoint: the
  model's weights, the optimizer's state and the position (one device's
  content whatever the layout: `engine.contents`).

  Raises:
    errors.RunDirError: it holds no checkpoint.
  """
  latest = checkpoints.latest_intact(model_dir)
  if latest is None:
    raise errors.RunDirError(f'{model_dir} holds no checkpoint; pass the '
                             '--model_dir of a run that trained.')
  reader = tf.train.load_checkpoint(latest[1])
  return latest[0], {key: reader.get_tensor(key)
                     for key in reader.get_variable_to_shape_map()
                     if not key.startswith(_BOOKKEEPING)}


def reproducible_rows(model_dir):
  """The atoms' rows `model_dir`'s run trained with (0: none).

  Raises:
    errors.RunDirError: it holds no readable job record.
  """
  try:
    with open(os.path.join(model_dir, run_dir.JOB_FILE)) as f:
      return json.load(f)['settings']['step_options']['reproducible_rows']
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise errors.RunDirError(
        f'{model_dir} holds no readable {run_dir.JOB_FILE} ({e}); pass the '
        '--model_dir of a tfmulti run.') from e


def differences(a, b, rtol, atol):
  """(the lines saying where runs `a` and `b` differ, the summary)."""
  exact = reproducible_rows(a) == reproducible_rows(b) != 0
  close = ((lambda x, y: np.array_equal(x, y)) if exact else
           (lambda x, y: np.allclose(x, y, rtol=rtol, atol=atol)))
  found = []
  losses_a, losses_b = losses(a), losses(b)
  steps = sorted(set(losses_a) & set(losses_b))
  found += [f'step {s}: loss {losses_a[s]!r} in {a}, {losses_b[s]!r} in {b}'
            for s in steps if not close(losses_a[s], losses_b[s])]
  (step_a, weights_a), (step_b, weights_b) = weights(a), weights(b)
  if step_a != step_b or weights_a.keys() != weights_b.keys():
    found.append(f'final checkpoint: step {step_a}, {len(weights_a)} '
                 f'tensors in {a}; step {step_b}, {len(weights_b)} in {b}')
  else:
    found += [f'{key}: differs by up to {_gap(weights_a[key], weights_b[key])}'
              for key in sorted(weights_a)
              if not close(weights_a[key], weights_b[key])]
  how = 'bit for bit' if exact else f'to rtol {rtol}, atol {atol}'
  return found, (f'{len(steps)} logged losses and the {len(weights_a)} '
                 f'tensors of the checkpoints at step {step_a}, {how}')


def _gap(x, y):
  return f'{float(np.max(np.abs(np.asarray(x, np.float64) - y))):.3g}'


def against_golden(run, golden, rtol, atol, first_steps=None):
  """(the lines saying where `run`'s losses differ from the golden file's
  at its steps, or its `first_steps` steps alone, the summary).

  Raises:
    errors.RunDirError: the golden file cannot be read.
  """
  try:
    with open(golden) as f:
      want = {int(step): loss for step, loss in json.load(f)['losses'].items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise errors.RunDirError(
        f'--golden={golden} cannot be read ({e}); write one with '
        '--write_golden from a run.') from e
  if first_steps is not None:
    want = dict(sorted(want.items())[:first_steps])
  got = losses(run)
  found = [f'step {s}: loss {got.get(s)!r} in {run}, {loss!r} golden'
           for s, loss in sorted(want.items())
           if s not in got or not np.isclose(got[s], loss, rtol=rtol,
                                             atol=atol)]
  return found, (f'{len(want)} golden losses, to rtol {rtol}, atol '
                 f'{atol}')


def write_golden(run, path):
  """Writes `run`'s logged losses as a golden file at `path`."""
  with open(path, 'w') as f:
    json.dump({'losses': {str(step): loss for step, loss in
                          sorted(losses(run).items())}}, f, indent=2)
    f.write('\n')


def _parser():
  parser = argparse.ArgumentParser(prog=PROGRAM,
                                   description=__doc__.split('\n')[0])
  parser.add_argument('runs', nargs='+', metavar='RUN',
                      help="a run's --model_dir; two to compare them")
  parser.add_argument('--golden', help="one run: a golden file's losses to "
                      'compare its own with')
  parser.add_argument('--write_golden', help="one run: write its losses as "
                      'a golden file here')
  parser.add_argument('--first_steps', type=int, help="with --golden: "
                      "its first this many steps alone (a job whose later "
                      "steps amplify round-off)")
  parser.add_argument('--rtol', type=float, default=1e-5)
  parser.add_argument('--atol', type=float, default=1e-6)
  return parser


def main(argv=None):
  parser = _parser()
  args = parser.parse_args(argv)
  golden = [flag for flag in ('golden', 'write_golden')
            if getattr(args, flag)]
  if len(args.runs) != (1 if golden else 2) or len(golden) > 1:
    parser.error('give two runs, or one run with --golden or '
                 '--write_golden')
  try:
    if args.write_golden:
      write_golden(args.runs[0], args.write_golden)
      return
    if args.first_steps is not None and (not args.golden or
                                         args.first_steps < 1):
      raise errors.ConfigError(
          f'--first_steps={args.first_steps}: give a count of 1 or more, '
          'with --golden.')
    found, summary = (
        against_golden(args.runs[0], args.golden, args.rtol, args.atol,
                       args.first_steps)
        if args.golden else
        differences(*args.runs, args.rtol, args.atol))
  except errors.UserError as e:
    sys.stderr.write(f'{PROGRAM}: error: {e}\n')
    sys.exit(2)
  sys.stdout.write(''.join(f'{line}\n' for line in found))
  sys.stdout.write(f'{"differ" if found else "agree"}: {summary}\n')
  sys.exit(1 if found else 0)


if __name__ == '__main__':
  main()
