"""Pipeline schedules measured on emulated devices.

`python -m tfmulti.bench.schedule_timelines` trains one clone cut into K
stages, on emulated devices (`bench.emulated`: each stage's forward pass
waits a fixed time a row, F; its backward pass B for the input gradients
and W for the weight gradients, B + W before the input gradient where they
are fused, apart under ZB-H1 and ZB-V; by default F = B = W, as Qi et al.
time them; where a device runs several chunks, interleaved 1F1B's v or
ZB-V's 2, each waits its share), with M micro-batches, under each
`--pipeline_schedule`. Every schedule cuts the same model: lcm(2, v)
blocks a device. A block is 3 Dense layers (`--stage_block=dense`: W
reads each layer's input and output gradient, twice what the forward pass
keeps for B) or an attention block (`--stage_block=attention`: the
forward pass also keeps the attention's probabilities, which W does not
read, as in the transformers Qi et al. measure). For each schedule and
(K, M) it reports:

  * the step's pipeline time (first pass start to last pass end) against
    the schedule's makespan, from `schedules.timeline` (every pass as soon
    as what it reads is there; (M + K - 1)(F + B + W) for GPipe and 1F1B,
    M(F + B + W) + (K - 1)(F + B - W) for ZB-H1, M(F + B + W) + (K - 1)F/2
    for ZB-V when F = B = W and M >= 2K - 1);
  * each device's idle fraction (1 - its waits' time / the pipeline time)
    and idle seconds against theory (`schedules.idle_theory`);
  * each device's peak activation memory, counted from the traced graph:
    the bytes of micro-batch 0's forward tensors that its backward passes
    read, held from its F to its last backward pass, and, where W is
    split off, those W reads held from B to W, at the most micro-batches
    the device's order holds at once (a buffer once, whatever its views);
    without and with recomputation.

`--chart_dir` draws each schedule's passes (device x time, as the papers
draw them) from the logged waits at the largest K and M. Every figure here
is emulated: it shows the order and overlap the executor gives the
schedule, not a device's speed.
"""

import argparse
import dataclasses
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Optional, Tuple

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti.bench import activations
from tfmulti.bench import designs as bench
from tfmulti.bench import emulated
from tfmulti.bench import flags
from tfmulti.deploy import placement
from tfmulti.deploy import towers as towers_lib
from tfmulti.pipeline import schedules

WIDTH = 64  # Features through every stage.
LAYERS_PER_BLOCK = 3
# The attention block: 16 positions of 16 features, 4 heads.
SEQUENCE, HEADS, ATTENTION_WIDTH = 16, 4, 16
BLOCKS = ('dense', 'attention')


@dataclasses.dataclass(frozen=True)
class ScheduleBenchConfig:
  """What to measure.

  Attributes:
    stages: the stage counts K.
    microbatches: the micro-batch counts M.
    schedules: the `--pipeline_schedule`s.
    virtual_stages: the chunks a device under 'interleaved_1f1b'.
    stage_block: what each stage computes, one of `BLOCKS`.
    rows: rows of each step's batch (one clone's).
    forward_ms_per_row: each stage's forward wait a row (F).
    backward_ms_per_row: its input gradients' wait a row (B); None: F.
    weights_ms_per_row: its weight gradients' wait a row (W); None: F.
    steps: timed steps per configuration (median over them).
  """
  stages: Tuple[int, ...] = (2, 4)
  microbatches: Tuple[int, ...] = (4, 8)
  virtual_stages: int = 2
  schedules: Tuple[str, ...] = schedules.SCHEDULES
  rows: int = 64
  forward_ms_per_row: float = 2.5
  backward_ms_per_row: Optional[float] = None
  weights_ms_per_row: Optional[float] = None
  steps: int = 3
  stage_block: str = 'dense'

  def __post_init__(self):
    errors.check_choice('stage_block', self.stage_block, BLOCKS)
    for count in self.stages + self.microbatches:
      errors.check_count('stages and microbatches', count, 1)
    for name in self.schedules:
      errors.check_choice('schedules', name, schedules.SCHEDULES)
    errors.check_count('steps', self.steps, 1)
    errors.check_count('virtual_stages', self.virtual_stages, 2)
    for name in ('forward_ms_per_row', 'backward_ms_per_row',
                 'weights_ms_per_row'):
      if getattr(self, name) is not None:
        errors.check_positive(name, getattr(self, name))
    for m in self.microbatches:
      if self.rows % m:
        raise errors.ConfigError(
            f'rows={self.rows}: each of microbatches={m} must get as many '
            'rows; pass a multiple of every micro-batch count.')

  def seconds_per_row(self):
    """{'F', 'B', 'W': seconds a row of each pass}."""
    forward = self.forward_ms_per_row
    return {kind: (forward if ms is None else ms) / 1000 for kind, ms in (
        ('F', forward), ('B', self.backward_ms_per_row),
        ('W', self.weights_ms_per_row))}


