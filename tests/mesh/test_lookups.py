"""Embedding tables looked up where their shards live: the rows and the
gradient slices one device would have, the table never joined on a
clone, and training equal to plain `fit`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.mesh import meshes
from tfmulti import devices
from tfmulti import fit
from tfmulti.bench import table_plan as table_plan_bench
from tfmulti.mesh import lookups
from tfmulti.mesh import mesh_layouts
from tfmulti.mesh import shards as shards_lib
from tfmulti.plan import peaks
from tfmulti.plan import traffic

ROWS, WIDTH = 64, 8


@pytest.mark.parametrize('parts', [(4, 1), (1, 2), (2, 2)])
def test_a_lookup_gives_one_devices_rows_and_slices(parts):
  table = tf.constant(np.arange(ROWS * WIDTH, dtype=np.float32).reshape(
      ROWS, WIDTH))
  ids = tf.constant([[5, 63, 5], [40, 0, 17]])
  shards = shards_lib.cut(parts, table)
  owners = [f'/device:CPU:{i}' for i in range(len(shards))]
  weights = tf.reshape(tf.range(6 * WIDTH, dtype=tf.float32), [2, 3, WIDTH])
  with tf.GradientTape(persistent=True) as tape:
    tape.watch([table, *shards])
    got = lookups.look_up(parts, shards, owners, ids)
    want = tf.gather(table, ids)
    loss_got, loss_want = (tf.reduce_sum(x * weights) for x in (got, want))
  np.testing.assert_array_equal(got, want)
  slices = tape.gradient(loss_got, shards)
  assert all(isinstance(s, tf.IndexedSlices) for s in slices)
  one_device = shards_lib.cut_slices(parts, tape.gradient(loss_want, table),
                                   table.shape)
  for piece, expected in zip(slices, one_device):
    np.testing.assert_array_equal(piece.indices, expected.indices)
    np.testing.assert_array_equal(piece.values, expected.values)


@pytest.mark.parametrize('dtype', ['int32', 'int64'])
def test_a_looked_up_layer_reads_ids_as_keras_does(dtype):
  """Negative ids count from the end, int64 ids and ids of unknown shape
  look up what Keras's own call gives."""
  layer = keras.layers.Embedding(ROWS, WIDTH)
  layer.build((None,))
  parts = (2, 2)
  shards = shards_lib.cut(parts, tf.convert_to_tensor(layer.embeddings))
  homes = [f'/device:CPU:{i}' for i in range(4)]
  ids = tf.constant([[3, -1, 63], [-64, 0, 40]], dtype)
  want = layer(ids)

  @tf.function(input_signature=[tf.TensorSpec([None, None], dtype)])
  def unknown_shape(ids):
    return layer(ids)
  with lookups.looking_up([(layer, parts, shards, homes)]):
    np.testing.assert_array_equal(layer(ids), want)
    np.testing.assert_array_equal(unknown_shape(ids), want)
  assert 'call' not in layer.__dict__  # Keras's own call again.


def _parallel(layout, shape=(4,), names=('model',)):
  mesh = keras.distribution.DeviceMesh(
      shape, list(names), keras.distribution.list_devices()[:4])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['table/embeddings'] = layout
  return keras.distribution.ModelParallel(layout_map=layout_map,
                                          batch_dim_name=names[0])


class TiedLogits(keras.layers.Layer):
  """Logits against a table read whole: a tied output layer."""

  def __init__(self, table, **kwargs):
    super().__init__(**kwargs)
    self.table = table

  def call(self, x):
    return keras.ops.matmul(x, keras.ops.transpose(self.table.embeddings))


def _model(tied=False):
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=(5,), dtype='int32')
  table = keras.layers.Embedding(ROWS, WIDTH, name='table')
  x = keras.layers.GlobalAveragePooling1D()(table(inputs))
  if tied:
    return keras.Model(inputs, TiedLogits(table, name='tied')(x))
  return keras.Model(inputs, keras.layers.Dense(4, name='out')(x))


def _data(classes=4):
  rng = np.random.default_rng(5)
  # Few ids, so a batch repeats rows: Adam's update differs for two slices
  # of a row and one, and each shard must get one device's.
  ids = rng.integers(0, ROWS, (32, 5)).astype('int32')
  ids[:, 0] = 7
  return ids, rng.integers(0, classes, 32).astype('int32')


