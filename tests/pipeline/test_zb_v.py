"""ZB-V: 2K chunks in a V on K devices, each backward pass split into B
and W: its order, its theory, the chunks' devices and the order read from
the traced step, exactness, no gradient op twice, refusals."""

import collections
import itertools

import keras
import numpy as np
import pytest

from tests.deploy.test_atoms import assert_bit_identical
from tests.deploy.test_atoms import train
from tests.helpers import L2
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import mlp
from tests.pipeline.test_interleaved import _assert_equals_one_device
from tests.pipeline.test_interleaved import _device_orders_in
from tests.pipeline.test_interleaved import deep_mlp
from tests.pipeline.test_zero_bubble import HALVES
from tests.pipeline.test_zero_bubble import reachable_gradient_ops
from tfmulti import deploy
from tfmulti import errors
from tfmulti.pipeline import schedules

ZB_V = schedules.ZB_V
EQUAL = {'F': 1.0, 'B': 1.0, 'W': 1.0}


def _zb_v(num_stages, num_microbatches, num_clones=1, model_fn=deep_mlp,
          pipeline_schedule=ZB_V, **kwargs):
  config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True,
                                   num_stages=num_stages)
  return make_deployed(config, model_fn, summarize_gradients=True,
                       num_microbatches=num_microbatches,
                       pipeline_schedule=pipeline_schedule, **kwargs)


def bn_mlp():
  """Dense(tanh), BatchNorm, Dense(tanh), Dense, with L2: 4 layers, a
  chunk each on 2 devices."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  x = keras.layers.Dense(16, activation='tanh',
                         kernel_regularizer=keras.regularizers.L2(L2))(inputs)
  x = keras.layers.BatchNormalization()(x)
  x = keras.layers.Dense(8, activation='tanh')(x)
  return keras.Model(inputs, keras.layers.Dense(
      3, kernel_regularizer=keras.regularizers.L2(L2))(x))


def test_the_chunks_make_a_v():
  """Chunks d and 2K - 1 - d on device d: the last device runs the two
  middle chunks, the first device the first chunk and the last."""
  assert schedules.chunk_devices(ZB_V, 4) == [0, 1, 2, 3, 3, 2, 1, 0]
  assert schedules.chunk_devices(ZB_V, 2) == [0, 1, 1, 0]


def test_the_order_is_the_papers():
  """K=2, M=4. Device 0 (chunks 0 and 3): 2(K - 0) - 1 = 3 forward passes
  of chunk 0; K = 2 triples (F, B, W) of chunk 3; (F, B, W) of chunk 0
  and of chunk 3 in turn while forward passes remain; then K pairs (B, W)
  of chunk 0. Device 1 (chunks 1 and 2): 1 forward pass of chunk 1, one
  pair (F 2, F 1), one triple of chunk 2, ..., its W passes left at the
  end, chunk 2's first."""
  first, second = schedules.device_orders(ZB_V, 2, 4)
  f, b, w = ((lambda c, m, kind=kind: (c, kind, m)) for kind in 'FBW')
  assert first == [
      f(0, 0), f(0, 1), f(0, 2),
      f(3, 0), b(3, 0), w(3, 0), f(3, 1), b(3, 1), w(3, 1),
      f(0, 3), b(0, 0), w(0, 0), f(3, 2), b(3, 2), w(3, 2),
      b(0, 1), w(0, 1), f(3, 3), b(3, 3), w(3, 3),
      b(0, 2), w(0, 2), b(0, 3), w(0, 3)]
  assert second == [
      f(1, 0), f(2, 0), f(1, 1), f(2, 1), b(2, 0), w(2, 0),
      f(1, 2), b(1, 0), w(1, 0), f(2, 2), b(2, 1), w(2, 1),
      f(1, 3), b(1, 1), w(1, 1), f(2, 3), b(2, 2), w(2, 2),
      b(1, 2), b(2, 3), b(1, 3), w(1, 2), w(2, 3), w(1, 3)]


@pytest.mark.parametrize('k', (2, 3, 4))
def test_every_pass_once_and_the_bubble(k):
  """Every (chunk, F/B/W, micro-batch) once, in a buildable order, for any
  M (fewer than 2K - 1 leave passes out); for M >= 2K - 1 with F = B = W,
  only the K - 1 half-stage forward passes before the last device starts
  are idle: (K - 1) / (6M + K - 1) of the step, on every device (each
  chunk half a stage: the step is 6M chunk passes long)."""
  for m in range(1, 4 * k + 1):
    per_device = schedules.device_orders(ZB_V, k, m)
    order = schedules.build_order(per_device, 2 * k)  # Raises: deadlock.
    assert sorted(order) == sorted(
        (c, kind, i) for c in range(2 * k) for kind in 'FBW'
        for i in range(m))
    assert schedules.devices_of(per_device) == dict(
        enumerate(schedules.chunk_devices(ZB_V, k)))
    if m >= 2 * k - 1:
      np.testing.assert_allclose(schedules.idle_theory(ZB_V, k, m, EQUAL),
                                 [(k - 1) / (6 * m + k - 1)] * k)
  # At K=4, M=8: 0.059, against ZB-H1's 0.111 and 1F1B's 0.273.
  if k == 4:
    assert max(schedules.idle_theory(ZB_V, 4, 8, EQUAL)) < 0.06


