"""The most bytes a step's tensors take on each device at once.

A dry run (`deploy.dry_run`) reads the traced step, which never runs, so
the memory a device needs is counted from the graph: `peaks` runs its ops
in the order they were made and keeps a tally of the tensors live on each
device (activations kept for the backward pass, gradients, copies
received), the most of which is the device's peak.
"""

import collections

import tensorflow as tf

from tfmulti import devices

# The ops that run function bodies: their attributes naming them.
_CALLS = {'PartitionedCall': ('f',), 'StatefulPartitionedCall': ('f',),
          'While': ('cond', 'body'), 'StatelessWhile': ('cond', 'body'),
          'If': ('then_branch', 'else_branch'),
          'StatelessIf': ('then_branch', 'else_branch')}
# Ops whose outputs alias memory counted elsewhere: variables' reads (held)
# and a body's arguments (its call's inputs).
_ALIASES = frozenset(('ReadVariableOp', 'Placeholder', '_Arg'))


def peaks(graph, placement=None, device=''):
  """{device: the most bytes of `graph`'s tensors live on it at once},
  running its ops in the order they were made (a valid order: each
  clone's forward pass, then its backward pass, as its tape made it).

  A tensor lives on the device that makes it until its last reader
  anywhere has run (a transfer reads it), and on each other device that
  reads it from when it is made until that device's last reader of it.
  Variables' reads alias the variables (counted as held), a function
  body's arguments alias its call's inputs, and a body (an XLA pass, an
  accumulation loop's) adds its own peak while its call runs."""
  placement = placement or devices.GraphPlacement()
  where = {op: placement.of_op(op) or device
           for op in graph.get_operations()}
  readers = collections.Counter()
  for op, here in where.items():
    for tensor in op.inputs:
      readers[tensor.ref(), here] += 1
      if where[tensor.op] != here:
        readers[tensor.ref(), where[tensor.op]] += 1
  live, peak = collections.Counter(), collections.Counter()
  for op, here in where.items():
    for body in bodies(op):
      for inner, size in peaks(body, placement, here).items():
        peak[inner] = max(peak[inner], live[inner] + size)
    for tensor in op.outputs:
      size = _bytes(tensor)
      homes = {here} | {where[r] for r in tensor.consumers() if r in where}
      for home in homes:
        live[home] += size
        peak[home] = max(peak[home], live[home])
      for home in homes:  # Read by nothing: freed once made.
        if not readers[tensor.ref(), home]:
          live[home] -= size
    for tensor in op.inputs:
      homes = {here, where[tensor.op]}
      for home in homes:
        readers[tensor.ref(), home] -= 1
        if not readers[tensor.ref(), home]:
          live[home] -= _bytes(tensor)
  return peak


def _bytes(tensor):
  """Bytes a tensor takes on its own: none for a variable's read or
  handle, a body's argument, or a shape not known."""
  if (tensor.op.type in _ALIASES or tensor.dtype in (tf.resource, tf.variant)
      or not tensor.shape.is_fully_defined()):
    return 0
  return tensor.shape.num_elements() * tensor.dtype.size


def bodies(op):
  """The function graphs `op` runs (calls, loops, branches; a function
  called by its own name), its attributes read only for those."""
  # pylint: disable=protected-access
  called = op.graph._get_function(op.type)
  if called is not None:
    yield called.graph
  for attr in _CALLS.get(op.type, ()):
    body = op.graph._get_function(op.get_attr(attr).name)
    if body is not None:
      yield body.graph
