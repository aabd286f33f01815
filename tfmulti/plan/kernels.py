"""A step's heavy ops as kernels to time alone: what a device model measures.

A FLOP rate says little of a small convolution: on a CPU, oneDNN's
kernels for a few channels, and a convolution's gradients, run far
below a matmul's rate. So a plan for the devices a job
runs on here times each distinct heavy op of its step by itself, on
every device at once (`measure`), and the device model takes that time
in place of its estimate (`device_model.device_seconds`).

`of(op)` is an op's `Kernel` (its type, its attributes and its inputs'
shapes and dtypes: what its time depends on), or None for an op that
computes little (under `MIN_FLOPS`, or fewer FLOPs than the bytes it
writes: an elementwise op, which a step runs in place on warm memory
and its bytes at the measured rate estimate well), reads a
variable or a resource, is stateful, has an input of unknown shape, or
an integer input whose value the graph does not fix (made up, a size of
zero would time nothing). A kernel is rebuilt alone from its `NodeDef`:
constant inputs, and integer ones the graph fixes (a gradient's shape
read from its variable's), as they are; the others as arguments of
random values.
"""

import dataclasses
import statistics
import time

import numpy as np
import tensorflow as tf

from tfmulti import keras_internals

MIN_FLOPS = 2**20  # An op that computes less: its estimate stands.
COPIES = 4  # The runs a device a kernel's time is the difference of.
_NO_VALUES = (tf.resource, tf.variant, tf.string)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """An op to time alone: a serialized `GraphDef` of the op (named 'op')
  and its inputs (constants, or placeholders 'in0', 'in1', ...: their
  (shape, dtype name) in `inputs`), its FLOPs and the bytes it writes."""
  graph_def: bytes
  inputs: tuple
  flops: int
  written_bytes: int


def written_bytes(op):
  """The bytes of `op`'s outputs whose shapes are known: what it writes
  (and its readers read), the memory traffic of an op that computes
  little."""
  return sum(output.shape.num_elements() * output.dtype.size
             for output in op.outputs
             if output.shape.is_fully_defined() and
             output.dtype not in _NO_VALUES)


def of(op):
  """`op`'s `Kernel`, or None (see the module)."""
  flops, written = keras_internals.node_flops(op), written_bytes(op)
  if (flops < max(MIN_FLOPS, written) or keras_internals.is_stateful(op) or
      any(t.dtype in _NO_VALUES or not t.shape.is_fully_defined()
          for t in list(op.inputs) + op.outputs) or
      any(not t.dtype.is_floating and _fixed(t) is None for t in op.inputs)):
    return None
  return _alone(op, flops, written)


def _alone(op, flops, written):
  """`op` as a `Kernel` (`of` says which ops are)."""
  graph_def = tf.compat.v1.GraphDef()
  inputs = []
  for index, tensor in enumerate(op.inputs):
    node = graph_def.node.add()
    if tensor.op.type == 'Const':
      node.CopyFrom(tensor.op.node_def)
      del node.input[:]  # Its control inputs: the step's order.
    elif not tensor.dtype.is_floating:
      node.op = 'Const'
      node.attr['dtype'].type = tensor.dtype.as_datatype_enum
      node.attr['value'].tensor.CopyFrom(tf.make_tensor_proto(
          _fixed(tensor), tensor.dtype))
    else:
      node.op = 'Placeholder'
      node.attr['dtype'].type = tensor.dtype.as_datatype_enum
      node.attr['shape'].shape.CopyFrom(tensor.shape.as_proto())
      inputs.append((tuple(tensor.shape.as_list()), tensor.dtype.name))
    node.name = f'in{index}'
    node.ClearField('device')
  node = graph_def.node.add()
  node.CopyFrom(op.node_def)
  node.name = 'op'
  node.ClearField('device')
  del node.input[:]
  node.input.extend(f'in{i}' for i in range(len(op.inputs)))
  return Kernel(graph_def.SerializeToString(deterministic=True),
                tuple(inputs), flops, written)


def _fixed(tensor):
  """The value the graph fixes for an integer `tensor` (a size, an axis,
  a shape: `ShapeN`'s too, which gradients read), or None."""
  if tensor.op.type == 'ShapeN':
    shape = tensor.op.inputs[tensor.value_index].shape
    return (np.array(shape.as_list(), tensor.dtype.as_numpy_dtype)
            if shape.is_fully_defined() else None)
  return tf.get_static_value(tensor)


def measure(kernels, device_names, repeats=5):
  """{kernel: seconds} of each of `kernels` run alone on every device of
  `device_names` at once (logical CPUs sharing the cores): a device's
  share of the time `COPIES` more runs of it a device add to a call
  (each on its own values: no two alike to merge), so that a call's own
  cost cancels and an op's dispatch counts, as in a step."""
  return {kernel: max(_seconds(kernel, device_names, 1 + COPIES, repeats) -
                      _seconds(kernel, device_names, 1, repeats), 0.0) /
          (COPIES * len(device_names)) for kernel in kernels}


def rebuilt(kernel, device_names, copies=1):
  """A traced function that runs `kernel` alone `copies` times on each of
  `device_names`, the i-th run of each on the i-th set of values of its
  placeholders (the function's arguments, set after set); returns its
  outputs."""
  graph_def = tf.compat.v1.GraphDef.FromString(kernel.graph_def)
  names = [f'{node.name}:0' for node in graph_def.node
           if node.op == 'Placeholder']

  @tf.function(autograph=False)  # Python builds it: no loop to convert.
  def run(*values):
    outputs = []
    for device in device_names:
      for copy in range(copies):
        fed = values[copy * len(names):(copy + 1) * len(names)]
        with tf.device(device):
          outputs += tf.graph_util.import_graph_def(
              graph_def, dict(zip(names, fed)), return_elements=['op'],
              name='kernel')[0].outputs
    return outputs
  return run


def _seconds(kernel, device_names, copies, repeats):
  """The median seconds of a call of the kernel rebuilt `copies` times on
  every device, on random values."""
  rng = tf.random.Generator.from_seed(0)
  values = [rng.normal(shape, dtype=dtype)
            for _ in range(copies) for shape, dtype in kernel.inputs]
  run = rebuilt(kernel, device_names, copies)
  run(*values)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run(*values)
    times.append(time.perf_counter() - start)
  return statistics.median(times)