def _fit(model, optimizer, classes=4, **arguments):
  model.compile(optimizer=optimizer, loss=keras.losses.
                SparseCategoricalCrossentropy(from_logits=True))
  arguments = {'epochs': 2, **arguments}
  return model.fit(*_data(classes), batch_size=8, shuffle=False, verbose=0,
                   **arguments).history['loss']


OPTIMIZERS = {'sgd': lambda: keras.optimizers.SGD(0.5, momentum=0.9),
              'adam': lambda: keras.optimizers.Adam(0.05),
              'adagrad': lambda: keras.optimizers.Adagrad(0.5)}


def _assert_trains_as_one_device(layout, optimizer, tied=False, fields=(),
                                 **kwargs):
  classes = ROWS if tied else 4
  plain = _model(tied)
  want = _fit(plain, OPTIMIZERS[optimizer](), classes)
  model = _model(tied)
  towers = fit.TowersModel(model, _parallel(layout, **kwargs), **dict(fields))
  got = _fit(towers, OPTIMIZERS[optimizer](), classes)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)
  return towers


def test_a_row_sharded_table_trains_as_one_device_under_adam():
  _assert_trains_as_one_device(('model', None), 'adam')


@pytest.mark.slow
def test_a_table_no_layout_splits_is_looked_up_where_it_lives():
  """Table-wise: a table left whole lives on one device, and each clone
  looks its ids up there (one device's training), never reading it whole:
  nothing of the table's size crosses devices."""
  towers = _assert_trains_as_one_device((None, None), 'adam')
  storage = towers.towers.parts.storage
  assert [layer.name for layer in storage.tables.values()] == ['table']
  ids, labels = _data()
  graph = towers.towers.traced_step(tf.constant(ids[:16]),
                                    (tf.constant(labels[:16]),)).graph
  assert all(size < ROWS * WIDTH * 4
             for *_, size in traffic.transfers(graph))
  runs = peaks.reachable(graph)
  gathers = {devices.canonical(op.device) for op in graph.get_operations()
             if op.name in runs and op.type == 'GatherV2'
             and tuple(op.inputs[0].shape) == (ROWS, WIDTH)}
  assert gathers == {devices.canonical(devices.device_of(
      towers.towers.model.get_layer('table').embeddings))}


