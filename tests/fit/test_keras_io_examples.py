"""keras.io's examples as their users write them, through `TowersModel` on 2
clones against plain one-device `fit`: the same layers, `compile` and `fit`
arguments, on small synthetic data of the same shapes and dtypes (no
network). Dropout rates are 0 and random draws come with the data (random
layers are not exact); BatchNorm runs synchronized (`sync_batch_norm`).
Every number `fit` logs is compared to 1e-5, and the weights after the
few steps each trains."""

import keras
from keras import layers
from keras import ops
import numpy as np
import pytest
import tensorflow as tf

from tests.fit import test_keras_models as text
from tests.fit import test_own_steps as own
from tests.helpers import readings_apart
from tfmulti import deploy
from tfmulti import fit

ROWS = 64
# Synchronized BatchNorm (Keras's) takes the batch variance as the clones'
# mean square less the square mean, which rounds otherwise than one
# device's: the moving statistics, and the validation numbers read from
# them, agree to 1e-4 (5.7e-5 seen); training's to 1e-5.
_MOVING_STATISTICS_RTOL = 1e-4


def _fit_both(model_fn, compile_fn, fit_fn, **options):
  """(plain fit's history, the towers', (plain model, towers' model)):
  `fit_fn(model)` fits a compiled model, `compile_fn()` gives its compile
  arguments (new optimizers and callbacks each run)."""
  histories, models = [], []
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  for towers in (False, True):
    with config.variables_scope():
      model = model_fn()
    trained = fit.TowersModel(model, config, **options) if towers else model
    trained.compile(**compile_fn())
    histories.append(fit_fn(trained).history)
    models.append(model)
  return histories, models


def _assert_same(histories, models, weights=True, val_rtol=1e-5,
                 inputs=None):
  """The logged numbers to 1e-5 (validation ones to `val_rtol`) and the
  weights, but the biases into a BatchNorm (`_into_batch_norm`), for which
  the outputs on `inputs` must agree instead."""
  want, got = histories
  assert readings_apart(got).keys() == want.keys()
  for key, values in want.items():
    np.testing.assert_allclose(
        got[key], values, rtol=val_rtol if key.startswith('val_') else 1e-5,
        atol=1e-7, err_msg=key)
  if not weights:
    return
  apart = _into_batch_norm(models[0])
  for g, w in zip(models[1].weights, models[0].weights):
    if w.path not in apart:
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)
  if apart:
    # Those biases drift by round-off on either run, and the moving means
    # carry it: the outputs agree within what plain Keras's own round-off
    # moves them (with and without XLA: 1e-4 to 3e-3 after a few epochs).
    np.testing.assert_allclose(models[1].predict(inputs, verbose=0),
                               models[0].predict(inputs, verbose=0),
                               rtol=0, atol=1e-3)


def _into_batch_norm(model):
  """The paths of the biases of layers that feed a BatchNormalization, and
  of its moving mean, which holds them: BatchNorm takes their mean away,
  so their true gradient is 0 and Adam moves them by normalised
  round-off, on one device too."""
  norms = [layer for layer in model.layers
           if isinstance(layer, layers.BatchNormalization)]
  feeding = [parent.operation for layer in norms
             for node in layer._inbound_nodes for parent in node.parent_nodes]
  return ({v.path for layer in feeding for v in layer.weights
           if v.path.endswith('bias')} |
          {layer.moving_mean.path for layer in norms})


def _rng():
  return np.random.default_rng(11)


def mnist_convnet():
  """vision/mnist_convnet: a Sequential convnet, softmax, 'adam'."""
  keras.utils.set_random_seed(0)
  return keras.Sequential([
      keras.Input(shape=(12, 12, 1)),
      layers.Conv2D(8, kernel_size=(3, 3), activation='relu'),
      layers.MaxPooling2D(pool_size=(2, 2)),
      layers.Conv2D(16, kernel_size=(3, 3), activation='relu'),
      layers.Flatten(), layers.Dropout(0.0),
      layers.Dense(10, activation='softmax')])


