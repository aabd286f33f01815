"""Keras's `ModelParallel` honoured: each variable its layout map splits is
stored as its shards over the mesh, and training equals plain `fit` on one
device; what cannot be honoured is refused in one line."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti import deploy
from tfmulti import errors
from tfmulti import fit
from tfmulti.deploy import keras_distribution
from tfmulti.mesh import mesh_layouts
from tfmulti.mesh import shard_views
from tfmulti.mesh import sharding


def _mesh(shape, names):
  count = int(np.prod(shape))
  return keras.distribution.DeviceMesh(
      shape, names, keras.distribution.list_devices()[:count])


def _parallel(shape, names, layouts, batch='batch'):
  layout_map = keras.distribution.LayoutMap(_mesh(shape, names))
  for key, axes in layouts.items():
    layout_map[key] = axes
  return keras.distribution.ModelParallel(layout_map=layout_map,
                                          batch_dim_name=batch)


def _model():
  """Token ids to a class: an Embedding table, two Dense layers."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=(3,), dtype='int32')
  x = keras.layers.Embedding(16, 8, name='table')(inputs)
  x = keras.layers.Flatten()(x)
  x = keras.layers.Dense(12, activation='relu', name='d1')(x)
  return keras.Model(inputs, keras.layers.Dense(4, name='d2')(x))


def _data():
  rng = np.random.default_rng(3)
  return (rng.integers(0, 16, (32, 3)).astype('int32'),
          rng.integers(0, 4, 32).astype('int32'))


