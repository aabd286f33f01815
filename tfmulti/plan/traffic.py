"""What each device holds and moves in one step, read from the traced step.

The towers' cost on real hardware is where the bytes go: with central
variables, the variables device sends every clone every variable and
receives every clone's gradients; spread variables share that out.
`step_traffic` counts it from the step's graph, device by device:

* held: the bytes of the variables and optimizer slots living there;
* sent and received: the bytes of every tensor one device's op makes and
  another device's op reads, split by what they are ('variables': a
  variable's value read for a clone; 'gradients': a gradient on its way to
  be summed; 'lookups': a table's ids and rows (`lookups`); 'activations':
  a split layer's rows, parts and partial sums, and their gradients, on
  their way to or from a block's device (`tensor_parallel`); 'other': input
  shards, losses, BatchNorm statistics, scalars),
  with the number of such transfers. TensorFlow sends a tensor once to each
  device that reads it, so a transfer is one (tensor, reading device) pair.

Where each op runs is `devices.GraphPlacement`'s reading of the graph (the
placer's rules); ops inside a loop (accumulation steps, the atoms' fold)
count once, as the loop op.
"""

import collections
import dataclasses

import tensorflow as tf

from tfmulti import devices
from tfmulti.mesh import lookups
from tfmulti.mesh import sharding
from tfmulti.mesh import tensor_parallel
from tfmulti.plan import peaks

KINDS = ('variables', 'gradients', 'lookups', 'activations', 'other')


@dataclasses.dataclass
class DeviceTraffic:
  """One device's bytes in one step.

  Attributes:
    held: bytes of the variables and optimizer slots on it.
    sent: {kind: bytes it sends to other devices} (`KINDS`).
    received: {kind: bytes it receives from other devices}.
    transfers_sent: {kind: tensors it sends, one a reading device}.
    transfers_received: {kind: tensors it receives}.
  """
  held: int = 0
  sent: dict = dataclasses.field(default_factory=collections.Counter)
  received: dict = dataclasses.field(default_factory=collections.Counter)
  transfers_sent: dict = dataclasses.field(
      default_factory=collections.Counter)
  transfers_received: dict = dataclasses.field(
      default_factory=collections.Counter)


def held_bytes(variables):
  """{device: bytes of `variables` living there}."""
  held = collections.Counter()
  for variable in variables:
    held[devices.canonical(devices.device_of(variable))] += (
        devices.variable_bytes(variable))
  return held


def _kind(tensor, reader):
  """What a transfer carries: a variable's value (read, or packed in
  'pack_variables'), a split layer's activations or their gradients
  (made or read in its parts' scope, `tensor_parallel.SCOPE`), a
  gradient (made under the tape's 'gradient_tape' scope or packed in
  'pack_gradients', or read to be summed in 'sum_gradients'), a table's
  lookup (its ids and rows, made in 'lookup': `mesh.lookups`), or other
  (a scalar a gradient op reads is not a gradient)."""
  if tensor.op.type == 'ReadVariableOp' or 'pack_variables' in (
      tensor.op.name):
    return 'variables'
  if 'sum_gradients' not in reader.name and any(
      tensor_parallel.in_scope(name)
      for name in (tensor.op.name, reader.name)):
    return 'activations'
  if 'gradient' in tensor.op.name or 'sum_gradients' in reader.name:
    return 'gradients'
  if lookups.in_scope(tensor.op.name):
    return 'lookups'
  return 'other'


def crossings(graph, stateful=False):
  """(tensor, source device, reading device, kind) of each tensor of
  `graph` that crosses devices, once a reading device, among the ops the
  step runs (`peaks.reachable`: a join no op reads is never run)."""
  placement = devices.GraphPlacement()
  runs = peaks.reachable(graph, stateful)
  seen = set()
  for op in graph.get_operations():
    if op.name not in runs:
      continue
    reader = placement.of_op(op)
    for tensor in op.inputs:
      source = placement.of_tensor(tensor)
      if (not reader or not source or reader == source
          or (tensor.name, reader) in seen):
        continue
      seen.add((tensor.name, reader))
      yield tensor, source, reader, _kind(tensor, op)