@pytest.mark.slow
def test_mnist_convnet():
  x = _rng().random((ROWS, 12, 12, 1)).astype('float32')
  y = keras.utils.to_categorical(_rng().integers(0, 10, ROWS), 10)
  _assert_same(*_fit_both(
      mnist_convnet,
      lambda: dict(loss='categorical_crossentropy', optimizer='adam',
                   metrics=['accuracy']),
      lambda m: m.fit(x, y, batch_size=16, epochs=2, validation_split=0.25,
                      shuffle=False, verbose=0)))


def timeseries_fcn():
  """timeseries/timeseries_classification_from_scratch: Conv1D, BatchNorm
  and ReLU three times, pooled to a softmax."""
  keras.utils.set_random_seed(0)
  input_layer = keras.layers.Input((20, 1))
  x = input_layer
  for _ in range(3):
    x = keras.layers.Conv1D(filters=8, kernel_size=3, padding='same')(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
  gap = keras.layers.GlobalAveragePooling1D()(x)
  output_layer = keras.layers.Dense(2, activation='softmax')(gap)
  return keras.models.Model(inputs=input_layer, outputs=output_layer)


@pytest.mark.slow
def test_timeseries_fcn_with_its_callbacks(tmp_path):
  x = _rng().normal(size=(ROWS, 20, 1))  # float64, as the example reads.
  y = _rng().integers(0, 2, ROWS)
  runs = iter(('plain', 'towers'))

  def callbacks():
    return [keras.callbacks.ModelCheckpoint(
        str(tmp_path / f'{next(runs)}.keras'), save_best_only=True,
        monitor='val_loss'),
            keras.callbacks.ReduceLROnPlateau(
                monitor='val_loss', factor=0.5, patience=1, min_lr=0.0001),
            keras.callbacks.EarlyStopping(monitor='val_loss', patience=2)]
  _assert_same(*_fit_both(
      timeseries_fcn,
      lambda: dict(optimizer='adam', loss='sparse_categorical_crossentropy',
                   metrics=['sparse_categorical_accuracy']),
      lambda m: m.fit(x, y, batch_size=16, epochs=4, callbacks=callbacks(),
                      validation_split=0.25, shuffle=False, verbose=0),
      sync_batch_norm=True), val_rtol=_MOVING_STATISTICS_RTOL, inputs=x)
  best = keras.models.load_model(tmp_path / 'towers.keras')  # Plain Keras.
  assert best.count_params() == timeseries_fcn().count_params()


def structured_data():
  """structured_data/structured_data_classification_from_scratch: a dict
  of inputs, numeric ones normalized, categories one-hot, a sigmoid."""
  keras.utils.set_random_seed(0)
  numeric = {name: keras.Input((1,), name=name) for name in ('age', 'chol')}
  thal = keras.Input((1,), name='thal', dtype='int64')
  encoded = [layers.Normalization(mean=50.0, variance=100.0)(numeric['age']),
             layers.Normalization(mean=200.0, variance=900.0)(
                 numeric['chol']),
             layers.CategoryEncoding(num_tokens=4, output_mode='one_hot')(
                 thal)]
  x = layers.Dense(16, activation='relu')(layers.concatenate(encoded))
  x = layers.Dropout(0.0)(x)
  output = layers.Dense(1, activation='sigmoid')(x)
  return keras.Model({**numeric, 'thal': thal}, output)


def _structured_dataset():
  rng = _rng()
  names = ['fixed', 'normal', 'reversible', 'unknown']
  frame = {'age': rng.integers(30, 70, ROWS).astype('float32'),
           'chol': rng.integers(150, 300, ROWS).astype('float32'),
           'thal': np.array(names)[rng.integers(0, 4, ROWS)]}
  target = rng.integers(0, 2, ROWS)
  lookup = layers.StringLookup(vocabulary=names[:3], num_oov_indices=1)

  def encode(features, label):  # The lookups run in tf.data.
    return (dict(features, thal=lookup(features['thal'])[..., None],
                 age=features['age'][..., None],
                 chol=features['chol'][..., None]), label)
  return tf.data.Dataset.from_tensor_slices((frame, target)).batch(16).map(
      encode)


@pytest.mark.slow
def test_structured_data_with_lookups_in_tf_data():
  dataset = _structured_dataset()
  _assert_same(*_fit_both(
      structured_data,
      lambda: dict(optimizer='adam', loss='binary_crossentropy',
                   metrics=['accuracy']),
      lambda m: m.fit(dataset, epochs=2, validation_data=dataset,
                      verbose=0)))


def small_xception(input_shape=(16, 16, 3), num_classes=2):
  """vision/image_classification_from_scratch: a small Xception (entry
  convolution, separable convolutions with residuals, BatchNorm)."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=input_shape)
  x = layers.Rescaling(1.0 / 255)(inputs)
  x = layers.Conv2D(8, 3, strides=2, padding='same')(x)
  x = layers.BatchNormalization()(x)
  x = layers.Activation('relu')(x)
  previous_block_activation = x
  for size in [16]:
    x = layers.Activation('relu')(x)
    x = layers.SeparableConv2D(size, 3, padding='same')(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation('relu')(x)
    x = layers.SeparableConv2D(size, 3, padding='same')(x)
    x = layers.BatchNormalization()(x)
    x = layers.MaxPooling2D(3, strides=2, padding='same')(x)
    residual = layers.Conv2D(size, 1, strides=2, padding='same')(
        previous_block_activation)
    x = layers.add([x, residual])
    previous_block_activation = x
  x = layers.GlobalAveragePooling2D()(x)
  x = layers.Dropout(0.0)(x)
  return keras.Model(inputs, layers.Dense(1)(x))


@pytest.mark.slow
def test_image_classification_from_scratch():
  x = _rng().integers(0, 256, (ROWS, 16, 16, 3)).astype('float32')
  y = _rng().integers(0, 2, ROWS)
  _assert_same(*_fit_both(
      small_xception,
      lambda: dict(optimizer=keras.optimizers.Adam(3e-4),
                   loss=keras.losses.BinaryCrossentropy(from_logits=True),
                   metrics=[keras.metrics.BinaryAccuracy(name='acc')]),
      lambda m: m.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                      validation_data=(x[:16], y[:16]), verbose=0),
      sync_batch_norm=True), val_rtol=_MOVING_STATISTICS_RTOL, inputs=x)


class RecommenderNet(keras.Model):
  """structured_data/collaborative_filtering_movielens: users and movies
  embedded, their dot product and biases through a sigmoid."""

  def __init__(self, num_users, num_movies, embedding_size, per_row=False,
               **kwargs):
    super().__init__(**kwargs)
    self.per_row = per_row  # Each row's own dot product: rows apart.
    self.user_embedding = layers.Embedding(
        num_users, embedding_size, embeddings_initializer='he_normal',
        embeddings_regularizer=keras.regularizers.l2(1e-6))
    self.user_bias = layers.Embedding(num_users, 1)
    self.movie_embedding = layers.Embedding(
        num_movies, embedding_size, embeddings_initializer='he_normal',
        embeddings_regularizer=keras.regularizers.l2(1e-6))
    self.movie_bias = layers.Embedding(num_movies, 1)

  def call(self, inputs):
    user_vector = self.user_embedding(inputs[:, 0])
    user_bias = self.user_bias(inputs[:, 0])
    movie_vector = self.movie_embedding(inputs[:, 1])
    movie_bias = self.movie_bias(inputs[:, 1])
    dot_user_movie = (ops.sum(user_vector * movie_vector, axis=1,
                              keepdims=True) if self.per_row
                      else ops.tensordot(user_vector, movie_vector, 2))
    x = dot_user_movie + user_bias + movie_bias
    return ops.nn.sigmoid(x)


def recommender(per_row=False):
  keras.utils.set_random_seed(0)
  model = RecommenderNet(20, 30, 8, per_row=per_row)
  model(np.zeros((1, 2), 'int64'))  # Built once, as its users do.
  return model


@pytest.mark.slow
@pytest.mark.parametrize('per_row', [False, True])
def test_collaborative_filtering(per_row):
  """As written, its `tensordot` over two axes sums over the whole batch:
  each row's output depends on the other rows', so the clones' shards
  compute another function (the documented exception: rows that
  interact). Each row's own dot product trains as plain fit."""
  x = np.stack([_rng().integers(0, 20, ROWS),
                _rng().integers(0, 30, ROWS)], axis=1)
  y = _rng().random(ROWS).astype('float32')
  histories, models = _fit_both(
      lambda: recommender(per_row),
      lambda: dict(loss=keras.losses.BinaryCrossentropy(),
                   optimizer=keras.optimizers.Adam(learning_rate=0.001)),
      lambda m: m.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                      validation_data=(x, y), verbose=0))
  if per_row:
    _assert_same(histories, models)
  else:
    assert abs(histories[1]['loss'][0] - histories[0]['loss'][0]) > 1e-4


