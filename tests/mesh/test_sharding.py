"""Shards joined and gradients cut: the whole's bits, in one copy, and an
Embedding's gradient kept as slices."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.mesh import sharding
from tfmulti.mesh import shards as shards_lib

GRIDS = [((8, 12), (1, 1)), ((8, 12), (1, 3)), ((8, 12), (2, 1)),
         ((8, 12), (2, 3)),
         ((4, 6, 10), (2, 1, 5)), ((4, 6, 10), (1, 2, 5)),
         ((6, 4, 10), (3, 2, 1)), ((4, 6, 10), (2, 3, 5)),
         # Unequal parts: no count divides its dimension.
         ((13, 4), (4, 1)), ((5, 7), (2, 3)), ((5, 7, 3), (2, 3, 2))]


@pytest.mark.parametrize('shape, parts', GRIDS)
def test_join_undoes_cut(shape, parts):
  whole = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  shards = shards_lib.cut(parts, tf.constant(whole))
  assert [tuple(s.shape) for s in shards] == list(itertools.product(*(
      shards_lib.part_sizes(d, n) for d, n in zip(shape, parts))))
  np.testing.assert_array_equal(shards_lib.join(parts, shards), whole)
  as_arrays = shards_lib.cut(parts, whole)  # An array's cut: the same.
  for array, shard in zip(as_arrays, shards):
    np.testing.assert_array_equal(array, shard)


@pytest.mark.parametrize('size, n, sizes', [
    (12, 4, [3, 3, 3, 3]), (13, 4, [4, 3, 3, 3]), (251, 2, [126, 125]),
    (7, 7, [1] * 7), (4001, 4, [1001, 1000, 1000, 1000])])
def test_parts_are_as_even_as_they_go_the_first_ones_longer(size, n, sizes):
  assert shards_lib.part_sizes(size, n) == sizes


@pytest.mark.parametrize('parts, copies', [
    ((1, 4), {'ConcatV2': 1}), ((2, 2), {'DynamicStitch': 1, 'Reshape': 1})])
def test_a_join_copies_the_bytes_once(parts, copies):
  """One copy of the bytes, and no op a shard but the stitch's index."""
  shards = [tf.TensorSpec((4, 3), tf.float32)] * 4
  graph = tf.function(lambda *s: shards_lib.join(parts, list(s))
                      ).get_concrete_function(*shards).graph
  types = [op.type for op in graph.get_operations()]
  assert {t: types.count(t) for t in ('ConcatV2', 'DynamicStitch', 'Reshape')
          if t in types} == copies


@pytest.mark.parametrize('shape, parts', [
    ((8, 16), (2, 1)), ((8, 16), (1, 4)), ((8, 16), (2, 4)),
    ((7, 5), (3, 2)), ((13, 6), (4, 1))])
def test_an_embeddings_gradient_is_cut_into_slices(shape, parts):
  table = tf.constant(np.arange(np.prod(shape), dtype=np.float32).reshape(
      shape))
  ids = tf.constant([5, 0, 5, 6, 2])
  with tf.GradientTape() as tape:
    tape.watch(table)
    loss = tf.reduce_sum(tf.gather(table, ids) * tf.range(
        float(shape[1])))
  gradient = tape.gradient(loss, table)
  assert isinstance(gradient, tf.IndexedSlices)
  storage = sharding.Sharded([], [parts], [], [table.shape])
  pieces = storage.cut_gradients([gradient])
  assert all(p.dense_shape.dtype == gradient.dense_shape.dtype
             for p in pieces)
  assert all(isinstance(p, tf.IndexedSlices) for p in pieces)
  want = shards_lib.cut(parts, tf.convert_to_tensor(gradient))
  for piece, dense in zip(pieces, want):  # Each its own shard's shape.
    assert list(piece.dense_shape.numpy()) == list(dense.shape)
    np.testing.assert_array_equal(tf.convert_to_tensor(piece), dense)
  # Each shard keeps its ids' slices apart, in the order they came, as
  # one device's optimizer would apply them.
  sizes = shards_lib.part_sizes(shape[0], parts[0])
  starts = np.cumsum([0] + sizes)
  for i in range(parts[0]):
    mine = [int(r) - starts[i] for r in ids
            if starts[i] <= int(r) < starts[i + 1]]
    assert list(pieces[i * parts[1]].indices.numpy()) == mine


def test_a_compiled_pass_returns_whole_gradients_and_they_are_cut_after():
  """An XLA-compiled pass returns the joined table's slices; the cut into
  shards, in numbers that vary, runs after it."""
  table = tf.Variable(np.arange(8 * 4, dtype=np.float32).reshape(8, 4))
  storage = sharding.Sharded([], [(2, 2)], [], [table.shape])

  def body(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.gather(table, ids))
    return 0, loss, 0, [tape.gradient(loss, table)], 0

  run = storage.cutting(tf.function(body, jit_compile=True))
  pieces = tf.function(run)(tf.constant([7, 1, 7]))[3]
  assert len(pieces) == 4
  assert [list(p.indices.numpy()) for p in pieces] == [[1], [1], [3, 3],
                                                        [3, 3]]
