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
