"""What a step costs, read alike under both doors: time, rows, memory, MFU.

A `Meter` turns the seconds some steps took into a `Reading`: the step's
time, examples (and tokens, where the input is tokens) a second, each
device's memory in use and at its peak, and the model FLOPs utilization
(MFU: the step's FLOPs a second over the compute devices' peak rate).
The command line logs it on every progress line and writes it to
TensorBoard; `fit` puts it in its logs, its progress bar and its History.

* FLOPs are the model's (PaLM's MFU): three times the forward pass's
  matmuls, convolutions and einsums (the pass, and the backward pass's
  input and weight gradients), counted from their shapes in the step's
  first trace, on each compute device; recomputation, elementwise ops
  and the update are left out.
* The peak rate is the device's for the step's compute dtype
  (`device_kinds`): a GPU's own name tells its kind; a CPU's, or a GPU not
  in the table, needs `--device_peak_flops`. Without one, no MFU.
* Memory is the runtime's (`get_memory_info`) where it has a figure a
  device (a GPU). Logical CPUs share the process's memory: it is reported
  once ('process': resident now and at most, of the host's), and each
  device's figure is the plan's (its step tensors at their peak,
  `plan.peaks`, labelled planned).
"""

import collections
import dataclasses
import math
import os
import resource
import sys
from typing import Optional

import tensorflow as tf

from tfmulti import device_kinds
from tfmulti import devices
from tfmulti import keras_internals
from tfmulti.pipeline import stages
from tfmulti.plan import dry_run
from tfmulti.plan import peaks

GIB = device_kinds.GIB
_size = device_kinds.size_text
PROCESS = 'process'
_PAGE = os.sysconf('SC_PAGE_SIZE')


@dataclasses.dataclass(frozen=True)
class Memory:
  """One device's memory: bytes in use and at peak (None: not known), of
  `total` bytes (None: not known); `planned`: the plan's figure, not the
  runtime's."""
  device: str
  in_use: Optional[int]
  peak: int
  total: Optional[int] = None
  planned: bool = False

  @property
  def name(self):
    """The device's short name ('GPU:0'; a worker's '/job:worker/...')."""
    return self.device.replace('/device:', '').strip('/')

  def text(self):
    if self.planned:
      return f'{self.name} {_size(self.peak)} planned peak'
    share = f' ({self.peak / self.total:.1%})' if self.total else ''
    return (f'{self.name} {_size(self.in_use)} in use, {_size(self.peak)} '
            f'peak{share}')


@dataclasses.dataclass(frozen=True)
class Reading:
  """Some steps' figures (see the module); None: not known here."""
  step_time: float
  examples_per_sec: float
  tokens_per_sec: Optional[float]
  mfu: Optional[float]
  memory: tuple

  def text(self):
    parts = [f'{self.step_time:.3f} s/step',
             f'{self.examples_per_sec:,.0f} examples/s']
    if self.tokens_per_sec is not None:
      parts.append(f'{self.tokens_per_sec:,.0f} tokens/s')
    if self.mfu is not None:
      parts.append(f'MFU {self.mfu:.2%}')
    return ', '.join(parts) + ' | memory ' + ', '.join(
        m.text() for m in self.memory)

  def scalars(self):
    """{TensorBoard tag: value}."""
    values = {'step_time': self.step_time,
              'examples_per_sec': self.examples_per_sec}
    if self.tokens_per_sec is not None:
      values['tokens_per_sec'] = self.tokens_per_sec
    if self.mfu is not None:
      values['mfu'] = self.mfu
    for m in self.memory:
      if m.planned:
        values[f'memory/{m.name}/planned_peak_gib'] = m.peak / GIB
      else:
        values[f'memory/{m.name}/in_use_gib'] = m.in_use / GIB
        values[f'memory/{m.name}/peak_gib'] = m.peak / GIB
    return {k: float(v) for k, v in values.items()}

  def logs(self):
    """{`fit` log key: value}: the scalars, memory as the most any
    device reports (the runtime's, else the plan's)."""
    values = {k: v for k, v in self.scalars().items()
              if not k.startswith('memory/')}
    measured = [m for m in self.memory if not m.planned]
    if measured:
      values['memory_gib'] = max(m.in_use for m in measured) / GIB
    values['memory_peak_gib'] = max(
        (m.peak for m in measured or self.memory), default=0) / GIB
    return values


