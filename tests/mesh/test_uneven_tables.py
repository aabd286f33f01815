"""Tables of any row count: a table whose rows (or columns) a mesh axis
does not divide is split in unequal shards (`shards.part_sizes`),
looked up where they live, trained equal to plain one-device `fit`, with
no op of the whole table in the traced step, and its checkpoint restores
on any shard count."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.mesh import meshes
from tests.mesh.test_lookups import TiedLogits
from tfmulti import errors
from tfmulti import fit
from tfmulti.mesh import lookups
from tfmulti.mesh import mesh_layouts
from tfmulti.mesh import shard_views
from tfmulti.mesh import shards
from tfmulti.plan import peaks

ROWS, WIDTH = 67, 7  # Primes: no axis of 2, 3 or 4 divides either.


def _model(tied=False, regularized=False):
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=(5,), dtype='int32')
  table = keras.layers.Embedding(
      ROWS, WIDTH, name='table',
      embeddings_regularizer=keras.regularizers.L2(0.01) if regularized
      else None)
  x = keras.layers.GlobalAveragePooling1D()(table(inputs))
  if tied:
    return keras.Model(inputs, TiedLogits(table, name='tied')(x))
  return keras.Model(inputs, keras.layers.Dense(4, name='out')(x))


def _data(classes=4):
  rng = np.random.default_rng(5)
  ids = rng.integers(0, ROWS, (32, 5)).astype('int32')
  ids[:, 0] = ROWS - 1  # The last shard's last row, every example.
  ids[:, 1] = 7  # A repeated row: Adam's update of two slices differs.
  return ids, rng.integers(0, classes, 32).astype('int32')


def _fit(model, classes=4, epochs=2):
  model.compile(optimizer=keras.optimizers.Adam(0.05),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model.fit(*_data(classes), batch_size=8, epochs=epochs,
                   shuffle=False, verbose=0).history['loss']


LAYOUTS = {  # name: (table's axes, mesh shape, mesh axes)
    'rows over 4': (('model', None), (4,), ('model',)),
    'rows over 3': (('model', None), (3,), ('model',)),
    'rows and columns on (2, 2)': (('rows', 'columns'), (2, 2),
                                   ('rows', 'columns')),
    'columns over 2 of (2, 2)': ((None, 'model'), (2, 2),
                                 ('batch', 'model')),
}


def _parallel(name):
  axes, shape, names = LAYOUTS[name]
  return meshes.parallel({'table/embeddings': axes}, shape, names)


def _assert_same(model, plain, got, want):
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


@pytest.mark.parametrize('name', [
    'rows over 4', pytest.param('rows over 3', marks=pytest.mark.slow),
    pytest.param('rows and columns on (2, 2)', marks=pytest.mark.slow),
    pytest.param('columns over 2 of (2, 2)', marks=pytest.mark.slow)])
def test_a_prime_table_trains_as_one_device(name):
  plain = _model()
  want = _fit(plain)
  model = _model()
  towers = fit.TowersModel(model, _parallel(name))
  _assert_same(model, plain, _fit(towers), want)
  storage = towers.towers.parts.storage
  (_, parts, pieces), = storage.sharded
  rows = [pieces[i].shape[0] for i in range(0, len(pieces), parts[1])]
  assert sum(rows) == ROWS and rows == shards.part_sizes(ROWS, parts[0])


@pytest.mark.slow
@pytest.mark.parametrize('tied, regularized', [(True, False), (False, True)])
def test_a_prime_table_read_whole_too_trains_as_one_device(tied,
                                                           regularized):
  """A tied output layer (or a weight penalty) reads the table whole:
  the unequal shards are joined for that read, on the clone."""
  classes = ROWS if tied else 4
  plain = _model(tied, regularized)
  want = _fit(plain, classes)
  model = _model(tied, regularized)
  towers = fit.TowersModel(model, _parallel('rows and columns on (2, 2)'))
  _assert_same(model, plain, _fit(towers, classes), want)


def _shapes(graph):
  """Every op's output shapes in `graph` and its function bodies, run or
  not."""
  for op in graph.get_operations():
    yield from (tuple(t.shape) for t in op.outputs)
    for body in peaks.bodies(op):
      yield from _shapes(body)


@pytest.mark.parametrize('tied', [
    False, pytest.param(True, marks=pytest.mark.slow)])
def test_no_op_of_the_whole_table_unless_a_layer_reads_it_whole(tied):
  """Read from the traced step, pruned ops too: looked up only, no op
  makes a tensor of the table's rows; tied, the read that needs it does."""
  model = _model(tied)
  towers = fit.TowersModel(model, _parallel('rows over 4'))
  _fit(towers, ROWS if tied else 4, epochs=1)
  ids, labels = _data()
  graph = towers.towers.traced_step(tf.constant(ids[:8]),
                                    (tf.constant(labels[:8]),)).graph
  whole = [s for s in _shapes(graph) if s[:1] == (ROWS,)]
  assert bool(whole) == tied, whole


