"""Pipeline schedules measured on emulated devices.

`python -m tfmulti.bench.schedules` trains one clone cut into K stages, on
emulated devices (`bench.emulated`: each stage's forward pass waits a
fixed time a row, its backward pass twice that), with M micro-batches,
under each `--pipeline_schedule`. For each schedule and (K, M) it reports:

  * the step's pipeline time (first pass start to last pass end) against
    the schedule's makespan (M + K - 1) * (t_F + t_B), t the time of one
    micro-batch's pass;
  * each stage's idle fraction (1 - its waits' time / the pipeline time)
    against theory, (K - 1) / (M + K - 1) for GPipe and 1F1B;
  * each stage's peak activation memory, counted from the traced graph:
    the bytes of the forward tensors that the backward pass reads, for one
    micro-batch, times the micro-batches the schedule holds at once
    (`schedules.peak_in_flight`), without and with recomputation.

`--chart_dir` draws each schedule's passes (stage x time, as the papers
draw them) from the logged waits at the largest K and M. Every figure here
is emulated: it shows the order and overlap the executor gives the
schedule, not a device's speed.
"""

import argparse
import dataclasses
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Tuple

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmulti import deploy
from tfmulti import devices
from tfmulti import errors
from tfmulti.bench import designs as bench
from tfmulti.bench import emulated
from tfmulti.pipeline import schedules

WIDTH = 64  # Features through every stage.
LAYERS_PER_STAGE = 3


@dataclasses.dataclass(frozen=True)
class ScheduleBenchConfig:
  """What to measure.

  Attributes:
    stages: the stage counts K.
    microbatches: the micro-batch counts M.
    schedules: the `--pipeline_schedule`s.
    rows: rows of each step's batch (one clone's).
    forward_ms_per_row: each stage's forward wait a row; backward 2x.
    steps: timed steps per configuration (median over them).
  """
  stages: Tuple[int, ...] = (2, 4)
  microbatches: Tuple[int, ...] = (4, 8)
  schedules: Tuple[str, ...] = schedules.SCHEDULES
  rows: int = 64
  forward_ms_per_row: float = 2.5
  steps: int = 3

  def __post_init__(self):
    for count in self.stages + self.microbatches:
      errors.check_count('stages and microbatches', count, 1)
    for name in self.schedules:
      errors.check_choice('schedules', name, schedules.SCHEDULES)
    errors.check_count('steps', self.steps, 1)
    errors.check_positive('forward_ms_per_row', self.forward_ms_per_row)
    for m in self.microbatches:
      if self.rows % m:
        raise errors.ConfigError(
            f'rows={self.rows}: each of microbatches={m} must get as many '
            'rows; pass a multiple of every micro-batch count.')


def build_model(num_stages, forward_s_per_row, log, width=WIDTH):
  """A chain of `num_stages` stages of Dense layers, each ending in an
  `EmulatedPass`; returns (model, the first layer of stages 1..K-1)."""
  keras.utils.set_random_seed(0)
  inputs = x = keras.Input((width,))
  firsts = []
  for s in range(num_stages):
    for j in range(LAYERS_PER_STAGE):
      name = f'stage{s}_dense{j}'
      if j == 0 and s:
        firsts.append(name)
      x = keras.layers.Dense(width, activation='tanh', name=name)(x)
    x = emulated.EmulatedPass(s, forward_s_per_row, 2 * forward_s_per_row,
                              log, name=f'stage{s}_emulated')(x)
  outputs = keras.layers.Dense(10, name='logits')(x)
  return keras.Model(inputs, outputs), tuple(firsts)


def deploy_stages(num_stages, num_microbatches, schedule, log,
                  forward_s_per_row, recompute=False, width=WIDTH):
  """One clone in `num_stages` stages on logical CPUs, emulated."""
  config = deploy.DeploymentConfig(clone_on_cpu=True, num_stages=num_stages)
  with tf.device(config.variables_device()):
    model, firsts = build_model(num_stages, forward_s_per_row, log, width)
    optimizer = keras.optimizers.SGD(0.01)
  return deploy.deploy(
      config, model,
      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer, num_microbatches=num_microbatches,
      stage_boundaries=firsts or None, pipeline_schedule=schedule,
      recompute=recompute)


def batch(rows, width=WIDTH):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, width)).astype(np.float32),
          rng.integers(0, 10, size=rows).astype(np.int32))


def idle_fractions(records, num_stages):
  """(pipeline seconds, each stage's idle fraction) of one step's waits;
  raises `RuntimeError` if two passes of a stage overlapped."""
  span = max(r[3] for r in records) - min(r[2] for r in records)
  idle = []
  for s in range(num_stages):
    mine = sorted((r[2], r[3]) for r in records if r[0] == s)
    for (_, end), (start, _) in zip(mine, mine[1:]):
      if start < end - 1e-4:
        raise RuntimeError(f'stage {s} ran two passes at once.')
    idle.append(1.0 - sum(end - start for start, end in mine) / span)
  return span, idle