@dataclasses.dataclass(frozen=True)
class StepCost:
  """One step's model FLOPs ({device: FLOPs}) and its tensors' planned
  peak ({device: bytes}), read from its traced graph."""
  flops: dict
  planned_peak: dict

  def compute_devices(self):
    """The devices that compute: of the kind doing most FLOPs (GPUs beside
    a host that applies updates), sorted."""
    by_kind = collections.Counter()
    for device, flops in self.flops.items():
      by_kind[dry_run.device_type(device)] += flops
    kind = by_kind.most_common(1)[0][0] if by_kind else 'CPU'
    return sorted(d for d, f in self.flops.items()
                  if f and dry_run.device_type(d) == kind)


# The ops a model's FLOPs are counted from (a step's matmuls and
# convolutions), each forward one three times: itself, and the backward
# pass's input and weight gradients (PaLM's model FLOPs: no recomputation,
# no elementwise ops).
_MODEL_OPS = frozenset((
    'MatMul', 'BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3', 'Conv2D',
    'Conv3D', 'DepthwiseConv2dNative', 'Einsum',
    # A transposed convolution's forward pass (outside a gradient).
    'Conv2DBackpropInput', 'Conv3DBackpropInputV2'))
# The name scope of a tape's gradient ops (and a stage's backward pass's
# suffix, whose recomputed forward pass counts as backward).
_BACKWARD = 'gradient_tape'


def step_cost(function):
  """The `StepCost` of `function`'s (a compiled step's) first trace; an
  op placed nowhere counts on the device eager ops run on."""
  graph = keras_internals.first_trace(function)
  return StepCost({}, {}) if graph is None else cost_of(graph)


def cost_of(graph):
  """The `StepCost` of a traced step's `graph` (see `step_cost`)."""
  placement = devices.GraphPlacement()
  flops = collections.Counter()
  here = devices.current()
  for device, count in _forward(graph, placement, here):
    flops[device] += 3 * count
  planned = {device or here: size
             for device, size in peaks.peaks(graph, placement).items()}
  return StepCost(dict(flops), planned)


def _forward(graph, placement, device, backward=False):
  """(device, FLOPs) of each forward matmul and convolution `graph` runs,
  inside function bodies too (a gradient's body is backward; a loop's
  counted as often as it runs, `_trips`; both branches of a condition)."""
  for op in graph.get_operations():
    here = placement.of_op(op) or device
    back = backward or any(scope == _BACKWARD or scope.endswith(
        stages.BACKWARD) for scope in op.name.split('/'))
    if not back and op.type in _MODEL_OPS:
      yield here, (_einsum_flops(op) if op.type == 'Einsum'
                   else keras_internals.node_flops(op))
    trips = _trips(op)
    for body in peaks.bodies(op):
      for where, count in _forward(body, placement, here,
                                   back or '_backward_' in body.name):
        yield where, count * trips


def _trips(op):
  """How often `op` runs its bodies: a loop's `maximum_iterations` where
  the graph holds it as a constant (the accumulation loop's,
  `rows.accumulate`), else once."""
  if op.type not in ('While', 'StatelessWhile'):
    return 1
  limit = tf.get_static_value(op.inputs[1])
  return int(limit) if limit is not None and limit >= 0 else 1


def _einsum_flops(op):
  """2 x the product of every index's size of a two-operand einsum (a
  contraction's multiply-adds); 0 where a size is not known."""
  inputs, _ = op.get_attr('equation').decode().replace(' ', '').split('->')
  terms = inputs.split(',')
  if len(terms) != 2 or '.' in inputs:
    return 0
  sizes = {}
  for term, tensor in zip(terms, op.inputs):
    if tensor.shape.rank != len(term):
      return 0
    sizes.update(zip(term, tensor.shape.as_list()))
  if None in sizes.values():
    return 0
  return 2 * math.prod(sizes.values())


