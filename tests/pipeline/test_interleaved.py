"""Interleaved 1F1B: v chunks of the model on each stage device, chunk c on
device c mod K, in Megatron's order: the order, its theory, the chunks'
devices and the order read from the traced step, exactness, refusals."""

import itertools
import re

import keras
import numpy as np
import pytest

from tests.helpers import assert_same_steps
from tests.helpers import L2
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.pipeline.test_schedules import _PASS
from tests.pipeline.test_schedules import _pass_of
from tfmulti import deploy
from tfmulti import errors
from tfmulti.pipeline import schedules

INTERLEAVED = schedules.INTERLEAVED_1F1B


def deep_mlp(seed=0):
  """Twelve Dense layers with L2, a skip from the second to the eleventh
  (across every cut): enough layers for 4 stages of 3 chunks."""
  keras.utils.set_random_seed(seed)
  inputs = x = keras.Input((6,))
  taps = []
  for i in range(11):
    x = keras.layers.Dense(8, activation='tanh', name=f'd{i}',
                           kernel_regularizer=keras.regularizers.L2(L2))(x)
    taps.append(x)
  x = keras.layers.Add(name='skip')([taps[1], x])
  return keras.Model(inputs, keras.layers.Dense(3, name='out')(x))


def _interleaved(num_stages, virtual_stages, num_microbatches, num_clones=1,
                 **kwargs):
  config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True,
                                   num_stages=num_stages)
  return make_deployed(config, deep_mlp, summarize_gradients=True,
                       num_microbatches=num_microbatches,
                       pipeline_schedule=INTERLEAVED,
                       virtual_stages=virtual_stages, **kwargs)


def _assert_equals_one_device(deployed, rows=8, steps=2):
  reference = make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                            deep_mlp, summarize_gradients=True)
  assert_same_steps(deployed, reference, rows, steps)


def test_the_order_is_megatrons():
  """K=2, v=2, M=4: device 0 fills with (K-1) x 2 + (v-1) x K = 4 forward
  passes, chunk by chunk in groups of K micro-batches; chunk c on device
  c mod 2; backward passes with the chunks reversed."""
  first, second = schedules.device_orders(INTERLEAVED, 2, 4, 2)
  f = lambda c, m: (c, 'F', m)  # noqa: E731
  b = lambda c, m: (c, 'B', m)  # noqa: E731
  assert first == [f(0, 0), f(0, 1), f(2, 0), f(2, 1),
                   f(0, 2), b(2, 0), f(0, 3), b(2, 1),
                   f(2, 2), b(0, 0), f(2, 3), b(0, 1),
                   b(2, 2), b(2, 3), b(0, 2), b(0, 3)]
  assert second[:5] == [f(1, 0), f(1, 1),  # 2 to fill it.
                        f(3, 0), b(3, 0), f(3, 1)]


@pytest.mark.parametrize('k, v', list(itertools.product((2, 3, 4), (2, 3))))
def test_every_pass_once_and_the_papers_bubble(k, v):
  """(K - 1) / (v M) of the ideal step idle (Narayanan et al. 2021), for
  M a multiple of K; a short batch whose micro-batches are not one still
  runs (every forward pass first)."""
  equal = {'F': 1.0, 'B': 1.0, 'W': 1.0}
  for m in (k, 2 * k, 3 * k, k + 1):
    per_device = schedules.device_orders(INTERLEAVED, k, m, v)
    order = schedules.build_order(per_device, k * v)  # Raises: deadlock.
    assert sorted(order) == sorted(
        (c, kind, i) for c in range(k * v) for kind in 'FB'
        for i in range(m))
    for d, device in enumerate(per_device):
      assert {c % k for c, _, _ in device} == {d}
    if m % k:
      continue
    times = schedules.timeline(per_device, equal, k * v)
    span = max(end for _, end in times.values())
    ideal = 3 * m
    np.testing.assert_allclose((span - ideal) / ideal, (k - 1) / (v * m))


