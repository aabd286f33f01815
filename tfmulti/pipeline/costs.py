"""What each layer of a functional Keras model costs, for cutting stages.

`estimated_costs` reads the shapes: a layer with a kernel does
kernel_size / output_channels multiply-adds per output element (exact for
Dense and convolutions), any other operation one unit per output element.
It is free, and blind to what multiply-adds do not count: reading large
weights, summing their gradients, small kernels that use a device poorly.
`measured_costs` times each layer's forward and backward pass on random
inputs of its shapes, on the current device, without changing the model.
"""

import functools
import math
import time

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import step_options

# The kinds of cost, named where the step options choose them.
ESTIMATED, MEASURED = step_options.ESTIMATED, step_options.MEASURED
KINDS = step_options.STAGE_COSTS


def median_seconds(run, repeats=3):
  """The median seconds of `run()` (which waits for its result)."""
  run()  # Traces the first time; warms caches after that.
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    seconds.append(time.perf_counter() - start)
  return sorted(seconds)[len(seconds) // 2]


def operations(model):
  """The model's operations (inputs excluded), in order, with their nodes.

  Raises:
    errors.ConfigError: not a functional model, or a layer called more
      than once (stages cut each layer once).
  """
  if not keras_internals.is_functional(model):
    raise errors.ConfigError(
        f'model {model.name!r} ({type(model).__name__}) is no graph of '
        'layers to cut into stages: build it functional (keras.Model('
        'inputs, outputs)), or train it without stages (the towers clone '
        'any Keras model).')
  found = []
  for operation in model.operations:
    if isinstance(operation, keras.layers.InputLayer):
      continue
    nodes = keras_internals.operation_nodes(model, operation)
    if len(nodes) != 1:
      raise errors.ConfigError(
          f'layer {operation.name!r} is called {len(nodes)} times in '
          f'{model.name!r}; stages need each layer called once.')
    found.append((operation, nodes[0]))
  return found


def _size(shape):
  return math.prod(d for d in shape[1:] if d is not None)


def operation_cost(operation, output_shapes):
  """An estimate of `operation`'s cost per example, in multiply-adds."""
  outputs = sum(_size(shape) for shape in output_shapes)
  kernel = getattr(operation, 'kernel', None)
  if isinstance(kernel, keras.Variable) and output_shapes[0][-1]:
    return outputs * (1 + math.prod(kernel.shape) / output_shapes[0][-1])
  return float(outputs)


def estimated_costs(model):
  """[(layer name, estimated multiply-adds per example)], in order."""
  return [(op.name, operation_cost(op, [t.shape for t in node.output_tensors]))
          for op, node in operations(model)]


def _forward_backward(operation, node, inputs):
  """`operation` on `inputs` (its node's input tensors), and its gradient,
  reduced to one number; statelessly, so BatchNorm statistics stay."""
  values = dict(zip((id(t) for t in node.input_tensors), inputs))
  args, kwargs = node.arguments.fill_in(values)
  with tf.GradientTape() as tape:
    tape.watch(inputs)
    if isinstance(operation, keras.layers.Layer):
      trainable = [v.value for v in operation.trainable_variables]
      tape.watch(trainable)
      if keras_internals.takes_training(operation):
        kwargs['training'] = True
      outputs, _ = operation.stateless_call(
          trainable, [v.value for v in operation.non_trainable_variables],
          *args, **kwargs)
    else:
      trainable, outputs = [], operation(*args, **kwargs)
    total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                      for o in keras.tree.flatten(outputs)])
  grads = tape.gradient(total, trainable + list(inputs))
  return total + tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32))
                           for g in grads if g is not None] + [0.0])


def measured_costs(model, rows=8):
  """[(layer name, seconds of its forward and backward pass on `rows`
  random rows)], in order, on the current device (median of 3)."""
  found = []
  for op, node in operations(model):
    inputs = [tf.random.uniform((rows, *t.shape[1:]), dtype=t.dtype)
              for t in node.input_tensors]
    step = tf.function(functools.partial(_forward_backward, op, node))
    found.append((op.name, median_seconds(
        lambda step=step, inputs=inputs: float(step(inputs)))))
  return found


# Each `stage_costs` name's costs.
BY_NAME = {ESTIMATED: estimated_costs, MEASURED: measured_costs}
