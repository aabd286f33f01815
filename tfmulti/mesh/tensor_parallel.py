"""Dense layers and convolutions computed where their kernels' blocks live.

A sharded kernel is joined on each clone for its pass (`sharding`), so
each clone holds the layer's whole activations. Where a layout splits a
plain `keras.layers.Dense` or `EinsumDense` kernel, or a plain
channels-last `Conv2D` or `Conv3D` kernel by its channels (its product
'...c,pqcd->...d' taken over its window), along a dimension named by a
*compute axis* (a mesh axis other than the batch axis: what JAX
computes in place), the layer is computed as blocks instead
(Megatron's tensor parallelism, read from Keras's layouts): block j of
the kernel (its shards along that dimension's part j, joined over the
batch axis where the layout splits it there too: sharded storage) is
joined on the device of the clone's mesh row with coordinate j on that
axis, and there it multiplies the rows' features it needs:

  an output dimension split    (column-parallel) block j makes part j of
                               the outputs, its bias and activation
                               added there; the clone keeps the parts
                               where they were made
  an input dimension split     (row-parallel) block j multiplies part j
                               of the inputs' features; the partial
                               sums are added on the clone's device,
                               then its bias and activation

An output's parts stay where they were made for the next layer: a
row-parallel layer takes its input's part j from where a column-parallel
layer made it, through the elementwise ops between them (an activation,
a gate's product: `Parts`), so a column-then-row pair (a feed-forward
block) sends the rows once to each device and the partial sums once
back, and each device holds its part of the block's activations. The
joined output is only a name for its parts: no op runs it unless
another layer reads it whole.

Each part runs under a custom gradient (`on`) that takes its backward
pass on the part's device too: a tape makes each op's gradient where the
gradient is taken, the clone's device. Each block's product is one 2-D
matmul of the rows where the subscripts allow (`_product`). A mesh row
is one clone spanning its devices (Megatron's structure): the clone at
coordinate 0 on the split axes takes the row's rows and traces them
once, each block's product on its device (`sharding.Sharded.leaders`);
the row's other clones hold blocks and take no rows. The tape watches
each block where it is joined; the storage cuts the block's gradient
into its shards' pieces (`sharding.Sharded.met`). Elementwise ops replayed on
parts are differentiated as ops: a custom gradient of theirs
(`tf.nn.silu`'s, which saves memory) gives way to their own, equal to
round-off.
Row-parallel layers add their partial sums in another order than one
device's product (equal to round-off, not to the bit), so
`reproducible_rows` joins the kernels instead. A layer with LoRA,
quantized, a subclass with its own `call` (or `convolution_op`), sparse
inputs, a kernel split along two compute axes, and a convolution
channels-first, grouped or split along its window are computed whole
(joined).
"""

import contextlib
import functools
import inspect
import re

import keras
import numpy as np
import tensorflow as tf

from tfmulti import keras_internals

# The name scope of each part's ops, forward and backward (`on`): what
# crosses into or out of it is a split layer's activations (`traffic`).
SCOPE = 'tensor_parallel'
_IN_SCOPE = re.compile(rf'(^|/){SCOPE}(_\d+)?/')

# One-output ops whose output at a position reads only that position of
# each input (broadcast aside): a part of their output is made from the
# same part of their inputs, on the part's device.
ELEMENTWISE = frozenset((
    'Identity', 'Cast', 'Relu', 'Relu6', 'Elu', 'Selu', 'LeakyRelu',
    'Sigmoid', 'Tanh', 'Softplus', 'Softsign', 'Erf', 'Exp', 'Log', 'Neg',
    'Square', 'Sqrt', 'Rsqrt', 'Abs', 'Mul', 'AddV2', 'Sub', 'RealDiv',
    'Maximum', 'Minimum', 'Pow', 'SquaredDifference'))

# Keras activations that act on each element alone (softmax does not).
ELEMENTWISE_ACTIVATIONS = frozenset((
    'linear', 'relu', 'relu6', 'elu', 'selu', 'leaky_relu', 'gelu', 'silu',
    'swish', 'sigmoid', 'hard_sigmoid', 'hard_silu', 'hard_swish', 'tanh',
    'softplus', 'softsign', 'exponential', 'mish', 'celu', 'sparse_plus',
    'squareplus', 'tanh_shrink', 'hard_tanh', 'soft_shrink', 'hard_shrink'))

# Keras's convolution, Conv2D's and Conv3D's (Conv1D has its own call): a
# layer that keeps both computes as `specs` says; one with its own
# `convolution_op` (a weight-standardized kernel, read whole) does not.
_CONV = (keras.layers.Conv2D.call, keras.layers.Conv2D.convolution_op)


