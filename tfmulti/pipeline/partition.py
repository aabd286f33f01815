"""Where to cut a model into stages: per-layer costs and the optimal split.

A pipeline step takes as long as its slowest stage, so the stages should
cost the same. `partition` finds the contiguous split of a list of layer
costs into K stages that minimises the slowest stage's time, where stage
s's time is its cost divided by its device's speed factor: the optimal
split, by dynamic programming (O(K n^2) for n layers).
`tfmulti.pipeline.costs` estimates or measures the layers' costs.
"""

import math

from tfmulti import errors


def check_speeds(speeds, num_stages):
  """Raises `ConfigError` unless `speeds` has one factor a stage (each is
  positive: `StepOptions` checks that)."""
  if speeds is None:
    return
  if len(speeds) != num_stages:
    raise errors.ConfigError(
        f'stage_speeds={",".join(map(str, speeds))}: give one factor per '
        f'stage ({num_stages}), e.g. {",".join(["1"] * num_stages)}.')


def partition(costs, num_stages, speeds=None):
  """The contiguous split of `costs` into `num_stages` non-empty stages
  whose slowest stage is as fast as it can be.

  Args:
    costs: a non-negative cost per layer, in model order.
    num_stages: how many stages.
    speeds: a speed factor per stage's device (stage s takes
      sum(costs of s) / speeds[s]); None for equal devices.

  Returns:
    The index of each stage's first layer: [0, b_1, ..., b_{K-1}].

  Raises:
    errors.ConfigError: more stages than layers, or bad speeds.
  """
  n = len(costs)
  if num_stages > n:
    raise errors.ConfigError(
        f'num_stages={num_stages}: the model has {n} layers to cut; use '
        f'num_stages={n} or fewer.')
  check_speeds(speeds, num_stages)
  speeds = speeds or [1.0] * num_stages
  prefix = [0.0]
  for cost in costs:
    prefix.append(prefix[-1] + cost)
  # best[s][i]: the slowest stage's time when layers [0, i) fill stages
  # [0, s); first[s][i]: where stage s-1 starts in that best split.
  best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
  first = [[0] * (n + 1) for _ in range(num_stages + 1)]
  best[0][0] = 0.0
  for s in range(1, num_stages + 1):
    for i in range(s, n - (num_stages - s) + 1):
      for j in range(s - 1, i):  # Stage s-1 is layers [j, i).
        time = max(best[s - 1][j], (prefix[i] - prefix[j]) / speeds[s - 1])
        if time < best[s][i]:
          best[s][i], first[s][i] = time, j
  starts, end = [], n
  for s in range(num_stages, 0, -1):
    end = first[s][end]
    starts.append(end)
  return starts[::-1]


def stage_times(costs, starts, speeds=None):
  """Each stage's time under the split `starts` (see `partition`)."""
  speeds = speeds or [1.0] * len(starts)
  ends = list(starts[1:]) + [len(costs)]
  return [sum(costs[a:b]) / speed
          for a, b, speed in zip(starts, ends, speeds)]