@pytest.mark.slow
@pytest.mark.parametrize('optimizer', ['sgd', 'adagrad'])
@pytest.mark.parametrize('layout', [('model', None), (None, 'model')])
def test_each_table_layout_trains_as_one_device(layout, optimizer):
  _assert_trains_as_one_device(layout, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize('fields', [dict(accumulation_steps=2),
                                    dict(clone_shares=(3, 1, 2, 2))])
def test_accumulation_and_shares_train_as_one_device(fields):
  _assert_trains_as_one_device(('model', None), 'adam',
                               fields=fields.items())


@pytest.mark.slow
def test_a_table_split_both_ways_trains_as_one_device():
  _assert_trains_as_one_device(('batch', 'model'), 'adam', shape=(2, 2),
                               names=('batch', 'model'))


@pytest.mark.slow
def test_a_table_read_whole_too_trains_as_one_device():
  """A tied output layer reads the table whole: that read joins the
  shards, and its gradient reaches them beside the lookup's."""
  _assert_trains_as_one_device(('model', None), 'adam', tied=True)


@pytest.mark.slow
@pytest.mark.parametrize('packs', [0, 'auto'])
def test_no_clone_joins_a_looked_up_table(packs):
  """Read from the traced step: of the ops it runs, none makes a tensor
  of the whole table's shape; each shard's rows leave its device only as
  the rows a clone looks up (packed reads leave the shards out)."""
  model = _model()
  towers = fit.TowersModel(model, _parallel(('model', None)),
                           gradient_packs=packs)
  _fit(towers, OPTIMIZERS['adam'](), epochs=1)
  ids, labels = _data()
  graph = towers.towers.traced_step(tf.constant(ids[:16]),
                                    (tf.constant(labels[:16]),)).graph
  runs = peaks.reachable(graph)
  shapes = {tuple(t.shape) for op in graph.get_operations()
            if op.name in runs for t in op.outputs}
  assert (ROWS, WIDTH) not in shapes
  # Nothing of a shard's size crosses devices, packed or not: the
  # transfers of a size the graph knows are the head's and the batch's.
  shard = ROWS // 4 * WIDTH * 4
  assert all(size < shard for *_, size in traffic.transfers(graph))
  gathers = [op for op in graph.get_operations()
             if op.name in runs and op.type == 'GatherV2'
             and tuple(op.inputs[0].shape) == (ROWS // 4, WIDTH)]
  owners = {devices.canonical(op.device) for op in gathers}
  assert owners == {devices.canonical(f'/device:CPU:{i}') for i in range(4)}
  assert len(gathers) == 4 * 4  # Each clone's ids, on each shard.


def _dlrm(sizes=(1_000_000, 1000, 100)):
  return table_plan_bench.dlrm(sizes)


def _clicks(rows=64, sizes=(1_000_000, 1000, 100)):
  rng = np.random.default_rng(11)
  features = {'dense': rng.normal(size=(rows, 4)).astype('float32')}
  for i, size in enumerate(sizes):
    # Popular ids repeat, as clicks do.
    features[f'c{i}'] = rng.zipf(1.5, (rows, 1)).astype('int32') % size
  return features, rng.integers(0, 2, rows).astype('float32')


@pytest.mark.slow
def test_a_dlrm_with_a_million_row_table_trains_as_one_device():
  """Its big table by rows and the next by columns over 4 clones, the
  third whole on one; Adagrad: equal to plain `fit` on one device."""
  def train(model):
    model.compile(optimizer=keras.optimizers.Adagrad(0.05),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model.fit(*_clicks(), batch_size=16, epochs=2, shuffle=False,
                     verbose=0).history['loss']
  plain = _dlrm()
  want = train(plain)
  mesh = keras.distribution.DeviceMesh(
      (4,), ['model'], keras.distribution.list_devices()[:4])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['table_0/embeddings'] = ('model', None)
  layout_map['table_1/embeddings'] = (None, 'model')
  model = _dlrm()
  towers = fit.TowersModel(model, keras.distribution.ModelParallel(
      layout_map=layout_map, batch_dim_name='model'))
  np.testing.assert_allclose(train(towers), want, rtol=1e-5)
  storage = towers.towers.parts.storage
  # The third, whole, is looked up where it lives (table-wise).
  assert sorted(layer.name for layer in storage.tables.values()) == [
      'table_0', 'table_1', 'table_2']
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


def test_a_looked_up_table_places_on_gpus_with_every_kernel():
  """Traced for 4 GPUs (none here: `plans.planning`): each op of the
  lookups (partitions, gathers, stitches) has a GPU kernel for its
  dtypes, and each GPU holds a quarter of the table and its slots."""
  layouts = mesh_layouts.VariableLayouts(
      (4,), ('model',), (('table/embeddings', ('model', None)),))
  gpus = meshes.planned_on_gpus(layouts, _model, _data(),
                                 OPTIMIZERS['adam'])
  assert len(gpus) == 4
  assert not [line for r in gpus.values() for line in r.missing_kernels]
  quarter = 3 * ROWS * WIDTH * 4 // 4  # The table and Adam's two slots.
  assert all(r.held_bytes >= quarter for r in gpus.values())
  assert all(r.held_bytes < 2 * quarter for r in gpus.values())


@pytest.mark.slow
def test_predict_looks_the_table_up_too():
  """Inference reads the table where it lives as the step does: the
  plain model's outputs, and no whole table on any device."""
  model = _model()
  towers = fit.TowersModel(model, _parallel(('model', None)))
  _fit(towers, OPTIMIZERS['adam'](), epochs=1)
  ids = tf.constant(_data()[0][:16])
  np.testing.assert_allclose(towers.towers.predict(ids), model(ids),
                             rtol=1e-6)
  graph = towers.towers._predict.get_concrete_function(ids).graph
  runs = peaks.reachable(graph)
  assert (ROWS, WIDTH) not in {tuple(t.shape) for op in graph.get_operations()
                               if op.name in runs for t in op.outputs}