@pytest.mark.slow
def test_a_prime_tables_checkpoint_restores_on_any_shard_count(tmp_path):
  """Saved from 4 unequal shards, it holds one device's table and slots;
  read into 3 shards, and into a plain model, the same values."""
  model = _model()
  towers = fit.TowersModel(model, _parallel('rows over 4'))
  _fit(towers, epochs=1)
  path = tf.train.Checkpoint(
      model=model, optimizer=shard_views.checkpointed(
          towers.towers.optimizer)).write(str(tmp_path / 'four'))
  again = _model()
  three = fit.TowersModel(again, _parallel('rows over 3'))
  _fit(three, epochs=1)
  tf.train.Checkpoint(model=again, optimizer=shard_views.checkpointed(
      three.towers.optimizer)).read(path).assert_consumed()
  plain = _model()
  tf.train.Checkpoint(model=plain).read(path).expect_partial()
  for a, b, c in zip(again.weights, plain.weights, model.weights):
    np.testing.assert_array_equal(a.numpy(), c.numpy())
    np.testing.assert_array_equal(b.numpy(), c.numpy())
  slots = [shard_views.checkpointed(t.towers.optimizer)._variables
           for t in (towers, three)]  # As one device's: whole slots.
  assert len(slots[0]) == len(slots[1])
  for a, b in zip(*slots):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('sizes', [[4, 4, 4, 4], [5, 4, 4, 4], [2, 1, 1],
                                   [17, 17, 16, 16, 16]])
def test_each_id_goes_to_the_shard_holding_its_row(sizes):
  ids = tf.range(sum(sizes))
  owner, local = lookups.owners(ids, sizes)
  starts = np.cumsum([0] + sizes[:-1])
  want_owner = np.repeat(np.arange(len(sizes)), sizes)
  np.testing.assert_array_equal(owner, want_owner)
  np.testing.assert_array_equal(local, ids.numpy() - starts[want_owner])
  assert shards.part_sizes(sum(sizes), len(sizes)) == sorted(
      sizes, reverse=True)


@pytest.mark.slow
def test_a_joined_kernel_of_unequal_shards_trains_as_one_device(caplog):
  """A Dense kernel of 7 units over 2 devices of a compute axis: not
  computed as blocks (they would be unequal), joined for the pass."""
  def make():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(7, activation='tanh', name='d1')(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name='d2')(x))
  rng = np.random.default_rng(0)
  data = (rng.normal(size=(32, 6)).astype('float32'),
          rng.integers(0, 4, 32).astype('int32'))
  plain = make()
  want = meshes.fit_model(plain, data)
  model = make()
  caplog.set_level('INFO', logger='absl')
  towers = fit.TowersModel(model, meshes.parallel({'d1/kernel': (
      None, 'model')}, (2, 2), ('batch', 'model')))
  np.testing.assert_allclose(meshes.fit_model(towers, data), want,
                             rtol=1e-5)
  assert 'kernel d1/kernel of shape (6, 7): its shards are unequal' in (
      caplog.text)
  assert not towers.towers.parts.storage.splits