def in_scope(name):
  """Whether the op named `name` is one of a part's (`SCOPE`, which
  TensorFlow numbers on each use)."""
  return bool(_IN_SCOPE.search(name))


def layers(model, axes_of, compute_axes):
  """{id(kernel): (its layer, the kernel's dimension split over a compute
  axis)} of `model`'s plain Dense, EinsumDense and convolution layers
  (`plain`) whose kernel's layout (`axes_of[id(kernel)]`) splits one
  dimension over one of `compute_axes` (a convolution's: a channels' one,
  not its window's)."""
  found = {}
  for layer in keras_internals.flat_layers(model):
    if not plain(layer):
      continue
    axes = axes_of.get(id(layer.kernel))
    split = [d for d, axis in enumerate(axes or ()) if axis in compute_axes]
    if len(split) == 1 and (not _is_conv(layer) or split[0] >= layer.rank):
      found[id(layer.kernel)] = (layer, split[0])
  return found


def _is_conv(layer):
  """Whether `layer` convolves as Keras's Conv2D and Conv3D do."""
  kind = type(layer)
  return (kind.call, getattr(kind, 'convolution_op', None)) == _CONV


def plain(layer):
  """Whether `layer` can compute as blocks: a plain Dense or EinsumDense,
  or a channels-last convolution without groups (Conv2D, Conv3D); none
  with LoRA or quantized."""
  if _is_conv(layer):
    if layer.data_format != 'channels_last' or layer.groups != 1:
      return False
  elif type(layer).call not in (keras.layers.Dense.call,
                                keras.layers.EinsumDense.call):
    return False
  return not (getattr(layer, 'lora_enabled', False)
              or getattr(layer, 'quantization_mode', None))


@contextlib.contextmanager
def computing(layers_and_blocks):
  """Inside, each layer of `layers_and_blocks` (layer, split dimension,
  kernel blocks, their devices) computes as blocks where they are, its
  outputs' parts kept for the next (`Parts`)."""
  parts = Parts()
  with keras_internals.calling(
      [(layer, _call(layer, dim, blocks, homes, parts))
       for layer, dim, blocks, homes in layers_and_blocks]):
    yield


def specs(layer):
  """(inputs, kernel, outputs) subscripts of `layer`'s product (a
  convolution's: its channels; its window's dimensions are never split)."""
  if _is_conv(layer):
    return '...c', 'pqr'[:layer.rank] + 'cd', '...d'
  equation = getattr(layer, 'equation', '...a,ab->...b')  # Dense's.
  operands, outputs = equation.split('->')
  inputs, kernel = operands.split(',')
  return inputs, kernel, outputs


def axis_of(subscripts, label, rank):
  """The axis (counted from the end) of `label` in a tensor of `rank`
  with `subscripts` (which may hold '...')."""
  after = subscripts.split('...')[-1]
  if label in after:
    return after.index(label) - len(after)
  return subscripts.index(label) - rank


def _call(layer, dim, blocks, homes, parts):
  keras_call = type(layer).call.__get__(layer)
  inputs_spec, kernel_spec, outputs_spec = specs(layer)
  label = kernel_spec[dim]
  product = _product(layer)

  def part(x, kernel, *bias):
    """One block's product (with its part of the bias and the activation
    where `bias` is given: a part of the outputs)."""
    y = product(x, tf.cast(kernel, layer.compute_dtype))
    return layer.activation(y + tf.cast(bias[0], y.dtype)) if bias else y

  def call(inputs, training=None):
    if not isinstance(inputs, tf.Tensor):  # Sparse: Keras's own product.
      return keras_call(inputs, **({} if training is None else
                                   {'training': training}))
    pieces = [inputs] * len(blocks)
    if label in inputs_spec:
      pieces = parts.of(inputs, axis_of(inputs_spec, label,
                                        inputs.shape.rank), homes)
    products = functools.partial(_each, part, homes)
    if label not in outputs_spec:  # Partial sums: added here.
      return _finished(layer, tf.add_n(products(list(zip(pieces, blocks)))))
    axis = axis_of(outputs_spec, label, _rank(inputs, inputs_spec,
                                              outputs_spec))
    if activation_name(layer) not in ELEMENTWISE_ACTIVATIONS:  # A softmax.
      return _finished(layer, tf.concat(
          products(list(zip(pieces, blocks))), axis))
    biases = _bias_parts(layer, axis, len(blocks))
    return parts.joined(products(list(zip(pieces, blocks, biases))), axis,
                        homes)
  return call


