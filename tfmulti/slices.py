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
"""

import tensorflow as tf


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

