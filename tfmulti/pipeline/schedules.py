"""Pipeline schedules: the order of each stage's passes over micro-batches.

A schedule gives each stage of a clone, for its M micro-batches, the order
of its forward (F) and backward passes; `Stages` imposes it on the traced
step with control dependencies, so the executor cannot pick another. A
backward pass is one B (the gradients of the stage's inputs and weights
together), or, where the schedule splits it, a B (input gradients only:
what the stage before waits for) and a later W (weight gradients only).
Each schedule is a small class (`Schedule`), chosen once by name (`get`),
as torch.distributed.pipelining makes each schedule a class over one
shared loop: a new schedule is a class here and its name in
`step_options.PIPELINE_SCHEDULES`, not a branch in the functions below.
With K stages: `GPipe`, `OneFOneB`, `ZBH1`, `Interleaved1F1B`, `ZBV`.

With F, B and W the seconds of one pass (B + W a fused backward pass),
GPipe and 1F1B leave each stage idle (K - 1)(F + B + W) seconds a step,
(K - 1) / (M + K - 1) of it; ZB-H1 leaves (K - 1)(F + B - W), a third of
that when F = B = W; interleaved 1F1B (K - 1)(F + B + W) / v, (K - 1) /
(v M) of the ideal step M(F + B + W); ZB-V, when F = B = W and M >= 2K - 1,
only the (K - 1) F / 2 before the last device's first pass (each chunk
half a stage), (K - 1) / (6M + K - 1) of the step (`idle_theory`).
"""

from tfmulti import errors
from tfmulti.step_options import GPIPE
from tfmulti.step_options import INTERLEAVED_1F1B
from tfmulti.step_options import ONE_F_ONE_B
from tfmulti.step_options import PIPELINE_SCHEDULES as SCHEDULES
from tfmulti.step_options import ZB_H1
from tfmulti.step_options import ZB_V

FORWARD, BACKWARD, WEIGHTS = 'F', 'B', 'W'


class Schedule:
  """A schedule of one chunk (stage) a device: each stage's forward passes
  to fill the pipeline (`warmup`), then one forward and one backward in
  turn, then the remaining backward passes, in `backward_order`; where
  `splits_backward`, each backward pass is a B and, `weights_lag(s)`
  micro-batches later, a W.

  Attributes:
    name: its `pipeline_schedule` name.
    splits_backward: whether it runs each backward pass as a B and a
      later W.
  """
  name = None
  splits_backward = False

  def chunks_per_device(self, virtual_stages=1):
    """The model's chunks each device runs."""
    del virtual_stages  # One a device.
    return 1

  def chunk_devices(self, num_devices, virtual_stages=1):
    """The device (an index among `num_devices`) of each chunk, in model
    order: chunk c on c mod K."""
    chunks = num_devices * self.chunks_per_device(virtual_stages)
    return [c % num_devices for c in range(chunks)]

  def warmup(self, stage, num_stages, num_microbatches):
    """Forward passes stage `stage` runs before its first backward one."""
    return min(num_stages - stage - 1, num_microbatches)

  def backward_order(self, num_microbatches):
    """The micro-batches in the order of their backward passes."""
    return list(range(num_microbatches))

  def weights_lag(self, stage):
    """How many B passes each W follows its own B by (`splits_backward`)."""
    del stage
    return None

  def passes(self, num_stages, num_microbatches):
    """Each stage's passes in order: a list (one a stage) of lists of
    (FORWARD, BACKWARD or WEIGHTS, micro-batch index)."""
    m = num_microbatches
    order = []
    for s in range(num_stages):
      warmup = self.warmup(s, num_stages, m)
      backwards = self.backward_order(m)
      lag = self.weights_lag(s)  # Of each W after its B.
      stage = [(FORWARD, i) for i in range(warmup)]
      for n, i in enumerate(backwards):
        if warmup + n < m:  # One forward, one backward in turn.
          stage.append((FORWARD, warmup + n))
        stage.append((BACKWARD, i))
        if lag is not None and n >= lag:
          stage.append((WEIGHTS, backwards[n - lag]))
      if lag is not None:
        stage += [(WEIGHTS, i) for i in backwards[max(0, m - lag):]]
      order.append(stage)
    return order

  def device_orders(self, num_devices, num_microbatches, virtual_stages=1):
    """Each device's passes in order: a list (one a device) of lists of
    (chunk, kind, micro-batch); here `passes`, a stage a device."""
    del virtual_stages  # One chunk a device.
    return [[(s, kind, m) for kind, m in stage] for s, stage in enumerate(
        self.passes(num_devices, num_microbatches))]


