"""ZB-H1: each backward pass split into B (input gradients) and W (weight
gradients), the W passes deferred into the bubble: its order, its theory,
its exactness, and, read from the traced step, that no gradient op runs
twice."""

import collections
import itertools

import keras
import numpy as np
import pytest

from tests.deploy.test_atoms import assert_bit_identical
from tests.deploy.test_atoms import train
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import mlp
from tests.pipeline.test_stages import _assert_same_steps
from tests.pipeline.test_stages import _pipelined
from tests.pipeline.test_stages import skip_mlp
from tfmulti import deploy
from tfmulti import models
from tfmulti.pipeline import schedules

ZB = schedules.ZB_H1


def test_the_order_is_the_papers():
  """K - s - 1 forwards; then 1F1B's [F, B] in turn, each W s micro-batches
  after its B (Qi et al.'s W "starting points" moved by the warm-up, as
  PyTorch's ZB1P lags them); the last s W passes end the step."""
  first, *_, last = schedules.passes(ZB, 4, 8)
  assert first == [('F', 0), ('F', 1), ('F', 2), ('F', 3)] + [
      pass_ for i in range(4) for pass_ in (
          ('B', i), ('W', i), ('F', 4 + i))] + [
              pass_ for i in range(4, 8) for pass_ in (('B', i), ('W', i))]
  assert last == [pass_ for i in range(3) for pass_ in (
      ('F', i), ('B', i))] + [pass_ for i in range(3, 8) for pass_ in (
          ('F', i), ('B', i), ('W', i - 3))] + [('W', 5), ('W', 6), ('W', 7)]
  # Fewer micro-batches than the lag: every W at the end.
  assert schedules.passes(ZB, 4, 2)[3] == [
      ('F', 0), ('B', 0), ('F', 1), ('B', 1), ('W', 0), ('W', 1)]


@pytest.mark.parametrize('k, m', list(itertools.product((2, 3, 4),
                                                        (1, 2, 4, 8))))
def test_every_pass_once_in_a_buildable_order(k, m):
  per_stage = schedules.passes(ZB, k, m)
  order = schedules.build_order(  # Raises on a deadlock.
      schedules.device_orders(ZB, k, m), k)
  assert len(order) == 3 * k * m
  for stage in per_stage:
    assert sorted(stage) == sorted(
        (kind, i) for kind in 'FBW' for i in range(m))
    assert stage.index(('B', 0)) < stage.index(('W', 0))
    # Its activations (whole, or kept for a pending W): K at most, as the
    # first stage of 1F1B.
    assert schedules.peak_in_flight(stage) == min(k, m)


def test_the_bubble_is_the_papers():
  """Qi et al. 2024: (K-1)(F+B+W) idle a stage under 1F1B, (K-1)(F+B-W)
  under ZB-H1; with F = B = W at K=4, M=8, 0.273 and 0.111 of the step."""
  equal = {'F': 1.0, 'B': 1.0, 'W': 1.0}
  one_f_one_b = schedules.idle_theory('1f1b', 4, 8, equal)
  zero_bubble = schedules.idle_theory(ZB, 4, 8, equal)
  np.testing.assert_allclose(one_f_one_b, [9 / 33] * 4)
  np.testing.assert_allclose(zero_bubble, [3 / 27] * 4)
  # Any F, B, W: (K-1)(F+B-W) seconds idle, the step M(F+B+W) longer.
  f, b, w = 1.0, 1.5, 0.75
  idle = schedules.idle_theory(ZB, 3, 6, {'F': f, 'B': b, 'W': w})
  want = 2 * (f + b - w)
  np.testing.assert_allclose(idle, [want / (6 * (f + b + w) + want)] * 3)


_QUICK = ((2, 2),)


@pytest.mark.parametrize('k, m', [
    pytest.param(k, m, marks=[] if (k, m) in _QUICK else [pytest.mark.slow])
    for k, m in itertools.product((2, 3, 4), (2, 4, 8))])
def test_zb_h1_equals_one_device(k, m):
  for recompute in (False, True):
    _assert_same_steps(_pipelined(k, m, pipeline_schedule=ZB,
                                  recompute=recompute), rows=8)