def test_a_table_of_fewer_rows_than_devices_is_refused_in_one_line():
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=(2,), dtype='int32')
  x = keras.layers.Embedding(3, 4, name='table')(inputs)
  model = keras.Model(inputs, keras.layers.Dense(2)(
      keras.layers.Flatten()(x)))
  towers = fit.TowersModel(model, _parallel('rows over 4'))
  with pytest.raises(errors.ConfigError, match=(
      r'variable table/embeddings of shape \(3, 4\): layout \(.model., '
      r'None\) splits a dimension of 3 over 4 devices of .model., more '
      r'than it has; use a smaller mesh axis, or None.')):
    towers.compile(optimizer='adam', loss='mse')


def test_unequal_shards_place_on_gpus_with_every_kernel():
  """Traced for 4 GPUs (none here): every op of the unequal lookups (of
  17, 17, 17 and 16 rows) has a GPU kernel."""
  layouts = mesh_layouts.VariableLayouts(
      (4,), ('model',), (('table/embeddings', ('model', None)),))
  gpus = meshes.planned_on_gpus(layouts, _model, _data())
  assert len(gpus) == 4
  assert not [line for r in gpus.values() for line in r.missing_kernels]
  assert shards.part_sizes(ROWS, 4) == [17, 17, 17, 16]


@pytest.mark.slow
def test_predict_and_evaluate_look_the_unequal_shards_up():
  model = _model()
  towers = fit.TowersModel(model, _parallel('rows and columns on (2, 2)'))
  _fit(towers, epochs=1)
  ids, labels = _data()
  np.testing.assert_allclose(towers.predict(ids, batch_size=8, verbose=0),
                             model(ids), rtol=1e-6, atol=1e-7)
  plain = _model()
  plain.set_weights(model.get_weights())
  plain.compile(loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  np.testing.assert_allclose(
      towers.evaluate(ids, labels, batch_size=8, verbose=0),
      plain.evaluate(ids, labels, batch_size=8, verbose=0), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('fields', [dict(accumulation_steps=2),
                                    dict(clone_shares=(3, 1, 2, 2))])
def test_unequal_shards_with_accumulation_or_shares_train_as_one_device(
    fields):
  """Each batch of 8 accumulated over two steps of 4 rows, or cut by
  shares: the updates of plain `fit` on the batches of 8."""
  plain = _model()
  want = _fit(plain)
  model = _model()
  towers = fit.TowersModel(model, _parallel('rows over 4'), **fields)
  _assert_same(model, plain, _fit(towers), want)


class CondTied(keras.layers.Layer):
  """A tied output layer that reads the table first inside a condition's
  branches, then outside them."""

  def __init__(self, table, **kwargs):
    super().__init__(**kwargs)
    self.table = table

  def call(self, x):
    def logits():
      return keras.ops.matmul(x, keras.ops.transpose(self.table.embeddings))
    inside = keras.ops.cond(keras.ops.sum(x) > -1e9, logits, logits)
    return inside + 0.0 * keras.ops.sum(self.table.embeddings)


@pytest.mark.slow
def test_a_whole_read_inside_a_condition_and_after_it_trains_as_one_device():
  """Each graph that reads the table whole joins it there (a branch's
  join is no value outside it)."""
  def make():
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(5,), dtype='int32')
    table = keras.layers.Embedding(ROWS, WIDTH, name='table')
    x = keras.layers.GlobalAveragePooling1D()(table(inputs))
    return keras.Model(inputs, CondTied(table, name='tied')(x))
  plain = make()
  want = _fit(plain, ROWS)
  model = make()
  towers = fit.TowersModel(model, _parallel('rows over 4'))
  _assert_same(model, plain, _fit(towers, ROWS), want)
