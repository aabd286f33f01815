"""Adversarial cases of the user's optimizer and weight penalties through
`TowersModel`, each against plain one-device `fit`: the optimizer is the
user's own object (its schedule, weight decay exclusions, EMA and a
subclass's state), and a weight penalty counts once under every layout
(central, spread, a kernel split over the batch axis, the model axis or
both)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.mesh import meshes
from tfmulti import deploy
from tfmulti import fit

ROWS, BATCH = 32, 16


class WarmUp(keras.optimizers.schedules.LearningRateSchedule):
  """keras.io's warm-up, written as its examples write it: no
  `get_config`."""

  def __init__(self, peak, steps):
    self.peak, self.steps = peak, steps

  def __call__(self, step):
    return self.peak * tf.minimum(
        1.0, tf.cast(step + 1, tf.float32) / self.steps)


class ScaledSGD(keras.optimizers.SGD):
  """A subclass with a constructor argument its config does not hold."""

  def __init__(self, scale=1.0, **kwargs):
    super().__init__(**kwargs)
    self.scale = scale

  def update_step(self, gradient, variable, learning_rate):
    return super().update_step(gradient * self.scale, variable,
                               learning_rate)


def _adamw_by_names(model):
  del model  # Excluded by name.
  optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
  optimizer.exclude_from_weight_decay(var_names=['bias', 'gamma', 'beta'])
  return optimizer


def _adamw_by_variables(model):
  optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
  optimizer.exclude_from_weight_decay(
      var_list=[model.get_layer('d1').kernel])
  return optimizer


OPTIMIZERS = {
    'adamw exclusions by name': _adamw_by_names,
    'adamw exclusions by variable': _adamw_by_variables,
    'subclass argument': lambda m: ScaledSGD(scale=0.1, learning_rate=0.5),
    'schedule without get_config': lambda m: keras.optimizers.Adam(
        WarmUp(0.05, 4)),
    'ema': lambda m: keras.optimizers.Adam(
        0.05, use_ema=True, ema_overwrite_frequency=None),
    'ema overwritten every 2 steps': lambda m: keras.optimizers.Adam(
        0.05, use_ema=True, ema_overwrite_frequency=2),
    'loss scale optimizer': lambda m: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.05)),
}

SPLIT = {'.*d1/kernel': (None, 'model'), '.*d2/kernel': ('model', None)}
LAYOUTS = {
    'central': lambda: deploy.DeploymentConfig(num_clones=2,
                                               clone_on_cpu=True),
    'spread': lambda: deploy.DeploymentConfig(
        num_clones=2, clone_on_cpu=True, variables_device='spread'),
    'split (1, 2)': lambda: meshes.parallel(SPLIT, shape=(1, 2)),
    'split (2, 2)': lambda: meshes.parallel(SPLIT),
}


def _model(penalty=None):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  x = keras.layers.Dense(8, activation='relu', name='d1',
                         kernel_regularizer=penalty,
                         bias_regularizer=penalty)(inputs)
  x = keras.layers.LayerNormalization(name='norm')(x)
  return keras.Model(inputs, keras.layers.Dense(
      2, name='d2', kernel_regularizer=penalty)(x))


def _data(features=6):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(ROWS, features)).astype(np.float32),
          rng.normal(size=(ROWS, 2)).astype(np.float32))


def _assert_as_plain_fit(make_model, make_optimizer, make_config, epochs=2,
                         data=None):
  data = data or _data()
  plain = make_model()
  plain.compile(make_optimizer(plain), 'mse')
  want = plain.fit(*data, batch_size=BATCH, epochs=epochs,
                   shuffle=False, verbose=0).history['loss']
  config = make_config()
  if isinstance(config, deploy.DeploymentConfig):
    with config.variables_scope():
      model = make_model()
  else:
    model = make_model()
  towers = fit.TowersModel(model, config)
  optimizer = make_optimizer(model)
  towers.compile(optimizer, 'mse')
  assert towers.optimizer is optimizer  # The user's own, not a copy.
  got = towers.fit(*data, batch_size=BATCH, epochs=epochs,
                   shuffle=False, verbose=0).history['loss']
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


@pytest.mark.parametrize('layout', [
    pytest.param(name, marks=() if name == 'split (1, 2)' else
                 pytest.mark.slow) for name in LAYOUTS])
@pytest.mark.parametrize('optimizer', [
    pytest.param(name, marks=() if name == 'adamw exclusions by variable'
                 else pytest.mark.slow) for name in OPTIMIZERS])
def test_the_users_optimizer_trains_as_plain_fit(optimizer, layout):
  _assert_as_plain_fit(_model, OPTIMIZERS[optimizer], LAYOUTS[layout])


PENALTY_LAYOUTS = {
    'model axis, by columns': ((2, 2), {'.*d1/kernel': (None, 'model')}),
    'model axis, by rows': ((2, 2), {'.*d1/kernel': ('model', None)}),
    'both axes': ((2, 2), {'.*d1/kernel': ('batch', 'model')}),
    'both axes, swapped': ((2, 2), {'.*d1/kernel': ('model', 'batch')}),
    'one mesh row of 2': ((1, 2), {'.*d1/kernel': (None, 'model')}),
    'one mesh row of 4': ((1, 4), {'.*d1/kernel': (None, 'model'),
                                   '.*d1/bias': ('model',)}),
    'a column then a row pair': ((2, 2), SPLIT),
    'batch axis alone': ((4, 1), {'.*d1/kernel': (None, 'batch')}),
}


@pytest.mark.parametrize('layout', [
    pytest.param(name, marks=() if name == 'model axis, by columns' else
                 pytest.mark.slow) for name in PENALTY_LAYOUTS])
def test_a_weight_penalty_counts_once_under_every_layout(layout):
  """An L2 penalty on every kernel (and d1's bias): its gradient was
  applied twice where a block of the kernel is one shard (split over
  the model axis alone)."""
  shape, layouts = PENALTY_LAYOUTS[layout]
  _assert_as_plain_fit(
      lambda: _model(keras.regularizers.L2(0.1)),
      lambda m: keras.optimizers.SGD(0.1),
      lambda: meshes.parallel(layouts, shape=shape), epochs=1)


@pytest.mark.slow
def test_two_penalised_split_layers_of_one_shape_train_as_plain_fit():
  def make_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = inputs
    for name in ('a', 'b'):
      x = keras.layers.Dense(8, activation='tanh', name=name,
                             kernel_regularizer=keras.regularizers.L2(
                                 0.05))(x)
    return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))
  _assert_as_plain_fit(
      make_model, lambda m: keras.optimizers.Adam(0.02),
      lambda: meshes.parallel({'.*a/kernel': (None, 'model'),
                               '.*b/kernel': ('model', None)}),
      data=_data(features=8))


def _table_model():
  """A penalised Embedding table (its penalty reads it whole while the
  lookups read its shards) and a penalised Dense."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((3,), dtype='int32')
  x = keras.layers.Embedding(16, 8, name='table',
                             embeddings_regularizer=keras.regularizers.L2(
                                 0.1))(inputs)
  x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(
      2, name='out', kernel_regularizer=keras.regularizers.L2(0.1))(x))


@pytest.mark.parametrize('axes', [
    ('model', None), pytest.param((None, 'model'), marks=pytest.mark.slow),
    pytest.param(('batch', 'model'), marks=pytest.mark.slow)],
                         ids=['by rows', 'by columns', 'both ways'])
def test_a_penalised_table_counts_its_penalty_once(axes):
  rng = np.random.default_rng(2)
  data = (rng.integers(0, 16, (ROWS, 3)).astype(np.int32),
          rng.normal(size=(ROWS, 2)).astype(np.float32))
  _assert_as_plain_fit(
      _table_model, lambda m: keras.optimizers.Adam(0.02),
      lambda: meshes.parallel({'.*table/embeddings': axes}), data=data)
