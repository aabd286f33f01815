"""This machine's rates, measured: what `device_model` reads on logical CPUs.

A plan for GPUs reads their datasheets (`device_model.for_kind`); a plan
for the logical CPUs a job runs on here reads rates measured here, each
with every device busy at once, as a step keeps them (logical CPUs share
the cores, so `Rates.shared`: a step is the sum of its devices' times at
these whole-machine rates):

* a matmul's FLOP rate: a chain of square float32 matmuls on each device;
* an op's cost: many independent products of a scalar on each device,
  summed (an executor's dispatch to its threads and a kernel's launch,
  with nothing to compute), against the same function without them: a
  call's cost;
* the bytes an op writes a second: a chain of minimums and maximums of a
  large tensor on each device (memory-bound; Grappler folds a chain of
  products or of sums into one op, not these);
* a copy's bandwidth: a tensor reduced on the next device, against the
  same reduced on its own (logical CPUs share the host's memory: a copy
  may cost nothing measurable, an infinite bandwidth).

Each is the median of `repeats` timed calls of a traced function, after
one call to trace it; its input is an argument, so that nothing is folded
into a constant before it runs.
"""

import dataclasses
import statistics
import time

import tensorflow as tf

from tfmulti.plan import device_model
from tfmulti.plan import kernels

MATMUL_SIZE = 256  # A matmul's side: the size of a small model's layers.
MATMULS = 16  # Chained matmuls a device a call.
OPS = 1000  # Independent ops a device a call.
WRITES = 40  # Chained minimums and maximums a device a call.
WRITE_BYTES = 2**22  # Each one's output: 4 MiB.
COPY_BYTES = 2**24  # A copy's size: 16 MiB.
LINK = 'cpu-cpu'  # The dry run's name of the link between logical CPUs.


def measure(device_names, repeats=9):
  """The `device_model.Rates` of `device_names` (logical CPUs of this
  process) measured here (see the module)."""
  n = len(device_names)

  def seconds(fn):
    return _seconds(fn, repeats)
  call = seconds(_products(device_names, 0))
  op_seconds = max(seconds(_products(device_names, OPS)) - call, 0) / (
      OPS * n)
  flops = 2 * MATMUL_SIZE**3 * MATMULS * n / (
      seconds(_matmuls(device_names)) - call)
  written = WRITE_BYTES * WRITES * n / (
      seconds(_bounds(device_names, WRITES)) -
      seconds(_bounds(device_names, 0)))
  copied = (seconds(_reductions(device_names, 1)) -
            seconds(_reductions(device_names, 0)))
  bandwidth = COPY_BYTES * n / copied if copied > 0 else float('inf')
  return device_model.Rates(flops, {LINK: bandwidth}, op_seconds,
                            host_flops=flops, shared=True,
                            call_seconds=call, written_bytes=written)


def with_kernels(device_names, plans):
  """`measure(device_names)`, with each heavy op of `plans` (`dry_run.Plan`s
  of steps on those devices) timed alone (`kernels.measure`): the rates a
  plan for this machine's logical CPUs reads."""
  rates = measure(device_names)
  return dataclasses.replace(rates, kernel_seconds=kernels.measure(
      {kernel for found in plans for report in found.devices.values()
       for kernel in report.kernels}, device_names))


def _seconds(fn, repeats):
  """The median seconds of a call of `fn` (traced) on an argument."""
  fn = tf.function(fn)
  seed = tf.constant(1.0)
  fn(seed).numpy()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(seed).numpy()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _each(device_names, body):
  """A function of a seed summing `body(seed, index)` on each device."""
  def fn(seed):
    outs = []
    for index, name in enumerate(device_names):
      with tf.device(name):
        outs.append(body(seed + float(index), index))
    return tf.add_n(outs)
  return fn


def _matmuls(device_names):
  def body(seed, _):
    x = tf.fill((MATMUL_SIZE,) * 2, seed / MATMUL_SIZE)
    for _ in range(MATMULS):
      x = tf.matmul(x, x)
    return tf.reduce_sum(x[:1, :1])
  return _each(device_names, body)


def _products(device_names, ops):
  def body(x, _):
    return tf.add_n([x] + [x * float(i) for i in range(ops)])
  return _each(device_names, body)


def _bounds(device_names, ops):
  def body(seed, _):
    x = tf.fill((WRITE_BYTES // 4,), seed)
    for i in range(ops):
      x = tf.maximum(x, seed) if i % 2 else tf.minimum(x, seed + 1.0)
    return tf.reduce_sum(x[:1])
  return _each(device_names, body)


def _reductions(device_names, shift):
  """Each device's tensor reduced `shift` devices on."""
  def body(seed, index):
    x = tf.fill((COPY_BYTES // 4,), seed)
    with tf.device(device_names[(index + shift) % len(device_names)]):
      return tf.reduce_max(tf.identity(x))
  return _each(device_names, body)