def transfers(graph, stateful=False):
  """[(source device, reading device, kind, bytes)] of `graph`: each
  tensor that crosses devices, once a reading device (those of a size
  the graph does not know left out: `measured_transfers` counts them).
  `stateful`: as `peaks.reachable` takes it."""
  return [(source, reader, kind,
           tensor.shape.num_elements() * tensor.dtype.size)
          for tensor, source, reader, kind in crossings(graph, stateful)
          if tensor.shape.is_fully_defined()]


def measured_transfers(deployed, images, labels):
  """As `transfers` of one step of `deployed` on this batch, with the
  tensors whose size the batch's values decide counted too (the ids a
  table's lookup sends each shard, the rows it returns, their gradient's
  slices): the step traced as a graph, pruned to those tensors' sizes
  and evaluated on the batch; nothing is updated."""
  def dynamic(graph):
    found = [crossing for crossing in crossings(graph, True)
             if not crossing[0].shape.is_fully_defined()]
    return found, [tensor for tensor, *_ in found]
  graph, found, sizes = _measured(deployed, images, labels, dynamic)
  return transfers(graph, stateful=True) + [
      (source, reader, kind, size)
      for (_, source, reader, kind), size in zip(found, sizes)]


def measured_lookups(deployed, images, labels):
  """[(device, bytes)] of each gather of a table's rows (or a shard's)
  in one step of `deployed` on this batch: the gathers of a table's
  lookup (`lookups`), their outputs evaluated as `measured_transfers`."""
  def gathers(graph):
    found = lookup_gathers(graph)
    return found, [op.outputs[0] for op in found]
  _, found, sizes = _measured(deployed, images, labels, gathers)
  placement = devices.GraphPlacement()
  return [(placement.of_op(op), size) for op, size in zip(found, sizes)]


def lookup_gathers(graph):
  """The ops of `graph`'s step that gather a table's rows (or a shard's)
  for a lookup (`lookups`): not its gradient's gathers."""
  runs = peaks.reachable(graph, True)
  return [op for op in graph.get_operations()
          if op.type == 'GatherV2' and op.name in runs
          and lookups.in_scope(op.name)
          and op.inputs[0].op.type == 'ReadVariableOp']


def _measured(deployed, images, labels, pick):
  """(the graph of one step of `deployed`, the items `pick(graph)` gives
  with their tensors, the bytes of each tensor on this batch)."""
  images, labels, layout, cut = deployed._step_arguments(  # pylint: disable=protected-access
      images, labels)
  specs = [tf.nest.map_structure(tf.TensorSpec.from_tensor, nest)
           for nest in (images, labels)]
  wrapped = tf.compat.v1.wrap_function(
      lambda x, y: deployed.step_graph(x, y, layout, cut).total, specs)
  found, tensors = pick(wrapped.graph)
  if not found:
    return wrapped.graph, found, []
  with wrapped.graph.as_default():
    sizes = [tf.size(tensor, out_type=tf.int64) * tensor.dtype.size
             for tensor in tensors]
  counted = wrapped.prune(wrapped.inputs, sizes)(
      *tf.nest.flatten((images, labels)))
  return wrapped.graph, found, [int(size) for size in counted]


def step_traffic(deployed, images, labels):
  """{device: `DeviceTraffic`} of one step of `deployed` (a
  `deploy.DeployedModel`) on this batch, every device that holds or moves
  anything."""
  graph = deployed.traced_step(images, labels).graph
  table = collections.defaultdict(DeviceTraffic)
  for device, held in held_bytes(
      sharding.stored_variables(deployed)).items():
    table[device].held += held
  for source, reader, kind, size in transfers(graph):
    table[source].sent[kind] += size
    table[source].transfers_sent[kind] += 1
    table[reader].received[kind] += size
    table[reader].transfers_received[kind] += 1
  return dict(sorted(table.items()))