def _fit(model, optimizer='adam', **fit_arguments):
  make = {'adam': lambda: keras.optimizers.Adam(0.02),
          'adagrad': lambda: keras.optimizers.Adagrad(0.1),
          'sgd': lambda: keras.optimizers.SGD(0.1, momentum=0.9)}[optimizer]
  model.compile(optimizer=make(), metrics=['accuracy'],
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  fit_arguments = {'epochs': 2, **fit_arguments}
  return model.fit(*_data(), batch_size=8, shuffle=False, verbose=0,
                   **fit_arguments).history


def _same(got, want, plain, model):
  for key, values in want.items():
    np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


LAYOUTS = {
    'one axis': ((4,), ['model'], {'d1/kernel': (None, 'model'),
                                   'd1/bias': ('model',)}),
    'two axes': ((2, 2), ['batch', 'model'], {
        'd1/kernel': ('batch', 'model'), 'd2/kernel': ('model', None)}),
    'table by rows': ((2, 2), ['batch', 'model'],
                      {'table/embeddings': ('model', None)}),
    'table by columns': ((2, 2), ['batch', 'model'],
                         {'table/embeddings': (None, 'batch')}),
    'table both ways, all by regex': ((2, 2), ['batch', 'model'], {
        'table/embeddings': ('batch', 'model'),
        '.*/kernel': (None, 'model')}),
}


@pytest.mark.parametrize('layout, optimizer', [
    ('two axes', 'adam'),  # The rest run in the slow suite.
    *(pytest.param(layout, 'adam', marks=pytest.mark.slow)
      for layout in LAYOUTS if layout != 'two axes'),
    pytest.param('table both ways, all by regex', 'adagrad',
                 marks=pytest.mark.slow),
    pytest.param('table both ways, all by regex', 'sgd',
                 marks=pytest.mark.slow)])
def test_each_layout_trains_as_one_device(layout, optimizer):
  plain = _model()
  want = _fit(plain, optimizer)
  model = _model()
  towers = fit.TowersModel(model, _parallel(*LAYOUTS[layout]))
  _same(_fit(towers, optimizer), want, plain, model)


def _stored(model):
  """{path: [(device, shape), ...]} of each variable's storage."""
  stored = {}
  for variable in model.weights:
    value = variable._value
    parts = value.shards if isinstance(value, sharding.ShardedValue) else [
        value]
    stored[variable.path] = [(p.device.split('device:')[-1],
                              tuple(p.shape)) for p in parts]
  return stored


@pytest.mark.slow
def test_no_device_holds_a_whole_sharded_variable():
  model = _model()
  towers = fit.TowersModel(model, _parallel(*LAYOUTS['two axes']))
  _fit(towers)
  stored = _stored(model)
  assert stored['d1/kernel'] == [('CPU:0', (12, 6)), ('CPU:1', (12, 6)),
                                 ('CPU:2', (12, 6)), ('CPU:3', (12, 6))]
  # ('model', None): shard m on a device of mesh column m, the less loaded.
  assert [shape for _, shape in stored['d2/kernel']] == [(6, 4), (6, 4)]
  assert {d for d, _ in stored['d2/kernel']} in ({'CPU:0', 'CPU:1'},
                                                 {'CPU:2', 'CPU:1'},
                                                 {'CPU:0', 'CPU:3'},
                                                 {'CPU:2', 'CPU:3'})
  assert all(len(parts) == 1 for path, parts in stored.items()
             if path not in ('d1/kernel', 'd2/kernel'))
  # Each slot beside its shard, its shard's shape.
  shards = {v.path: v for v in towers.towers.parts.storage.variables}
  for slot in towers.towers.optimizer.variables:
    owner = [v for path, v in shards.items()
             if slot.path.startswith(f'adam/{path.replace("/", "_")}_')]
    if owner:
      assert slot.value.device == owner[0].value.device, slot.path
      assert slot.shape == owner[0].shape, slot.path


@pytest.mark.slow
def test_each_clone_gathers_and_each_shard_is_summed_beside_it():
  # The one axis is the batch's: every variable is joined for the pass
  # (none computed as blocks, `tests/mesh/test_tensor_parallel.py`).
  model = _model()
  towers = fit.TowersModel(model, _parallel(*LAYOUTS['one axis'],
                                            batch='model'))
  _fit(towers, epochs=1)
  images, labels = _data()
  graph = towers.towers.traced_step(tf.constant(images[:8]),
                                    (tf.constant(labels[:8]),)).graph
  operations = graph.get_operations()
  gathers = {op.device.split('device:')[-1] for op in operations
             if 'gather_shards' in op.name and op.type == 'ConcatV2'}
  assert gathers == {'CPU:0', 'CPU:1', 'CPU:2', 'CPU:3'}
  # The joined variables' gradients are cut into the shards' pieces, and
  # each piece is summed on its shard's device.
  cuts = {op.device.split('device:')[-1] for op in operations
          if op.type == 'Split' and 'cut_shards' in op.name}
  assert cuts == {'CPU:0', 'CPU:1', 'CPU:2', 'CPU:3'}
  shards = [v for v in towers.towers.parts.storage.variables
            if '/shard_' in v.path]
  sums = {op.device for op in operations
          if op.type == 'AddN' and 'sum_gradients' in op.name}
  assert {v.value.device for v in shards} <= sums


@pytest.mark.slow
def test_the_same_bits_on_every_mesh_under_reproducible_rows():
  weights = []
  for shape, names, layouts in [LAYOUTS['two axes'],
                                LAYOUTS['table both ways, all by regex'],
                                ((4,), ['batch'], {})]:
    model = _model()
    _fit(fit.TowersModel(model, _parallel(shape, names, layouts),
                         reproducible_rows=2))
    weights.append([w.numpy() for w in model.weights])
  for other in weights[1:]:
    for a, b in zip(weights[0], other):
      np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_the_guides_model_parallel_code_trains_sharded():
  # The keras.io distribution guide's code, and the wrap (its Dropout
  # draws other numbers on each clone: learning, not equality).
  devices = keras.distribution.list_devices()[:8]
  mesh_2d = keras.distribution.DeviceMesh(
      shape=(2, 4), axis_names=['data', 'model'], devices=devices)
  layout_map = keras.distribution.LayoutMap(mesh_2d)
  layout_map['d1/kernel'] = (None, 'model')
  layout_map['d1/bias'] = ('model',)
  layout_map['d2/output'] = ('data', None)
  model_parallel = keras.distribution.ModelParallel(
      layout_map=layout_map, batch_dim_name='data')
  inputs = keras.layers.Input(shape=(28, 28, 1))
  y = keras.layers.Flatten()(inputs)
  y = keras.layers.Dense(units=200, use_bias=False, activation='relu',
                         name='d1')(y)
  y = keras.layers.Dropout(0.4)(y)
  y = keras.layers.Dense(units=10, activation='softmax', name='d2')(y)
  model = keras.Model(inputs=inputs, outputs=y)
  towers = fit.TowersModel(model, model_parallel)
  towers.compile(loss='sparse_categorical_crossentropy', optimizer='adam')
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 10, 128)
  images = rng.normal(size=(128, 28, 28, 1)).astype('float32') * 0.1
  images[np.arange(128), labels, labels, 0] += 3.0
  history = towers.fit(images, labels, batch_size=16, epochs=5,
                       verbose=0).history
  assert history['loss'][-1] < 0.5 * history['loss'][0]
  assert [device for device, _ in _stored(model)['d1/kernel']] == [
      'CPU:0', 'CPU:1', 'CPU:2', 'CPU:3']
  assert towers.config.num_clones == 8


