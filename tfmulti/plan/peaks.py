"""The most bytes a step's tensors take on each device at once.

A dry run (`plan.dry_run`) reads the traced step, which never runs, so
the memory a device needs is counted from the graph: `peaks` runs the ops
the runtime would run (`reachable`), each as soon as its inputs have
(`as_soon_as_ready`), and keeps
a tally of the buffers live on each device (activations kept for the
backward pass, gradients, copies received), the most of which is the
device's peak. The pipeline benchmark's activation count
(`bench.activations`) reads buffers by the same rules (`buffer_of`).
"""

import collections

import tensorflow as tf

from tfmulti import devices
from tfmulti import keras_internals

# The ops that run function bodies: their attributes naming them.
_CALLS = {'PartitionedCall': ('f',), 'StatefulPartitionedCall': ('f',),
          'While': ('cond', 'body'), 'StatelessWhile': ('cond', 'body'),
          'If': ('then_branch', 'else_branch'),
          'StatelessIf': ('then_branch', 'else_branch')}
# Ops whose output is their input's buffer, seen another way: a tensor and
# its views are held once.
VIEWS = frozenset(('Identity', 'IdentityN', 'Reshape', 'Squeeze',
                   'ExpandDims'))
# Ops whose output on their own device is memory counted elsewhere: a
# variable's read (held) and a body's arguments (its call's inputs).
# Another device reading one receives a copy.
_ALIASES = frozenset(('ReadVariableOp', 'Placeholder', '_Arg'))
# Element-wise ops whose kernels write their output into an input's buffer
# where nothing else holds it (`forward_input_or_allocate_output`).
IN_PLACE = frozenset((
    'Abs', 'Add', 'AddN', 'AddV2', 'BiasAdd', 'Div', 'DivNoNan', 'Elu',
    'EluGrad', 'Exp', 'LeakyRelu', 'LeakyReluGrad', 'Log', 'Maximum',
    'Minimum', 'Mul', 'MulNoNan', 'Neg', 'RealDiv', 'Reciprocal', 'Relu',
    'Relu6', 'Relu6Grad', 'ReluGrad', 'Rsqrt', 'Selu', 'SeluGrad',
    'Sigmoid', 'SigmoidGrad', 'Sign', 'Sqrt', 'Square',
    'SquaredDifference', 'Sub', 'Tanh', 'TanhGrad'))


def reachable(graph, stateful=False):
  """The names of the ops the step's outputs and updates need: what the
  runtime runs (it prunes the rest: ops no result reads). `stateful`: its
  stateful ops are its updates too (a graph without automatic control
  dependencies, as `tf.compat.v1.wrap_function` traces)."""
  todo = [t.op for t in graph.outputs] + list(graph.control_outputs)
  if stateful:
    todo += [op for op in graph.get_operations()
             if keras_internals.is_stateful(op)]
  seen = set()
  while todo:
    op = todo.pop()
    if op.name not in seen:
      seen.add(op.name)
      todo += [t.op for t in op.inputs] + list(op.control_inputs)
  return seen


def buffer_of(tensor):
  """The tensor whose buffer `tensor` is (through views on one device)."""
  while tensor.op.type in VIEWS and tensor.op.inputs:
    source = tensor.op.inputs[
        tensor.value_index if tensor.op.type == 'IdentityN' else 0]
    if (devices.canonical(source.op.device)
        != devices.canonical(tensor.op.device)):
      break
    tensor = source
  return tensor


