"""A layout map derived from a model (`layout_map='auto'`).

Megatron's rules, read from how the model uses its variables, on a mesh
as Keras names its axes:

  a compute axis   (the first mesh axis other than the batch axis, of more
                   than one device) splits plain Dense, EinsumDense and
                   convolution kernels (`tensor_parallel`): a kernel whose
                   inputs are made, through elementwise ops alone, by
                   split kernels' outputs is split by its inputs (a row
                   kernel: the second of a feed-forward pair), those
                   kernels by their outputs (columns), and every other by
                   its outputs; an EinsumDense's first output dimension
                   is its heads (attention's query, key and value) and
                   its first contracted one, where it contracts two, the
                   heads its output projection reads (a row kernel);
                   an Embedding table splits by rows
  the batch axis   (of more than one device) splits each variable's
                   largest dimension the compute axis leaves, where it
                   divides: storage joined for the pass (FSDP)

A variable under `MIN_BYTES`, one whose dimensions do not divide, a
non-trainable one and one with a constraint stay whole; every variable
gets its own rule (its path, escaped), so no variable is laid out by
falling through, and the large ones left whole are logged with why; with
`plan_tables`, the plain Embedding tables are left to `table_plan`.
Which kernels pair is read from one trace of the model's forward pass on
its input specs (a functional model's inputs, or the shape it was built
on); without one, no kernel is a row kernel.
"""

import re

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmulti import keras_internals
from tfmulti.mesh import lookups
from tfmulti.mesh import tensor_parallel

# Variables smaller than this stay whole: a shard of one on 8 devices
# would be under 8 KiB, less than what its join costs to send.
MIN_BYTES = 64 * 1024


def rules_for(layouts, model, min_bytes=MIN_BYTES):
  """The (key, axes) rules of `model`'s variables on `layouts`' mesh, one
  rule a variable (its path, escaped)."""
  compute = next((a for a in layouts.compute_axes
                  if layouts.parts_of(a) > 1), None)
  batch = layouts.batch_axis if layouts.parts_of(layouts.batch_axis) > 1 \
      else None
  roles = _roles(model) if compute else {}
  kernels = {id(layer.kernel): layer
             for layer in keras_internals.flat_layers(model)
             if tensor_parallel.plain(layer)}
  tables = {id(layer.embeddings) for layer in keras_internals.flat_layers(
      model) if isinstance(layer, keras.layers.Embedding)}
  planned = lookups.tables(model, tables) if layouts.plan_tables else {}
  rules, whole = [], []
  for variable in (v for v in model.variables if id(v) not in planned):
    axes, why = _axes(layouts, variable, min_bytes, compute, batch,
                      _compute_dim(variable, kernels, tables, roles))
    rules.append((re.escape(variable.path), axes))
    if why and _bytes(variable) >= min_bytes:
      whole.append(f'{variable.path} {tuple(variable.shape)} ({why})')
  named = [a for _, axes in rules for a in axes if a]
  logging.info("layout_map='auto': %d of %d variables split (%s).",
               sum(any(axes) for _, axes in rules), len(rules),
               ', '.join(f'{named.count(a)} over {a!r}'
                         for a in (compute, batch) if a) or 'none')
  if whole:
    logging.info("layout_map='auto' leaves %d variables of %s bytes or "
                 'more whole: %s.', len(whole), f'{min_bytes:,}',
                 '; '.join(whole))
  return tuple(rules)


def _axes(layouts, variable, min_bytes, compute, batch, compute_dim):
  """(axes, why it is whole or None) of one variable."""
  rank = len(variable.shape)
  axes = [None] * rank
  if not variable.trainable:
    return tuple(axes), 'not trainable'
  if variable.constraint is not None or variable.overwrite_with_gradient:
    return tuple(axes), 'a constraint reads it whole'
  if _bytes(variable) < min_bytes:
    return tuple(axes), 'small'
  if compute and compute_dim is not None and (
      variable.shape[compute_dim] % layouts.parts_of(compute) == 0):
    axes[compute_dim] = compute
  if batch:
    free = [d for d in range(rank) if axes[d] is None and
            variable.shape[d] % layouts.parts_of(batch) == 0]
    if free:
      axes[max(free, key=lambda d: (variable.shape[d], -d))] = batch
  if not any(axes):
    return tuple(axes), 'no dimension divides by its axis'
  return tuple(axes), None


