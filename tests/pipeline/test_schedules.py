"""Pipeline schedules: their orders, imposed on the traced step, exact."""

import itertools
import re

import pytest

from tests.helpers import make_batch
from tests.pipeline.test_stages import _assert_same_steps
from tests.pipeline.test_stages import _pipelined
from tfmulti import errors
from tfmulti.pipeline import schedules

STAGES = (2, 3, 4)
MICROBATCHES = (1, 2, 4, 8)


def test_the_orders_are_the_papers():
  assert schedules.passes('gpipe', 2, 4) == [
      [('F', 0), ('F', 1), ('F', 2), ('F', 3),
       ('B', 3), ('B', 2), ('B', 1), ('B', 0)]] * 2
  assert schedules.passes('1f1b', 2, 4) == [
      [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('F', 3), ('B', 2),
       ('B', 3)],
      [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2), ('F', 3),
       ('B', 3)]]


@pytest.mark.parametrize('k, m', list(itertools.product(STAGES, MICROBATCHES)))
def test_activations_held_per_stage(k, m):
  """GPipe's stage s holds M micro-batches; 1F1B's min(K - s, M)."""
  for schedule in (schedules.GPIPE, schedules.ONE_F_ONE_B):
    per_stage = schedules.passes(schedule, k, m)
    order = schedules.build_order(  # Raises on a deadlock.
        schedules.device_orders(schedule, k, m), k)
    assert len(order) == 2 * k * m
    for s, stage in enumerate(per_stage):
      assert sorted(stage) == sorted(
          (kind, i) for kind in 'FB' for i in range(m))
      want = m if schedule == 'gpipe' else min(k - s, m)
      assert schedules.peak_in_flight(stage) == want


def test_an_unknown_schedule_is_refused():
  with pytest.raises(errors.ConfigError,
                     match="pipeline_schedule='zb': choose one of"):
    schedules.passes('zb', 2, 2)


_PASS = re.compile(r'microbatch_(\d+)/stage_(\d+)(_backward|_weights)?/')


def _pass_of(op_name):
  """(stage, kind, micro-batch) of the pass that made the op `op_name`."""
  m, s, suffix = _PASS.search(op_name).groups()
  kind = {'_backward': 'B', '_weights': 'W'}.get(suffix, 'F')
  if kind == 'F' and op_name.startswith('gradient_tape/'):
    kind = 'B'
  return int(s), kind, int(m)


def stage_orders(graph):
  """Each stage's passes in the order the traced graph imposes, read from
  the gates: a pass's gates wait (control inputs) on the ops that ended
  its stage's previous pass."""
  previous = {}
  for op in graph.get_operations():
    if not re.search(r'/pass_gate(_\d+)?$', op.name):
      continue
    this = _pass_of(op.name)
    before = {_pass_of(c.name) for c in op.control_inputs}
    assert len(before) <= 1, (op.name, before)
    assert all(b[0] == this[0] for b in before)  # The same stage.
    previous.setdefault(this, set()).update(before)
  orders = {}
  for (s, kind, m), before in previous.items():
    orders.setdefault(s, {})[next(iter(before), None)] = (s, kind, m)
  result = []
  for s in sorted(orders):
    chain, current = [], None
    while current in orders[s] or (current is None and None in orders[s]):
      current = orders[s][current]
      chain.append(current[1:])
    result.append(chain)
  return result


@pytest.mark.parametrize('schedule, recompute', [
    (schedule, recompute) if recompute is False or schedule ==
    schedules.ZB_H1 else pytest.param(schedule, recompute,
                                      marks=pytest.mark.slow)
    for recompute in (False, True)
    for schedule in (schedules.ONE_F_ONE_B, schedules.GPIPE,
                     schedules.ZB_H1)])
def test_each_stage_runs_the_schedules_order(schedule, recompute):
  deployed = _pipelined(3, 4, pipeline_schedule=schedule, recompute=recompute)
  graph = deployed.traced_step(*make_batch(8)).graph
  assert stage_orders(graph) == schedules.passes(schedule, 3, 4)


@pytest.mark.parametrize('k, m', [
    pytest.param(k, m, marks=[] if (k, m) == (4, 2) else [pytest.mark.slow])
    for k, m in itertools.product(STAGES, MICROBATCHES)])
def test_gpipe_equals_one_device(k, m):
  """1F1B (the default) is checked for these by test_stages.py."""
  for recompute in (False, True):
    _assert_same_steps(_pipelined(k, m, pipeline_schedule='gpipe',
                                  recompute=recompute), rows=8)


@pytest.mark.slow
@pytest.mark.parametrize('schedule', [schedules.GPIPE, schedules.ONE_F_ONE_B])
def test_with_clones_shares_and_accumulation_equal_one_device(schedule):
  _assert_same_steps(
      _pipelined(2, 4, num_clones=2, pipeline_schedule=schedule,
                 clone_shares=(3, 1), accumulation_steps=2, recompute=True),
      rows=32)
