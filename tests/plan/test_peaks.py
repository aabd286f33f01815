"""The plan's order of a step's ops (`peaks.as_soon_as_ready`): each op
once its inputs and control inputs have run, a gate made after the op
it holds back included, and the peak of ops ready together."""

import tensorflow as tf

from tfmulti import keras_internals
from tfmulti.plan import peaks


def _graph(held_back):
  """Two products of one input; with `held_back`, the first waits for a
  gate made after it (as a zero-bubble schedule holds a W pass back)."""
  @tf.function
  def step(x):
    first = tf.matmul(x, x, name='first')
    second = tf.matmul(x, x, name='second')
    gate = tf.identity(second, name='gate')
    if held_back:
      keras_internals.wait_for(first.op, gate.op)
    return tf.reduce_sum(first) + tf.reduce_sum(second)
  return step.get_concrete_function(
      tf.TensorSpec((1024, 1024), tf.float32)).graph


def test_an_op_held_back_by_a_later_gate_runs_after_it():
  for held_back in (False, True):
    graph = _graph(held_back)
    order = [op.name for op in peaks.as_soon_as_ready(
        [op for op in graph.get_operations()])]
    assert (order.index('first') > order.index('gate')) == held_back


def test_ops_that_are_ready_together_run_together():
  """Two products of the input, the first summed before the second is
  made: made in order, one is live at a time; both are ready at the
  step's start, so the runtime may hold both (the input is an argument,
  fed: none of the step's)."""
  @tf.function
  def step(x):
    first = tf.reduce_sum(tf.matmul(x, x))
    return first + tf.reduce_sum(tf.matmul(x, x))
  graph = step.get_concrete_function(
      tf.TensorSpec((1024, 1024), tf.float32)).graph
  (peak,) = peaks.peaks(graph).values()
  assert 2 * 4 * 2**20 <= peak < 3 * 4 * 2**20


def _peak(step, device='/device:CPU:0'):
  """The peak on `device` of `step` of a column of 1024 (4 KiB)."""
  graph = step.get_concrete_function(
      tf.TensorSpec((1024, 1), tf.float32)).graph
  return peaks.peaks(graph)[device]


def _outer(x):
  """A 4 MiB product of the column."""
  return tf.matmul(x, x, transpose_b=True)


def test_an_element_wise_op_writes_into_an_input_nothing_else_reads():
  """A product, its ReLU and their double: one buffer where each is read
  once (TensorFlow's element-wise kernels forward it); where the product
  is read again, the ReLU's is a buffer of its own."""
  mib4 = 4 * 2**20

  @tf.function
  def chain(x):
    with tf.device('/device:CPU:0'):
      return tf.reduce_sum(tf.nn.relu(_outer(x)) * 2.0)

  @tf.function
  def reread(x):
    with tf.device('/device:CPU:0'):
      product = _outer(x)
      return tf.reduce_sum(tf.nn.relu(product) * 2.0 + product)

  assert mib4 <= _peak(chain) < 1.1 * mib4
  assert 2 * mib4 <= _peak(reread) < 2.1 * mib4


def test_a_buffer_sent_to_another_device_leaves_its_own_once_sent():
  """A product made on CPU:0 and read on CPU:1 alone, late, is not held
  on CPU:0 while it waits there (a transfer takes its copy as it is
  made): the product CPU:0 makes next is its only buffer then."""
  @tf.function
  def step(x):
    with tf.device('/device:CPU:0'):
      sent = _outer(x)
    with tf.device('/device:CPU:1'):
      late = tf.reduce_sum(tf.nn.relu(x))  # Ready after the product.
      read = tf.reduce_sum(sent * late)
    with tf.device('/device:CPU:0'):
      after = tf.reduce_sum(_outer(x * 2.0))  # Made as CPU:1 waits.
    return read + after

  assert _peak(step) < 1.1 * 4 * 2**20
  assert _peak(step, '/device:CPU:1') >= 4 * 2**20  # Its copy.
