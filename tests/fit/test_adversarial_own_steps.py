"""Adversarial cases of a model's own steps through `TowersModel`: what a
user plausibly writes that a step run per clone got wrong (optimizers in
a list or a dict, an update inside a `tf.function` helper, Python that
reads the rows, clone shares, a 1-row last batch, shared layers), each
equal to plain one-device `fit`, or refused in one line with the model
unchanged (a loss added in a call, a layer whose rows interact, a
BatchNorm in training)."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.fit import test_own_steps as own
from tfmulti import deploy
from tfmulti import errors
from tfmulti import fit

ROWS, BATCH = own.ROWS, own.BATCH


class ListedOptimizers(own.GAN):
  """keras.io's GAN with its two optimizers kept in a list."""

  def compile(self, d_optimizer, g_optimizer, loss_fn):
    keras.Model.compile(self)
    self.optimizers = [d_optimizer, g_optimizer]
    self.loss_fn = loss_fn
    self.d_loss_metric = keras.metrics.Mean(name='d_loss')
    self.g_loss_metric = keras.metrics.Mean(name='g_loss')

  @property
  def d_optimizer(self):
    return self.optimizers[0]

  @property
  def g_optimizer(self):
    return self.optimizers[1]


class DictOptimizers(ListedOptimizers):
  """The same, its optimizers in a dict."""

  def compile(self, d_optimizer, g_optimizer, loss_fn):
    super().compile(d_optimizer, g_optimizer, loss_fn)
    self.optimizers = {0: d_optimizer, 1: g_optimizer}


def _gan_of(cls):
  def make(seed=0):
    gan = own._gan(seed)
    return cls(gan.discriminator, gan.generator, latent_dim=4)
  return make


def _gan_data():
  rng = np.random.default_rng(7)
  return tf.data.Dataset.from_tensor_slices(tuple(
      rng.normal(size=(ROWS, *shape)).astype(np.float32)
      for shape in ((8, 8, 1), (4,), (4,)))).batch(BATCH)


def _gan_compile():
  return dict(d_optimizer=keras.optimizers.Adam(0.0003),
              g_optimizer=keras.optimizers.Adam(0.0003),
              loss_fn=keras.losses.BinaryCrossentropy())


@pytest.mark.slow
@pytest.mark.parametrize('cls', [ListedOptimizers, DictOptimizers],
                         ids=['list', 'dict'])
def test_a_gans_optimizers_in_a_container_train_as_plain_fit(cls):
  own._assert_same(*own._fit_both(_gan_of(cls), dict(x=_gan_data(),
                                                     epochs=1),
                                  _gan_compile))


class HelperApplies(own.GuideModel):
  """Its update in a `tf.function` helper of its own."""

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      loss = self.compute_loss(y=y, y_pred=self(x, training=True))
    self.apply(tape.gradient(loss, self.trainable_variables))
    return {'loss': loss}

  @tf.function
  def apply(self, gradients):
    self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))


def test_an_update_in_a_tf_function_helper_trains_as_plain_fit():
  x, y = own._data()
  own._assert_same(*own._fit_both(
      lambda: own._functional(HelperApplies),
      dict(x=x, y=y, batch_size=BATCH, epochs=1),
      dict(optimizer='adam', loss='mse')))


_HELPER_SCRIPT = textwrap.dedent('''
    from tests import conftest  # The logical CPUs, soft placement off.
    from tests.fit import test_adversarial_own_steps as t
    t.test_an_update_in_a_tf_function_helper_trains_as_plain_fit()
    print('exact')
''')