def _each(part, homes, blocks):
  """`part(rows, *weights)` of each block's (rows, *weights) of
  `blocks` on its home, for this clone's rows."""
  return [on(home, part, *block) for block, home in zip(blocks, homes)]


def _product(layer):
  """`layer`'s product of its inputs by a kernel block: one 2-D matmul of
  the inputs' rows where the subscripts contract the inputs' last
  dimensions with the kernel's first ones (Dense's, and EinsumDense's
  projections: 'bqm,muh->bquh', 'bquh,uhm->bqm'), else Keras's einsum; a
  convolution's, the layer's own.
  Each part is small, and oneDNN's batched matmul of a 3-D input costs
  several times a 2-D matmul of the same rows, forward and backward."""
  if _is_conv(layer):
    return layer.convolution_op
  count = _contracted(*specs(layer))
  if count is None:
    return lambda x, k: keras.ops.einsum(layer.equation, x, k)

  def matmul(x, k):
    if x.shape.rank == 2 and k.shape.rank == 2 and count == 1:
      return tf.matmul(x, k)
    inner = int(np.prod(k.shape[:count]))
    y = tf.matmul(tf.reshape(x, [-1, inner]), tf.reshape(k, [inner, -1]))
    rows = x.shape[:-count]
    if rows.is_fully_defined():
      return tf.reshape(y, rows.as_list() + k.shape[count:].as_list())
    return tf.reshape(y, tf.concat([tf.shape(x)[:-count], k.shape[count:]],
                                   0))
  return matmul


def _contracted(inputs, kernel, outputs):
  """How many of the inputs' last dimensions the subscripts contract with
  the kernel's first ones, the rest kept in order ('...bq' + 'uh'); None
  where they say another product (a label shared by all three or
  repeated, a transposed operand)."""
  shared = [c for c in kernel if c in inputs]
  count = len(shared)
  labels = inputs.replace('...', '') + kernel
  if (not count or len(set(labels)) + count != len(labels)
      or any(c in outputs for c in shared)
      or not inputs.endswith(''.join(shared))
      or not kernel.startswith(''.join(shared))):
    return None
  return count if outputs == inputs[:-count] + kernel[count:] else None


def _rank(inputs, inputs_spec, outputs_spec):
  """The rank of the product of `inputs` by the subscripts."""
  rank = len(outputs_spec.replace('...', ''))
  if '...' in outputs_spec:
    rank += inputs.shape.rank - len(inputs_spec.replace('...', ''))
  return rank


def activation_name(layer):
  """The name of `layer`'s activation, None for one without (a layer, a
  partial): not known to act elementwise."""
  return getattr(layer.activation, '__name__', None)


def _bias_parts(layer, axis, count):
  """`layer`'s bias cut along the outputs' `axis` (counted from the end)
  into `count` parts where it spans it; else itself each (zeros: none)."""
  if layer.bias is None:
    return [tf.zeros([], layer.compute_dtype)] * count
  bias = tf.convert_to_tensor(layer.bias)
  if bias.shape.rank < -axis or bias.shape[axis] == 1:
    return [bias] * count
  return tf.split(bias, count, axis=axis)


def _finished(layer, y):
  """`y` (the whole product) with `layer`'s bias and activation."""
  if layer.bias is not None:
    y = y + tf.cast(tf.convert_to_tensor(layer.bias), y.dtype)
  return layer.activation(y)


def on(home, fn, *inputs):
  """`fn(*inputs)` run on `home`, and its gradient made there too: a tape
  makes each op's gradient on the device current where the gradient is
  taken (the clone's), which would run every part's backward pass on the
  clone. Eagerly (the towers' step is always traced) the forward runs on
  `home` and the backward where the tape's gradient is taken."""
  if tf.executing_eagerly():
    with tf.device(home), tf.name_scope(SCOPE):
      return fn(*inputs)

  @tf.custom_gradient
  def run(*xs):
    with tf.GradientTape() as tape:
      tape.watch(xs)
      y = fn(*xs)

    def gradient(dy):
      with tf.device(home), tf.name_scope(SCOPE):
        return tape.gradient(y, xs, output_gradients=dy)
    return y, gradient
  with tf.device(home), tf.name_scope(SCOPE):  # Its identities too.
    return run(*inputs)


