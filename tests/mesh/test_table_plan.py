"""Tables planned whole, by rows or by columns: each device within 1.1x an
even share of the bytes held and looked up, tables split only where
balance needs it, and a planned DLRM training as one device."""

import keras
import numpy as np
import pytest

from tests.mesh.test_lookups import _clicks
from tfmulti import devices
from tfmulti import fit
from tfmulti.bench.table_plan import dlrm
from tfmulti.deploy import keras_distribution
from tfmulti.mesh import mesh_layouts
from tfmulti.mesh import sharding
from tfmulti.mesh import shards
from tfmulti.mesh import table_plan

MESH_4 = mesh_layouts.VariableLayouts((4,), ('model',))
MESH_2_2 = mesh_layouts.VariableLayouts((2, 2), ('batch', 'model'))
# A big table, then small ones of one id an example: the big one's bytes
# need all four devices; the small ones' lookups fill them whole, one a
# device, and the rest split by rows (the last, 50, in unequal shards).
SIZES = (100_000, 1000, 100, 100, 100, 100, 100, 50)


def _tables(sizes=SIZES, width=16, ids=1):
  return [table_plan.Table(f'table_{i}/embeddings', (rows, width), ids)
          for i, rows in enumerate(sizes)]


def test_a_table_splits_only_where_balance_needs_it():
  tables = _tables()
  choices = table_plan.plan(tables, MESH_4)
  got = [choices[t.path].axes for t in tables]
  assert got == [('model', None), None, None, None, None,
                 ('model', None), ('model', None), ('model', None)]
  # The whole ones, one a device.
  assert sorted(choices[t.path].homes[0] for t in tables[1:5]) == [0, 1, 2, 3]
  held, looked = table_plan.peak(tables, choices, MESH_4)
  assert held <= table_plan.TARGET and looked <= table_plan.TARGET


def test_equal_tables_go_whole_one_a_device():
  tables = _tables((64, 64, 64, 64))
  choices = table_plan.plan(tables, MESH_4)
  assert [choices[t.path] for t in tables] == [
      table_plan.Choice(None, (d,)) for d in range(4)]
  assert table_plan.peak(tables, choices, MESH_4) == (1.0, 1.0)


def test_a_table_split_over_a_2d_mesh_takes_the_fewest_devices():
  """Two equal tables on a (2, 2) mesh: each by rows over one axis, on
  the two devices the other one leaves."""
  tables = _tables((1024, 1024))
  choices = table_plan.plan(tables, MESH_2_2)
  homes = [set(choices[t.path].homes) for t in tables]
  assert [len(h) for h in homes] == [2, 2] and not homes[0] & homes[1]
  assert all(choices[t.path].axes[0] is not None for t in tables)
  assert table_plan.peak(tables, choices, MESH_2_2) == (1.0, 1.0)


def test_without_splits_every_table_stays_whole():
  choices = table_plan.plan(_tables(), MESH_4, may_split=False)
  assert all(c.axes is None for c in choices.values())


@pytest.mark.parametrize('shape, ids', [((20,), 20), ((None,), 1)])
def test_lookups_come_from_the_layer_input_shape(shape, ids, caplog):
  """The ids an example gives, as built; an unknown length counts 1, and
  a warning names the table."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape, dtype='int32')
  x = keras.layers.Embedding(64, 8, name='seq')(inputs)
  model = keras.Model(inputs, keras.layers.Dense(1)(x))
  with caplog.at_level('WARNING', logger='absl'):
    [table] = table_plan.tables_of(model, skip=()).values()
  assert table == table_plan.Table('seq/embeddings', (64, 8), ids)
  assert ('table seq/embeddings: its input shape' in caplog.text) == (
      ids == 1)


def test_a_table_no_axis_divides_splits_in_unequal_shards():
  """4 divides neither dimension of a big table: it splits by rows in
  shards of 1001, 1000, 1000 and 1000 rows (`shards.part_sizes`), each
  device within the target, where it once had to stay whole (3.9 times an
  even share on one device)."""
  tables = [table_plan.Table('big', (4001, 15), 1),
            table_plan.Table('hot', (64, 16), 30)]
  choices = table_plan.plan(tables, MESH_4)
  assert choices['big'].axes == ('model', None)
  assert shards.part_sizes(4001, 4) == [1001, 1000, 1000, 1000]
  held, looked = table_plan.peak(tables, choices, MESH_4)
  assert held <= table_plan.TARGET and looked <= table_plan.TARGET


def test_a_choice_says_where_each_shard_lives():
  assert (table_plan.Choice(('model', None), (0, 1)).describe()
          == 'by rows over model on devices 0, 1')
  assert table_plan.Choice(None, (3,)).describe() == 'whole on device 3'


def _train(model):
  model.compile(optimizer=keras.optimizers.Adagrad(0.05),
                loss=keras.losses.BinaryCrossentropy(from_logits=True))
  return model.fit(*_clicks(sizes=SIZES), batch_size=16, epochs=2,
                   shuffle=False, verbose=0).history['loss']


@pytest.mark.slow
def test_a_planned_dlrm_trains_as_one_device_where_planned():
  """Through `fit` with Keras's ModelParallel and no rules: the plan's
  tables, each shard (or whole table) on the device the plan names, read
  from the variables; Adagrad: equal to plain `fit` on one device."""
  want = _train(plain := dlrm(SIZES))
  mesh = keras.distribution.DeviceMesh(
      (4,), ['model'], keras.distribution.list_devices()[:4])
  config = keras_distribution.from_model_parallel(
      keras.distribution.ModelParallel(
          layout_map=keras.distribution.LayoutMap(mesh),
          batch_dim_name='model'), plan_tables=True)
  model = dlrm(SIZES)
  towers = fit.TowersModel(model, config)
  np.testing.assert_allclose(_train(towers), want, rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)
  tables = list(table_plan.tables_of(plain, skip=()).values())
  choices = table_plan.plan(tables, config.variable_layouts)
  # Whole and by rows (unequal where 4 does not divide), through fit; by
  # columns only where a table has fewer rows than devices.
  assert {c.axes for c in choices.values()} == {None, ('model', None)}
  stored = {v.path: devices.canonical(devices.device_of(v))
            for v in towers.towers.parts.storage.variables}
  for table in tables:
    choice = choices[table.path]
    paths = ([table.path] if choice.axes is None else [
        sharding.shard_path(table.path, block) for block in
        mesh_layouts.blocks(mesh_layouts.grid(MESH_4, choice.axes))])
    assert [stored[p] for p in paths] == [
        devices.canonical(config.clone_device(d)) for d in choice.homes]


def test_unequal_shards_load_their_devices_by_their_rows():
  """5 rows over 4 devices: 2, 1, 1 and 1 rows, so the first device holds
  two fifths of the table (1.6 times an even share), not a quarter."""
  tables = [table_plan.Table('small', (5, 8), 1)]
  choices = {'small': table_plan.Choice(('model', None), (0, 1, 2, 3))}
  held, looked = table_plan.peak(tables, choices, MESH_4)
  assert (held, looked) == (pytest.approx(1.6), pytest.approx(1.6))