@pytest.mark.slow
def test_an_update_in_a_tf_function_helper_ends_within_a_minute():
  """In a process of its own, so a wait (one was 600 s) fails the test
  instead of hanging the suite."""
  done = subprocess.run([sys.executable, '-c', _HELPER_SCRIPT],
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 0 and 'exact' in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize('rows, options', [
    (ROWS, dict(clone_shares=(3, 1))),
    pytest.param(17, {}, id='a 1-row last batch', marks=pytest.mark.slow),
    pytest.param(ROWS, dict(num_clones=4, clone_shares=(1, 2, 3, 2)),
                 marks=pytest.mark.slow, id='4 clones, uneven')])
def test_shares_and_short_batches_train_as_plain_fit(rows, options):
  x, y = own._data()
  own._assert_same(*own._fit_both(
      own._guide_model, dict(x=x[:rows], y=y[:rows], batch_size=BATCH,
                             epochs=2),
      dict(optimizer='adam', loss='mse', metrics=['mae']), **options))


class Twice(keras.Model):
  """A trainer that calls its one model twice a step (a shared layer
  stack) and sums the two losses."""

  def __init__(self, model):
    super().__init__()
    self.model = model

  def call(self, x):
    return self.model(x)

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      loss = (keras.ops.mean((self.model(x) - y) ** 2)
              + keras.ops.mean((self.model(2.0 * x) - y) ** 2))
    gradients = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
    return {'loss': loss}


@pytest.mark.slow
def test_a_model_called_twice_a_step_trains_as_plain_fit():
  x, y = own._data()
  own._assert_same(*own._fit_both(
      lambda: Twice(own._functional(keras.Model)),
      dict(x=x, y=y, batch_size=BATCH, epochs=2),
      lambda: dict(optimizer=keras.optimizers.SGD(0.05))))


class AddsLoss(keras.layers.Layer):
  """Adds the mean of its inputs' squares as a loss: each clone's would be
  its rows' mean."""

  def call(self, x):
    self.add_loss(keras.ops.mean(x ** 2))
    return x


class Pooled(keras.layers.Layer):
  """Its output is a mean over the rows: they interact."""

  def call(self, x):
    return keras.ops.mean(x, axis=0)


class PooledStep(own.GuideModel):
  def train_step(self, data):
    x, _ = data
    with tf.GradientTape() as tape:
      loss = keras.ops.sum(self.pool(self(x, training=True)))
    self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                         self.trainable_variables)
    return {'loss': loss}


def _adds_loss():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  x = AddsLoss()(keras.layers.Dense(4)(inputs))
  return own.GuideModel(inputs, keras.layers.Dense(1)(x))


def _pooled():
  model = own._functional(PooledStep)
  model.pool = Pooled(name='pool')
  return model


def _with_batch_norm():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  x = keras.layers.BatchNormalization(name='bn')(inputs)
  return own.GuideModel(inputs, keras.layers.Dense(1)(x))


@pytest.mark.parametrize('make, message', [
    (_adds_loss, r"a layer of 'guide_model\w*' adds a loss in its call "
     r'\(add_loss, an activity regularizer\), which each clone would '
     r'compute on its rows alone; add it in the step, or train on one '
     r'clone\.$'),
    (_pooled, r"layer 'pool' gives an output of shape \(1\,?\) for 8 rows: "
     r'its rows interact, so the clones cannot compute it by rows; train '
     r'it on one clone\.$'),
    (_with_batch_norm, r"model '\w+' has its own train_step and a "
     r"BatchNormalization in training \('bn'\): each clone would normalize "
     r'its own rows; freeze it \(trainable=False\), or use num_clones=1\.$'),
], ids=['add_loss', 'rows that interact', 'batch norm'])
def test_what_cannot_be_split_by_rows_is_refused_in_one_line(make, message):
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = make()
  before = [w.numpy() for w in model.weights]
  with pytest.raises(errors.UserError, match=message) as refused:
    towers = fit.TowersModel(model, config)
    towers.compile(optimizer='sgd', loss='mse')
    towers.fit(*own._data(), batch_size=BATCH, verbose=0)
  assert '\n' not in str(refused.value)
  for got, want in zip(model.weights, before):
    np.testing.assert_array_equal(got, want)
