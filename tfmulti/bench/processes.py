"""The main command against the plain Keras script, as whole processes.

  python -m tfmulti.bench.processes --rounds=5 --output=processes.json

Times, in alternating rounds (the order rotates each round), each command
from its start to its exit, as a user's shell sees it: imports, start-up,
training, evaluation, checkpoints, the export and the exit. The commands:
`python train.py --num_clones=2 --clone_on_cpu` (its defaults, among them
`--steps_per_loop=auto`), the same with one step a call, with 1 clone,
and the Keras script (`bench.fit_script`) doing the same work on one
device. Medians, and each command's wall over the script's.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from tfmulti.bench import fit_script
from tfmulti.bench import flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TRAIN = [sys.executable, os.path.join(REPO, 'train.py'), '--clone_on_cpu',
         '--batch_size=%d']
COMMANDS = {
    'train_py_2clones': TRAIN + ['--num_clones=2'],
    'train_py_2clones_one_a_call': TRAIN + ['--num_clones=2',
                                            '--steps_per_loop=1'],
    'train_py_1clone': TRAIN + ['--num_clones=1'],
    'fit_script': [sys.executable, '-m', 'tfmulti.bench.fit_script'],
}
REFERENCE = 'fit_script'


def _argv(name, model_dir, epochs, data_dir):
  """The command line of `name`, writing to `model_dir`."""
  argv = list(COMMANDS[name])
  if name != REFERENCE:
    clones = 2 if '2clones' in name else 1
    argv[3] %= fit_script.BATCH // clones
  argv += [f'--model_dir={model_dir}', f'--epochs={epochs}']
  return argv + ([f'--data_dir={data_dir}'] if data_dir else [])


def _timed(argv):
  """Wall seconds of `argv` as a process; raises if it fails."""
  started = time.perf_counter()
  subprocess.run(argv, check=True, cwd=REPO, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
  return time.perf_counter() - started


def run(rounds, epochs, data_dir, names=tuple(COMMANDS)):
  """{name: [wall seconds a round]}, alternating."""
  walls = {name: [] for name in names}
  for k in range(rounds):
    for name in names[k % len(names):] + names[:k % len(names)]:
      model_dir = tempfile.mkdtemp(prefix='tfmulti-processes-')
      try:
        walls[name].append(_timed(_argv(name, model_dir, epochs, data_dir)))
      finally:
        shutil.rmtree(model_dir, ignore_errors=True)
      print(f'round {k + 1} {name}: {walls[name][-1]:.2f} s', flush=True)
  return walls


def summarize(walls):
  """{name: {'median', 'x_fit_script'}}."""
  medians = {name: statistics.median(w) for name, w in walls.items()}
  return {name: {'median_s': m, 'x_fit_script': m / medians[REFERENCE]}
          for name, m in medians.items()}


def parser():
  """The command line: the shared --output and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.processes',
      description=__doc__.split('\n')[0], parents=[flags.shared()])
  p.add_argument('--rounds', type=int, default=5)
  p.add_argument('--epochs', type=int, default=40)
  p.add_argument('--data_dir')
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  walls = run(args.rounds, args.epochs, args.data_dir)
  summary = summarize(walls)
  for name, entry in summary.items():
    print(f'{name:30s} {entry["median_s"]:7.2f} s  '
          f'{entry["x_fit_script"]:.3f}x the Keras script')
  if args.output:
    with open(args.output, 'w') as f:
      json.dump({'epochs': args.epochs, 'rounds': walls,
                 'medians': summary}, f, indent=2)


if __name__ == '__main__':
  main()
