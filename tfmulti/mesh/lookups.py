"""Embedding tables looked up where their shards live, never joined.

A sharded variable is joined on each clone for its pass (`sharding`); a
table of a million rows cannot be. Under a layout map every plain
Embedding is looked up instead, where its table lives: split by rows, by
columns or both as its layout says, or whole on one device where no
layout names it (table-wise: whole tables are spread over the devices by
bytes, as every variable no layout splits), or as `table_plan` lays it
out. Each clone sends each id to the shards that hold its row (an
all-to-all: rows split, the ids partitioned by their row's shard;
columns split, every id to each column's shard), each shard gathers its
rows on its own device, and the clone puts the rows back in the ids'
order. What crosses devices is the ids and the rows they touch, each way.

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
`ReversibleEmbedding`) reads the table whole and is joined, as are
sparse or ragged ids (Keras's own call), and a table's weight penalty
(its regularizer reads the whole table, on the piece that counts it).
A negative id counts from the end, as Keras's `take` counts it.
"""

import contextlib

import keras
import tensorflow as tf

from tfmulti import keras_internals

SCOPE = 'lookup'  # A lookup's ops' name scope (its gradient's too).


def in_scope(name):
  """Whether the op named `name` is one of a lookup's (`SCOPE`)."""
  return f'/{SCOPE}/' in f'/{name}'


def tables(model, ids):
  """{id(table variable): its Embedding layer} of `model`'s plain
  Embedding layers whose table's id is in `ids`."""
  found = {}
  for layer in keras_internals.flat_layers(model):
    if (type(layer).call is keras.layers.Embedding.call
        and not layer.lora_enabled and not layer.quantization_mode
        and id(layer.embeddings) in ids):
      found[id(layer.embeddings)] = layer
  return found


@contextlib.contextmanager
def looking_up(layers_and_tables):
  """Inside, each Embedding layer of `layers_and_tables` (layer, parts,
  shard values, shard devices) looks its ids up in its shards (`look_up`)
  instead of reading its whole table."""
  with keras_internals.calling([(layer, _call(layer, *table))
                                for layer, *table in layers_and_tables]):
    yield


def _call(layer, parts, shards, homes):
  keras_call = type(layer).call.__get__(layer)
  vocabulary = layer.input_dim

  def call(inputs):
    if isinstance(inputs, (tf.SparseTensor, tf.RaggedTensor)):
      return keras_call(inputs)  # Keras's own take: the table joined.
    if inputs.dtype not in (tf.int32, tf.int64):
      inputs = tf.cast(inputs, tf.int32)
    # Keras's take counts a negative id from the end.
    inputs = tf.where(inputs < 0, inputs + vocabulary, inputs)
    return tf.cast(look_up(parts, shards, homes, inputs),
                   layer.compute_dtype)
  return call


def owners(ids, sizes):
  """(the shard of each of `ids`' rows, as int32; its row there) for a
  table split by rows into shards of `sizes` rows (`shards.part_sizes`:
  equal, or the first ones a row more)."""
  big, small = max(sizes), min(sizes)
  more = sizes.count(big) if big != small else 0
  big_rows = tf.constant(big, ids.dtype)
  if not more:
    return tf.cast(ids // big_rows, tf.int32), ids % big_rows
  wide = tf.constant(more * big, ids.dtype)  # The rows of the bigger ones.
  rest = ids - wide
  small_rows = tf.constant(small, ids.dtype)
  owner = tf.where(ids < wide, ids // big_rows, more + rest // small_rows)
  local = tf.where(ids < wide, ids % big_rows, rest % small_rows)
  return tf.cast(owner, tf.int32), local


def look_up(parts, shards, homes, ids):
  """The rows `ids` name of a table stored as `shards` (row-major over
  `parts`: (row blocks, column blocks)), each gathered on its shard's
  device in `homes`, joined on the current device in the ids' order."""
  with tf.name_scope(SCOPE):
    found = _looked_up(parts, shards, homes, tf.reshape(ids, [-1]))
  width = found.shape[-1]
  if ids.shape.is_fully_defined():
    return tf.reshape(found, [*ids.shape, width])
  return tf.reshape(found, tf.concat([tf.shape(ids), [width]], axis=0))


def _looked_up(parts, shards, homes, flat):
  """`look_up` of `flat` ids: each sent to its row block's shards, its
  row back, stitched in the ids' order."""
  row_blocks, column_blocks = parts
  if row_blocks == 1:
    return _gathered(shards, homes, flat)
  owner, local = owners(flat, [shards[r * column_blocks].shape[0]
                               for r in range(row_blocks)])
  positions = tf.dynamic_partition(tf.range(tf.size(flat)), owner,
                                   row_blocks)
  local = tf.dynamic_partition(local, owner, row_blocks)
  return tf.dynamic_stitch(positions, [
      _gathered(shards[r * column_blocks:(r + 1) * column_blocks],
                homes[r * column_blocks:(r + 1) * column_blocks], local[r])
      for r in range(row_blocks)])


def _gathered(shards, homes, ids):
  """Rows `ids` of one row block's column shards, each gathered on its
  device, the columns joined here."""
  columns = []
  for shard, home in zip(shards, homes):
    with tf.device(home):
      columns.append(tf.gather(shard, ids))
  return columns[0] if len(columns) == 1 else tf.concat(columns, axis=-1)
