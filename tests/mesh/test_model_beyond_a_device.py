"""A model that needs four times a device's memory on one device is planned
to fit each of 8 devices with its kernels split over them (FSDP's
layout: joined in their layers' calls, let go after), and trains on 8
logical CPUs as plain one-device `fit` does."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.mesh import meshes
from tfmulti import fit
from tfmulti import plans
from tfmulti.deploy import keras_distribution
from tfmulti.deploy import placement
from tfmulti.plan import dry_run

DEPTH, WIDTH = 16, 512


def _model():
  """16 hidden Dense layers 512 wide, each kernel 1 MiB."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((64,))
  x = inputs
  for i in range(DEPTH):
    x = keras.layers.Dense(WIDTH, activation='relu', name=f'hidden_{i}')(x)
  return keras.Model(inputs, keras.layers.Dense(10, name='logits')(x))


def _momentum():
  return keras.optimizers.SGD(0.01, momentum=0.9)


def _data(rows=64):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, 64)).astype('float32'),
          rng.integers(0, 10, rows).astype('int32'))


def _config():
  return keras_distribution.from_model_parallel(meshes.parallel(
      {'.*hidden_.*/kernel': (None, 'batch')}, (8,), ('batch',)))


def _needs(reports):
  """The most bytes a device needs: what it holds and its step's peak."""
  return max(r.held_bytes + r.peak_bytes for r in reports.values())


def _on_one_gpu(data):
  config = placement.DeploymentConfig(num_clones=1, variables_device='spread')
  with plans.planning():
    with config.variables_scope():
      model = _model()
    with tf.device(config.optimizer_variables_device()):
      optimizer = _momentum()
    found = dry_run.plan(config, model, keras.losses.
                         SparseCategoricalCrossentropy(from_logits=True),
                         optimizer, *data)
  return {d: r for d, r in found.devices.items() if 'GPU' in d}


@pytest.mark.slow
def test_a_model_four_times_a_device_fits_eight_and_trains_as_one():
  images, labels = _data(32)
  whole = _needs(_on_one_gpu((images, labels)))
  split = _needs(meshes.planned_on_gpus(
      _config().variable_layouts, _model, (images, labels), _momentum))
  assert split <= whole / 4, (split, whole)
  plain, towers = _model(), _model()
  losses = []
  for model in (plain, fit.TowersModel(towers, _config())):
    model.compile(optimizer=_momentum(), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    losses.append(model.fit(*_data(), batch_size=32, epochs=2,
                            shuffle=False, verbose=0).history['loss'])
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
  for got, want in zip(towers.weights, plain.weights):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                               err_msg=want.path)