@pytest.mark.slow
def test_with_clones_shares_and_accumulation_equal_one_device():
  _assert_same_steps(
      _pipelined(2, 4, num_clones=2, pipeline_schedule=ZB,
                 clone_shares=(3, 1), accumulation_steps=2, recompute=True),
      rows=32)


def _bn_layout(schedule):
  return (dict(num_clones=2, num_stages=2),
          dict(num_microbatches=4, pipeline_schedule=schedule))


@pytest.mark.slow
def test_the_same_bits_as_1f1b_with_reproducible_rows():
  """A BatchNorm MLP with L2 (weights, slots, moving statistics)."""
  def batch(step):
    return make_batch(32, seed=step)

  def bn_mlp():
    return mlp(batch_norm=True)
  want = train(bn_mlp, _bn_layout('1f1b'), 3, batch)
  assert_bit_identical(train(bn_mlp, _bn_layout(ZB), 3, batch), want,
                       staged=True)


# --- No gradient op runs twice: counted from the traced step. ---

# The two halves of a layer's gradient, and the bias's: each must be
# reachable exactly as often under ZB-H1 as in the fused 1F1B step.
HALVES = ('Conv2DBackpropInput', 'Conv2DBackpropFilter', 'MatMul',
          'BiasAddGrad')


def reachable_gradient_ops(deployed, batch):
  """{device: [gradient ops]} of the ops the traced step's outputs (and
  stateful updates) need: what the runtime runs, as it prunes the rest."""
  graph = deployed.traced_step(*batch).graph
  seen, todo = set(), [t.op for t in graph.outputs] + list(
      graph.control_outputs)
  while todo:
    op = todo.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    todo += [t.op for t in op.inputs] + list(op.control_inputs)
  found = collections.defaultdict(list)
  for op in graph.get_operations():
    if op.name in seen and 'gradient_tape' in op.name:
      found[op.device].append(op)
  return found


def _traced(model_fn, shape, schedule, num_microbatches, boundaries):
  config = deploy.DeploymentConfig(clone_on_cpu=True, num_stages=2)
  deployed = make_deployed(config, model_fn,
                           num_microbatches=num_microbatches,
                           pipeline_schedule=schedule,
                           stage_boundaries=boundaries)
  rng = np.random.default_rng(0)
  batch = (rng.normal(size=(8, *shape)).astype(np.float32),
           rng.integers(0, 3, size=8).astype(np.int32))
  return deployed, reachable_gradient_ops(deployed, batch)


def lenet():
  keras.utils.set_random_seed(0)
  return models.get_model('lenet', input_shape=(28, 28, 1), num_classes=3)


def resnet20():
  keras.utils.set_random_seed(0)
  return models.get_model('resnet20', input_shape=(32, 32, 3),
                          num_classes=3)


# (model, input shape, the cut: None for the automatic one).
MODELS = {
    'lenet': (lenet, (28, 28, 1), None),
    'resnet20': (resnet20, (32, 32, 3), None),
    'skip_mlp': (skip_mlp, (6,), ('d2',)),  # Its skip crosses the cut.
}


@pytest.mark.parametrize('model_name', [
    'skip_mlp', pytest.param('lenet', marks=pytest.mark.slow),
    pytest.param('resnet20', marks=pytest.mark.slow)])
def test_each_half_of_each_gradient_runs_once(model_name):
  """Per stage device, the very gradient ops of the fused 1F1B step, each
  as often: the convolution, matmul and bias gradients (B the input
  halves, W the weight halves), and no activation's gradient, no shape,
  no scale built again for W."""
  model_fn, shape, boundaries = MODELS[model_name]
  m = 2
  _, fused = _traced(model_fn, shape, '1f1b', m, boundaries)
  _, split = _traced(model_fn, shape, ZB, m, boundaries)
  assert set(split) == set(fused) == {'/device:CPU:0', '/device:CPU:1'}
  for device in fused:
    want = collections.Counter(op.type for op in fused[device])
    got = collections.Counter(op.type for op in split[device])
    assert sum(want[t] for t in HALVES) > 0
    assert got == want, (device, got - want, want - got)