class GPipe(Schedule):
  """GPipe (Huang et al. 2019): every forward pass, then every backward
  pass, the last micro-batch's first. Stage s holds M micro-batches'
  activations at once."""
  name = GPIPE

  def warmup(self, stage, num_stages, num_microbatches):
    return num_microbatches

  def backward_order(self, num_microbatches):
    return list(reversed(range(num_microbatches)))


class OneFOneB(Schedule):
  """1F1B (PipeDream-Flush, Narayanan et al. 2021; DeepSpeed's
  TrainSchedule): min(K - s - 1, M) forward passes to fill the pipeline,
  then one forward and one backward in turn, then the remaining backward
  passes. Stage s holds at most min(K - s, M) micro-batches' activations."""
  name = ONE_F_ONE_B


class ZBH1(Schedule):
  """ZB-H1 (Qi et al., ICLR 2024, the handcrafted schedule of "Zero Bubble
  Pipeline Parallelism"; PyTorch's ZB1P): 1F1B's order with each backward
  pass split into B and W, stage s's W passes each s micro-batches late:
  W of micro-batch i follows B of i + s, and the last min(s, M) W passes
  end the step, where the stage would wait for the last B from the s
  stages after it. Every stage then holds K micro-batches at most (the
  paper's "same number of in-flight micro-batches"), s of them only for
  W: what W reads (`Split`), not the whole forward pass."""
  name = ZB_H1
  splits_backward = True

  def weights_lag(self, stage):
    return stage


class _ByDevice(Schedule):
  """A schedule of several chunks a device: it orders devices, not
  stages (`device_orders`)."""

  def passes(self, num_stages, num_microbatches):
    raise ValueError(f'{self.name} orders devices, not stages: see '
                     'device_orders.')


class Interleaved1F1B(_ByDevice):
  """Interleaved 1F1B (Narayanan et al. 2021; Megatron-LM's interleaved
  schedule, PyTorch's ScheduleInterleaved1F1B): the model cut into K x v
  chunks, chunk c on device c mod K, so each device runs v chunks. Device
  d runs its chunks' forward passes in groups of K micro-batches, chunk by
  chunk, and their backward passes the same way with the chunks reversed;
  (K - d - 1) x 2 + (v - 1) x K forward passes fill the pipeline, then one
  forward and one backward in turn. M must be a multiple of K; a short
  last batch whose micro-batches are not runs every forward pass first."""
  name = INTERLEAVED_1F1B

  def chunks_per_device(self, virtual_stages=1):
    return virtual_stages

  def device_orders(self, num_devices, num_microbatches, virtual_stages=1):
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


class ZBV(_ByDevice):
  """ZB-V (Qi et al. 2024, section 6; PyTorch's ScheduleZBVZeroBubble): the
  model cut into 2K chunks in a V, chunks d and 2K - 1 - d on device d (the
  last device runs the two middle chunks, so the first chunk's device also
  runs the last, and the loss). Device d: 2(K - d) - 1 forward passes of
  its first chunk; d pairs (forward of its second chunk, forward of its
  first); K - d triples (F, B, W) of its second chunk; then, while forward
  passes remain, F (while its first chunk has any), B and W of its first
  chunk, and F, B and W of its second; then d pairs of B (first chunk,
  second chunk), K - d pairs (B, W) of its first chunk, and the W passes
  left, the second chunk's first. The order is cut for 2K - 1
  micro-batches or more; with fewer, the passes of the micro-batches that
  do not exist are left out."""
  name = ZB_V
  splits_backward = True

  def chunks_per_device(self, virtual_stages=1):
    del virtual_stages  # Two, in a V.
    return 2

  def chunk_devices(self, num_devices, virtual_stages=1):
    chunks = 2 * num_devices
    return [min(c, chunks - 1 - c) for c in range(chunks)]

  def device_orders(self, num_devices, num_microbatches, virtual_stages=1):
    return [_zb_v(num_devices, num_microbatches, d)
            for d in range(num_devices)]