@pytest.mark.slow
def test_text_classification_with_transformer():
  x, y = text._tokens()
  _assert_same(*_fit_both(
      text._positions,
      lambda: dict(optimizer='adam', loss='sparse_categorical_crossentropy',
                   metrics=['accuracy']),
      lambda m: m.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                      validation_data=(x, y), verbose=0)),
               weights=False)


@pytest.mark.slow
def test_the_trainer_pattern():
  own.test_the_trainer_pattern_trains_as_plain_fit()


@pytest.mark.slow
def test_dcgan():
  own.test_a_gan_with_two_optimizers_trains_as_plain_fit()


class Sampling(layers.Layer):
  """generative/vae: z from (z_mean, z_log_var) by the reparameterization
  trick; epsilon comes with the data (the example draws it)."""

  def call(self, inputs):
    z_mean, z_log_var, epsilon = inputs
    return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
  """generative/vae's model: its own train_step and loss trackers."""

  def __init__(self, encoder, decoder, **kwargs):
    super().__init__(**kwargs)
    self.encoder = encoder
    self.decoder = decoder
    self.total_loss_tracker = keras.metrics.Mean(name='total_loss')
    self.reconstruction_loss_tracker = keras.metrics.Mean(
        name='reconstruction_loss')
    self.kl_loss_tracker = keras.metrics.Mean(name='kl_loss')

  @property
  def metrics(self):
    return [self.total_loss_tracker, self.reconstruction_loss_tracker,
            self.kl_loss_tracker]

  def train_step(self, data):
    (images, epsilon), = data  # Keras's (x,), x the images and epsilon.
    with tf.GradientTape() as tape:
      z_mean, z_log_var, z = self.encoder([images, epsilon])
      reconstruction = self.decoder(z)
      reconstruction_loss = ops.mean(ops.sum(
          keras.losses.binary_crossentropy(images, reconstruction),
          axis=(1, 2)))
      kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) -
                        ops.exp(z_log_var))
      kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
      total_loss = reconstruction_loss + kl_loss
    grads = tape.gradient(total_loss, self.trainable_weights)
    self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
    self.total_loss_tracker.update_state(total_loss)
    self.reconstruction_loss_tracker.update_state(reconstruction_loss)
    self.kl_loss_tracker.update_state(kl_loss)
    return {'loss': self.total_loss_tracker.result(),
            'reconstruction_loss': self.reconstruction_loss_tracker.result(),
            'kl_loss': self.kl_loss_tracker.result()}