def _dense_block(x, s, width):
  for j in range(LAYERS_PER_BLOCK):
    x = keras.layers.Dense(width, activation='tanh',
                           name=f'block{s}_dense{j}')(x)
  return x


def _attention_block(x, s, width):
  """Self-attention over the positions: query, key, value and output
  projections (Dense layers, whose W passes are deferred) around the
  scores' softmax (Keras ops: no weights, all in B)."""
  ops = keras.ops
  split = lambda t: ops.reshape(t, (-1, SEQUENCE, HEADS, width // HEADS))  # noqa: E731
  q, k, v = (split(keras.layers.Dense(width, name=f'block{s}_{n}')(x))
             for n in ('query', 'key', 'value'))
  scores = ops.einsum('bqhd,bkhd->bhqk', q, k) / (width // HEADS) ** 0.5
  mixed = ops.einsum('bhqk,bkhd->bqhd', ops.softmax(scores, axis=-1), v)
  return keras.layers.Dense(width, activation='tanh', name=f'block{s}_out')(
      ops.reshape(mixed, (-1, SEQUENCE, width)))


def input_shape(block, width=WIDTH):
  """One row's shape under `block`."""
  return (width,) if block == 'dense' else (SEQUENCE, ATTENTION_WIDTH)


def build_model(num_stages, seconds_per_row, log, width=WIDTH,
                block='dense', blocks_per_stage=1):
  """A chain of `num_stages` stages (or chunks) of `blocks_per_stage`
  `block`s, each stage ending in an `EmulatedPass`; returns (model, the
  first layer of stages 1..K-1)."""
  keras.utils.set_random_seed(0)
  inputs = x = keras.Input(input_shape(block, width))
  run = _dense_block if block == 'dense' else _attention_block
  firsts = []
  for s in range(num_stages):
    for b in range(s * blocks_per_stage, (s + 1) * blocks_per_stage):
      x = run(x, b, width if block == 'dense' else ATTENTION_WIDTH)
    x = emulated.EmulatedPass(
        s, seconds_per_row['F'], seconds_per_row['B'], log,
        weights_s_per_row=seconds_per_row['W'], name=f'stage{s}_emulated')(x)
    first = s * blocks_per_stage
    if s:
      firsts.append(f'block{first}_{"dense0" if block == "dense" else "query"}')
  if block != 'dense':
    x = keras.layers.Flatten(name='flatten')(x)
  outputs = keras.layers.Dense(10, name='logits')(x)
  return keras.Model(inputs, outputs), tuple(firsts)


def deploy_stages(num_stages, num_microbatches, schedule, log,
                  seconds_per_row, recompute=False, width=WIDTH,
                  virtual_stages=1, block='dense'):
  """One clone in `num_stages` stages on logical CPUs, emulated
  (`seconds_per_row`: {'F', 'B', 'W': seconds} of a stage, shared by its
  chunks under interleaved 1F1B, `virtual_stages` of them, and ZB-V). Every
  schedule cuts the same model: lcm(2, `virtual_stages`) blocks a device,
  so that the activations held compare."""
  config = placement.DeploymentConfig(clone_on_cpu=True, num_stages=num_stages)
  chunks = schedules.chunks_per_device(schedule, virtual_stages)
  blocks = math.lcm(2, virtual_stages) // chunks
  waits = dict(seconds_per_row)
  if not schedules.splits_backward(schedule):
    # A fused backward pass hands on its input gradient after B + W, as the
    # papers time it: the executor would otherwise be free to run the
    # weight half after the input half, and give 1F1B part of ZB-H1's gain.
    waits = {'F': waits['F'], 'B': waits['B'] + waits['W'], 'W': 0.0}
  with tf.device(config.variables_device()):
    model, firsts = build_model(
        num_stages * chunks, {kind: t / chunks for kind, t in waits.items()},
        log, width, block, blocks)
    optimizer = keras.optimizers.SGD(0.01)
  return towers_lib.deploy(
      config, model,
      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer, num_microbatches=num_microbatches,
      stage_boundaries=firsts or None, pipeline_schedule=schedule,
      virtual_stages=(virtual_stages if schedule == schedules.INTERLEAVED_1F1B
                      else 1), recompute=recompute)


def batch(rows, width=WIDTH, block='dense'):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, *input_shape(block, width))).astype(
      np.float32), rng.integers(0, 10, size=rows).astype(np.int32))


