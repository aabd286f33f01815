"""Keras's distribution API honoured: the keras.io distribution guide's
`DataParallel` code trains on those devices through `TowersModel`, as
plain `fit` on one device; what the towers do not honour is refused."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti import deploy
from tfmulti import errors
from tfmulti import fit
from tfmulti.deploy import keras_distribution


@pytest.fixture
def distribution():
  """Sets a Keras distribution for the test, and none after."""
  yield keras.distribution.set_distribution
  keras.distribution.set_distribution(None)


def _model():
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=(6,))
  x = keras.layers.Dense(16, activation='relu')(inputs)
  return keras.Model(inputs, keras.layers.Dense(3)(x))


def _data():
  rng = np.random.default_rng(2)
  return (rng.normal(size=(32, 6)).astype('float32'),
          rng.integers(0, 3, 32).astype('int32'))


def _fit(model):
  model.compile(optimizer=keras.optimizers.Adam(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), metrics=['accuracy'])
  return model.fit(*_data(), batch_size=8, epochs=2, shuffle=False,
                   verbose=0).history


@pytest.mark.slow
def test_the_guides_data_parallel_trains_on_its_devices_as_one_device(
    distribution):
  plain = _model()
  want = _fit(plain)
  # The guide's code, and the wrap.
  devices = keras.distribution.list_devices()[:2]
  data_parallel = keras.distribution.DataParallel(devices=devices)
  distribution(data_parallel)
  model = _model()
  towers = fit.TowersModel(model)
  got = _fit(towers)
  assert towers.config.num_clones == 2 and towers.config.clone_on_cpu
  for key, values in want.items():
    np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)
  images, labels = _data()
  graph = towers.towers.traced_step(  # Keras's targets: (labels,).
      tf.constant(images[:8]), (tf.constant(labels[:8]),)).graph
  assert {op.device.split('device:')[-1] for op in graph.get_operations()
          if op.type == 'MatMul'} == {'CPU:0', 'CPU:1'}


def test_a_data_parallel_becomes_one_clone_a_device():
  config = keras_distribution.config_for(
      keras.distribution.DataParallel(devices=['gpu:0', 'gpu:1', 'gpu:2']))
  assert (config.num_clones, config.clone_on_cpu) == (3, False)
  assert config.clone_device(2).endswith('GPU:2')
  same = deploy.DeploymentConfig(num_clones=2)
  assert keras_distribution.config_for(same) is same


@pytest.mark.parametrize('make, error, message', [
    (lambda: None, errors.ConfigError,
     r'no DeploymentConfig and no Keras distribution set: pass '
     r'config=deploy\.DeploymentConfig'),
    (lambda: keras.distribution.DataParallel(devices=['gpu:1', 'gpu:2']),
     errors.ConfigError, r"DataParallel\(devices=\['gpu:1', 'gpu:2'\]\): the "
     r"towers run clone i on device i; give one kind's devices from 0"),
    (lambda: keras.distribution.DataParallel(devices=['cpu:0', 'gpu:1']),
     errors.ConfigError, r"give one kind's devices"),
    (lambda: keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(
            keras.distribution.DeviceMesh((2,), ['model'], ['cpu:1', 'cpu:0'])),
        batch_dim_name='model'), errors.ConfigError,
     r"ModelParallel\(devices=\['cpu:1', 'cpu:0'\]\): the towers run "
     r'clone i on device i'),
])
def test_a_distribution_the_towers_do_not_honour_is_one_line(make, error,
                                                             message):
  with pytest.raises(error, match=message) as refused:
    keras_distribution.config_for(make())
  assert '\n' not in str(refused.value)


def _named():
  """`_model` with its layers named (a layout map's keys name them)."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=(6,))
  x = keras.layers.Dense(16, activation='relu', name='d1')(inputs)
  return keras.Model(inputs, keras.layers.Dense(3, name='d2')(x))


def _model_parallel(**keys):
  """keras.io's distribution guide's ModelParallel on a (2, 2) mesh of
  logical CPUs, its layout map's `keys` ({key: axes})."""
  mesh = keras.distribution.DeviceMesh(
      (2, 2), ['batch', 'model'], keras.distribution.list_devices()[:4])
  layout_map = keras.distribution.LayoutMap(mesh)
  for key, axes in keys.items():
    layout_map[key] = axes
  return keras.distribution.ModelParallel(layout_map=layout_map,
                                          batch_dim_name='batch')


GUIDE = {'.*d1/kernel': (None, 'model'), '.*d2/kernel': ('model', None)}


def _assert_trains_as_plain_fit(make_towers):
  plain = _named()
  want = _fit(plain)
  towers, model = make_towers()
  got = _fit(towers)
  assert towers.config.variable_layouts is not None
  for key, values in want.items():
    np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


@pytest.mark.slow
def test_a_model_built_and_wrapped_in_a_distribution_scope_trains_as_one(
    distribution):
  """keras-hub's way: `with distribution.scope():` around the model."""
  del distribution  # Unset after the test, whatever it sets.

  def make():
    with _model_parallel(**GUIDE).scope():
      model = _named()
      return fit.TowersModel(model), model
  _assert_trains_as_plain_fit(make)


@pytest.mark.slow
def test_a_distribution_set_after_the_model_was_built_trains_as_one(
    distribution):
  def make():
    model = _named()
    distribution(_model_parallel(**GUIDE))
    return fit.TowersModel(model), model
  _assert_trains_as_plain_fit(make)


@pytest.mark.slow
def test_an_output_layout_is_ignored_in_one_line(distribution, caplog):
  """The guide's `layout_map['.../d2/output'] = ('batch', None)` under
  `set_distribution`: Keras's TensorFlow backend crashed in the layer's
  call; the towers ignore it, saying so once."""
  caplog.set_level('INFO', logger='absl')

  def make():
    model = _named()
    distribution(_model_parallel(**GUIDE, **{'.*d2/output': ('batch',
                                                               None)}))
    return fit.TowersModel(model), model
  _assert_trains_as_plain_fit(make)
  said = [r.getMessage() for r in caplog.records
          if "layers' outputs, ignored" in r.getMessage()]
  assert len(said) == 1 and "'.*d2/output'" in said[0]
  assert 'matching no variable' not in caplog.text


def test_a_key_matching_nothing_is_an_error_under_strict_layout_map():
  """keras.io's `d1/kernel` against a Sequential's whole path: refused in
  one line naming the nearest path, before anything is placed; without
  strict_layout_map, a warning."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((6,)),
                            keras.layers.Dense(16, name='d1'),
                            keras.layers.Dense(3, name='d2')])
  before = [w.numpy() for w in model.weights]
  config = keras_distribution.from_model_parallel(
      _model_parallel(**{'d1/kernel': (None, 'model')}),
      strict_layout_map=True)
  with pytest.raises(errors.ConfigError, match=(
      r"^layout map key 'd1/kernel' matches no variable of model "
      r"'sequential\w*' \(strict_layout_map\); the nearest paths: "
      r'sequential\w*/d1/kernel')) as refused:
    fit.TowersModel(model, config).compile(
        keras.optimizers.SGD(0.1), 'mse')
  assert '\n' not in str(refused.value)
  for got, want in zip(model.weights, before):
    np.testing.assert_array_equal(got, want)
    assert 'CPU:0' in got.value.device  # Not moved: nothing was placed.
