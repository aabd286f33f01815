"""Pipeline schedules: the order of each stage's passes over micro-batches.

A schedule gives each stage of a clone, for its M micro-batches, the order
of its forward (F) and backward passes; `Stages` imposes it on the traced
step with control dependencies, so the executor cannot pick another. A
backward pass is one B (the gradients of the stage's inputs and weights
together), or, where the schedule splits it, a B (input gradients only:
what the stage before waits for) and a later W (weight gradients only).
With K stages:

  gpipe  (Huang et al. 2019): every forward pass, then every backward pass
         (the last micro-batch's first). Stage s holds M micro-batches'
         activations at once.
  1f1b   (PipeDream-Flush, Narayanan et al. 2021; DeepSpeed's
         TrainSchedule): min(K - s - 1, M) forward passes to fill the
         pipeline, then one forward and one backward in turn, then the
         remaining backward passes. Stage s holds at most min(K - s, M)
         micro-batches' activations.
  zb_h1  (ZB-H1, Qi et al., ICLR 2024, the handcrafted schedule of
         "Zero Bubble Pipeline Parallelism"): 1F1B's order with each
         backward pass split into B and W. Stage s's first min(s, M) W
         passes are deferred to the end of its step, where it would wait
         for the last micro-batch's B from the s stages after it; every
         other W follows its B at once. With K - s - 1 = w warm-up
         forwards: F x w; then [F, B] with W deferred (the first s), then
         [F, B, W] while forwards remain; [B, W] for the rest; the s
         deferred W last. When M < s, only M are deferred.
  interleaved_1f1b  (Narayanan et al. 2021; Megatron-LM's interleaved
         schedule, PyTorch's ScheduleInterleaved1F1B): the model cut into
         K x v chunks, chunk c on device c mod K, so each device runs v
         chunks. Device d runs its chunks' forward passes in groups of K
         micro-batches, chunk by chunk, and their backward passes the same
         way with the chunks reversed; (K - d - 1) x 2 + (v - 1) x K
         forward passes fill the pipeline, then one forward and one
         backward in turn. M must be a multiple of K; a short last batch
         whose micro-batches are not runs every forward pass first.

With F, B and W the seconds of one pass (B + W a fused backward pass),
GPipe and 1F1B leave each stage idle (K - 1)(F + B + W) seconds a step,
(K - 1) / (M + K - 1) of it; ZB-H1 leaves (K - 1)(F + B - W), a third of
that when F = B = W; interleaved 1F1B (K - 1)(F + B + W) / v, (K - 1) /
(v M) of the ideal step M(F + B + W) (`idle_theory`).
"""

from tfmulti import errors
from tfmulti.step_options import GPIPE
from tfmulti.step_options import INTERLEAVED_1F1B
from tfmulti.step_options import ONE_F_ONE_B  # noqa: F401
from tfmulti.step_options import PIPELINE_SCHEDULES as SCHEDULES
from tfmulti.step_options import ZB_H1

FORWARD, BACKWARD, WEIGHTS = 'F', 'B', 'W'


def splits_backward(schedule):
  """Whether `schedule` runs each backward pass as a B and a later W."""
  return schedule == ZB_H1


def passes(schedule, num_stages, num_microbatches):
  """Each stage's passes in order, for a schedule of one chunk a device
  (all but 'interleaved_1f1b'): a list (one a stage) of lists of
  (FORWARD, BACKWARD or WEIGHTS, micro-batch index)."""
  errors.check_choice('pipeline_schedule', schedule, SCHEDULES)
  if schedule == INTERLEAVED_1F1B:
    raise ValueError(f'{schedule} orders devices, not stages: see '
                     'device_orders.')
  m = num_microbatches
  order = []
  for s in range(num_stages):
    warmup = m if schedule == GPIPE else min(num_stages - s - 1, m)
    backwards = list(range(m))
    if schedule == GPIPE:
      backwards.reverse()
    deferred = min(s, m) if splits_backward(schedule) else 0
    stage = [(FORWARD, i) for i in range(warmup)]
    for n, i in enumerate(backwards):
      if warmup + n < m:  # One forward, one backward in turn.
        stage.append((FORWARD, warmup + n))
      stage.append((BACKWARD, i))
      if splits_backward(schedule) and n >= deferred:
        stage.append((WEIGHTS, i))
    stage += [(WEIGHTS, i) for i in backwards[:deferred]]
    order.append(stage)
  return order