class Meter:
  """Readings of one run's steps (see the module).

  Args:
    function: the compiled step (`Trainer.step_function`, or a model's own
      step under `fit`): its first trace is counted once it has run.
    rows: examples a step: the job's global batch.
    compute_dtype: the layers' compute dtype ('float32', 'bfloat16', ...).
    kind: a `device_kinds.Kind` (`--device_peak_flops`); None: a GPU's own.
    device_memory: bytes a GPU holds (`--device_memory`); None: its kind's.
    tokens_per_row: token positions a row where the input is tokens.
    devices: how many devices compute the step (this process's clones
      and stages, `DeploymentConfig.compute_devices`): the MFU's
      denominator; None: those the step's matmuls run on.
  """

  def __init__(self, function, rows, *, compute_dtype='float32', kind=None,
               device_memory=None, tokens_per_row=None, devices=None):
    self._function = function
    self.rows = rows
    self.tokens_per_row = tokens_per_row
    self._dtype = compute_dtype
    self._kind = kind
    self._device_memory = device_memory
    self._devices = devices
    self._cost = None

  @property
  def cost(self):
    """The step's `StepCost` (`count`)."""
    return self.count()

  def count(self):
    """The step's `StepCost`, counted once, when its step has been traced:
    call it before the clock starts (a large graph takes a while)."""
    if self._cost is None:
      if keras_internals.first_trace(self._function) is None:
        return StepCost({}, {})  # Not traced yet: counted when it is.
      self._cost = step_cost(self._function)
    return self._cost

  def reading(self, seconds, steps):
    """The `Reading` of `steps` steps that took `seconds`."""
    step_time = seconds / steps
    tokens = (None if self.tokens_per_row is None
              else self.rows * self.tokens_per_row / step_time)
    return Reading(step_time, self.rows / step_time, tokens,
                   self._mfu(step_time), tuple(self.memory()))

  def _mfu(self, step_time):
    compute = self.cost.compute_devices()
    kind = self._kind or _gpu_kind(compute)
    if kind is None or not compute:
      return None
    rate = kind.rate(rate_dtype(self._dtype, compute[0]))
    flops = sum(self.cost.flops[d] for d in compute)
    return flops / step_time / (rate * (self._devices or len(compute)))

  def memory(self):
    """Each compute device's `Memory` (`memory_of`)."""
    return memory_of(self.cost, self._device_memory)


def memory_of(cost, device_memory=None):
  """Each of `cost`'s compute devices' `Memory` (see the module): a GPU's
  the runtime's, of `device_memory` bytes (None: its kind's); else the
  process's, and each device's planned peak where there are several."""
  compute = cost.compute_devices()
  if compute and dry_run.device_type(compute[0]) == 'GPU':
    total = device_memory or _gpu_memory(compute)
    return [_measured(d, total) for d in compute]
  planned = [Memory(d, None, cost.planned_peak.get(d, 0), planned=True)
             for d in compute]
  return [_process_memory()] + (planned if len(compute) > 1 else [])


def tokens_per_row(inputs):
  """Token positions a row where `inputs` (a batch, as a step takes it)
  are tokens, else None: the integer (rows, positions) input a dict names
  'token_ids' (keras-hub's; else its one key naming a token), or the
  only input, if integer and of that rank. Padding counts: a position is
  a token."""
  if isinstance(inputs, dict):
    named = ([inputs['token_ids']] if 'token_ids' in inputs else
             [v for k, v in inputs.items() if 'token' in str(k)])
    return _positions(named[0]) if len(named) == 1 else None
  flat = tf.nest.flatten(inputs)
  return _positions(flat[0]) if len(flat) == 1 else None


def _positions(tensor):
  shape = getattr(tensor, 'shape', None)
  if (shape is None or shape.rank != 2 or shape[1] is None
      or not tf.as_dtype(tensor.dtype).is_integer):
    return None
  return int(shape[1])


def _measured(device, total):
  info = tf.config.experimental.get_memory_info(
      tf.DeviceSpec.from_string(device).to_string())
  return Memory(device, info['current'], info['peak'], total)


def _process_memory():
  """The process's `Memory` (resident now, at most), of the host's: what
  the devices of a host share (the runtime's CPU allocator counts only
  its large buffers). Where no /proc says what is resident now (macOS),
  the most it has been."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  peak *= 1 if sys.platform == 'darwin' else 1024  # Bytes there, KiB here.
  try:
    with open('/proc/self/statm') as statm:
      now = int(statm.read().split()[1]) * _PAGE
  except OSError:
    now = peak
  return Memory(PROCESS, now, max(peak, now),
                _PAGE * os.sysconf('SC_PHYS_PAGES'))


def rate_dtype(compute_dtype, device):
  """The `Kind.rate` key of a compute dtype on `device`: float32 matmuls
  on a GPU run as TF32 where TensorFlow allows it."""
  if (compute_dtype == 'float32' and dry_run.device_type(device) == 'GPU'
      and tf.config.experimental.tensor_float_32_execution_enabled()):
    return 'tf32'
  return compute_dtype


def _gpu_name(compute):
  gpus = tf.config.list_physical_devices('GPU')
  if not gpus or dry_run.device_type(compute[0]) != 'GPU':
    return ''
  return tf.config.experimental.get_device_details(gpus[0]).get(
      'device_name', '')


def _gpu_kind(compute):
  name = device_kinds.kind_of(_gpu_name(compute)) if compute else None
  return device_kinds.KINDS.get(name)


def _gpu_memory(compute):
  kind = _gpu_kind(compute)
  return kind and kind.memory_gib * GIB
