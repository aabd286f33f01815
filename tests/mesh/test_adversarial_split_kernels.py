"""Adversarial cases of kernels split over a compute axis and computed as
blocks (`tensor_parallel`), each against plain one-device `fit`: Python
that reads a clone's rows under uneven shares, a 1-row last batch, a
layer called twice, wrappers and attention; each exact, or refused in
one line."""

import keras
import numpy as np
import pytest

from tests.mesh import meshes
from tfmulti import fit

BATCH = 16


class Chunked(keras.layers.Layer):
  """Calls its Dense on its rows 4 at a time: as many calls as a clone
  has rows / 4."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(8, name='inner')

  def build(self, shape):
    self.dense.build(shape)

  def call(self, x):
    rows = x.shape[0] or 4  # Keras's symbolic build: no rows.
    return keras.ops.concatenate(
        [self.dense(x[i:i + 4]) for i in range(0, rows, 4)], 0)


def _model(make_layer=None, features=6):
  """A layer (made after the seed is set: Keras draws a layer's
  initializers' seeds when it is made) and a Dense."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((features,))
  x = (make_layer or (lambda: keras.layers.Dense(8, name='inner')))()(inputs)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _twice():
  """One split Dense called on the inputs and again on its outputs."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  shared = keras.layers.Dense(6, activation='tanh', name='inner')
  x = shared(shared(inputs))
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _time_distributed():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((3, 6))
  x = keras.layers.TimeDistributed(keras.layers.Dense(8, name='inner'))(
      inputs)
  x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _bidirectional():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((3, 6))
  x = keras.layers.Bidirectional(keras.layers.LSTM(4), name='bi')(inputs)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _attention():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((4, 8))
  x = keras.layers.MultiHeadAttention(4, 2, name='mha')(inputs, inputs)
  x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _data(rows=32, shape=(6,)):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, *shape)).astype(np.float32),
          rng.normal(size=(rows, 2)).astype(np.float32))


def _assert_as_plain_fit(make_model, layouts, data, shape=(1, 2),
                         optimizer=lambda: keras.optimizers.Adam(0.02),
                         **options):
  plain = make_model()
  plain.compile(optimizer(), 'mse')
  want = plain.fit(*data, batch_size=BATCH, epochs=2, shuffle=False,
                   verbose=0).history['loss']
  model = make_model()
  towers = fit.TowersModel(model, meshes.parallel(layouts, shape=shape),
                           **options)
  towers.compile(optimizer(), 'mse')
  got = towers.fit(*data, batch_size=BATCH, epochs=2, shuffle=False,
                   verbose=0).history['loss']
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


INNER = {'.*inner/kernel': (None, 'model')}


def test_python_that_reads_a_clones_rows_under_shares_trains_as_plain_fit():
  """Shares 3:1: 12 rows call the Dense 3 times, 4 rows once; it crashed
  in the strategy's regrouping, as the clones met by order."""
  _assert_as_plain_fit(lambda: _model(lambda: Chunked(name='chunked')), INNER,
                       _data(), clone_shares=(3, 1))


@pytest.mark.parametrize('make, layouts, shape, rows', [
    pytest.param(_model, INNER, (6,), 17, id='a 1-row last batch'),
    pytest.param(_twice, INNER, (6,), 32, id='a layer called twice',
                 marks=pytest.mark.slow),
    pytest.param(_time_distributed, INNER, (3, 6), 32,
                 id='TimeDistributed', marks=pytest.mark.slow),
    pytest.param(_bidirectional, {'.*bi/.*/kernel': (None, 'model')},
                 (3, 6), 32, id='Bidirectional, its kernels sharded',
                 marks=pytest.mark.slow),
    pytest.param(_attention, {'.*mha/(query|key|value)/kernel': (
        None, 'model', None), '.*mha/attention_output/kernel': (
            'model', None, None)}, (4, 8), 32, id='attention by heads',
                 marks=pytest.mark.slow),
])
def test_what_users_write_around_split_layers_trains_as_plain_fit(
    make, layouts, shape, rows):
  """With SGD: attention's key bias has a gradient of zero but for
  round-off (a softmax over keys ignores a constant), which Adam scales
  to a step, on one device as on any other."""
  _assert_as_plain_fit(make, layouts, _data(rows, shape), shape=(2, 2),
                       optimizer=lambda: keras.optimizers.SGD(0.1))


class Seeing(keras.layers.Layer):
  """Records the dtype policy Keras's global state gives its calls."""
  seen = []

  def call(self, x):
    Seeing.seen.append(keras.config.dtype_policy().name)
    return x


def test_every_clone_traced_at_once_sees_the_callers_keras_state():
  """A mesh row's leader traces its rows with Keras's global state (its
  dtype policy, set after the model was built) as the caller set it."""
  def make():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = Seeing()(keras.layers.Dense(8, name='inner')(inputs))
    return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))
  towers = fit.TowersModel(make(), meshes.parallel(INNER))
  towers.compile(keras.optimizers.SGD(0.1), 'mse')
  Seeing.seen = []
  keras.config.set_dtype_policy('mixed_bfloat16')  # After the build.
  try:
    towers.fit(*_data(), batch_size=BATCH, epochs=1, verbose=0)
  finally:
    keras.config.set_dtype_policy('float32')
  assert Seeing.seen and set(Seeing.seen) == {'mixed_bfloat16'}, Seeing.seen
