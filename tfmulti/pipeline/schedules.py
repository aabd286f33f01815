"""Pipeline schedules: the order of each stage's passes over micro-batches.

A schedule gives each stage of a clone, for its M micro-batches, the order
of its forward (F) and backward (B) passes; `Stages` imposes it on the
traced step with control dependencies, so the executor cannot pick
another. With K stages:

  gpipe  (Huang et al. 2019): every forward pass, then every backward pass
         (the last micro-batch's first). Stage s holds M micro-batches'
         activations at once.
  1f1b   (PipeDream-Flush, Narayanan et al. 2021; DeepSpeed's
         TrainSchedule): min(K - s - 1, M) forward passes to fill the
         pipeline, then one forward and one backward in turn, then the
         remaining backward passes. Stage s holds at most min(K - s, M)
         micro-batches' activations.

Both leave each stage idle (K - 1) / (M + K - 1) of a step when the stages
take equal time; 1F1B needs less memory for activations.
"""

from tfmulti import errors
from tfmulti.step_options import GPIPE  # noqa: F401
from tfmulti.step_options import ONE_F_ONE_B  # noqa: F401
from tfmulti.step_options import PIPELINE_SCHEDULES as SCHEDULES

FORWARD, BACKWARD = 'F', 'B'


def passes(schedule, num_stages, num_microbatches):
  """Each stage's passes in order: a list (one a stage) of lists of
  (FORWARD or BACKWARD, micro-batch index)."""
  errors.check_choice('pipeline_schedule', schedule, SCHEDULES)
  m = num_microbatches
  order = []
  for s in range(num_stages):
    if schedule == GPIPE:
      warmup = m
    else:
      warmup = min(num_stages - s - 1, m)
    stage = [(FORWARD, i) for i in range(warmup)]
    for i in range(m - warmup):  # One forward, one backward in turn.
      stage += [(FORWARD, warmup + i), (BACKWARD, i)]
    backward_first = m - warmup
    rest = range(backward_first, m)
    if schedule == GPIPE:
      rest = reversed(rest)
    stage += [(BACKWARD, i) for i in rest]
    order.append(stage)
  return order


def build_order(per_stage):
  """The passes of every stage, (stage, kind, micro-batch), in an order
  that builds each after the passes it reads (F on stage s after F on
  s - 1; B on s after B on s + 1 and F on s) and after its stage's
  previous pass; raises `ValueError` for a schedule that deadlocks."""
  num_stages = len(per_stage)
  done, order = set(), []
  next_pass = [0] * num_stages
  total = sum(len(stage) for stage in per_stage)
  while len(order) < total:
    progressed = False
    for s in range(num_stages):
      if next_pass[s] == len(per_stage[s]):
        continue
      kind, m = per_stage[s][next_pass[s]]
      if kind == FORWARD:
        needs = [(s - 1, FORWARD, m)] if s else []
      else:
        needs = [(s, FORWARD, m)] + (
            [(s + 1, BACKWARD, m)] if s + 1 < num_stages else [])
      if all(need in done for need in needs):
        done.add((s, kind, m))
        order.append((s, kind, m))
        next_pass[s] += 1
        progressed = True
    if not progressed:
      raise ValueError(f'the schedule {per_stage} deadlocks.')
  return order


def peak_in_flight(stage_passes):
  """The most micro-batches whose forward pass has run and backward pass
  not yet, on one stage: how many micro-batches' activations it holds."""
  held = peak = 0
  for kind, _ in stage_passes:
    held += 1 if kind == FORWARD else -1
    peak = max(peak, held)
  return peak