class Parts:
  """The parts of the outputs the split layers made in one pass, each on
  its device, and those of tensors made from them elementwise."""

  def __init__(self):
    self._made = {}  # tensor.ref() -> (axis, parts, homes)

  def joined(self, made, axis, homes):
    """The whole of `made` (parts along `axis`), kept by its parts."""
    whole = tf.concat(made, axis)
    self._made[whole.ref()] = (axis, made, tuple(homes))
    return whole

  def of(self, tensor, axis, homes):
    """`tensor`'s parts along `axis`, one for each of `homes`: where they
    were made (`joined`, and what elementwise ops made of them), else
    split here and each sent to its home."""
    found = self._derived(tensor, axis, tuple(homes))
    if found is not None:
      return found
    return tf.split(tensor, len(homes), axis=axis)

  def _derived(self, tensor, axis, homes):
    """`tensor`'s parts made where the parts it is made of live: known,
    or each part's elementwise ops replayed on its device as one pass
    (`on`: a tensor two of them read has its gradients added there
    too), or None."""
    known = self._made.get(tensor.ref())
    if known is not None:
      return known[1] if known[0] == axis and known[2] == homes else None
    if tf.executing_eagerly():
      return None
    found = self._chain(tensor, axis, homes)
    if found is None or not any(kind == 'parts'
                                for kind, _ in found[1].values()):
      return None
    steps, leaves = found
    values = {key: (value if kind == 'parts' else
                    [value] * len(homes) if kind == 'whole' else
                    tf.split(value, len(homes), axis=axis))
              for key, (kind, value) in leaves.items()}
    made = [on(home, functools.partial(_replay, steps, list(values), tensor),
               *[parts[j] for parts in values.values()])
            for j, home in enumerate(homes)]
    self._made[tensor.ref()] = (axis, made, homes)
    return made

  def _chain(self, tensor, axis, homes, seen=None):
    """(steps, leaves) that make `tensor`'s parts elementwise: the
    elementwise tensors on the way ({ref: tensor}, inputs first) and
    what they start from ({ref: ('parts', known parts) | ('whole', a
    tensor each part reads whole, broadcast) | ('split', a tensor to
    split)}); None where `tensor` is not made elementwise. `seen`: the
    chains found so far (a tensor two ops read is walked once)."""
    seen = {} if seen is None else seen
    if tensor.ref() not in seen:
      seen[tensor.ref()] = self._walked(tensor, axis, homes, seen)
    return seen[tensor.ref()]

  def _walked(self, tensor, axis, homes, seen):
    known = self._made.get(tensor.ref())
    if known is not None:
      if known[0] != axis or known[2] != homes:
        return None
      return {}, {tensor.ref(): ('parts', known[1])}
    op = tensor.op
    if op.type == 'IdentityN':  # A custom gradient's: the output is input.
      inputs = [op.inputs[tensor.value_index]]
    elif op.type in ELEMENTWISE:
      inputs = list(op.inputs)
    else:
      return None
    steps, leaves = {}, {}
    for x in inputs:
      if x.shape.rank is None:
        return None
      found = None
      if x.shape.rank < -axis or x.shape[axis] == 1:  # Broadcast.
        leaves[x.ref()] = ('whole', x)
      else:
        found = self._chain(x, axis, homes, seen)
      if found is not None:
        steps.update(found[0])
        leaves.update(found[1])
      elif x.ref() not in leaves:
        leaves[x.ref()] = ('split', x)
    steps[tensor.ref()] = tensor
    return steps, leaves


def _replay(steps, keys, target, *values):
  """`target` made again of `values` (those of the leaves `keys`) by
  `steps` (`Parts._chain`), each op with its attributes kept."""
  made = dict(zip(keys, values))
  for key, tensor in steps.items():
    op = tensor.op
    if op.type == 'IdentityN':
      made[key] = made[op.inputs[tensor.value_index].ref()]
      continue
    run = getattr(tf.raw_ops, op.type)
    given = inspect.signature(run).parameters
    attributes = {k: op.get_attr(k) for k in op.node_def.attr if k in given}
    names = [arg.name for arg in op.op_def.input_arg]
    made[key] = run(**dict(zip(names, [made[x.ref()] for x in op.inputs])),
                    **attributes)
  return made[target.ref()]


def homes(mesh_shape, here, axis, count):
  """The flat mesh indices of the devices of `here`'s mesh row along
  `axis` (the device with each coordinate 0..count-1 on it)."""
  coordinates = list(np.unravel_index(here, mesh_shape))
  found = []
  for j in range(count):
    coordinates[axis] = j
    found.append(int(np.ravel_multi_index(coordinates, mesh_shape)))
  return found
