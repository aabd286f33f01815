"""The classic model-parallel experiment: `python -m tfmulti.bench.pipeline`.

PyTorch's model-parallel tutorial trains ResNet-50 on 3 batches of 120
images (128x128), once on one device, once cut into two stages (model
parallel: one device works at a time), and pipelined with the batch cut
into micro-batches. This benchmark runs the same three designs through the
training code (`--strategy=towers` with `--num_stages` and
`--num_microbatches`), on synthetic data already on the devices:

  one_device        one clone, one stage
  model_parallel    one clone in 2 stages, 1 micro-batch
  pipelined_M       one clone in 2 stages, M micro-batches
  one_device_M      one stage, the rows in M micro-batches (M the smallest
                    of the sweep): the control for what smaller batches
                    alone change

Each design is timed over `--rounds` interleaved rounds of 3 steps (the
order rotates each round, so a noisy neighbour slows all alike); the report
gives each one's mean and spread in seconds per 3 batches and its ratio to
one device. It also profiles one step of each pipelined design and reports
each stage's busy fraction (the union of its ops' time in the TensorFlow
profiler trace, over the step) next to GPipe's prediction M / (M + K - 1)
(one minus the bubble (K - 1) / (M + K - 1)).

Logical CPUs share one machine's cores, so on a CPU the stages cannot run
at once: the CPU figures show the cost of the cut, and the GPU commands in
BENCHMARKS.md show the overlap.
"""

import argparse
import dataclasses
import glob
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Tuple

from absl import logging
import keras
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import models
from tfmulti import step_options
from tfmulti.bench import designs as bench
from tfmulti.bench import flags
from tfmulti.deploy import placement
from tfmulti.engine import registry
from tfmulti.train import build
from tfmulti.train import config as config_lib

NUM_CLASSES = 1000  # The tutorial's ResNet-50 head.
STEPS_PER_ROUND = 3  # The tutorial's 3 batches.
NUM_STAGES = 2


@dataclasses.dataclass(frozen=True)
class PipelineBenchConfig:
  """What to time.

  Attributes:
    model: a registered model name.
    image_size: height and width of the synthetic images (3 channels).
    batch_size: rows of each of the 3 batches (one clone's).
    microbatches: the micro-batch counts of the pipelined designs.
    rounds: timed rounds (mean and spread are over them).
    clone_on_cpu: stages on logical CPUs instead of GPUs.
    boundaries: the first layer of stage 1; None to cut where the
      `stage_costs` balance.
    stage_costs: 'estimated' or 'measured' layer costs (`costs`).
    pipeline_schedule: the order of each stage's passes
      (`step_options.PIPELINE_SCHEDULES`).
    virtual_stages: each device's chunks under 'interleaved_1f1b'.
  """
  model: str = 'resnet50'
  image_size: int = 128
  batch_size: int = 120
  microbatches: Tuple[int, ...] = (2, 3, 4, 6, 8, 12)
  rounds: int = 5
  clone_on_cpu: bool = False
  boundaries: Tuple[str, ...] = None
  stage_costs: str = step_options.ESTIMATED
  pipeline_schedule: str = step_options.ONE_F_ONE_B
  virtual_stages: int = 2

  def __post_init__(self):
    models.check(self.model)
    errors.check_choice('pipeline_schedule', self.pipeline_schedule,
                        step_options.PIPELINE_SCHEDULES)
    for name in ('image_size', 'batch_size', 'rounds'):
      errors.check_count(name, getattr(self, name), 1)
    for count in self.microbatches:
      errors.check_count('microbatches', count, 2)
      if count > self.batch_size:
        raise errors.ConfigError(
            f'microbatches={count} is more than batch_size={self.batch_size}.')


def _design(config, num_stages, num_microbatches):
  """(trainer, images, labels) of one design, built as train.py builds it.
  The schedule orders micro-batches: the model-parallel design (one) runs
  the plain cut."""
  schedule = (config.pipeline_schedule if num_stages > 1 and
              num_microbatches > 1 else step_options.ONE_F_ONE_B)
  train_config = config_lib.TrainConfig(
      model=config.model, dataset='synthetic', optimizer='sgd',
      batch_size=config.batch_size, step_options=step_options.StepOptions(
          num_microbatches=num_microbatches,
          stage_boundaries=config.boundaries if num_stages > 1 else None,
          stage_costs=(config.stage_costs if num_stages > 1
                       else step_options.ESTIMATED),
          pipeline_schedule=schedule,
          virtual_stages=(config.virtual_stages if
                          schedule == step_options.INTERLEAVED_1F1B else 1)))
  deploy_config = placement.DeploymentConfig(clone_on_cpu=config.clone_on_cpu,
                                             num_stages=num_stages)
  shape = (config.image_size, config.image_size, 3)
  make = build.model_and_optimizer(train_config, deploy_config,
                                   input_shape=shape, num_classes=NUM_CLASSES,
                                   learning_rate=0.001)

  def seeded(model_scope=None):
    keras.utils.set_random_seed(0)
    return make(model_scope)
  setup = registry.Setup(registry.check_options(
      registry.TOWERS, train_config.step_options, deploy_config), deploy_config,
      seeded, build.make_loss())
  towers = registry.get(registry.TOWERS).build(setup)
  with tf.device(deploy_config.inputs_device()):
    images = tf.random.stateless_uniform((config.batch_size, *shape),
                                         seed=[0, 0])
    labels = tf.random.stateless_uniform((config.batch_size,), seed=[0, 1],
                                         maxval=NUM_CLASSES, dtype=tf.int32)
  return towers, images, labels