def _device_orders_in(graph, num_devices, device_of=None):
  """Each device's passes (chunk, kind, micro-batch) in the order the
  traced graph imposes, read from the gates' control inputs; chunk c on
  device `device_of[c]` (default: c mod `num_devices`)."""
  device_of = device_of or [c % num_devices for c in range(64)]
  previous = {}
  for op in graph.get_operations():
    if re.search(r'/pass_gate(_\d+)?$', op.name):
      this = _pass_of(op.name)
      before = {_pass_of(c.name) for c in op.control_inputs}
      if not before:  # The previous pass made the gate's very input.
        before = {p for p in (_pass_of(t.op.name) for t in op.inputs
                              if _PASS.search(t.op.name))
                  if device_of[p[0]] == device_of[this[0]]}
      assert len(before) <= 1, (op.name, before)
      assert all(device_of[p[0]] == device_of[this[0]]
                 for p in before)  # The same device, another chunk maybe.
      previous.setdefault(this, set()).update(before)
  chains = []
  for d in range(num_devices):
    after = {next(iter(b), None): this for this, b in previous.items()
             if device_of[this[0]] == d}
    chain, current = [], None
    while current in after:
      current = after[current]
      chain.append(current)
    chains.append(chain)
  return chains


@pytest.mark.slow
def test_each_device_runs_its_chunks_in_the_order():
  deployed = _interleaved(2, 2, 4)
  graph = deployed.traced_step(*make_batch(8)).graph
  assert _device_orders_in(graph, 2) == schedules.device_orders(
      INTERLEAVED, 2, 4, 2)
  # Chunk c's layers on device c mod 2: d0-d2 chunk 0, d3-d5 chunk 1, ...
  for op in graph.get_operations():
    found = re.search(r'microbatch_\d+/stage_(\d+)/d\d+', op.name)
    if found and not op.name.startswith('gradient_tape/'):
      assert op.device.endswith(f'CPU:{int(found.group(1)) % 2}'), op.name


@pytest.mark.slow
@pytest.mark.parametrize('k, v, m', [
    (2, 2, 2), (2, 2, 4), (2, 3, 4), (3, 2, 3), (3, 2, 6), (4, 2, 4),
    (4, 3, 8)])
def test_interleaved_equals_one_device(k, v, m):
  for recompute in (False, True):
    deployed = _interleaved(k, v, m, recompute=recompute)
    assert len(deployed.stages.stages) == k * v
    _assert_equals_one_device(deployed, rows=2 * m)


@pytest.mark.slow
def test_with_clones_shares_and_accumulation_equal_one_device():
  _assert_equals_one_device(
      _interleaved(2, 2, 4, num_clones=2, clone_shares=(3, 1),
                   accumulation_steps=2, recompute=True), rows=32)


@pytest.mark.parametrize('options, message', [
    (dict(virtual_stages=2),
     "virtual_stages=2 gives each device several chunks of the model, which "
     "only pipeline_schedule='interleaved_1f1b' runs"),
    (dict(pipeline_schedule=INTERLEAVED),
     'virtual_stages=1 makes one .* set virtual_stages=2 or more'),
])
def test_options_that_cannot_interleave_are_one_line(options, message):
  with pytest.raises(errors.ConfigError, match=message) as raised:
    deploy.StepOptions(num_microbatches=4, **options)
  assert '\n' not in str(raised.value) and len(str(raised.value)) < 300


def test_micro_batches_not_a_multiple_of_the_stages_are_refused():
  with pytest.raises(errors.ConfigError,
                     match='num_microbatches=3: .* use num_microbatches=2'):
    _interleaved(2, 2, 3)


def test_more_chunks_than_layers_are_refused():
  with pytest.raises(errors.ConfigError,
                     match='virtual_stages=4: 4 stages of 4 chunks cut .* 16 '
                     'chunks, and it has 13 layers'):
    _interleaved(4, 4, 4)


def test_stage_boundaries_name_every_chunk_but_the_first():
  deployed = _interleaved(2, 2, 2, stage_boundaries=('d3', 'd6', 'd9'))
  assert [s.first_layer for s in deployed.stages.stages] == [
      'd0', 'd3', 'd6', 'd9']
  with pytest.raises(errors.ConfigError,
                     match=r'name the first layer of stages 1\.\.3 \(3 '):
    _interleaved(2, 2, 2, stage_boundaries=('d3',))
