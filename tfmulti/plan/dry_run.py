"""A dry run: the towers built and traced for GPUs this machine lacks.

`plan(config, model, loss_fn, optimizer, images, labels)` builds the step
for `config`'s devices (GPU:0 to GPU:N-1 need not exist) inside
`plans.planning()`: variables are made on the host, each with its planned
device (the clones' GPUs when spread or sharded, its slots beside it),
and the step is traced on a batch of the given shapes; nothing runs
(`read` does the same for towers built already: a `TowersModel`'s,
`fit.planned`). Read from the traced graph, each device's `DeviceReport`:
the variable and slot bytes it holds, the most bytes of the step's
tensors live on it at once (`plan.peaks`), the bytes it sends and
receives and over which links (host-GPU, GPU-GPU; with several workers,
the all-reduce over the network), its FLOPs (TensorFlow's registered op
statistics), its ops, the bytes its ops write, its heavy ops as kernels
to time alone (`kernels`; a CPU's only: the device model times them
here), and each op placed on a GPU with no GPU kernel for its dtypes
(TensorFlow's kernel registry lists GPU kernels on a machine without
CUDA). Under XLA (on by default for GPU clones) a clone's pass is
compiled, and XLA's lowering decides, not the kernels: the check is then
of what the pass would need without XLA. `over_memory` names the devices
a memory size cannot hold, with their biggest holders.
"""

import collections
import dataclasses
import functools

import tensorflow as tf

from tfmulti import device_kinds
from tfmulti import devices
from tfmulti import keras_internals
from tfmulti import plans
from tfmulti.deploy import towers
from tfmulti.mesh import sharding
from tfmulti.plan import kernels
from tfmulti.plan import peaks
from tfmulti.plan import traffic

# Ops the runtime runs without a kernel of their own on the device (calls
# and control flow run their bodies' ops; arguments are fed).
_NO_KERNEL_NEEDED = frozenset((
    'PartitionedCall', 'StatefulPartitionedCall', 'While', 'StatelessWhile',
    'If', 'StatelessIf', 'NoOp', 'Placeholder', '_Arg', '_Retval'))
# The workers' all-reduce (`_across_workers`): its link and its op.
NETWORK = 'network'
_ALL_REDUCE = 'CollectiveReduceV2'
# Kernels a GPU runs: its own, and those registered for any device (int32
# constants and shapes, kept in host memory).
_GPU_KERNELS = ('GPU', 'DEFAULT')


@dataclasses.dataclass
class DeviceReport:
  """One device's part of one step (see the module)."""
  held_bytes: int = 0
  peak_bytes: int = 0
  sent_bytes: dict = dataclasses.field(default_factory=collections.Counter)
  received_bytes: dict = dataclasses.field(
      default_factory=collections.Counter)
  flops: int = 0
  ops: int = 0
  written_bytes: int = 0
  kernels: dict = dataclasses.field(default_factory=collections.Counter)
  missing_kernels: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Plan:
  """A dry run's findings: {device: `DeviceReport`}, and the biggest
  variables and slots as (bytes, path, device), largest first."""
  devices: dict
  holders: list


def plan(config, model, loss_fn, optimizer, images, labels, options=None,
         **fields):
  """The `Plan` of one step of `model` on `config`'s devices (see the
  module); `options` and `fields` as `towers.deploy` takes them. Build the
  model and the optimizer inside `plans.planning()` when its variables
  live on the devices planned (spread): they are made on the host."""
  with plans.planning():
    deployed = towers.deploy(config, model, loss_fn, optimizer, options,
                             **fields)
    return read(deployed, images, labels)


def read(deployed, images, labels):
  """The `Plan` of one step of `deployed` (a `towers.DeployedModel` built
  inside `plans.planning()`, as `fit.planned` does for a `TowersModel`)
  on a batch of `images` and `labels`' shapes: traced, never run."""
  with plans.planning():
    graph = deployed.traced_step(images, labels).graph
    return _read(deployed, graph)


def _read(deployed, graph):
  table = collections.defaultdict(DeviceReport)
  holders = []
  for variable in sharding.stored_variables(deployed):
    device = devices.canonical(devices.device_of(variable))
    size = devices.variable_bytes(variable)
    table[device].held_bytes += size
    holders.append((size, getattr(variable, 'path', variable.name), device))
  for source, reader, _, size in traffic.transfers(graph):
    link = _link(source, reader)
    table[source].sent_bytes[link] += size
    table[reader].received_bytes[link] += size
  if deployed.config.num_workers > 1:
    _across_workers(table, deployed)
  placement = devices.GraphPlacement()
  for device, peak in peaks.peaks(graph, placement).items():
    table[device].peak_bytes = peak
  for op, device in _walk(graph, placement):
    report = table[device]
    report.ops += 1
    report.flops += keras_internals.node_flops(op)
    report.written_bytes += kernels.written_bytes(op)
    kernel = None if device_type(device) == 'GPU' else kernels.of(op)
    if kernel is not None:  # A GPU's ops are not timed here: none runs.
      report.kernels[kernel] += 1
    missing = _missing_kernel(op, device)
    if missing:
      report.missing_kernels.append(missing)
  table.pop('', None)
  return Plan(dict(sorted(table.items())), sorted(holders, reverse=True))