def _three_batches(design):
  towers, images, labels = design
  loss = None
  for _ in range(STEPS_PER_ROUND):
    loss = towers.train_step(images, labels)
  float(loss)  # Waits for the devices.


def designs(config):
  """{name: (trainer, images, labels)}, each traced and run once."""
  built = {'one_device': _design(config, 1, 1),
           'model_parallel': _design(config, NUM_STAGES, 1)}
  # The control: one device, its rows in the smallest sweep's micro-batches
  # (what smaller batches alone change, without a second stage).
  smallest = min(config.microbatches)
  built[f'one_device_{smallest}'] = _design(config, 1, smallest)
  for count in config.microbatches:
    built[f'pipelined_{count}'] = _design(config, NUM_STAGES, count)
  return built


def time_designs(built, rounds):
  """{name: [seconds per 3 batches of each round]}, interleaved."""
  first = {}
  for name, design in built.items():
    start = time.perf_counter()
    _three_batches(design)  # Traces, then warms up.
    first[name] = time.perf_counter() - start
    logging.info('%s: traced and warmed up in %.1f s', name, first[name])
  seconds = {name: [] for name in built}
  names = list(built)
  for round_index in range(rounds):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter()
      _three_batches(built[name])
      seconds[name].append(time.perf_counter() - start)
    logging.info('round %d of %d done', round_index + 1, rounds)
  retraced = [name for name, (towers, _, _) in built.items()
              if towers.trace_count != 1]
  if retraced:
    raise RuntimeError(f'{retraced} retraced; a timing that includes tracing '
                       'is not a step time.')
  return seconds, first


_STAGE = re.compile(r'(?:^|/)stage_(\d+)(?:_backward|_sum)?/')


def busy_fractions(xspace):
  """Each stage's busy fraction of one profiled step.

  A stage is busy while any op under its name scope runs (forward,
  backward, or its gradient sum); the fraction is the union of those
  intervals over the span from the first stage op to the last.
  """
  intervals = {}
  for plane in xspace.planes:
    for line in plane.lines:
      for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        match = _STAGE.search(name)
        if match:
          start = line.timestamp_ns * 1000 + event.offset_ps
          intervals.setdefault(int(match.group(1)), []).append(
              (start, start + event.duration_ps))
  if not intervals:
    return {}
  first = min(a for spans in intervals.values() for a, _ in spans)
  last = max(b for spans in intervals.values() for _, b in spans)
  return {stage: _union(spans) / (last - first)
          for stage, spans in sorted(intervals.items())}


def _union(spans):
  total, end = 0, None
  for a, b in sorted(spans):
    if end is None or a > end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total


def profile_step(design):
  """The busy fractions of one step of `design`, from a profiler trace."""
  towers, images, labels = design
  with tempfile.TemporaryDirectory() as logdir:
    tf.profiler.experimental.start(logdir)
    float(towers.train_step(images, labels))
    tf.profiler.experimental.stop()
    space = keras_internals.xplane_proto().XSpace()
    path, = glob.glob(os.path.join(logdir, 'plugins/profile/*/*.xplane.pb'))
    with open(path, 'rb') as f:
      space.ParseFromString(f.read())
  return busy_fractions(space)


def run(config):
  """The report: environment, config, one row a design, busy fractions."""
  built = designs(config)
  seconds, first = time_designs(built, config.rounds)
  reference = statistics.mean(seconds['one_device'])
  rows = []
  for name, values in seconds.items():
    mean = statistics.mean(values)
    row = {'design': name, 'seconds_mean': mean,
           'seconds_stdev': statistics.stdev(values) if len(values) > 1
           else 0.0, 'x_one_device': reference / mean,
           'first_seconds': first[name]}
    if not config.clone_on_cpu:  # GPUs' allocators report their peaks.
      row['peak_bytes_per_device'] = peak_memory(built[name])
    if name.startswith('pipelined_'):
      count = int(name.split('_')[1])
      row['microbatches'] = count
      row['busy_predicted'] = count / (count + NUM_STAGES - 1)
      row['busy_measured'] = profile_step(built[name])
    rows.append(row)
  stages = built['model_parallel'][0].stages.stages
  return {'environment': bench.environment(),
          'config': dataclasses.asdict(config),
          'stages': [stage.first_layer for stage in stages],
          'rows': rows}