def vae(latent_dim=2):
  keras.utils.set_random_seed(0)
  images = keras.Input(shape=(8, 8, 1))
  epsilon = keras.Input(shape=(latent_dim,))
  x = layers.Conv2D(8, 3, activation='relu', strides=2, padding='same')(
      images)
  x = layers.Flatten()(x)
  x = layers.Dense(16, activation='relu')(x)
  z_mean = layers.Dense(latent_dim, name='z_mean')(x)
  z_log_var = layers.Dense(latent_dim, name='z_log_var')(x)
  z = Sampling()([z_mean, z_log_var, epsilon])
  encoder = keras.Model([images, epsilon], [z_mean, z_log_var, z],
                        name='encoder')
  latent_inputs = keras.Input(shape=(latent_dim,))
  x = layers.Dense(4 * 4 * 8, activation='relu')(latent_inputs)
  x = layers.Reshape((4, 4, 8))(x)
  x = layers.Conv2DTranspose(1, 3, activation='sigmoid', strides=2,
                             padding='same')(x)
  decoder = keras.Model(latent_inputs, x, name='decoder')
  return VAE(encoder, decoder)


@pytest.mark.slow
def test_vae():
  images = _rng().random((ROWS, 8, 8, 1)).astype('float32')
  epsilon = _rng().normal(size=(ROWS, 2)).astype('float32')
  _assert_same(*_fit_both(
      vae, lambda: dict(optimizer=keras.optimizers.Adam()),
      lambda m: m.fit((images, epsilon), epochs=2, batch_size=16,
                      shuffle=False, verbose=0)))