def test_each_device_holds_as_many_micro_batches_as_1f1bs_first_stage():
  """Counted in stages' worth (a chunk is half a stage): a micro-batch is
  held by a chunk from its F to its W. 1F1B's first stage holds K."""
  for k, m in itertools.product((2, 3, 4), (4, 8, 16)):
    for device in schedules.device_orders(ZB_V, k, m):
      held = peak = 0
      for _, kind, _ in device:
        held += {'F': 1, 'B': 0, 'W': -1}[kind]
        peak = max(peak, held)
      assert peak / 2 <= k, (k, m, peak)


@pytest.mark.slow
def test_each_device_runs_its_chunks_in_the_order():
  """Read back from the traced step's gates, and each chunk's layers on
  its device of the V."""
  deployed = _zb_v(2, 4)
  graph = deployed.traced_step(*make_batch(8)).graph
  device_of = schedules.chunk_devices(ZB_V, 2)
  assert _device_orders_in(graph, 2, device_of) == schedules.device_orders(
      ZB_V, 2, 4)
  placed = collections.defaultdict(set)
  for op in graph.get_operations():
    for c in range(4):
      if f'microbatch_0/stage_{c}/' in op.name and 'gradient_tape' not in (
          op.name) and op.device:
        placed[c].add(op.device[-5:])
  assert placed == {0: {'CPU:0'}, 1: {'CPU:1'}, 2: {'CPU:1'}, 3: {'CPU:0'}}


@pytest.mark.slow
def test_a_chunk_without_weights_keeps_its_order():
  """Chunk 2 holds only the skip's Add: its W passes have nothing to take,
  and still hold the device's next pass back (read from the traced step);
  exact against one device."""
  deployed = _zb_v(2, 4, stage_boundaries=('d5', 'skip', 'out'))
  assert [s.first_layer for s in deployed.stages.stages] == [
      'd0', 'd5', 'skip', 'out']
  assert not deployed.stages.stages[2].trainable
  graph = deployed.traced_step(*make_batch(8)).graph
  assert _device_orders_in(
      graph, 2, schedules.chunk_devices(ZB_V, 2)) == schedules.device_orders(
          ZB_V, 2, 4)
  _assert_equals_one_device(
      _zb_v(2, 4, stage_boundaries=('d5', 'skip', 'out')), rows=8)


@pytest.mark.slow
@pytest.mark.parametrize('k, m', [
    (k, m) for k in (2, 3, 4) for m in (k, 2 * k, 4 * k)])
def test_zb_v_equals_one_device(k, m):
  for recompute in (False, True):
    deployed = _zb_v(k, m, recompute=recompute)
    assert len(deployed.stages.stages) == 2 * k
    _assert_equals_one_device(deployed, rows=2 * m)


@pytest.mark.slow
def test_with_clones_shares_and_accumulation_equal_one_device():
  _assert_equals_one_device(
      _zb_v(2, 4, num_clones=2, clone_shares=(3, 1), accumulation_steps=2,
            recompute=True), rows=32)


@pytest.mark.slow
def test_the_same_bits_as_1f1b_with_reproducible_rows():
  """A BatchNorm MLP with L2 (weights, slots, moving statistics), 2 clones
  of 2 stage devices: 4 chunks under ZB-V, 2 stages under 1F1B."""
  def batch(step):
    return make_batch(32, seed=step)

  def layout(schedule):
    return (dict(num_clones=2, num_stages=2),
            dict(num_microbatches=4, pipeline_schedule=schedule))
  want = train(bn_mlp, layout('1f1b'), 3, batch)
  assert_bit_identical(train(bn_mlp, layout(ZB_V), 3, batch), want,
                       staged=True)


@pytest.mark.slow
def test_each_half_of_each_gradient_runs_once():
  """The very gradient ops of the fused interleaved 1F1B step on the same
  4 chunks (2 a device), each as often: the matmul and bias gradients (B
  the input halves, W the weight halves), and nothing built again for W."""
  batch = make_batch(8)
  fused = reachable_gradient_ops(
      _zb_v(2, 2, pipeline_schedule='interleaved_1f1b', virtual_stages=2),
      batch)
  split = reachable_gradient_ops(_zb_v(2, 2), batch)
  count = lambda ops: collections.Counter(  # noqa: E731
      op.type for device in ops.values() for op in device)
  assert sum(count(fused)[t] for t in HALVES) > 0
  assert count(split) == count(fused)


def test_too_few_layers_for_2k_chunks_is_one_line():
  with pytest.raises(errors.ConfigError) as raised:
    _zb_v(4, 4, model_fn=lambda: mlp())
  message = str(raised.value)
  assert message.startswith("pipeline_schedule='zb_v': 4 stages of 2 "
                            'chunks cut')
  assert 'into 8 chunks, and it has' in message
  assert '\n' not in message


def test_virtual_stages_is_refused_with_zb_v():
  with pytest.raises(errors.ConfigError,
                     match="'zb_v' runs 2, always"):
    deploy.StepOptions(num_microbatches=4, pipeline_schedule=ZB_V,
                       virtual_stages=2)
