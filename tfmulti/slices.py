"""Gradients that stay sparse: an Embedding's `tf.IndexedSlices`.

Keras's TensorFlow backend hands an optimizer an Embedding's gradient as
`tf.IndexedSlices`, one slice a looked-up row, in row order (a row looked
up twice has two slices), and its optimizers apply each slice: Adam
squares each before duplicates meet, so Adam on the slices is not Adam on
their dense sum. The towers therefore never make slices dense: the
pieces' slices (each already weighted by its rows, as a dense gradient
is) meet by concatenation in row order, as tf.distribute's all-reduce
joins them (`cross_device_utils.aggregate_tensors_or_indexed_slices`), and
the optimizer receives the slices one device would have. Concatenation
does no arithmetic, so it is exact on every layout; and slices move the
rows a step touched, not the whole table.

But for a lookup whose indices do not come from the rows (positions
`arange(maxlen)`, a fixed row, a learned query table): one device looks
those rows up once a batch and gives each one slice, summed over the
batch; every piece looks up the same rows, so joined they would be one
slice a piece. `fixed_lookups` finds such gradients where the pieces'
gradients are traced, and `collapsed` sums their copies of each row, in
piece order, before the optimizer sees them.
"""

import tensorflow as tf

from tfmulti import keras_internals


def is_sparse(gradient):
  """Whether `gradient` is `tf.IndexedSlices`."""
  return isinstance(gradient, tf.IndexedSlices)


def concat(parts):
  """`tf.IndexedSlices` `parts` of one variable joined in order (their
  slices one after another)."""
  if len(parts) == 1:
    return parts[0]
  return tf.IndexedSlices(tf.concat([p.values for p in parts], axis=0),
                          tf.concat([p.indices for p in parts], axis=0),
                          parts[0].dense_shape)


def add(parts, name=None):
  """Gradients `parts` of one variable (in row order) combined: slices
  joined (`concat`); dense ones, or a mix (as a tape aggregates one),
  summed by `tf.add_n`."""
  if all(is_sparse(p) for p in parts):
    return concat(parts)
  return tf.add_n([tf.convert_to_tensor(p) for p in parts], name=name)


def components(tensors):
  """`tensors` as plain tensors: each one, or a slice's values and indices
  (for what takes tensors alone: a `tf.TensorArray`, an all-gather)."""
  return [part for t in tensors for part in (
      (t.values, t.indices) if is_sparse(t) else (t,))]


def from_components(like, parts):
  """The tensors `components(like)` gave, rebuilt from `parts` (the same
  components, joined or gathered)."""
  parts = iter(parts)
  return [tf.IndexedSlices(next(parts), next(parts), t.dense_shape)
          if is_sparse(t) else next(parts) for t in like]


def none_like(gradient):
  """What adds nothing to `gradient` in an all-reduce: slices of no rows
  (zero-valued slices would still move an optimizer's slots), or dense
  zeros."""
  if is_sparse(gradient):
    return tf.IndexedSlices(gradient.values[:0], gradient.indices[:0],
                            gradient.dense_shape)
  return tf.zeros_like(gradient)



# Ops that read a resource but give a variable's value, not a step's rows.
_VARIABLE_READS = frozenset({'ReadVariableOp'})
_CALLS = frozenset({'PartitionedCall', 'StatefulPartitionedCall'})


def fixed_rows(tensor):
  """Whether `tensor` (traced) is computed from constants and variables'
  values alone: not from a step's rows (the step's arguments, an
  iterator's next element), nor from a stateful op (a random draw) or
  anything else that reads a resource but a variable (a loop over a
  variable: counted as rows). A call (an
  XLA-compiled pass) is followed into its function, and its arguments
  back to the caller's tensors."""
  if not hasattr(tensor, 'op'):
    return False  # Eager: nothing to read.
  seen, todo = set(), [(tensor, ())]
  while todo:
    tensor, calls = todo.pop()
    op = tensor.op
    if (tensor.ref(), calls) in seen or op.type in _VARIABLE_READS or (
        op.type == 'Const') or tensor.dtype == tf.resource:
      continue
    seen.add((tensor.ref(), calls))
    if op.type in _CALLS:
      function = keras_internals.function_of(op.graph, op.get_attr('f').name)
      todo.append((function.graph.outputs[tensor.value_index],
                   calls + (op,)))
    elif op.type == 'Placeholder':
      if not calls:
        return False  # The step's own arguments: its rows.
      argument = [t.ref() for t in op.graph.inputs].index(tensor.ref())
      todo.append((calls[-1].inputs[argument], calls[:-1]))
    elif op.type == 'ResourceGather':  # A variable's rows at indices.
      todo.append((op.inputs[1], calls))
    elif op.op_def.is_stateful or any(
        t.dtype == tf.resource for t in op.inputs):
      return False  # An iterator's next rows, a random draw, a loop.
    else:
      todo.extend((t, calls) for t in op.inputs)
  return True


def fixed_lookups(gradients_by_piece):
  """Per variable, whether its gradient is slices of a lookup whose
  indices are `fixed_rows` in some piece (a clone's, traced), so that
  every piece gives the same rows' slices: `collapsed` sums those."""
  return [any(is_sparse(g) and fixed_rows(g.indices) for g in grads)
          for grads in zip(*gradients_by_piece)]


def collapsed(gradient):
  """Slices `gradient` with the copies of each row summed in their order
  (the pieces' copies of a `fixed_lookups` row: one device's one slice
  of it). A left fold from zero, in piece order, so the same pieces in
  the same order give the same bits on every layout."""
  rows, at = tf.unique(gradient.indices)
  return tf.IndexedSlices(
      tf.math.unsorted_segment_sum(gradient.values, at, tf.shape(rows)[0]),
      rows, gradient.dense_shape)
