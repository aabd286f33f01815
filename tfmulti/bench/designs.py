"""What each design costs, side by side: `python -m tfmulti.bench`.

The variants (`bench_variants`: single, towers, towers_spread,
towers_spread_packs, towers_gpu_vars,
towers_one_device, independent, mirrored_<op>, central_storage) train the
same model on the same global batch, built through the training code. After
warm-up they are timed in interleaved rounds (the order rotates each round),
so a noisy neighbour slows all of them alike; the report gives each
variant's median and spread in global images/sec and its ratio to `single`,
the `--strategy=single` step.

`--sweep` times the towers at 1, 2, 4 and 8 clones and a fixed per-clone
batch, and reports the cost per image and the trace time per clone count.
XLA is set explicitly in every variant (the tf.distribute paths run
without it); a variant that retraces after warm-up fails the benchmark.
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from typing import Tuple

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import models
from tfmulti.bench import flags
from tfmulti.bench import variants as bench_variants
from tfmulti.deploy import placement


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What to benchmark.

  Attributes:
    model: a registered model name.
    batch_size: examples per clone per step; the global batch is
      batch_size * num_clones for every variant.
    num_clones: clones (tf.distribute replicas) of the multi-device variants.
    clone_on_cpu: clones on logical CPUs instead of GPUs.
    xla: compile with XLA where the variant can (not the tf.distribute
      ones, which run without it and say so).
    mixed_precision: bfloat16 on CPUs, float16 with loss scaling on GPUs.
    rounds: timed rounds per variant (the report's median is over them).
    steps_per_round: steps timed in one round.
    untimed_steps: steps per variant before the rounds, not timed.
    sweep_clones: clone counts of the sweep; empty for no sweep.
    reproducible_rows: the atom of the `towers_reproducible` variant.
  """
  model: str = 'resnet20'
  batch_size: int = 64
  num_clones: int = 2
  clone_on_cpu: bool = False
  xla: bool = False
  mixed_precision: bool = False
  rounds: int = 5
  steps_per_round: int = 10
  untimed_steps: int = 3
  sweep_clones: Tuple[int, ...] = ()
  reproducible_rows: int = 32

  def __post_init__(self):
    models.check(self.model)
    for name in ('batch_size', 'num_clones', 'rounds', 'steps_per_round',
                 'untimed_steps', 'reproducible_rows'):
      errors.check_count(name, getattr(self, name), 1)
    for count in self.sweep_clones:
      errors.check_count('sweep_clones', count, 1)
    if self.batch_size % self.reproducible_rows:
      raise errors.ConfigError(
          f'reproducible_rows={self.reproducible_rows}: each clone\'s '
          f'batch_size={self.batch_size} must be whole atoms; pass a divisor '
          f'of {self.batch_size}.')


def _run_steps(variant, steps):
  loss = None
  for _ in range(steps):
    loss = variant.step()
  float(loss)  # Waits for the device to finish the last step.


def _warm_up(variants, config):
  """Runs each variant's warm-up; returns {name: seconds of the first step}."""
  first_step = {}
  for variant in variants:
    start = time.perf_counter()
    _run_steps(variant, 1)  # Traces (and compiles) the step.
    first_step[variant.name] = time.perf_counter() - start
    _run_steps(variant, config.untimed_steps)
  return first_step


def time_variants(variants, config):
  """{name: [images/sec of each round]}, rounds interleaved over variants.

  Raises:
    RuntimeError: a variant retraced after warm-up (its timing would hide
      the tracing).
  """
  traces = {v.name: v.trace_count() for v in variants}
  global_batch = config.batch_size * config.num_clones
  rates = {v.name: [] for v in variants}
  for round_index in range(config.rounds):
    shift = round_index % len(variants)
    for variant in variants[shift:] + variants[:shift]:
      start = time.perf_counter()
      _run_steps(variant, config.steps_per_round)
      seconds = time.perf_counter() - start
      rates[variant.name].append(config.steps_per_round * global_batch /
                                 seconds)
  retraced = [v.name for v in variants if v.trace_count() != traces[v.name]]
  if retraced:
    raise RuntimeError(f'{retraced} retraced after warm-up; a timing that '
                       'includes tracing is not a step time.')
  return rates


def _summary(rates, reference):
  median = statistics.median(rates)
  return {'images_per_sec_median': median,
          'images_per_sec_min': min(rates), 'images_per_sec_max': max(rates),
          'ratio_to_single': median / reference}


def compare(config):
  """Times every variant; returns the report as a dict (with each
  variant's peak bytes on each GPU, where there are GPUs)."""
  variants, skipped = bench_variants.build_variants(config)
  first_step = _warm_up(variants, config)
  rates = time_variants(variants, config)
  report = summarize(rates, first_step, {v.name: v.xla for v in variants},
                     skipped)
  gpus = [d.name for d in tf.config.list_logical_devices('GPU')]
  for name, peaks in peak_memory(variants, gpus).items():
    report['variants'][name]['step_peak_bytes_per_device'] = peaks
  return report


