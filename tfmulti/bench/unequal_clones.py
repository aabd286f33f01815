"""Automatic shares on an unequal pair of clones.

  python -m tfmulti.bench.unequal_clones

Two clones on two devices, one of them made slower: every row that clone
1 computes also waits `seconds_per_row` (a sleep inside its forward pass,
on its device, so it costs time without taking the other clone's cores:
a slow device, simulated). `--slowdown=3` picks the wait that makes clone 1
take 3x clone 0's time per row, measured first.

It then reports, side by side in one process (rounds interleaved):
  * each clone's solo throughput (rows a second, alone) and the ideal: the
    sum of the two, what a perfect split reaches;
  * the even split's throughput (what `fit` and tf.distribute do);
  * the throughput with `--clone_shares=auto`'s shares (`balance.Balancer`
    measures the clones and sets them; the log line gives them).

`--emulated=3,1` measures the balancer on EMULATED devices instead: both
clones only wait (`bench.emulated.DeviceWaits`, a time a row in proportion
to 1 / speed, taking no CPU), so the two really run at once and the sum of
their solo rates is reachable. It reports the balanced split's step rate
against that sum, then slows clone 1 down 2x and reports, step by step,
how soon the balancer (measuring every `--every_steps`) reaches the new
ideal, and the traces (one a distinct split).
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
from tfmulti.bench import emulated
from tfmulti.bench import flags
from tfmulti.deploy import balance
from tfmulti.deploy import placement
from tfmulti.deploy import towers as towers_lib

SLOW_CLONE = 1


class ExtraWorkOn(keras.layers.Layer):
  """Identity, but on `device` it first waits `seconds_per_row` a row.

  `seconds_per_row` is read when the step runs, so it can change without a
  retrace.
  """

  def __init__(self, device, **kwargs):
    super().__init__(**kwargs)
    self.device = device
    self.seconds_per_row = 0.0

  def _wait(self, rows):
    time.sleep(float(rows) * self.seconds_per_row)
    return np.float32(0.0)

  def call(self, inputs):
    if not tf.identity(inputs).device.endswith(self.device):
      return inputs
    waited = tf.py_function(self._wait, [tf.shape(inputs)[0]], tf.float32)
    waited.set_shape([])
    return inputs + tf.cast(tf.stop_gradient(waited), inputs.dtype)

  def compute_output_shape(self, input_shape):
    return input_shape


def _towers(model_name, batch_size):
  """Two towers whose clone 1 carries an `ExtraWorkOn` layer, and their
  shares policy (`balance.Fixed`: the splits set by hand)."""
  config = placement.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  shape = (28, 28, 1)
  with tf.device(config.variables_device()):
    keras.utils.set_random_seed(0)
    inner = models.get_model(model_name, input_shape=shape, num_classes=10)
    inputs = keras.Input(shape)
    extra = ExtraWorkOn(config.clone_device(SLOW_CLONE).split('/')[-1])
    model = keras.Model(inputs, inner(extra(inputs)))
    optimizer = keras.optimizers.SGD(0.01)
  pinned = balance.Fixed()
  towers = towers_lib.deploy(
      config, model,
      keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer,
      shares=pinned)
  rng = np.random.default_rng(0)
  images = rng.random((2 * batch_size, *shape), np.float32)
  labels = rng.integers(0, 10, 2 * batch_size).astype(np.int32)
  return towers, pinned, extra, tf.constant(images), tf.constant(labels)


def _balancer(towers, every_steps):
  """`clone_shares='auto'`'s policy, measuring `towers`' clones, whose
  shares the benchmark pins itself (a batch is one accumulation step)."""
  return balance.Balancer(every_steps, measure=towers.throughputs)


def _rate(towers, images, labels, steps):
  start = time.perf_counter()
  for _ in range(steps):
    loss = towers.train_step(images, labels)
  float(loss)
  return steps * images.shape[0] / (time.perf_counter() - start)


def run(model_name='lenet', batch_size=64, slowdown=3.0, rounds=5, steps=10):
  """The report: solo throughputs, ideal, even and balanced splits."""
  towers, pinned, extra, images, labels = _towers(model_name, batch_size)
  base = towers.throughputs(images, labels)  # No extra yet.
  extra.seconds_per_row = (slowdown - 1) / base[0]
  solo = towers.throughputs(images, labels)
  auto_shares = _balancer(towers, 10**9).rebalance(
      images, labels, rows=images.shape[0], current=None)
  splits = {'even': None, 'auto': auto_shares}
  rates = {name: [] for name in splits}
  for shares in splits.values():  # Traces each split once.
    pinned.value = shares
    _rate(towers, images, labels, 2)
  for round_index in range(rounds):
    order = list(splits)[::1 if round_index % 2 == 0 else -1]
    for name in order:
      pinned.value = splits[name]
      rates[name].append(_rate(towers, images, labels, steps))
  ideal = sum(solo)
  report = {'environment': bench.environment(),
            'config': dict(model=model_name, batch_size=batch_size,
                           slowdown=slowdown, rounds=rounds, steps=steps),
            'solo_rows_per_sec': solo, 'ideal_rows_per_sec': ideal,
            'auto_shares': list(auto_shares), 'trace_count':
            towers.trace_count}
  for name, values in rates.items():
    median = statistics.median(values)
    report[name] = {'rows_per_sec_median': median,
                    'rows_per_sec_min': min(values),
                    'rows_per_sec_max': max(values),
                    'of_ideal': median / ideal}
  report['auto_over_even'] = (report['auto']['rows_per_sec_median'] /
                              report['even']['rows_per_sec_median'])
  return report


def _emulated_towers(waits, batch_size):
  """Two towers on emulated devices (`waits`: seconds a row by device),
  their `DeviceWaits` layer (whose copy of `waits` the step reads), and a
  batch of 2 * batch_size rows."""
  config = placement.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    device_waits = emulated.DeviceWaits(waits)
    outputs = keras.layers.Dense(10)(device_waits(inputs))
    model = keras.Model(inputs, outputs)
    optimizer = keras.optimizers.SGD(0.01)
  pinned = balance.Fixed()  # Measured apart from steps.
  towers = towers_lib.deploy(
      config, model,
      keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer,
      shares=pinned)
  rng = np.random.default_rng(0)
  images = tf.constant(rng.random((2 * batch_size, 16), np.float32))
  labels = tf.constant(rng.integers(0, 10, 2 * batch_size).astype(np.int32))
  return towers, pinned, device_waits, images, labels


def run_emulated(speeds, batch_size=64, ms_per_row=1.0, steps=10,
                 every_steps=5):
  """The balancer on an emulated pair of these speeds (the fastest waits
  `ms_per_row` a row); the report, as a dict. Measurements are timed
  apart from the steps."""
  waits = {f'CPU:{i}': ms_per_row / 1000 * max(speeds) / speed
           for i, speed in enumerate(speeds)}
  towers, pinned, device_waits, images, labels = _emulated_towers(
      waits, batch_size)
  solo = towers.throughputs(images, labels)
  _rate(towers, images, labels, 1)  # Traces the even split.
  even = statistics.median(_rate(towers, images, labels, 1)
                           for _ in range(steps))
  balanced = _balancer(towers, every_steps)
  shares = pinned.value = balanced.rebalance(
      images, labels, rows=images.shape[0], current=None)
  _rate(towers, images, labels, 1)  # Traces the balanced split.
  auto = statistics.median(_rate(towers, images, labels, 1)
                           for _ in range(steps))
  # Clone 1 slows down 2x, just after a measurement.
  device_waits.seconds_per_row['CPU:1'] *= 2
  after = []
  for step in range(1, 2 * every_steps + 1):
    if step % every_steps == 0:
      pinned.value = balanced.rebalance(
          images, labels, rows=images.shape[0], current=pinned.value)
    after.append(_rate(towers, images, labels, 1))
  new_solo = towers.throughputs(images, labels)
  new_ideal = sum(new_solo)
  reached = next((i + 1 for i, rate in enumerate(after)
                  if min(after[i:]) >= 0.9 * new_ideal), None)
  splits = {tuple(entry[1]) for entry in balanced.history} | {None}
  return {
      'emulated': True, 'speeds': list(speeds), 'solo_rows_per_sec': solo,
      'ideal_rows_per_sec': sum(solo), 'even_rows_per_sec': even,
      'even_of_ideal': even / sum(solo), 'auto_shares': list(shares),
      'auto_rows_per_sec': auto, 'auto_of_ideal': auto / sum(solo),
      'slowed_solo_rows_per_sec': new_solo,
      'slowed_ideal_rows_per_sec': new_ideal,
      'slowed_shares': list(towers.clone_shares),
      'slowed_of_ideal_by_step': [rate / new_ideal for rate in after],
      'steps_to_0_90_of_new_ideal': reached,
      'distinct_splits': len(splits), 'trace_count': towers.trace_count}


def format_emulated(reports):
  lines = ['EMULATED devices (waits, not compute): the balancer',
           f"{'pair':>6}{'even':>8}{'auto':>8}{'shares':>8}"
           f"{'slowed 2x: steps to 0.90':>26}{'shares':>8}{'traces':>8}"
           f"{'splits':>8}"]
  for r in reports:
    lines.append(
        f"{':'.join(map(str, r['speeds'])):>6}{r['even_of_ideal']:>8.3f}"
        f"{r['auto_of_ideal']:>8.3f}"
        f"{':'.join(map(str, r['auto_shares'])):>8}"
        f"{str(r['steps_to_0_90_of_new_ideal']):>26}"
        f"{':'.join(map(str, r['slowed_shares'])):>8}"
        f"{r['trace_count']:>8}{r['distinct_splits']:>8}")
  lines.append('even and auto: step rate / the sum of the solo rates.')
  return '\n'.join(lines)


def format_report(report):
  lines = [
      'solo rows/s: ' + ', '.join(
          f'clone {i} {r:.0f}' for i, r in enumerate(
              report['solo_rows_per_sec'])) +
      f"; ideal (sum) {report['ideal_rows_per_sec']:.0f}",
      f"{'split':<8}{'rows/s':>10}{'min':>10}{'max':>10}{'of ideal':>10}"]
  for name in ('even', 'auto'):
    entry = report[name]
    lines.append(f"{name:<8}{entry['rows_per_sec_median']:>10.0f}"
                 f"{entry['rows_per_sec_min']:>10.0f}"
                 f"{entry['rows_per_sec_max']:>10.0f}"
                 f"{entry['of_ideal']:>10.2f}")
  lines.append(f"auto shares {report['auto_shares']}; auto / even "
               f"{report['auto_over_even']:.2f}")
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.unequal_clones',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model='lenet')])
  p.add_argument('--batch_size', type=int, default=64,
                 help='rows per clone of an even split')
  p.add_argument('--slowdown', type=float, default=3.0,
                 help="clone 1's time per row / clone 0's")
  p.add_argument('--rounds', type=int, default=5)
  p.add_argument('--steps', type=int, default=10)
  p.add_argument('--emulated', help='pairs of speeds, e.g. 3:1,5:3: '
                 'measure the balancer on emulated devices instead')
  p.add_argument('--every_steps', type=int, default=5,
                 help='(emulated) steps between measurements')
  p.add_argument('--ms_per_row', type=float, default=1.0,
                 help="(emulated) the fastest device's wait a row")
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  try:
    errors.check_positive('slowdown', args.slowdown)
    if args.slowdown < 1:
      raise errors.ConfigError(f'slowdown={args.slowdown}: must be >= 1.')
    for name in ('batch_size', 'rounds', 'steps', 'every_steps'):
      errors.check_count(name, getattr(args, name), 1)
    errors.check_positive('ms_per_row', args.ms_per_row)
    pairs = _pairs(args.emulated) if args.emulated else None
    if pairs:
      emulated.use_threads(8)
    devices.create_logical_cpus(2)
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.unequal_clones: error: {e}')
  if pairs:
    reports = [run_emulated(pair, args.batch_size, args.ms_per_row,
                            args.steps, args.every_steps) for pair in pairs]
    bench.emit({'environment': bench.environment(), 'pairs': reports},
               format_emulated(reports), args.output)
    return
  report = run(args.model, args.batch_size, args.slowdown, args.rounds,
               args.steps)
  bench.emit(report, format_report(report), args.output)


def _pairs(text):
  """--emulated's pairs of speeds: '3:1,5:3' -> [(3.0, 1.0), (5.0, 3.0)]."""
  try:
    pairs = [tuple(float(v) for v in pair.split(':'))
             for pair in text.split(',')]
  except ValueError:
    pairs = []
  if not pairs or any(len(p) != 2 or min(p) <= 0 for p in pairs):
    raise errors.ConfigError(
        f'--emulated={text}: give pairs of speeds > 0, e.g. 3:1,5:3.')
  return pairs


if __name__ == '__main__':
  main()
