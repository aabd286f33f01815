"""`--clone_shares=auto`: the balancing rule, re-balancing, bounded retraces."""

import numpy as np
import pytest

from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import weights
from tfmulti import deploy
from tfmulti import errors
from tfmulti.deploy import balance


def test_shares_follow_throughputs_within_rounding():
  assert balance.shares_for([300.0, 100.0]) == (12, 4)  # 3:1 exactly.
  assert balance.shares_for([1.0, 1.0]) == (8, 8)
  assert balance.shares_for([2.0, 1.0]) == (11, 5)  # 10.67 : 5.33.
  assert balance.shares_for([1.0, 1.0, 2.0]) == (4, 4, 8)
  # A clone 1000x slower still keeps one bucket.
  assert balance.shares_for([1.0, 1000.0]) == (1, 15)
  assert sum(balance.shares_for([5.0, 3.0, 0.1])) == balance.BUCKETS


def test_predicted_step_is_the_slowest_clone():
  assert balance.predicted_step_seconds([6, 2], [300.0, 100.0]) == 0.02
  assert balance.predicted_step_seconds([4, 4], [300.0, 100.0]) == 0.04


class _Timings:
  """Injected throughputs: 3:1, then clone 0 slows to a third of clone 1."""

  def __init__(self, slow_down_after):
    self.calls = 0
    self.slow_down_after = slow_down_after

  def __call__(self, images, labels):
    del images, labels
    self.calls += 1
    return [300.0, 100.0] if self.calls <= self.slow_down_after else [
        100.0, 300.0]


def test_noise_on_equal_devices_keeps_the_split():
  # 930:1070 alone would give 7/9, whose step is only 2% faster.
  assert balance.shares_for([930.0, 1070.0]) == (7, 9)
  timings = iter([[1000.0, 1000.0], [930.0, 1070.0], [1070.0, 930.0]])
  balanced, policy = _balanced(lambda x, y: next(timings), every_steps=1)
  for step in range(3):
    balanced.train_step(*make_batch(16, seed=step))
  # 8/8 stays: 9/7 or 7/9 would predict a step less than 5% faster.
  assert [shares for _, shares, _ in policy.history] == [(8, 8)] * 3
  assert balanced.trace_count == 1


def _balanced(measure, every_steps):
  """(towers, their shares policy) measuring with `measure`."""
  policy = balance.Balancer(every_steps, measure=measure)
  towers = make_deployed(deploy.DeploymentConfig(num_clones=2,
                                                 clone_on_cpu=True),
                         shares=policy)
  return towers, policy


def test_rebalances_at_the_next_measurement_after_a_slowdown():
  balanced, policy = _balanced(_Timings(slow_down_after=1), every_steps=3)
  for step in range(7):
    balanced.train_step(*make_batch(16, seed=step))
  assert [(step, shares) for step, shares, _ in policy.history] == [
      (0, (12, 4)), (3, (4, 12)), (6, (4, 12))]


def test_a_new_split_retraces_once_and_stays_exact():
  timings = iter([[300.0, 100.0], [100.0, 300.0]] * 4)
  balanced, _ = _balanced(lambda x, y: next(timings), every_steps=1)
  reference = make_deployed(deploy.DeploymentConfig(clone_on_cpu=True))
  for step in range(8):
    images, labels = make_batch(16, seed=step)
    np.testing.assert_allclose(balanced.train_step(images, labels),
                               reference.train_step(images, labels),
                               atol=1e-5)
  # Eight re-balances over two distinct splits: two traces.
  assert balanced.trace_count == 2
  for got, want in zip(weights(balanced.model), weights(reference.model)):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_clone_throughputs_are_measured_on_every_clone():
  towers = make_deployed(deploy.DeploymentConfig(num_clones=2,
                                                 clone_on_cpu=True))
  speeds = towers.throughputs(*make_batch(8))
  assert len(speeds) == 2 and all(s > 0 for s in speeds)
  assert towers.trace_count == 0  # Measuring never traces the step.


def test_bad_rebalance_interval():
  with pytest.raises(errors.ConfigError, match='rebalance_every_steps=0'):
    deploy.StepOptions(clone_shares='auto', rebalance_every_steps=0)
