"""Embedding tables looked up where their shards live, never joined.

A sharded variable is joined on each clone for its pass (`sharding`); a
table of a million rows cannot be. An Embedding layer whose table a
layout splits (by rows, by columns, or both) is looked up instead: each
clone sends each id to the shards that hold its row (an all-to-all: rows
split, the ids partitioned by their row's shard; columns split, every id
to each column's shard), each shard gathers its rows on its own device,
and the clone puts the rows back in the ids' order. What crosses devices
is the ids and the rows they touch, each way.

The gradient needs nothing of its own: TensorFlow's gradient of each
shard's gather is a `tf.IndexedSlices` of the rows it gathered, in the
order the ids came, which the combiners send to the shard and join there
in clone order: on each shard, the slices one device's gradient holds for
its rows, in one device's order, so Keras's optimizer applies them as one
device would (Adam included, whose update of a row differs for two slices
and one). Where the model reads the table otherwise too (a tied output
layer), that read joins the shards as any sharded variable's and its
gradient reaches the shards through the join.

A table is looked up when its layer is a plain `keras.layers.Embedding`
(its own `call`, no LoRA, not quantized); a subclass's `call` (keras-hub's
`ReversibleEmbedding`) reads the table whole and is joined.
"""

import contextlib

import keras
import tensorflow as tf


def tables(model, sharded_ids):
  """{id(table variable): its Embedding layer} of `model`'s plain
  Embedding layers whose table is sharded (its id in `sharded_ids`)."""
  found = {}
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    if (type(layer).call is keras.layers.Embedding.call
        and not layer.lora_enabled and not layer.quantization_mode
        and id(layer.embeddings) in sharded_ids):
      found[id(layer.embeddings)] = layer
  return found


@contextlib.contextmanager
def looking_up(layers_and_tables):
  """Inside, each Embedding layer of `layers_and_tables` (layer, parts,
  shard values, shard devices) looks its ids up in its shards (`look_up`)
  instead of reading its whole table."""
  for layer, *table in layers_and_tables:
    layer.__dict__['call'] = _call(layer, *table)
  try:
    yield
  finally:
    for layer, *_ in layers_and_tables:
      del layer.__dict__['call']


def _call(layer, parts, shards, owners):
  def call(inputs):
    if inputs.dtype not in (tf.int32, tf.int64):
      inputs = tf.cast(inputs, tf.int32)
    return tf.cast(look_up(parts, shards, owners, inputs),
                   layer.compute_dtype)
  return call


def look_up(parts, shards, owners, ids):
  """The rows `ids` name of a table stored as `shards` (row-major over
  `parts`: (row blocks, column blocks)), each gathered on its shard's
  device in `owners`, joined on the current device in the ids' order."""
  rows_per_shard = shards[0].shape[0]
  flat = tf.reshape(ids, [-1])
  row_blocks, column_blocks = parts
  if row_blocks == 1:
    found = _gathered(shards, owners, flat)
  else:
    owner = tf.cast(flat // rows_per_shard, tf.int32)
    positions = tf.dynamic_partition(tf.range(tf.size(flat)), owner,
                                     row_blocks)
    local = tf.dynamic_partition(flat % rows_per_shard, owner, row_blocks)
    found = tf.dynamic_stitch(positions, [
        _gathered(shards[r * column_blocks:(r + 1) * column_blocks],
                  owners[r * column_blocks:(r + 1) * column_blocks],
                  local[r])
        for r in range(row_blocks)])
  shape = (ids.shape.as_list() if ids.shape.is_fully_defined()
           else tf.unstack(tf.shape(ids)))
  return tf.reshape(found, [*shape, found.shape[-1]])


def _gathered(shards, owners, ids):
  """Rows `ids` of one row block's column shards, each gathered on its
  device, the columns joined here."""
  columns = []
  for shard, owner in zip(shards, owners):
    with tf.device(owner):
      columns.append(tf.gather(shard, ids))
  return columns[0] if len(columns) == 1 else tf.concat(columns, axis=-1)
