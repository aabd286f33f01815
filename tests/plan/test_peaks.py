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
