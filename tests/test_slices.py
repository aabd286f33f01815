"""Tests for tfmulti.slices' fixed lookups: indices computed from no row."""

import tensorflow as tf

from tfmulti import slices


def _traced(make):
  """`make(rows, table)`'s indices as traced in a step of rows `rows`."""
  table = tf.Variable(tf.range(10))
  found = []

  @tf.function
  def step(rows):
    found.append(make(rows, table))
    return 0
  step.get_concrete_function(tf.TensorSpec([4], tf.int32))
  return found[0]


def test_positions_and_a_variables_values_are_fixed():
  assert slices.fixed_rows(_traced(lambda rows, table: tf.range(6)))
  assert slices.fixed_rows(_traced(
      lambda rows, table: tf.gather(table.read_value(), tf.range(3))))


def test_what_the_rows_or_a_random_draw_give_is_not_fixed():
  assert not slices.fixed_rows(_traced(lambda rows, table: rows + 1))
  # A variable's rows at indices from the step's rows (a remap table).
  assert not slices.fixed_rows(_traced(
      lambda rows, table: tf.nn.embedding_lookup(table, rows)))
  assert not slices.fixed_rows(_traced(lambda rows, table: tf.random.uniform(
      [4], maxval=10, dtype=tf.int32)))
  assert not slices.fixed_rows(tf.range(3))  # Eager: nothing to read.