def idle_fractions(records, device_of):
  """(pipeline seconds, each stage device's idle fraction) of one step's
  waits (logged by chunk c, on device `device_of[c]`); raises
  `RuntimeError` if two passes of a device overlapped."""
  span = max(r[3] for r in records) - min(r[2] for r in records)
  idle = []
  for s in range(max(device_of) + 1):
    mine = sorted((r[2], r[3]) for r in records if device_of[r[0]] == s)
    for (_, end), (start, _) in zip(mine, mine[1:]):
      if start < end - 1e-4:
        raise RuntimeError(f'device {s} ran two passes at once.')
    idle.append(1.0 - sum(end - start for start, end in mine) / span)
  return span, idle


def measure(config, num_stages, num_microbatches, schedule, log):
  """One (K, M, schedule): the timings and memory counts, as a dict."""
  per_row = config.seconds_per_row()
  chunks = schedules.chunks_per_device(schedule, config.virtual_stages)
  device_of = schedules.chunk_devices(schedule, num_stages,
                                      config.virtual_stages)
  block = config.stage_block
  deployed = deploy_stages(num_stages, num_microbatches, schedule, log,
                           per_row, virtual_stages=config.virtual_stages,
                           block=block)
  images, labels = batch(config.rows, block=block)
  deployed.train_step(images, labels)  # Traces; not timed.
  spans, idles, walls, traces = [], [], [], []
  for _ in range(config.steps):
    log.clear()
    started = time.perf_counter()
    deployed.train_step(images, labels)
    walls.append(time.perf_counter() - started)
    traces.append(list(log.records))
    span, idle = idle_fractions(log.records, device_of)
    spans.append(span)
    idles.append(idle)
  rows = config.rows // num_microbatches
  seconds = {kind: s * rows for kind, s in per_row.items()}
  per_device = schedules.device_orders(schedule, num_stages,
                                       num_microbatches, chunks)
  timeline = schedules.timeline(per_device, seconds, num_stages * chunks)
  memory = _memory(deployed, (num_stages, num_microbatches, schedule, log,
                              per_row, config), per_device, device_of)
  pipeline = statistics.median(spans)
  idle = [statistics.median(i[s] for i in idles) for s in range(num_stages)]
  return {
      'schedule': schedule, 'num_stages': num_stages,
      'virtual_stages': chunks, 'num_microbatches': num_microbatches,
      'pipeline_seconds': pipeline,
      'step_seconds': statistics.median(walls),
      'makespan_seconds': max(end for _, end in timeline.values()),
      'ideal_seconds': num_microbatches * sum(seconds.values()),
      'idle_theory': schedules.idle_theory(schedule, num_stages,
                                           num_microbatches, seconds, chunks),
      'idle_measured': idle,
      'idle_seconds_measured': [x * pipeline for x in idle],
      'memory': memory,
      'passes': traces[len(traces) // 2],
  }


def _memory(deployed, setting, per_device, device_of):
  """{'plain', 'recompute': each device's chunks' held bytes and its peak
  (`activations`)}: the deployed step's, and again with recomputation."""
  num_stages, num_microbatches, schedule, log, per_row, config = setting
  images, labels = batch(config.rows, block=config.stage_block)
  memory = {}
  for recompute in (False, True):
    stages = deploy_stages(
        num_stages, num_microbatches, schedule, log, per_row, recompute,
        virtual_stages=config.virtual_stages, block=config.stage_block
    ) if recompute else deployed
    graph = stages.traced_step(images, labels).graph
    held = activations.activation_bytes(graph, len(device_of))
    memory['recompute' if recompute else 'plain'] = [
        {'held_per_stage': [held[c] for c, on in enumerate(device_of)
                            if on == d],
         'peak_bytes': activations.peak_bytes(device, held)}
        for d, device in enumerate(per_device)]
  return memory


def run(config):
  """Every configuration; returns the report (a JSON-able dict)."""
  log = emulated.PassLog()
  results = []
  for k in config.stages:
    for m in config.microbatches:
      for schedule in config.schedules:
        result = measure(config, k, m, schedule, log)
        logging.info('%s K=%d M=%d: idle %s (theory %s)', schedule, k, m,
                     ' '.join(f'{x:.3f}' for x in result['idle_measured']),
                     ' '.join(f'{x:.3f}' for x in result['idle_theory']))
        results.append(result)
  return {'config': dataclasses.asdict(config), 'emulated': True,
          'results': results}


def format_report(report):
  lines = ['EMULATED devices (waits, not compute): pipeline schedules, '
           f'{report["config"]["stage_block"]} stages',
           f'{"schedule":9} {"K":>2} {"M":>2} {"pipeline s":>10} '
           f'{"makespan s":>10} {"idle s":>7}  idle per device: measured '
           '(theory)  |  peak activations held (KiB), busiest stage: '
           'plain, recompute']
  for r in report['results']:
    idle = ' '.join(f'{x:.3f} ({t:.3f})' for x, t in zip(
        r['idle_measured'], r['idle_theory']))
    plain, again = (max(stage['peak_bytes'] for stage in r['memory'][kind])
                    / 1024 for kind in ('plain', 'recompute'))
    lines.append(
        f'{r["schedule"]:9} {r["num_stages"]:>2} {r["num_microbatches"]:>2} '
        f'{r["pipeline_seconds"]:>10.3f} {r["makespan_seconds"]:>10.3f} '
        f'{statistics.mean(r["idle_seconds_measured"]):>7.3f}  {idle}  |  '
        f'{plain:.0f}, {again:.0f}')
  return '\n'.join(lines)


_COLOURS = {'F': '#9ecae1', 'B': '#3182bd', 'W': '#08519c'}


def write_charts(report, directory):
  """One PNG a schedule: its passes at the largest (K, M), device x time
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
    split = schedules.splits_backward(r['schedule'])
    device_of = schedules.chunk_devices(r['schedule'], k, r['virtual_stages'])
    for s, device in enumerate(schedules.device_orders(
        r['schedule'], k, m, r['virtual_stages'])):
      mine = sorted((p for p in r['passes'] if device_of[p[0]] == s),
                    key=lambda p: p[2])
      # A fused backward pass logs its B and W waits; each gets its index.
      indices = [i for _, kind, i in device for _ in (
          'BW' if kind == 'B' and not split else kind)]
      for index, (_, kind, begin, end) in zip(indices, mine):
        axes.broken_barh([(begin - start, end - begin)], (k - 1 - s, 0.8),
                         color=_COLOURS[kind])
        axes.text((begin + end) / 2 - start, k - 0.6 - s,
                  f'{kind}{index}', ha='center', va='center', fontsize=7)
    axes.set(yticks=[k - 0.6 - s for s in range(k)],
             yticklabels=[f'device {s}' for s in range(k)],
             xlabel='seconds (emulated devices)',
             title=f'{r["schedule"]}, K={k}, M={m}: idle '
             f'{statistics.mean(r["idle_measured"]):.3f} (theory '
             f'{statistics.mean(r["idle_theory"]):.3f})')
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
  deployed = deploy_stages(2, 8, schedule, emulated.PassLog(),
                           {'F': 0.0, 'B': 0.0, 'W': 0.0}, width=RSS_WIDTH,
                           virtual_stages=2)
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
          [sys.executable, '-m', 'tfmulti.bench.schedule_timelines',
           f'--rss_child={name}'], capture_output=True, text=True,
          check=True, timeout=600)
      peaks[name].append(float(done.stdout.split()[-1]))
  return peaks


def parser():
  """The command line: the shared --output and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.schedule_timelines',
      description=__doc__.split('\n')[0], parents=[flags.shared()])
  p.add_argument('--stages', default='2,4')
  p.add_argument('--microbatches', default='4,8')
  p.add_argument('--rows', type=int, default=64)
  p.add_argument('--forward_ms_per_row', type=float, default=2.5)
  p.add_argument('--backward_ms_per_row', type=float,
                 help="the input gradients' wait (B); default F's")
  p.add_argument('--weights_ms_per_row', type=float,
                 help="the weight gradients' wait (W); default F's")
  p.add_argument('--steps', type=int, default=3)
  p.add_argument('--virtual_stages', type=int, default=2,
                 help="each device's chunks under interleaved_1f1b")
  p.add_argument('--schedules', default=','.join(schedules.SCHEDULES),
                 help='the --pipeline_schedule values to run')
  p.add_argument('--stage_block', default='dense',
                 help='what each stage computes: ' + ', '.join(BLOCKS))
  p.add_argument('--chart_dir', help='draw each schedule here (PNG)')
  p.add_argument('--rss', action='store_true',
                 help="also each schedule's peak resident memory at "
                 'K=2, M=8, in fresh processes (coarse)')
  p.add_argument('--rss_child', choices=schedules.SCHEDULES,
                 help=argparse.SUPPRESS)
  return p


def _counts(name, text):
  try:
    return tuple(int(v) for v in text.split(','))
  except ValueError:
    raise errors.ConfigError(f'--{name}={text}: give counts, e.g. 2,4.'
                             ) from None


def main(argv=None):
  args = parser().parse_args(argv)
  if args.rss_child:
    devices.create_logical_cpus(2)
    print(f'peak_rss_mib {rss_child(args.rss_child):.1f}')
    return
  try:
    config = ScheduleBenchConfig(
        stages=_counts('stages', args.stages),
        microbatches=_counts('microbatches', args.microbatches),
        rows=args.rows, forward_ms_per_row=args.forward_ms_per_row,
        backward_ms_per_row=args.backward_ms_per_row,
        weights_ms_per_row=args.weights_ms_per_row,
        virtual_stages=args.virtual_stages, steps=args.steps,
        schedules=tuple(args.schedules.split(',')),
        stage_block=args.stage_block)
    emulated.use_threads(8 * max(config.stages))
    devices.create_logical_cpus(max(config.stages))
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.schedule_timelines: error: {e}')
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