def _walk(graph, placement, device=''):
  """(op, device) of every op the step runs, inside function bodies too
  (an op there without a device runs on its call's): those its outputs
  or its effects need (`peaks.reachable`; the runtime prunes the rest)."""
  live = peaks.reachable(graph, stateful=True)
  for op in graph.get_operations():
    if op.name not in live:
      continue
    here = placement.of_op(op) or device
    yield op, here
    for body in peaks.bodies(op):
      yield from _walk(body, placement, here)


def _across_workers(table, deployed):
  """Adds the workers' all-reduce of this worker's gradient sums (Keras's
  `apply_gradients` under the workers' strategy, outside the towers'
  traced step): a ring's bytes, 2 (W-1)/W of each sum each way over the
  network from the device it is summed on (each sum dense: an Embedding's
  slices, all-gathered, may move less), and one line for a sum on a GPU
  with no GPU kernel of the collective for its dtype."""
  config = deployed.config
  share = 2 * (config.num_workers - 1) / config.num_workers
  for variable in deployed.parts.storage.variables:
    owner = devices.canonical(config.owner_device(
        devices.device_of(variable)))
    size = int(devices.variable_bytes(variable) * share)
    table[owner].sent_bytes[NETWORK] += size
    table[owner].received_bytes[NETWORK] += size
    dtype = tf.as_dtype(variable.dtype)
    if device_type(owner) == 'GPU' and not _has_gpu_kernel(
        _ALL_REDUCE, tuple(
            frozenset((dtype.as_datatype_enum,) if name == 'T' else ())
            for name in _constrained(_ALL_REDUCE))):
      table[owner].missing_kernels.append(
          f'{_ALL_REDUCE} of {variable.path} on {owner}: no GPU kernel for '
          f'{dtype.name}')


def _link(source, reader):
  kinds = {device_type(d) for d in (source, reader)}
  return {frozenset({'GPU'}): 'gpu-gpu',
          frozenset({'CPU'}): 'cpu-cpu'}.get(frozenset(kinds), 'host-gpu')


def _missing_kernel(op, device):
  """One line naming `op` if it is on a GPU with no GPU kernel for its
  dtypes, else None."""
  if (device_type(device) != 'GPU'
      or op.type in _NO_KERNEL_NEEDED):
    return None
  if _has_gpu_kernel(op.type, tuple(_types(op, name)
                                    for name in _constrained(op.type))):
    return None
  dtypes = sorted({t.dtype.name for t in list(op.inputs) + op.outputs})
  return (f'{op.type} {op.name!r} on {device}: no GPU kernel for '
          f'{", ".join(dtypes) or "its attributes"}')


@functools.lru_cache(maxsize=None)
def device_type(device):
  """'GPU', 'CPU', ... of a device name (a graph names a few, often)."""
  return tf.DeviceSpec.from_string(device).device_type


@functools.lru_cache(maxsize=None)
def _has_gpu_kernel(op_type, types):
  """Whether a GPU kernel of `op_type` takes `types`: the dtype enums
  (frozensets) of its constrained attributes, in `_constrained` order
  (asked once a signature: a graph repeats a few)."""
  named = dict(zip(_constrained(op_type), types))
  return any(all(named[name] <= allowed for name, allowed in constraints)
             for constraints in _gpu_kernels(op_type))


@functools.lru_cache(maxsize=None)
def _constrained(op_type):
  """The attributes some GPU kernel of `op_type` constrains, sorted."""
  return tuple(sorted({name for constraints in _gpu_kernels(op_type)
                       for name, _ in constraints}))


@functools.lru_cache(maxsize=None)
def _gpu_kernels(op_type):
  """The type constraints of each GPU kernel of `op_type`: a tuple of
  (attribute, frozenset of allowed dtype enums) a kernel (read once: the
  registry parses its proto at each call)."""
  return tuple(
      tuple((c.name, frozenset(c.allowed_values.list.type))
            for c in kernel.constraint)
      for kernel in keras_internals.registered_kernels(op_type)
      if kernel.device_type in _GPU_KERNELS)


def _types(op, name):
  """The dtype enums of `op`'s attribute `name` (none: no such one)."""
  try:
    value = op.get_attr(name)
  except ValueError:
    value = []
  return frozenset(tf.as_dtype(v).as_datatype_enum for v in (
      value if isinstance(value, list) else [value]))


def over_memory(found, memory_bytes, top=3):
  """One line for each device of `found` (a `Plan`) whose variables,
  slots and peak of tensors exceed `memory_bytes`, naming by how much,
  its biggest holders and the fix for what fills most of it; none when
  all fit."""
  lines = []
  for device, report in found.devices.items():
    need = report.held_bytes + report.peak_bytes
    if device_type(device) != 'GPU' or (
        need <= memory_bytes):
      continue
    biggest = [f'{path} {device_kinds.size_text(size)}'
               for size, path, d in found.holders if d == device][:top]
    held, peak = report.held_bytes, report.peak_bytes
    text = device_kinds.size_text
    lines.append(
        f'{device} needs {text(need)} ({text(held)} of variables and '
        f'slots, {text(peak)} of tensors at their peak), '
        f'{text(need - memory_bytes)} over its {text(memory_bytes)}; its '
        f'biggest: {", ".join(biggest)}; '
        + (TENSORS_FIX if peak > held else VARIABLES_FIX))
  return lines


TENSORS_FIX = ("its step's tensors are the most of it: lower --batch_size, or "
               'raise --accumulation_steps to keep the global batch')
VARIABLES_FIX = ('its variables and slots are the most of it: spread or '
                 'shard them (--variables_device=spread, --mesh_shape)')