def _compute_dim(variable, kernels, tables, roles):
  """The dimension of `variable` the compute axis splits, or None: a
  plain layer's kernel by its role, a table by its rows."""
  if id(variable) in tables:
    return 0
  layer = kernels.get(id(variable))
  if layer is None:
    return None
  inputs, kernel, outputs = tensor_parallel.specs(layer)
  contracted = [d for d, c in enumerate(kernel)
                if c in inputs and c not in outputs]
  made = [d for d, c in enumerate(kernel) if c in outputs and c not in inputs]
  role = roles.get(id(variable))
  if contracted and (role == 'row' or (len(contracted) > 1 and
                                       role != 'column')):
    return contracted[0]  # A row kernel, or heads an output reads.
  return made[0] if made else None


def _bytes(variable):
  return int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize


def _roles(model):
  """{id(kernel): 'column' | 'row'} of the plain layers that pair, read
  from one trace of the model's forward pass ({} where none can be)."""
  specs = _input_specs(model)
  if specs is None:
    logging.info("layout_map='auto': model %r has no input shapes to "
                 'trace; its kernels are split by their outputs, none '
                 'paired.', model.name)
    return {}
  layers = [layer for layer in keras_internals.flat_layers(model)
            if tensor_parallel.plain(layer)]
  seen = []  # (layer, its inputs, its output) in call order.

  def recording(layer):
    own = type(layer).call.__get__(layer)

    def call(inputs, *args, **kwargs):
      output = own(inputs, *args, **kwargs)
      seen.append((layer, inputs, output))
      return output
    return call
  with keras_internals.calling([(layer, recording(layer))
                                for layer in layers]):
    tf.function(lambda inputs: model(inputs, training=False),
                autograph=False).get_concrete_function(specs)
  return _paired(seen)


def _paired(seen):
  """Roles from the recorded calls: a layer called once whose inputs are
  made elementwise from split kernels' outputs alone is a row, they
  columns (a column already a row stays one, and its reader unpaired)."""
  made_by = {}
  for layer, _, output in seen:
    if isinstance(output, tf.Tensor):
      made_by[output.ref()] = layer
  calls = {}
  for layer, _, _ in seen:
    calls[id(layer)] = calls.get(id(layer), 0) + 1
  roles = {}
  for layer, inputs, _ in seen:
    if calls[id(layer)] > 1 or not isinstance(inputs, tf.Tensor):
      continue
    sources = _sources(inputs, made_by)
    if not sources or any(
        calls[id(s)] > 1 or roles.get(id(s.kernel)) == 'row' or
        tensor_parallel.activation_name(s) not in
        tensor_parallel.ELEMENTWISE_ACTIVATIONS for s in sources):
      continue
    roles[id(layer.kernel)] = 'row'
    for source in sources:
      roles[id(source.kernel)] = 'column'
  return roles


def _sources(tensor, made_by):
  """The plain layers whose outputs make `tensor` through elementwise ops
  alone (`tensor_parallel.ELEMENTWISE`, a custom gradient's identities,
  broadcast operands aside); None where anything else makes it."""
  found, stack, seen = [], [tensor], set()
  while stack:
    x = stack.pop()
    if x.ref() in seen:
      continue
    seen.add(x.ref())
    if x.ref() in made_by:
      found.append(made_by[x.ref()])
    elif x.op.type == 'IdentityN':
      stack.append(x.op.inputs[x.value_index])
    elif x.op.type in tensor_parallel.ELEMENTWISE:
      stack.extend(i for i in x.op.inputs
                   if i.shape.rank == x.shape.rank and
                   i.shape[-1] == x.shape[-1])
    elif x.op.type != 'Const' and x.op.type != 'ReadVariableOp':
      return None
  return list({id(layer): layer for layer in found}.values())


def _input_specs(model):
  """`tf.TensorSpec`s of `model`'s inputs (a nest), or None unknown."""
  if keras_internals.is_functional(model):
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype), model.input)
  shape = keras_internals.build_input_shape(model)
  if shape is None or not all(isinstance(d, (int, type(None)))
                              for d in shape):
    return None
  return tf.TensorSpec(shape, model.input_dtype)
