"""A step's heavy ops rebuilt alone and timed on this machine's logical
CPUs; the device model takes a timed kernel's seconds in place of its
estimate; this machine's rates, measured."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.plan import device_model
from tfmulti.plan import dry_run
from tfmulti.plan import kernels
from tfmulti.plan import measured_rates

CPUS = ['/device:CPU:0', '/device:CPU:1']


def _ops(fn, *specs):
  graph = tf.function(fn).get_concrete_function(*specs).graph
  return {op.type: op for op in graph.get_operations()}


def test_a_convolution_rebuilt_alone_computes_the_ops_output():
  ops = _ops(lambda x: tf.nn.conv2d(x, tf.ones((3, 3, 4, 8)), 1, 'SAME'),
             tf.TensorSpec((8, 32, 32, 4)))
  kernel = kernels.of(ops['Conv2D'])
  assert kernel.flops > 0
  # The filter is a constant of the graph: kept; the images are fed.
  assert kernel.inputs == (((8, 32, 32, 4), 'float32'),)
  x = tf.random.stateless_normal((8, 32, 32, 4), (1, 2))
  outputs = kernels.rebuilt(kernel, CPUS)(x)
  want = tf.nn.conv2d(x, tf.ones((3, 3, 4, 8)), 1, 'SAME')
  assert len(outputs) == len(CPUS)
  for output in outputs:
    np.testing.assert_allclose(output, want, rtol=1e-5, atol=1e-5)


def test_a_size_the_graph_fixes_is_kept_not_made_up():
  """A filter's gradient reads its shape from the filter: zeros there
  would make an empty gradient, timed as nothing."""
  def grad(x, w):
    with tf.GradientTape() as tape:
      tape.watch(w)
      y = tf.nn.conv2d(x, w, 1, 'SAME')
    return tape.gradient(y, w)
  ops = _ops(grad, tf.TensorSpec((8, 16, 16, 32)),
             tf.TensorSpec((3, 3, 32, 32)))
  kernel = kernels.of(ops['Conv2DBackpropFilter'])
  assert [shape for shape, _ in kernel.inputs] == [(8, 16, 16, 32)] * 2
  x, dy = (tf.random.stateless_normal((8, 16, 16, 32), (i, 0))
           for i in range(2))
  (got,) = kernels.rebuilt(kernel, CPUS[:1])(x, dy)
  want = tf.raw_ops.Conv2DBackpropFilter(
      input=x, filter_sizes=[3, 3, 32, 32], out_backprop=dy,
      strides=[1, 1, 1, 1], padding='SAME')
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_an_elementwise_op_is_left_to_its_bytes_estimate():
  ops = _ops(lambda x: tf.nn.relu(x) * 2.0, tf.TensorSpec((8, 64, 64, 64)))
  assert kernels.written_bytes(ops['Relu']) == 8 * 64 * 64 * 64 * 4
  assert kernels.of(ops['Relu']) is None
  assert kernels.of(ops['Mul']) is None


def test_light_stateful_and_variable_ops_are_not_kernels():
  v = tf.Variable(tf.ones((256, 256)))

  def fn(x, y):
    return (tf.matmul(v, x), y + 1.0, tf.random.uniform((512, 512)))
  ops = _ops(fn, tf.TensorSpec((256, 256)), tf.TensorSpec((4, 4)))
  assert kernels.of(ops['ReadVariableOp']) is None  # A resource's read.
  assert kernels.of(ops['AddV2']) is None  # 16 FLOPs, 64 bytes written.
  assert kernels.of(ops['RandomUniform']) is None  # Stateful.
  assert kernels.of(ops['MatMul']) is not None


def test_an_input_of_unknown_shape_is_not_a_kernel():
  ops = _ops(lambda x: tf.matmul(x, x), tf.TensorSpec((None, None)))
  assert kernels.of(ops['MatMul']) is None


def test_a_kernel_is_timed_on_every_device_at_once():
  ops = _ops(lambda x: tf.matmul(x, x), tf.TensorSpec((128, 128)))
  kernel = kernels.of(ops['MatMul'])
  (seconds,) = kernels.measure([kernel], CPUS).values()
  assert 0 < seconds < 1


def test_an_integer_input_the_graph_does_not_fix_is_not_made_up():
  """Zeros for the sizes a gradient is fed would run, and time nothing."""
  def fn(dy, w, sizes):
    x = tf.raw_ops.Conv2DBackpropInput(
        input_sizes=sizes, filter=w, out_backprop=dy, strides=[1] * 4,
        padding='SAME')
    x.set_shape((8, 16, 16, 32))
    return x
  ops = _ops(fn, tf.TensorSpec((8, 16, 16, 32)),
             tf.TensorSpec((3, 3, 32, 32)), tf.TensorSpec((4,), tf.int32))
  assert kernels.of(ops['Conv2DBackpropInput']) is None


def test_a_timed_kernels_seconds_replace_its_estimate():
  kernel = kernels.Kernel(b'', (), flops=10**9, written_bytes=10**6)
  report = dry_run.DeviceReport(flops=3 * 10**9, ops=5,
                                written_bytes=4 * 10**6)
  report.kernels[kernel] = 2
  rates = device_model.Rates(flops=1e11, links={}, op_seconds=1e-6,
                             written_bytes=1e10, shared=True,
                             call_seconds=1e-4)
  estimate = 3e-2 + 5e-6 + 4e-4
  assert device_model.step_seconds(
      dry_run.Plan({'/device:CPU:0': report}, []), rates) == pytest.approx(
          1e-4 + estimate)
  timed = device_model.Rates(**{**rates.__dict__,
                                'kernel_seconds': {kernel: 5e-3}})
  # Each of its two runs: 5 ms in place of 10 ms + 1 us + 0.1 ms.
  assert device_model.step_seconds(
      dry_run.Plan({'/device:CPU:0': report}, []), timed) == pytest.approx(
          1e-4 + estimate + 2 * (5e-3 - (1e-2 + 1e-6 + 1e-4)))


def test_this_machines_rates_are_measured_with_every_device_busy():
  rates = measured_rates.measure(CPUS, repeats=3)
  assert rates.shared
  assert 1e9 < rates.flops < 1e14  # A core's vector units, not a fold.
  assert rates.host_flops == rates.flops
  assert 0 < rates.call_seconds < 1
  assert 0 < rates.written_bytes < 1e13
  assert 0 <= rates.op_seconds < 1e-3
  assert rates.links[measured_rates.LINK] > 0
  assert not math.isnan(rates.links[measured_rates.LINK])