def peak_memory(design):
  """{device: bytes} that 3 batches of `design` held on each of its stage
  devices above the resident (`bench.step_peak_bytes`, as the design
  benchmark; GPUs: `tf.config.experimental.get_memory_info`)."""
  return bench.step_peak_bytes(lambda: _three_batches(design),
                               design[0].config.compute_devices())


def format_report(report):
  """The report as a text table."""
  lines = [f"stages start at {report['stages']}",
           f"{'design':<16}{'s / 3 batches':>14}{'stdev':>8}"
           f"{'x one device':>13}{'busy (GPipe)':>14}  busy per stage"]
  for row in report['rows']:
    busy = row.get('busy_measured', {})
    lines.append(
        f"{row['design']:<16}{row['seconds_mean']:>14.3f}"
        f"{row['seconds_stdev']:>8.3f}{row['x_one_device']:>13.3f}"
        + (f"{row['busy_predicted']:>14.2f}  " + ' '.join(
            f'{b:.2f}' for b in busy.values()) if busy else ''))
  return '\n'.join(lines)


def write_chart(report, path):
  """A PNG: seconds per 3 batches against micro-batches, with spread."""
  pyplot = bench.pyplot_for('--chart')
  piped = [row for row in report['rows'] if 'microbatches' in row]
  figure, axes = pyplot.subplots(figsize=(6, 3.8))
  axes.errorbar([r['microbatches'] for r in piped],
                [r['seconds_mean'] for r in piped],
                yerr=[r['seconds_stdev'] for r in piped], fmt='o-',
                capsize=3, label='pipelined (2 stages)')
  flat = [row for row in report['rows'] if 'microbatches' not in row]
  for row, style in zip(flat, ('--', ':', '-.')):
    axes.axhline(row['seconds_mean'], linestyle=style, color='grey',
                 label=row['design'].replace('_', ' '))
  config = report['config']
  axes.set(xlabel='micro-batches', ylabel='seconds per 3 batches',
           title=f"{config['model']}, {config['batch_size']} images of "
           f"{config['image_size']}x{config['image_size']}",
           xticks=[r['microbatches'] for r in piped])
  axes.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  pyplot.close(figure)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.pipeline',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model='resnet50', clone_on_cpu=True)])
  p.add_argument('--image_size', type=int, default=128)
  p.add_argument('--batch_size', type=int, default=120)
  p.add_argument('--microbatches', default='2,3,4,6,8,12',
                 help='micro-batch counts of the pipelined designs')
  p.add_argument('--rounds', type=int, default=5)
  p.add_argument('--split_gpu', action='store_true',
                 help='split GPU 0 into 2 logical GPUs')
  p.add_argument('--gpu_memory_mb', type=int, default=30000,
                 help='memory of each logical GPU of --split_gpu')
  p.add_argument('--stage_boundary', help='the first layer of stage 1')
  p.add_argument('--stage_costs', default=step_options.ESTIMATED,
                 choices=step_options.STAGE_COSTS,
                 help='what the automatic cut balances')
  p.add_argument('--pipeline_schedule', default=step_options.ONE_F_ONE_B,
                 choices=step_options.PIPELINE_SCHEDULES,
                 help="the order of each stage's passes")
  p.add_argument('--virtual_stages', type=int, default=2,
                 help="each device's chunks under interleaved_1f1b")
  p.add_argument('--chart', help='write the chart here (PNG)')
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  try:
    try:
      counts = tuple(int(c) for c in args.microbatches.split(','))
    except ValueError:
      raise errors.ConfigError(
          f'--microbatches={args.microbatches}: give counts, e.g. 2,4,8.'
      ) from None
    config = PipelineBenchConfig(
        model=args.model, image_size=args.image_size,
        batch_size=args.batch_size, microbatches=counts, rounds=args.rounds,
        clone_on_cpu=args.clone_on_cpu,
        boundaries=(args.stage_boundary,) if args.stage_boundary else None,
        stage_costs=args.stage_costs,
        pipeline_schedule=args.pipeline_schedule,
        virtual_stages=args.virtual_stages)
    if args.clone_on_cpu:
      devices.create_logical_cpus(NUM_STAGES)
    elif args.split_gpu:
      devices.split_gpu(NUM_STAGES, args.gpu_memory_mb)
    devices.check_devices_exist(placement.DeploymentConfig(
        clone_on_cpu=args.clone_on_cpu, num_stages=NUM_STAGES
    ).compute_devices())
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.pipeline: error: {e}')
  report = run(config)
  bench.emit(report, format_report(report), args.output)
  if args.chart:
    write_chart(report, args.chart)


if __name__ == '__main__':
  main()