@pytest.mark.slow
def test_weights_saved_sharded_load_on_another_mesh_and_one_device(tmp_path):
  model = _model()
  _fit(fit.TowersModel(model, _parallel(*LAYOUTS['two axes'])))
  path = str(tmp_path / 'sharded.weights.h5')
  model.save_weights(path)
  plain = _model()
  plain.load_weights(path)
  other = _model()
  fit.TowersModel(other, _parallel(*LAYOUTS['table by columns']))
  other.load_weights(path)
  for a, b, c in zip(model.weights, plain.weights, other.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(a.numpy(), c.numpy())
  checkpoint = tf.train.Checkpoint(model=model)
  saved = checkpoint.write(str(tmp_path / 'ckpt'))
  restored = _model()
  fit.TowersModel(restored, _parallel(*LAYOUTS['one axis']))
  tf.train.Checkpoint(model=restored).read(saved).assert_consumed()
  for a, b in zip(model.weights, restored.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_model_parallel_becomes_clones_with_layouts():
  config = keras_distribution.config_for(
      _parallel(*LAYOUTS['two axes']))
  assert (config.num_clones, config.clone_on_cpu) == (4, True)
  assert config.variable_layouts == mesh_layouts.VariableLayouts(
      (2, 2), ('batch', 'model'),
      (('d1/kernel', ('batch', 'model')), ('d2/kernel', ('model', None))))
  assert config.spread_variables


def _refused_at_build(layouts, optimizer=None, model=None, **options):
  model = model or _model()
  config = deploy.DeploymentConfig(
      num_clones=4, clone_on_cpu=True,
      variable_layouts=mesh_layouts.VariableLayouts(
          (2, 2), ('batch', 'model'), tuple(layouts.items())))
  return deploy.deploy(config, model, keras.losses.MeanSquaredError(),
                       optimizer or keras.optimizers.Adam(), **options)


@pytest.mark.parametrize('make, error, message', [
    (lambda: _refused_at_build({'d1/kernel': ('model',)}), errors.ConfigError,
     r'variable d1/kernel of shape \(24, 12\): layout \(\'model\',\) names 1 '
     r'dimensions'),
    (lambda: _refused_at_build({'d1/kernel': ('batch', None)},
                               model=_odd_model()), errors.ConfigError,
     r'variable d1/kernel of shape \(1, 4\): layout \(\'batch\', None\) '
     r'splits a dimension of 1 over 2 devices of .batch., more than it has'),
    (lambda: _refused_at_build({'d1/.*': (None, 'model'),
                                '.*/kernel': (None, 'model')}),
     errors.ConfigError, r'variable d1/kernel: Path .d1/kernel. matches '
     r'multiple layout specification keys'),
    (lambda: _refused_at_build({'d1/kernel': (None, 'model')},
                               keras.optimizers.Adafactor()),
     errors.UnsupportedError, r'optimizer Adafactor: its update reads whole '
     r'variables'),
    (lambda: _refused_at_build({'d1/kernel': (None, 'model')},
                               keras.optimizers.Adam(clipnorm=1.0)),
     errors.UnsupportedError, r'clipnorm=1\.0: it clips each variable'),
    (lambda: _refused_at_build({'d1/kernel': (None, 'model')},
                               sync_batch_norm=True),
     errors.UnsupportedError, r'sync_batch_norm with variable layouts'),
    (lambda: mesh_layouts.VariableLayouts(
        (2, 2), ('batch', 'model'), (('d1/kernel', (None, 'modle')),)),
     errors.ConfigError, r"layout_map\['d1/kernel'\] = \(None, 'modle'\): "
     r"'modle' is not an axis of the mesh"),
    (lambda: mesh_layouts.VariableLayouts(
        (2, 2), ('batch', 'model'), (('d1/kernel', ('model', 'model')),)),
     errors.ConfigError, r'a mesh axis splits one dimension'),
    (lambda: deploy.DeploymentConfig(
        num_clones=2, clone_on_cpu=True,
        variable_layouts=mesh_layouts.VariableLayouts((2, 2), ('a', 'b'))),
     errors.ConfigError, r'num_clones=2 with a mesh of \(2, 2\): one clone a '
     r'mesh device; use num_clones=4'),
    (lambda: deploy.DeploymentConfig(
        num_clones=2, num_stages=2, clone_on_cpu=True,
        variable_layouts=mesh_layouts.VariableLayouts((2,), ('a',))),
     errors.UnsupportedError, r'variable layouts with num_stages=2'),
    (lambda: deploy.DeploymentConfig(
        num_clones=2, num_ps_tasks=1, clone_on_cpu=True,
        variable_layouts=mesh_layouts.VariableLayouts((2,), ('a',))),
     errors.UnsupportedError, r'num_ps_tasks=1: the towers shard variables'),
    (lambda: _refused_at_build({'hidden/kernel': (None, 'model')},
                               model=_constrained()),
     errors.UnsupportedError, r'variable hidden/kernel: layout \(None, '
     r"'model'\) on a variable with a constraint"),
    (lambda: mesh_layouts.VariableLayouts(
        (2,), ('a',), (('d1/kernel', [None, 'a']),)), errors.ConfigError,
     r"layout_map\['d1/kernel'\] = \[None, 'a'\]: give a tuple"),
    (lambda: mesh_layouts.VariableLayouts((2,), ('a',), (('d1/(', ('a',)),)),
     errors.ConfigError, r"layout_map\['d1/\('\]: the key is not a regular "
     'expression'),
    (lambda: mesh_layouts.resolved(mesh_layouts.VariableLayouts(
        (2, 2), ('data', 'model'), mesh_layouts.MODEL_OWN), _Owned()),
     errors.ConfigError, r"layout_map='model': _Owned.get_layout_map on mesh "
     r"axes \('data', 'model'\) failed"),
    (lambda: mesh_layouts.same_mesh(
        mesh_layouts.VariableLayouts((2, 2), ('batch', 'model')),
        mesh_layouts.VariableLayouts((4,), ('model',)), 'm:f'),
     errors.ConfigError, r'layout_map=m:f: its mesh \(4,\) of axes '
     r"\('model',\) is not the mesh \(2, 2\)"),
])
def test_a_layout_the_towers_cannot_honour_is_one_line(make, error, message):
  with pytest.raises(error, match=message) as refused:
    make()
  assert '\n' not in str(refused.value)


def _constrained():
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=(6,))
  return keras.Model(inputs, keras.layers.Dense(
      4, kernel_constraint=keras.constraints.NonNeg(), name='hidden')(inputs))


class _Owned(keras.Model):
  """A model whose layout map, as keras-hub's, wants 'batch' and 'model'."""

  def get_layout_map(self, device_mesh):
    if 'batch' not in device_mesh.axis_names:
      raise ValueError(f'batch is not found in {device_mesh.axis_names}')
    return keras.distribution.LayoutMap(device_mesh)


@pytest.mark.slow
def test_a_model_sharded_before_trains_whole_again():
  model = _model()
  _fit(fit.TowersModel(model, _parallel(*LAYOUTS['two axes'])), epochs=1)
  again = fit.TowersModel(model, deploy.DeploymentConfig(  # Spread there.
      num_clones=4, clone_on_cpu=True, variables_device='spread'))
  _fit(again, epochs=1)
  assert not any(isinstance(v._value, sharding.ShardedValue)
                 for v in model.weights)


def _odd_model():
  """A kernel of one row: no axis of 2 splits it."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=(1,))
  return keras.Model(inputs, keras.layers.Dense(4, name='d1')(inputs))


def test_a_refused_layout_changes_no_variable():
  model = _model()
  before = [(v._value, v.numpy()) for v in model.weights]
  with pytest.raises(errors.UnsupportedError):
    _refused_at_build({'d1/kernel': (None, 'model')},
                      keras.optimizers.Lamb(), model=model)
  for variable, (storage, value) in zip(model.weights, before):
    assert variable._value is storage
    np.testing.assert_array_equal(variable.numpy(), value)


@pytest.mark.slow
def test_the_export_is_a_whole_model_plain_tensorflow_serves(tmp_path):
  model = _model()
  towers = fit.TowersModel(model, _parallel(*LAYOUTS['two axes']))
  _fit(towers, epochs=1)
  images, _ = _data()
  want = towers.predict(images, verbose=0)
  towers.export(str(tmp_path / 'served'), verbose=False)
  served = tf.saved_model.load(str(tmp_path / 'served'))
  np.testing.assert_allclose(served.serve(tf.constant(images)), want,
                             rtol=1e-5, atol=1e-6)
  assert isinstance(model.get_layer('d1').kernel._value,
                    sharding.ShardedValue)


@pytest.mark.slow
def test_a_sharded_checkpoint_is_one_devices_and_resumes_anywhere(tmp_path):
  """The checkpoint of a sharded run holds what one device's would (whole
  weights and whole slots, same keys): restored into a plain model and
  optimizer it trains on as the sharded run does."""
  model = _model()
  towers = fit.TowersModel(model, _parallel(*LAYOUTS['two axes']))
  _fit(towers, epochs=1)
  optimizer = towers.towers.optimizer
  path = tf.train.Checkpoint(
      model=model, optimizer=shard_views.checkpointed(optimizer)).write(
          str(tmp_path / 'sharded'))
  plain = _model()
  plain.compile(optimizer=keras.optimizers.Adam(0.02), metrics=['accuracy'],
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  plain.optimizer.build(plain.trainable_variables)
  tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).read(
      path).assert_consumed()
  assert int(plain.optimizer.iterations) == int(optimizer.iterations) == 4
  images, labels = _data()
  want = plain.fit(images, labels, batch_size=8, epochs=1, shuffle=False,
                   verbose=0).history
  got = towers.fit(images, labels, batch_size=8, epochs=1, shuffle=False,
                   verbose=0).history
  _same(got, want, plain, model)
  # And back: the plain checkpoint restores into another mesh's shards.
  again = _model()
  other = fit.TowersModel(again, _parallel(*LAYOUTS['table by rows']))
  _fit(other, epochs=1)
  tf.train.Checkpoint(
      model=again, optimizer=shard_views.checkpointed(
          other.towers.optimizer)).read(tf.train.Checkpoint(
              model=plain, optimizer=plain.optimizer).write(
                  str(tmp_path / 'plain'))).assert_consumed()
  for a, b in zip(again.weights, plain.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.slow
def test_a_sharded_model_saves_as_plain_keras_loads_it(tmp_path):
  model = _model()
  towers = fit.TowersModel(model, _parallel(*LAYOUTS['two axes']))
  _fit(towers, epochs=1)
  path = str(tmp_path / 'sharded.keras')
  towers.save(path)
  loaded = keras.models.load_model(path)  # Plain Keras, one device.
  for a, b in zip(loaded.weights, model.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  view = shard_views.checkpointed(towers.towers.optimizer)
  assert len(loaded.optimizer.variables) == len(view._variables)
  for a, b in zip(loaded.optimizer.variables, view._variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


class _Subclassed(keras.Model):
  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.d1 = keras.layers.Dense(12, activation='relu', name='d1')
    self.d2 = keras.layers.Dense(4, name='d2')

  def call(self, inputs):
    return self.d2(self.d1(keras.ops.cast(inputs, 'float32')))


def _sequential():
  keras.utils.set_random_seed(0)
  return keras.Sequential([
      keras.Input((3,), dtype='int32'),
      keras.layers.Embedding(16, 8, name='table'), keras.layers.Flatten(),
      keras.layers.Dense(12, activation='relu', name='d1'),
      keras.layers.Dense(4, name='d2')])


def _subclassed():
  keras.utils.set_random_seed(0)
  model = _Subclassed(name='subclassed')
  model(np.zeros((1, 3), np.int32))
  return model


@pytest.mark.slow
@pytest.mark.parametrize('make, layouts', [
    (_sequential, {'.*table/embeddings': ('model', 'batch'),  # Paths start
                   '.*d1/kernel': ('batch', 'model')}),  # 'sequential_1/'.
    (_subclassed, {'subclassed/d1/kernel': (None, 'model'),
                   'subclassed/d2/kernel': ('batch', None)}),
])
def test_sequential_and_subclassed_models_shard_as_one_device(make, layouts):
  plain = make()
  want = _fit(plain)
  model = make()
  towers = fit.TowersModel(model, _parallel((2, 2), ['batch', 'model'],
                                            layouts))
  _same(_fit(towers), want, plain, model)
  assert isinstance(model.get_layer('d1').kernel._value,
                    sharding.ShardedValue)


class _OwnStep(keras.Model):
  def train_step(self, data):
    return super().train_step(data)


def test_a_models_own_step_refuses_variable_layouts():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  model = _OwnStep(inputs, keras.layers.Dense(4, name='d1')(inputs))
  with pytest.raises(errors.UnsupportedError, match=r'has its own '
                     'train_step, which reads and updates whole variables: '
                     'variable layouts are not honoured') as refused:
    fit.TowersModel(model, _parallel(
        (4,), ['model'], {'d1/kernel': (None, 'model')})).compile(
            optimizer='adam', loss='mse')
  assert '\n' not in str(refused.value)
  assert not isinstance(model.get_layer('d1').kernel._value,
                        sharding.ShardedValue)


def test_keys_that_match_no_variable_are_named(caplog):
  model = _sequential()  # Its paths start with the model's name.
  with caplog.at_level('WARNING', logger='absl'):
    fit.TowersModel(model, _parallel((4,), ['model'], {
        'd1/kernel': (None, 'model')})).compile(optimizer='adam', loss='mse')
  assert (f"layout map keys matching no variable of '{model.name}' (its "
          f"paths start as '{model.name}/table/embeddings'): ['d1/kernel']"
          in caplog.text)
