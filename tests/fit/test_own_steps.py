"""A model's own steps (`train_step`, `test_step`, `compute_loss`) through
`TowersModel` as through plain `fit`: keras.io's trainer pattern, the
TensorFlow guide's overrides and a GAN with two optimizers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti import deploy
from tfmulti import fit

ROWS, BATCH = 48, 16


class _Counted(keras.Model):
  """Counts its own `train_step` calls (traced, so per clone a trace)."""
  calls = 0


class GuideModel(keras.Model):
  """The TensorFlow guide's first override: its own train_step, with
  `compute_loss`, the optimizer and `self.metrics` Keras compiled."""
  traced = 0

  def train_step(self, data):
    GuideModel.traced += 1
    x, y = data
    with tf.GradientTape() as tape:
      y_pred = self(x, training=True)
      loss = self.compute_loss(y=y, y_pred=y_pred)
    trainable_vars = self.trainable_variables
    gradients = tape.gradient(loss, trainable_vars)
    self.optimizer.apply(gradients, trainable_vars)
    for metric in self.metrics:
      if metric.name == 'loss':
        metric.update_state(loss)
      else:
        metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}


def _guide_model(seed=0):
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((6,))
  x = keras.layers.Dense(16, activation='tanh')(inputs)
  return GuideModel(inputs, keras.layers.Dense(1)(x))


def _data():
  rng = np.random.default_rng(3)
  return (rng.normal(size=(ROWS, 6)).astype(np.float32),
          rng.normal(size=(ROWS, 1)).astype(np.float32))


def test_the_guides_own_train_step_trains_as_plain_fit():
  compile_args = dict(optimizer='adam', loss='mse', metrics=['mae'])
  plain = _guide_model()
  plain.compile(**compile_args)
  GuideModel.traced = 0
  want = plain.fit(*_data(), batch_size=BATCH, epochs=2, shuffle=False,
                   verbose=0).history
  plain_traces = GuideModel.traced
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = _guide_model()
  towers = fit.TowersModel(model, config)
  towers.compile(**compile_args)
  GuideModel.traced = 0
  got = towers.fit(*_data(), batch_size=BATCH, epochs=2, shuffle=False,
                   verbose=0).history
  # The model's own step, on each clone where plain fit runs it once.
  assert GuideModel.traced == 2 * plain_traces
  assert got.keys() == want.keys()
  for key, values in want.items():
    np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)
