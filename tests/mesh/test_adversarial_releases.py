"""Adversarial cases of sharded variables joined in their layer's call
and let go after (`mesh.releases`), each trained by `TowersModel` on a
mesh whose one axis is the batch's (every sharded variable joined for
the pass): equal to plain one-device `fit` (a layer called once bit for
bit equal to the same run with its joins kept through the step,
`keep_joins`, under mixed precision too): Python
that reads a clone's rows under shares, a 1-row last batch, wrappers,
attention by heads, a convolution beside a LayerNormalization (its
scale joined as any variable is), masks, a Dense
subclass with its own call, accumulation steps, an RNN's cell and a
condition's branches (traced in bodies of their own: joined for the
pass there)."""

import keras
import numpy as np
import pytest

from tests.mesh import meshes
from tests.mesh.test_adversarial_split_kernels import _attention
from tests.mesh.test_adversarial_split_kernels import Chunked
from tfmulti import fit
from tfmulti.deploy import keras_distribution

BATCH = 16


def _dense(make_layer=None, shape=(6,)):
  """A layer (made after the seed is set) and a Dense."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape)
  x = (make_layer or (lambda: keras.layers.Dense(8, name='inner')))()(inputs)
  if len(x.shape) > 2:
    x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


class OwnCall(keras.layers.Dense):
  """A Dense whose call is its own: joined as any variable is."""

  def call(self, inputs):
    return super().call(inputs) * 2.0


def _conv():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6, 6, 2))
  x = keras.layers.Conv2D(4, 3, name='conv')(inputs)
  x = keras.layers.LayerNormalization(name='norm')(x)
  x = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(x))
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _masked():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((5,), dtype='int32')
  x = keras.layers.Embedding(10, 6, mask_zero=True, name='table')(inputs)
  x = keras.layers.Dense(8, activation='tanh', name='inner')(x)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


class Cell(keras.layers.Layer):
  """An RNN cell whose Dense runs in the RNN's loop body."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.inner = keras.layers.Dense(8, activation='tanh', name='inner')
    self.state_size = 8

  def build(self, shape):
    self.inner.build((shape[0], shape[-1] + 8))

  def call(self, x, states):
    y = self.inner(keras.ops.concatenate([x, states[0]], -1))
    return y, [y]


class Branches(keras.layers.Layer):
  """Its Dense called in either branch of a condition on its weights (one
  on its rows would make them interact)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.inner = keras.layers.Dense(8, name='inner')

  def build(self, shape):
    self.inner.build(shape)

  def call(self, x):
    return keras.ops.cond(keras.ops.sum(self.inner.bias) >= 0,
                          lambda: self.inner(x), lambda: self.inner(x) * 2.0)


def _data(rows=32, shape=(6,), ids=False):
  rng = np.random.default_rng(4)
  x = (rng.integers(0, 10, (rows, *shape)).astype('int32') if ids else
       rng.normal(size=(rows, *shape)).astype('float32'))
  if ids:
    x[:, -2:] = 0  # Masked positions.
  return x, rng.integers(0, 2, rows).astype('int32')


def _fit(model, data):
  model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model.fit(*data, batch_size=BATCH, epochs=2, shuffle=False,
                   verbose=0).history['loss']


def _trained(make, layouts, data, keep_joins=False, **fields):
  """(the losses, the model) of `make()` trained by `TowersModel` on a
  mesh (4,) of the batch's axis under `layouts`."""
  model = make()
  config = keras_distribution.from_model_parallel(
      meshes.parallel(layouts, (4,), ('batch',)), keep_joins=keep_joins)
  return _fit(fit.TowersModel(model, config, **fields), data), model


def _assert_released_as_plain_fit(make, layouts, data, **fields):
  plain = make()
  want = _fit(plain, data)
  got, model = _trained(make, layouts, data, **fields)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


KERNELS = {'.*inner/kernel': (None, 'batch')}


@pytest.mark.parametrize('make, layouts, data, fields', [
    pytest.param(lambda: _dense(lambda: Chunked(name='chunked')), KERNELS,
                 _data(), dict(clone_shares=(3, 1, 2, 2)),
                 id="Python reading a clone's rows under shares"),
    pytest.param(_dense, KERNELS, _data(17), {}, id='a 1-row last batch',
                 marks=pytest.mark.slow),
    pytest.param(lambda: _dense(lambda: OwnCall(8, name='inner')), KERNELS,
                 _data(), {}, id='a Dense subclass with its own call',
                 marks=pytest.mark.slow),
    pytest.param(lambda: _dense(lambda: keras.layers.TimeDistributed(
        keras.layers.Dense(8, name='inner')), (3, 6)), KERNELS,
                 _data(shape=(3, 6)), {}, id='TimeDistributed',
                 marks=pytest.mark.slow),
    pytest.param(_attention, {
        '.*mha/(query|key|value)/kernel': (None, 'batch', None),
        '.*mha/attention_output/kernel': ('batch', None, None)},
                 _data(shape=(4, 8)), {}, id='attention by heads',
                 marks=pytest.mark.slow),
    pytest.param(_conv, {'conv/kernel': (None, None, None, 'batch'),
                         'norm/gamma': ('batch',)},
                 _data(shape=(6, 6, 2)), {},
                 id='a convolution beside a LayerNormalization',
                 marks=pytest.mark.slow),
    pytest.param(_masked, {'inner/kernel': (None, 'batch')},
                 _data(shape=(5,), ids=True), {}, id='a mask through it',
                 marks=pytest.mark.slow),
    pytest.param(_dense, KERNELS, _data(), dict(accumulation_steps=2),
                 id='accumulation steps', marks=pytest.mark.slow),
    pytest.param(lambda: _dense(lambda: keras.layers.RNN(Cell(), name='rnn'),
                                (3, 6)), KERNELS, _data(shape=(3, 6)), {},
                 id="an RNN's cell, in its loop's body",
                 marks=pytest.mark.slow),
    pytest.param(lambda: _dense(lambda: Branches(name='branches')), KERNELS,
                 _data(), {}, id="a condition's branches",
                 marks=pytest.mark.slow),
])
def test_what_users_write_around_released_layers_trains_as_plain_fit(
    make, layouts, data, fields):
  _assert_released_as_plain_fit(make, layouts, data, **fields)


@pytest.mark.parametrize('make, layouts, data', [
    pytest.param(_dense, KERNELS, _data(), id='a Dense'),
    pytest.param(_conv, {'conv/kernel': (None, None, None, 'batch')},
                 _data(shape=(6, 6, 2)), id='a convolution',
                 marks=pytest.mark.slow)])
@pytest.mark.parametrize('policy', [
    'float32', pytest.param('mixed_bfloat16', marks=pytest.mark.slow)])
def test_a_layer_called_once_trains_the_kept_joins_bits(make, layouts, data,
                                                        policy):
  """Its backward pass is the kept join's ops on the same values (under
  mixed precision the kernel joined in float32 and cast in the call, its
  recomputation cast alike); a layer called several times may sum its
  calls' gradients in another order."""
  keras.config.set_dtype_policy(policy)
  try:
    (_, released), (_, kept) = (
        _trained(make, layouts, data, keep_joins=keep_joins)
        for keep_joins in (False, True))
  finally:
    keras.config.set_dtype_policy('float32')
  for r, k in zip(released.weights, kept.weights):
    np.testing.assert_array_equal(r, k, err_msg=r.path)
