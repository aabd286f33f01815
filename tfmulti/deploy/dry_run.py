"""A dry run: the towers built and traced for GPUs this machine lacks.

`plan(config, model, loss_fn, optimizer, images, labels)` builds the step
for `config`'s devices (GPU:0 to GPU:N-1 need not exist) inside
`plans.planning()`: variables are made on the host, each with its planned
device (the clones' GPUs when spread or sharded, its slots beside it),
and the step is traced on a batch of the given shapes; nothing runs. Read
from the traced graph, each device's `DeviceReport`: the variable and slot
bytes it holds, the activation bytes its backward pass keeps (forward
outputs a gradient op reads), the bytes it sends and receives and over
which links (host-GPU, GPU-GPU), its FLOPs (TensorFlow's registered op
statistics), its ops, and each op placed on a GPU with no GPU kernel for
its dtypes (TensorFlow's kernel registry lists GPU kernels on a machine
without CUDA). Under XLA (on by default for GPU clones) a clone's pass is
compiled, and XLA's lowering decides, not the kernels: the check is then
of what the pass would need without XLA. `over_memory` names the devices
a memory size cannot hold, with their biggest holders.
"""

import collections
import dataclasses
import functools

import tensorflow as tf
from tensorflow.python.framework import kernels
from tensorflow.python.framework import ops as ops_lib
from tensorflow.python.util import deprecation

from tfmulti import devices
from tfmulti import keras_internals
from tfmulti import plans
from tfmulti.deploy import sharding
from tfmulti.deploy import towers
from tfmulti.deploy import traffic

# Ops the runtime runs without a kernel of their own on the device (calls
# and control flow run their bodies' ops; arguments are fed).
_NO_KERNEL_NEEDED = frozenset((
    'PartitionedCall', 'StatefulPartitionedCall', 'While', 'StatelessWhile',
    'If', 'StatelessIf', 'NoOp', 'Placeholder', '_Arg', '_Retval'))
_FUNCTION_ATTRS = ('f', 'body', 'cond', 'then_branch', 'else_branch')
# Kernels a GPU runs: its own, and those registered for any device (int32
# constants and shapes, kept in host memory).
_GPU_KERNELS = ('GPU', 'DEFAULT')


@dataclasses.dataclass
class DeviceReport:
  """One device's part of one step (see the module)."""
  held_bytes: int = 0
  activation_bytes: int = 0
  sent_bytes: dict = dataclasses.field(default_factory=collections.Counter)
  received_bytes: dict = dataclasses.field(
      default_factory=collections.Counter)
  flops: int = 0
  ops: int = 0
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
    _plan_slots(deployed.optimizer)
    graph = deployed.traced_step(images, labels).graph
    return _read(deployed, graph)


def _plan_slots(optimizer):
  """Each slot planned beside its variable (`keras_internals.slot_lists`)."""
  variables = getattr(optimizer, 'inner_optimizer',
                      optimizer)._trainable_variables
  for slots in keras_internals.slot_lists(optimizer).values():
    for slot, variable in zip(slots, variables):
      plans.plan(keras_internals.storage(slot), devices.device_of(variable))


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
  placement = devices.GraphPlacement()
  for op, device in _walk(graph, placement):
    report = table[device]
    report.ops += 1
    report.flops += _flops(op)
    report.activation_bytes += _kept(op)
    missing = _missing_kernel(op, device)
    if missing:
      report.missing_kernels.append(missing)
  table.pop('', None)
  return Plan(dict(sorted(table.items())), sorted(holders, reverse=True))


def _walk(graph, placement, device=''):
  """(op, device) of every op the step runs, inside function bodies too
  (an op there without a device runs on its call's)."""
  for op in graph.get_operations():
    here = placement.of_op(op) or device
    yield op, here
    for attr in _FUNCTION_ATTRS:
      try:
        name = op.get_attr(attr).name
      except (ValueError, AttributeError):
        continue
      body = graph._get_function(name)  # pylint: disable=protected-access
      if body is not None:
        yield from _walk(body.graph, placement, here)


def _link(source, reader):
  kinds = {tf.DeviceSpec.from_string(d).device_type for d in (source,
                                                              reader)}
  return {frozenset({'GPU'}): 'gpu-gpu',
          frozenset({'CPU'}): 'cpu-cpu'}.get(frozenset(kinds), 'host-gpu')


def _flops(op):
  try:
    with deprecation.silence():  # Convolutions read shapes a TF 1 way.
      value = ops_lib.get_stats_for_node_def(op.graph, op.node_def,
                                             'flops').value
  except (ValueError, TypeError):  # No statistics, or unknown shapes.
    return 0
  return value or 0


def _kept(op):
  """Bytes of `op`'s outputs a gradient op reads, for a forward op."""
  if 'gradient_tape' in op.name:
    return 0
  kept = 0
  for tensor in op.outputs:
    if tensor.shape.is_fully_defined() and tensor.dtype != tf.resource and any(
        'gradient_tape' in reader.name for reader in tensor.consumers()):
      kept += tensor.shape.num_elements() * tensor.dtype.size
  return kept


def _missing_kernel(op, device):
  """One line naming `op` if it is on a GPU with no GPU kernel for its
  dtypes, else None."""
  if (tf.DeviceSpec.from_string(device).device_type != 'GPU'
      or op.type in _NO_KERNEL_NEEDED):
    return None
  types = {}  # Each attribute's dtype enums, read once.
  for constraints in _gpu_kernels(op.type):
    if all(_types(op, name, types) <= allowed
           for name, allowed in constraints):
      return None
  dtypes = sorted({t.dtype.name for t in list(op.inputs) + op.outputs})
  return (f'{op.type} {op.name!r} on {device}: no GPU kernel for '
          f'{", ".join(dtypes) or "its attributes"}')


@functools.lru_cache(maxsize=None)
def _gpu_kernels(op_type):
  """The type constraints of each GPU kernel of `op_type`: a tuple of
  (attribute, frozenset of allowed dtype enums) a kernel (read once: the
  registry parses its proto at each call)."""
  return tuple(
      tuple((c.name, frozenset(c.allowed_values.list.type))
            for c in kernel.constraint)
      for kernel in kernels.get_registered_kernels_for_op(op_type).kernel
      if kernel.device_type in _GPU_KERNELS)


def _types(op, name, types):
  """The dtype enums of `op`'s attribute `name` (none: no such one)."""
  if name not in types:
    try:
      value = op.get_attr(name)
    except ValueError:
      value = []
    types[name] = frozenset(tf.as_dtype(v).as_datatype_enum for v in (
        value if isinstance(value, list) else [value]))
  return types[name]


def over_memory(found, memory_bytes, top=3):
  """One line for each device of `found` (a `Plan`) whose variables,
  slots and kept activations exceed `memory_bytes`, naming by how much
  and its biggest holders; none when all fit."""
  lines = []
  for device, report in found.devices.items():
    need = report.held_bytes + report.activation_bytes
    if tf.DeviceSpec.from_string(device).device_type != 'GPU' or (
        need <= memory_bytes):
      continue
    biggest = [f'{path} {size / 2**20:.0f} MiB'
               for size, path, d in found.holders if d == device][:top]
    over = (need - memory_bytes) / 2**30
    held, kept = report.held_bytes / 2**30, report.activation_bytes / 2**30
    lines.append(
        f'{device} needs {need / 2**30:.2f} GiB ({held:.2f} of variables and '
        f'slots, {kept:.2f} of kept activations), {over:.2f} GiB over its '
        f'{memory_bytes / 2**30:.0f} GiB; its biggest: {", ".join(biggest)}')
  return lines