def peaks(graph, placement=None, device=''):
  """{device: the most bytes of `graph`'s buffers live on it at once}.

  A buffer lives on the device that makes it until its last reader there
  has run (a transfer takes its copy as it is made), and on each other
  device that reads it (a copy) from when it is made until that device's
  last reader; readers of its views are its readers. An element-wise op
  whose last read of an input's buffer it is writes into that buffer
  (`IN_PLACE`). A function body (an XLA pass, an accumulation loop's)
  adds its own peak while its call runs.
  """
  placement = placement or devices.GraphPlacement()
  needed = reachable(graph)
  ops = as_soon_as_ready([op for op in graph.get_operations()
                          if op.name in needed])
  where = {op.name: placement.of_op(op) or device for op in ops}
  tally = _Tally()
  for op in ops:
    for tensor in op.inputs:
      tally.will_read(buffer_of(tensor), where[op.name])
  for op in ops:
    here = where[op.name]
    for body in bodies(op):
      for inner, size in peaks(body, placement, here).items():
        tally.peak[inner] = max(tally.peak[inner], tally.live[inner] + size)
    reused = tally.reusable(op, here)
    for tensor in op.outputs:
      if buffer_of(tensor).name != tensor.name:
        continue  # A view: its buffer is its input's.
      if reused is not None and tensor is op.outputs[0]:
        tally.take(reused, tensor, here)
        continue
      for home in tally.homes[tensor.ref()] | {here}:
        tally.make(tensor, home, 0 if home == here and op.type in _ALIASES
                   else _bytes(tensor))
    for tensor in op.inputs:
      tally.free(buffer_of(tensor), here)
  return tally.peak


class _Tally:
  """The buffers live on each device as a step's ops run: {(buffer,
  device): bytes}, each device's total and its most."""

  def __init__(self):
    self.readers = collections.Counter()  # (buffer, device) -> reads left.
    self.homes = collections.defaultdict(set)  # buffer -> reading devices.
    self.live, self.peak, self.held = (collections.Counter(),
                                       collections.Counter(), {})

  def will_read(self, root, home):
    self.readers[root.ref(), home] += 1
    self.homes[root.ref()].add(home)

  def make(self, tensor, home, size):
    key = tensor.ref(), home
    self.held[key] = size
    self.live[home] += size
    self.peak[home] = max(self.peak[home], self.live[home])
    if not self.readers[key]:  # Read by nothing: freed.
      self.live[home] -= self.held.pop(key)

  def free(self, root, home):
    key = root.ref(), home
    self.readers[key] -= 1
    if not self.readers[key]:
      self.live[home] -= self.held.pop(key, 0)

  def reusable(self, op, here):
    """The input buffer `op` may write its output into (TensorFlow's
    element-wise kernels forward an input no later op reads, of the
    output's size), or None."""
    if op.type not in IN_PLACE or not op.outputs:
      return None
    size = _bytes(op.outputs[0])
    reads = collections.Counter(buffer_of(t).ref() for t in op.inputs)
    for ref, count in reads.items():
      key = ref, here
      if (self.held.get(key) == size and size and
          self.readers[key] == count and len(self.homes[ref]) == 1):
        return key
    return None

  def take(self, key, tensor, here):
    """`tensor` (made on `here`) written into `key`'s buffer."""
    self.held[tensor.ref(), here] = self.held.pop(key)
    if not self.readers[tensor.ref(), here]:
      self.live[here] -= self.held.pop((tensor.ref(), here))


def as_soon_as_ready(ops):
  """`ops` in the order the runtime runs them: each once its inputs and
  control inputs have run, every device at once (a clone's ops beside
  another's, a sum as soon as its terms exist); ties in the order they
  were made. An op may be given a control input made after it (a gate
  held back, a loop's late inputs): its level is worked out again until
  none changes."""
  names = {op.name for op in ops}
  level = dict.fromkeys(names, 0)
  changed = True
  while changed:
    changed = False
    for op in ops:
      before = [t.op.name for t in op.inputs] + [c.name for c in
                                                  op.control_inputs]
      now = 1 + max((level[n] for n in before if n in names), default=0)
      if now != level[op.name]:
        level[op.name], changed = now, True
  return sorted(ops, key=lambda op: level[op.name])


def _bytes(tensor):
  """Bytes of a tensor's buffer: none for a handle or a shape not known."""
  if (tensor.dtype in (tf.resource, tf.variant)
      or not tensor.shape.is_fully_defined()):
    return 0
  return tensor.shape.num_elements() * tensor.dtype.size


def bodies(op):
  """The function graphs `op` runs (calls, loops, branches; a function
  called by its own name), its attributes read only for those."""
  called = keras_internals.function_of(op.graph, op.type)
  if called is not None:
    yield called.graph
  for attr in _CALLS.get(op.type, ()):
    body = keras_internals.function_of(op.graph, op.get_attr(attr).name)
    if body is not None:
      yield body.graph