_BY_NAME = {cls.name: cls() for cls in (GPipe, OneFOneB, ZBH1,
                                        Interleaved1F1B, ZBV)}
assert set(_BY_NAME) == set(SCHEDULES), 'a schedule without its class'


def get(name):
  """The `Schedule` named `name`; raises `ConfigError` for other names."""
  errors.check_choice('pipeline_schedule', name, SCHEDULES)
  return _BY_NAME[name]


def splits_backward(schedule):
  """Whether `schedule` runs each backward pass as a B and a later W."""
  return get(schedule).splits_backward


def chunks_per_device(schedule, virtual_stages=1):
  """The model's chunks each device runs under `schedule`: v under
  interleaved 1F1B, 2 under ZB-V, else 1 (a stage a device)."""
  return get(schedule).chunks_per_device(virtual_stages)


def chunk_devices(schedule, num_devices, virtual_stages=1):
  """The device (an index among `num_devices`) of each chunk of the model,
  in model order: chunk c on c mod K (interleaved 1F1B: one chunk in each
  K consecutive), or, under ZB-V, in a V: c, then 2K - 1 - c."""
  return get(schedule).chunk_devices(num_devices, virtual_stages)


def passes(schedule, num_stages, num_microbatches):
  """Each stage's passes in order, for a schedule of one chunk a device
  (all but 'interleaved_1f1b' and 'zb_v'): a list (one a stage) of lists
  of (FORWARD, BACKWARD or WEIGHTS, micro-batch index)."""
  return get(schedule).passes(num_stages, num_microbatches)


def device_orders(schedule, num_devices, num_microbatches,
                  virtual_stages=1):
  """Each device's passes in order: a list (one a device) of lists of
  (chunk, kind, micro-batch), chunk c on its `chunk_devices` device; with
  one chunk a device, `passes` with its stages."""
  return get(schedule).device_orders(num_devices, num_microbatches,
                                     virtual_stages)


def _zb_v(k, m, d):
  """Device d's passes under ZB-V (see the module): its chunks d (first)
  and 2k - 1 - d (second), cut for max(m, 2k - 1) micro-batches."""
  first, second = d, 2 * k - 1 - d
  count = max(m, 2 * k - 1)
  made = {(c, kind): 0 for c in (first, second) for kind in 'FBW'}

  def run(chunk, *kinds):
    these = []
    for kind in kinds:
      these.append((chunk, kind, made[chunk, kind]))
      made[chunk, kind] += 1
    return these

  order = run(first, *[FORWARD] * (2 * (k - d) - 1))
  for _ in range(d):
    order += run(second, FORWARD) + run(first, FORWARD)
  for _ in range(k - d):
    order += run(second, FORWARD, BACKWARD, WEIGHTS)
  while made[first, FORWARD] < count or (
      made[second, FORWARD] < made[first, FORWARD]):
    if made[first, FORWARD] < count:
      order += run(first, FORWARD)
    order += run(first, BACKWARD, WEIGHTS)
    order += run(second, FORWARD, BACKWARD, WEIGHTS)
  for _ in range(d):
    order += run(first, BACKWARD) + run(second, BACKWARD)
  for _ in range(k - d):
    order += run(first, BACKWARD, WEIGHTS)
  for chunk in (second, first):
    order += run(chunk, *[WEIGHTS] * (made[chunk, BACKWARD] -
                                      made[chunk, WEIGHTS]))
  return [this for this in order if this[2] < m]


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


def devices_of(per_device):
  """{chunk: the device (index) whose order runs it}."""
  return {c: d for d, device in enumerate(per_device) for c, _, _ in device}


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
  device_of = devices_of(per_device)
  times, free = {}, [0.0] * len(per_device)
  for this in build_order(per_device, num_stages):
    d = device_of[this[0]]
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
  K; for ZB-V (K-1) / (6M+K-1) of the step when F = B = W and M >= 2K-1
  (the half-stage forward passes before the last device starts)."""
  per_device = device_orders(schedule, num_devices, num_microbatches,
                             virtual_stages)
  device_of = devices_of(per_device)
  times = timeline(per_device, seconds, len(device_of))
  span = max(end for _, end in times.values())
  idle = []
  for d in range(num_devices):
    busy = sum(end - start for this, (start, end) in times.items()
               if device_of[this[0]] == d)
    idle.append(1 - busy / span)
  return idle