def peak_memory(variants, devices, steps=3):
  """{variant: {device: bytes}}: the most each variant's `steps` steps
  held on each device above what was resident before them (GPUs report
  this per device, `get_memory_info`; CPUs do not: pass none). Every
  variant stays built, so the resident bytes (all variants' variables
  and slots) are left out: what remains is the step's own (activations,
  gradients, the copies of variables and gradients between devices)."""
  return {variant.name: step_peak_bytes(
      lambda variant=variant: _run_steps(variant, steps), devices)
          for variant in (variants if devices else ())}


def step_peak_bytes(run, devices):
  """{device: bytes}: the most `run()` held on each device above what was
  resident before it (the one measure every benchmark reports)."""
  memory = tf.config.experimental
  resident = {}
  for device in devices:
    memory.reset_memory_stats(device)
    resident[device] = memory.get_memory_info(device)['current']
  run()
  return {device: memory.get_memory_info(device)['peak'] - resident[device]
          for device in devices}


def summarize(rates, first_step, xla, skipped):
  """The comparison report from each variant's per-round images/sec.

  Args:
    rates: {variant: [images/sec of each round]}; 'single', 'towers' and
      'independent' among them.
    first_step: {variant: seconds of its first (tracing) step}.
    xla: {variant: whether it ran with XLA}.
    skipped: {variant: why it was not run}.
  """
  reference = statistics.median(rates['single'])
  report = {name: dict(_summary(r, reference), xla=xla[name],
                       first_step_seconds=first_step[name])
            for name, r in rates.items()}
  towers = report['towers']['images_per_sec_median']
  independent = report['independent']['images_per_sec_median']
  return {
      'variants': report, 'skipped': skipped,
      # The time towers spend beyond clones that never combine gradients.
      'gradient_combination_share': max(0.0, 1.0 - towers / independent),
      'towers_over_mirrored': {
          name: towers / entry['images_per_sec_median']
          for name, entry in report.items() if name.startswith('mirrored')},
  }


def sweep(config):
  """Towers at each of `config.sweep_clones`, fixed per-clone batch."""
  rows = []
  for num_clones in config.sweep_clones:
    sub = dataclasses.replace(config, num_clones=num_clones)
    variant = bench_variants.towers(sub)
    first_step = _warm_up([variant], sub)['towers']
    rates = time_variants([variant], sub)['towers']
    rows.append({'num_clones': num_clones,
                 'global_batch': config.batch_size * num_clones,
                 'images_per_sec_median': statistics.median(rates),
                 'ms_per_image': 1000 / statistics.median(rates),
                 'first_step_seconds': first_step})
  for row in rows:
    row['per_image_cost_vs_1_clone'] = (row['ms_per_image'] /
                                        rows[0]['ms_per_image'])
  return rows


def environment():
  """Machine and versions, for the report."""
  gpus = tf.config.list_physical_devices('GPU')
  details = [tf.config.experimental.get_device_details(g).get('device_name')
             for g in gpus]
  return {'date': time.strftime('%Y-%m-%d'),
          'python': platform.python_version(),
          'tensorflow': tf.__version__, 'keras': keras.__version__,
          'numpy': np.__version__, 'machine': platform.machine(),
          'processor': platform.processor(), 'cpu_count': os.cpu_count(),
          'intra_op_threads':
              tf.config.threading.get_intra_op_parallelism_threads(),
          'gpus': details}


def run(config):
  """The whole report: environment, config, comparison and sweep."""
  report = {'environment': environment(),
            'config': dataclasses.asdict(config),
            'comparison': compare(config)}
  if config.sweep_clones:
    report['sweep'] = sweep(config)
  return report


def emit(report, text, output=None):
  """Prints a benchmark's `text` table; writes `report` as JSON to `output`."""
  print(text)
  if output:
    with open(output, 'w') as f:
      json.dump(report, f, indent=2)


def format_report(report):
  """The report as text tables (what the command prints)."""
  comparison = report['comparison']
  lines = [f"{'variant':<34}{'images/sec':>12}{'min':>10}{'max':>10}"
           f"{'x single':>10}{'xla':>6}{'1st step s':>12}"]
  for name, entry in comparison['variants'].items():
    lines.append(
        f"{name:<34}{entry['images_per_sec_median']:>12.0f}"
        f"{entry['images_per_sec_min']:>10.0f}"
        f"{entry['images_per_sec_max']:>10.0f}"
        f"{entry['ratio_to_single']:>10.3f}{str(entry['xla']):>6}"
        f"{entry['first_step_seconds']:>12.2f}")
  for name, reason in comparison['skipped'].items():
    lines.append(f'{name:<34}skipped: {reason}')
  lines.append('gradient combination share of the towers step: '
               f"{comparison['gradient_combination_share']:.1%}")
  for name, ratio in comparison['towers_over_mirrored'].items():
    lines.append(f'towers / {name}: {ratio:.3f}')
  if 'sweep' in report:
    lines.append(f"{'clones':>6}{'global batch':>14}{'images/sec':>12}"
                 f"{'ms/image':>10}{'x 1 clone':>11}{'1st step s':>12}")
    for row in report['sweep']:
      lines.append(f"{row['num_clones']:>6}{row['global_batch']:>14}"
                   f"{row['images_per_sec_median']:>12.0f}"
                   f"{row['ms_per_image']:>10.4f}"
                   f"{row['per_image_cost_vs_1_clone']:>11.3f}"
                   f"{row['first_step_seconds']:>12.2f}")
  return '\n'.join(lines)


