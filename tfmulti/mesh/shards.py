"""A sharded variable's tensors cut into its shards and joined back.

A dimension a mesh axis names is cut into that axis's device count of
parts (`part_sizes`: equal where the count divides it, else as even as
they go); a value is cut into its shards in row-major order over its
grid of parts (`cut`), joined from them in one copy (`join`), and a
gradient's `tf.IndexedSlices` cut into each shard's slices (`cut_slices`).
"""

import math

import numpy as np
import tensorflow as tf

from tfmulti.mesh import lookups


def part_sizes(size, n):
  """The sizes of a dimension of `size` (at least `n`) cut into `n` parts:
  equal where `n` divides it, else as even as they go, the first ones an
  entry more (a table of 13 rows over 4: 4, 3, 3, 3; none empty)."""
  small, more = divmod(size, n)
  return [small + 1] * more + [small] * (n - more)


def join(parts, shards):
  """The whole tensor of `shards` (row-major over `parts`, the parts along
  each dimension), joined on the current device in one copy: a concat
  where one dimension is split; where several are, one stitch of the
  shards' rows into the whole's (a concat a dimension would copy the
  bytes once a dimension), or, for shards of unequal sizes, a concat a
  dimension."""
  split = [dim for dim, n in enumerate(parts) if n > 1]
  if len(split) <= 1:  # One shard (axes of size 1), or one dimension.
    return tf.concat(shards, axis=split[0]) if split else shards[0]
  if len({tuple(shard.shape) for shard in shards}) > 1:
    for dim in reversed(split):  # The last dimension's first.
      shards = [tf.concat(shards[i:i + parts[dim]], axis=dim)
                for i in range(0, len(shards), parts[dim])]
    return shards[0]
  whole = [n * d for n, d in zip(parts, shards[0].shape)]
  last = split[-1]
  # The whole as rows, each a shard's slab past its dimensions before
  # `last` (its part of `last` and all after): each shard is stitched as
  # it is, its index a row number for each of its leading positions.
  rows = np.arange(math.prod(whole[:last]) * parts[last]).reshape(
      whole[:last] + [parts[last]])
  indices = [tf.constant(block[..., 0], tf.int32)
             for block in cut(parts[:last + 1], rows)]
  stitched = tf.dynamic_stitch(indices, shards)
  return tf.reshape(stitched, whole)


def joined(parts, shards):
  """`join` under the name scope 'gather_shards' (a gather's ops, as the
  step's readers and tests find them)."""
  with tf.name_scope('gather_shards'):
    return join(parts, shards)


def cut(parts, value):
  """`value` (a tensor, or an array) cut into shards along each dimension
  (`part_sizes`), in row-major order."""
  shards = [value]
  for dim, n in enumerate(parts):
    if n > 1:
      shards = [s for whole in shards for s in _split(whole, n, dim)]
  return shards


def _split(value, n, dim):
  sizes = part_sizes(value.shape[dim], n)
  if isinstance(value, np.ndarray):
    return np.split(value, np.cumsum(sizes)[:-1], axis=dim)
  return tf.split(value, n if len(set(sizes)) == 1 else sizes, axis=dim)


def cut_slices(parts, value, shape):
  """`value` (`tf.IndexedSlices` of a whole variable of `shape`) cut into
  its shards' slices, in row-major order: along the first dimension each
  row goes to its shard (in the order it came), along another each
  slice's values are split."""
  shards = [(value, list(shape))]
  for dim, n in enumerate(parts):
    if n > 1:
      shards = [piece for whole, whole_shape in shards
                for piece in _cut_slices(whole, n, dim, whole_shape)]
  return [s for s, _ in shards]


def _cut_slices(value, n, dim, shape):
  """`value`'s n slices along `dim` of a variable of `shape`, each with
  its shard's shape: [(slices, shape)]."""
  sizes = part_sizes(shape[dim], n)
  shapes = [shape[:dim] + [size] + shape[dim + 1:] for size in sizes]
  dense = [tf.constant(s, value.dense_shape.dtype) for s in shapes]
  if dim:
    pieces = [tf.IndexedSlices(v, value.indices, d) for v, d in zip(
        _split(value.values, n, dim), dense)]
  else:
    owner, local = lookups.owners(value.indices, sizes)
    pieces = [tf.IndexedSlices(v, i, d) for v, i, d in zip(
        tf.dynamic_partition(value.values, owner, n),
        tf.dynamic_partition(local, owner, n), dense)]
  return list(zip(pieces, shapes))