def device_orders(schedule, num_devices, num_microbatches,
                  virtual_stages=1):
  """Each device's passes in order: a list (one a device) of lists of
  (stage, kind, micro-batch), stage c running on device c mod
  `num_devices`; with one chunk a device, `passes` with its stages."""
  if schedule != INTERLEAVED_1F1B:
    return [[(s, kind, m) for kind, m in stage] for s, stage in enumerate(
        passes(schedule, num_devices, num_microbatches))]
  k, m, v = num_devices, num_microbatches, virtual_stages
  groups = [range(start, min(start + k, m)) for start in range(0, m, k)]
  orders = []
  for d in range(k):
    forwards = [(c * k + d, FORWARD, i) for group in groups
                for c in range(v) for i in group]
    backwards = [(c * k + d, BACKWARD, i) for group in groups
                 for c in reversed(range(v)) for i in group]
    total = len(forwards)
    warmup = min(total, (k - d - 1) * 2 + (v - 1) * k) if m % k == 0 else (
        total)
    order = forwards[:warmup]
    for n in range(total - warmup):  # One forward, one backward in turn.
      order += [forwards[warmup + n], backwards[n]]
    orders.append(order + backwards[total - warmup:])
  return orders


def _needs(s, kind, m, num_stages):
  """The passes that (stage s, kind, micro-batch m) reads: F on s - 1 for
  F; F on s and B on s + 1 for B; B on s for W."""
  if kind == FORWARD:
    return [(s - 1, FORWARD, m)] if s else []
  if kind == WEIGHTS:
    return [(s, BACKWARD, m)]
  return [(s, FORWARD, m)] + (
      [(s + 1, BACKWARD, m)] if s + 1 < num_stages else [])


def build_order(per_device, num_stages):
  """The passes of every device (`device_orders`), (stage, kind,
  micro-batch), in an order that builds each after the passes it reads
  (`_needs`) and after its device's previous pass; raises `ValueError` for
  a schedule that deadlocks."""
  done, order = set(), []
  next_pass = [0] * len(per_device)
  total = sum(len(device) for device in per_device)
  while len(order) < total:
    progressed = False
    for d, device in enumerate(per_device):
      if next_pass[d] == len(device):
        continue
      this = device[next_pass[d]]
      if all(need in done for need in _needs(*this, num_stages)):
        done.add(this)
        order.append(this)
        next_pass[d] += 1
        progressed = True
    if not progressed:
      raise ValueError(f'the schedule {per_device} deadlocks.')
  return order


def peak_in_flight(stage_passes):
  """The most micro-batches whose forward pass has run and whose last
  backward pass (B, or W where it is split) has not, on one stage: how
  many micro-batches' activations it holds, wholly or for a pending W."""
  split = any(kind == WEIGHTS for kind, _ in stage_passes)
  last = WEIGHTS if split else BACKWARD
  held = peak = 0
  for kind, _ in stage_passes:
    held += 1 if kind == FORWARD else -1 if kind == last else 0
    peak = max(peak, held)
  return peak


def timeline(per_device, seconds, num_stages):
  """When each pass runs if each starts as soon as what it reads and its
  device's previous pass are done: {(stage, kind, m): (start, end)}, with
  `seconds` {kind: seconds of one stage's pass} (a fused B takes B + W; a
  chunk of v a device, 1 / v of it). The schedule's own clock, with no
  transfer time: the theory the emulated benchmark compares with."""
  split = any(kind == WEIGHTS for device in per_device
              for _, kind, _ in device)
  chunks = num_stages // len(per_device)
  duration = {kind: t / chunks for kind, t in seconds.items()}
  if not split:
    duration[BACKWARD] += duration[WEIGHTS]
  times, free = {}, [0.0] * len(per_device)
  for this in build_order(per_device, num_stages):
    d = this[0] % len(per_device)
    start = max([free[d]] + [times[need][1]
                             for need in _needs(*this, num_stages)])
    times[this] = (start, start + duration[this[1]])
    free[d] = start + duration[this[1]]
  return times


def idle_theory(schedule, num_devices, num_microbatches, seconds,
                virtual_stages=1):
  """Each device's idle share of the step (the first pass's start to the
  last pass's end) by `timeline`. With F, B, W the same on every stage:
  (K-1)(F+B+W) / (M(F+B+W) + (K-1)(F+B+W)) for GPipe and 1F1B; (K-1)(F+B-W)
  / (M(F+B+W) + (K-1)(F+B-W)) for ZB-H1 (Qi et al. 2024, section 2), for
  M >= K; for interleaved 1F1B an idle time of (K-1)/(v M) of the ideal
  step M(F+B+W) (Narayanan et al. 2021, section 2.2), for M a multiple of
  K."""
  per_device = device_orders(schedule, num_devices, num_microbatches,
                             virtual_stages)
  times = timeline(per_device, seconds, num_devices * virtual_stages)
  span = max(end for _, end in times.values())
  idle = []
  for d in range(num_devices):
    busy = sum(end - start for this, (start, end) in times.items()
               if this[0] % num_devices == d)
    idle.append(1 - busy / span)
  return idle