def pyplot_for(flag):
  """matplotlib's pyplot, drawing to files, for the benchmark flag `flag`.

  Raises:
    ImportError: matplotlib is missing (pip install -e ".[chart]").
  """
  try:
    import matplotlib
    matplotlib.use('Agg')
    from matplotlib import pyplot
  except ImportError as e:
    raise ImportError(f'{flag} needs matplotlib: pip install -e ".[chart]"'
                      ) from e
  return pyplot


def write_chart(rows, path):
  """A PNG of the sweep: cost per image and first-step time per clone count
  (`pyplot_for` says what is missing without matplotlib)."""
  pyplot = pyplot_for('--chart')
  clones = [row['num_clones'] for row in rows]
  figure, (cost, trace) = pyplot.subplots(1, 2, figsize=(9, 3.5))
  cost.plot(clones, [row['per_image_cost_vs_1_clone'] for row in rows], 'o-')
  cost.axhline(1.0, color='grey', linewidth=0.8)
  cost.set(xlabel='clones', ylabel='cost per image / 1 clone',
           title='per-image cost', xticks=clones)
  trace.plot(clones, [row['first_step_seconds'] for row in rows], 'o-')
  trace.set(xlabel='clones', ylabel='seconds', title='first step (trace)',
            xticks=clones)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  pyplot.close(figure)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench', description=__doc__.split('\n')[0],
      parents=[flags.shared(model='resnet20', num_clones=2,
                            clone_on_cpu=True)])
  p.add_argument('--batch_size', type=int, default=64,
                 help='examples per clone per step')
  p.add_argument('--reproducible_rows', type=int, default=32,
                 help='the atom of the towers_reproducible variant')
  p.add_argument('--share_cores', action='store_true',
                 help='with --clone_on_cpu: size the ops\' thread pool to '
                 '--num_clones\' share of the cores, as train.py does for '
                 'that many clones; every variant and sweep row runs in '
                 'that one pool')
  p.add_argument('--xla', action='store_true')
  p.add_argument('--mixed_precision', action='store_true')
  p.add_argument('--rounds', type=int, default=5)
  p.add_argument('--steps_per_round', type=int, default=10)
  p.add_argument('--untimed_steps', type=int, default=3,
                 help='steps per variant before the rounds, not timed')
  # Deprecated for one release: training's --warmup_steps is the
  # learning-rate warm-up, a different thing.
  p.add_argument('--warmup_steps', type=int, help=argparse.SUPPRESS)
  p.add_argument('--sweep', action='store_true',
                 help='also time the towers at 1, 2, 4 and 8 clones')
  p.add_argument('--split_gpu', type=int, default=0,
                 help='split GPU 0 into this many logical GPUs')
  p.add_argument('--gpu_memory_mb', type=int, default=16384,
                 help='memory of each logical GPU of --split_gpu')
  p.add_argument('--chart', help='write the sweep chart here (PNG)')
  return p


def _parse(argv):
  args = parser().parse_args(argv)
  if args.warmup_steps is not None:
    logging.warning('--warmup_steps is deprecated: use --untimed_steps (the '
                    'steps before the timed rounds).')
    args.untimed_steps = args.warmup_steps
  return args


def main(argv=None):
  args = _parse(argv)
  sweep_clones = (1, 2, 4, 8) if args.sweep else ()
  try:
    config = BenchConfig(
        model=args.model, batch_size=args.batch_size,
        num_clones=args.num_clones, clone_on_cpu=args.clone_on_cpu,
        xla=args.xla, mixed_precision=args.mixed_precision,
        rounds=args.rounds, steps_per_round=args.steps_per_round,
        untimed_steps=args.untimed_steps, sweep_clones=sweep_clones,
        reproducible_rows=args.reproducible_rows)
    if args.chart and not args.sweep:
      raise errors.ConfigError('--chart draws the sweep: add --sweep.')
    if args.share_cores and not args.clone_on_cpu:
      raise errors.ConfigError('--share_cores shares the cores among clones '
                               'on logical CPUs: add --clone_on_cpu.')
    if args.clone_on_cpu:
      devices.create_logical_cpus(max((args.num_clones,) + sweep_clones))
      if args.share_cores:
        devices.share_cores(args.num_clones)
    elif args.split_gpu:
      devices.split_gpu(args.split_gpu, args.gpu_memory_mb)
    devices.check_devices_exist(placement.DeploymentConfig(
        num_clones=max((args.num_clones,) + sweep_clones),
        clone_on_cpu=args.clone_on_cpu).clone_devices())
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench: error: {e}')
  report = run(config)
  emit(report, format_report(report), args.output)
  if args.chart:
    write_chart(report['sweep'], args.chart)


if __name__ == '__main__':
  main()