_FORWARD = re.compile(r'microbatch_0/stage_(\d+)/')
_BACKWARD = re.compile(r'microbatch_0/stage_(\d+)(_backward/|/)')


def activation_bytes(graph, num_stages):
  """Per stage, the bytes of micro-batch 0's forward tensors that its
  backward pass reads, counted from the traced step's graph."""
  counted = [0] * num_stages
  for op in graph.get_operations():
    found = _FORWARD.search(op.name)
    if not found or op.name.startswith('gradient_tape/'):
      continue
    s = int(found.group(1))
    for tensor in op.outputs:
      readers = [c for c in tensor.consumers() if _reads_backward(c.name, s)]
      if readers and tensor.shape.is_fully_defined():
        counted[s] += tensor.shape.num_elements() * tensor.dtype.size
  return counted


def _reads_backward(name, stage):
  found = _BACKWARD.search(name)
  if not found or int(found.group(1)) != stage:
    return False
  return name.startswith('gradient_tape/') or found.group(2) == '_backward/'


def measure(config, num_stages, num_microbatches, schedule, log):
  """One (K, M, schedule): the timings and memory counts, as a dict."""
  seconds = config.forward_ms_per_row / 1000
  deployed = deploy_stages(num_stages, num_microbatches, schedule, log,
                           seconds)
  images, labels = batch(config.rows)
  deployed.train_step(images, labels)  # Traces; not timed.
  spans, idles, walls, traces = [], [], [], []
  for _ in range(config.steps):
    log.clear()
    started = time.perf_counter()
    deployed.train_step(images, labels)
    walls.append(time.perf_counter() - started)
    traces.append(list(log.records))
    span, idle = idle_fractions(log.records, num_stages)
    spans.append(span)
    idles.append(idle)
  rows = config.rows // num_microbatches
  makespan = (num_microbatches + num_stages - 1) * 3 * seconds * rows
  theory = (num_stages - 1) / (num_microbatches + num_stages - 1)
  per_stage = schedules.passes(schedule, num_stages, num_microbatches)
  memory = {}
  for recompute in (False, True):
    stages = deploy_stages(num_stages, num_microbatches, schedule, log,
                           seconds, recompute) if recompute else deployed
    graph = stages.traced_step(images, labels).graph
    counted = activation_bytes(graph, num_stages)
    memory['recompute' if recompute else 'plain'] = [
        {'bytes_per_microbatch': b,
         'microbatches_held': schedules.peak_in_flight(per_stage[s]),
         'peak_bytes': b * schedules.peak_in_flight(per_stage[s])}
        for s, b in enumerate(counted)]
  return {
      'schedule': schedule, 'num_stages': num_stages,
      'num_microbatches': num_microbatches,
      'pipeline_seconds': statistics.median(spans),
      'step_seconds': statistics.median(walls),
      'makespan_seconds': makespan,
      'idle_theory': theory,
      'idle_measured': [statistics.median(i[s] for i in idles)
                        for s in range(num_stages)],
      'memory': memory,
      'passes': traces[len(traces) // 2],
  }


def run(config):
  """Every configuration; returns the report (a JSON-able dict)."""
  log = emulated.PassLog()
  results = []
  for k in config.stages:
    for m in config.microbatches:
      for schedule in config.schedules:
        result = measure(config, k, m, schedule, log)
        logging.info('%s K=%d M=%d: idle %s (theory %.3f)', schedule, k, m,
                     ' '.join(f'{x:.3f}' for x in result['idle_measured']),
                     result['idle_theory'])
        results.append(result)
  return {'config': dataclasses.asdict(config), 'emulated': True,
          'results': results}


def format_report(report):
  lines = ['EMULATED devices (waits, not compute): pipeline schedules',
           f'{"schedule":9} {"K":>2} {"M":>2} {"pipeline s":>10} '
           f'{"makespan s":>10} {"idle theory":>11}  idle measured per '
           'stage  |  stage 0 activations held (KiB): plain, recompute']
  for r in report['results']:
    idle = ' '.join(f'{x:.3f}' for x in r['idle_measured'])
    plain = r['memory']['plain'][0]['peak_bytes'] / 1024
    again = r['memory']['recompute'][0]['peak_bytes'] / 1024
    lines.append(
        f'{r["schedule"]:9} {r["num_stages"]:>2} {r["num_microbatches"]:>2} '
        f'{r["pipeline_seconds"]:>10.3f} {r["makespan_seconds"]:>10.3f} '
        f'{r["idle_theory"]:>11.3f}  {idle}  |  {plain:.0f}, {again:.0f}')
  return '\n'.join(lines)


def write_charts(report, directory):
  """One PNG a schedule: its passes at the largest (K, M), stage x time
  (`designs.pyplot_for` says what is missing without matplotlib)."""
  pyplot = bench.pyplot_for('--chart_dir')
  k, m = max(report['config']['stages']), max(
      report['config']['microbatches'])
  paths = []
  for r in report['results']:
    if (r['num_stages'], r['num_microbatches']) != (k, m):
      continue
    figure, axes = pyplot.subplots(figsize=(10, 0.6 * k + 1))
    start = min(p[2] for p in r['passes'])
    order = schedules.passes(r['schedule'], k, m)
    for s in range(k):
      mine = sorted((p for p in r['passes'] if p[0] == s),
                    key=lambda p: p[2])
      for (kind, index), (_, _, begin, end) in zip(order[s], mine):
        axes.broken_barh([(begin - start, end - begin)], (k - 1 - s, 0.8),
                         color='#9ecae1' if kind == 'F' else '#3182bd')
        axes.text((begin + end) / 2 - start, k - 0.6 - s,
                  f'{kind}{index}', ha='center', va='center', fontsize=7)
    axes.set(yticks=[k - 0.6 - s for s in range(k)],
             yticklabels=[f'stage {s}' for s in range(k)],
             xlabel='seconds (emulated devices)',
             title=f'{r["schedule"]}, K={k}, M={m}: idle '
             f'{statistics.mean(r["idle_measured"]):.3f} (theory '
             f'{r["idle_theory"]:.3f})')
    figure.tight_layout()
    path = os.path.join(directory, f'schedule_{r["schedule"]}.png')
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    paths.append(path)
  return paths


# The coarse memory measurement: a process's peak resident memory, 2 stages
# of wide activations (4 MiB a tensor a micro-batch), 8 micro-batches.
RSS_ROWS, RSS_WIDTH, RSS_STEPS = 32768, 256, 2


def rss_child(schedule):
  """Trains RSS_STEPS steps under `schedule` (no waits); returns this
  process's peak resident memory in MiB. Run it in a fresh process."""
  deployed = deploy_stages(2, 8, schedule, emulated.PassLog(), 0.0,
                           width=RSS_WIDTH)
  images, labels = batch(RSS_ROWS, RSS_WIDTH)
  for _ in range(RSS_STEPS):
    float(deployed.train_step(images, labels))
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_rss(repeats=2):
  """{schedule: [peak MiB of each run]}, fresh processes, alternating."""
  peaks = {name: [] for name in schedules.SCHEDULES}
  for _ in range(repeats):
    for name in peaks:
      done = subprocess.run(
          [sys.executable, '-m', 'tfmulti.bench.schedules',
           f'--rss_child={name}'], capture_output=True, text=True,
          check=True, timeout=600)
      peaks[name].append(float(done.stdout.split()[-1]))
  return peaks


def _parse(argv):
  parser = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.schedules',
      description=__doc__.split('\n')[0])
  parser.add_argument('--stages', default='2,4')
  parser.add_argument('--microbatches', default='4,8')
  parser.add_argument('--rows', type=int, default=64)
  parser.add_argument('--forward_ms_per_row', type=float, default=2.5)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--output', help='write the report here as JSON')
  parser.add_argument('--chart_dir', help='draw each schedule here (PNG)')
  parser.add_argument('--rss', action='store_true',
                      help="also each schedule's peak resident memory at "
                      'K=2, M=8, in fresh processes (coarse)')
  parser.add_argument('--rss_child', choices=schedules.SCHEDULES,
                      help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def _counts(name, text):
  try:
    return tuple(int(v) for v in text.split(','))
  except ValueError:
    raise errors.ConfigError(f'--{name}={text}: give counts, e.g. 2,4.'
                             ) from None


def main(argv=None):
  args = _parse(argv)
  if args.rss_child:
    devices.create_logical_cpus(2)
    print(f'peak_rss_mib {rss_child(args.rss_child):.1f}')
    return
  try:
    config = ScheduleBenchConfig(
        stages=_counts('stages', args.stages),
        microbatches=_counts('microbatches', args.microbatches),
        rows=args.rows, forward_ms_per_row=args.forward_ms_per_row,
        steps=args.steps)
    emulated.use_threads(8 * max(config.stages))
    devices.create_logical_cpus(max(config.stages))
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.schedules: error: {e}')
  report = run(config)
  text = format_report(report)
  if args.rss:
    report['peak_rss_mib'] = measure_rss()
    text += '\npeak resident MiB at K=2, M=8 (fresh processes): ' + ', '.join(
        f'{name} {statistics.median(v):.0f}'
        for name, v in report['peak_rss_mib'].items())
  bench.emit(report, text, args.output)
  if args.chart_dir:
    for path in write_charts(report, args.chart_dir):
      logging.info('wrote %s', path)


if __name__ == '__main__':
  main()
