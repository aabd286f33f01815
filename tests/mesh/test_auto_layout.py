"""`layout_map='auto'`: a layout map derived from a model. Feed-forward
pairs split by columns then rows, attention by heads, tables by rows, the
rest over the batch axis (`tfmulti.mesh.auto_layout`), read from how the
layers use their variables; against keras-hub's own maps; trained as
plain `fit`."""

import keras
import keras_hub
import numpy as np
import pytest

from tests.mesh import meshes
from tfmulti import fit
from tfmulti.mesh import auto_layout
from tfmulti.mesh import mesh_layouts

WIDTH = 128  # A hidden kernel 64 KiB: split (auto_layout.MIN_BYTES).


def _mlp(depth=4, width=WIDTH):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((WIDTH,))
  x = inputs
  for i in range(depth):
    x = keras.layers.Dense(width, activation='relu', name=f'hidden_{i}')(x)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _axes(model, shape=(1, 2), names=('batch', 'model'), min_bytes=None,
          **fields):
  """{path: axes} of each of `model`'s variables under the derived map
  (None: whole), read back through Keras's own lookup."""
  layouts = mesh_layouts.VariableLayouts(shape, names, **fields)
  rules = auto_layout.rules_for(layouts, model, *(
      () if min_bytes is None else (min_bytes,)))
  layouts = mesh_layouts.VariableLayouts(shape, names, rules, **fields)
  assert len(rules) == len(model.variables)
  return {v.path: layouts.axes_for(v.path, v.shape) for v in model.variables}


def test_a_feed_forward_chain_pairs_columns_then_rows():
  found = _axes(_mlp())
  assert [found[f'hidden_{i}/kernel'] for i in range(4)] == [
      (None, 'model'), ('model', None)] * 2
  assert found['out/kernel'] is None  # 1 KiB: small.
  assert all(found[f'hidden_{i}/bias'] is None for i in range(4))


def test_the_batch_axis_splits_each_large_variable_for_storage():
  assert [_axes(_mlp(), (2,), ('batch',))[f'hidden_{i}/kernel']
          for i in range(4)] == [('batch', None)] * 4
  assert [_axes(_mlp(), (2, 2))[f'hidden_{i}/kernel'] for i in range(4)] == [
      ('batch', 'model'), ('model', 'batch')] * 2


def _gate():
  """Llama's feed-forward: silu(gate(x)) * up(x), then down."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((WIDTH,))
  gate = keras.layers.Dense(WIDTH, activation='silu', name='gate')(inputs)
  up = keras.layers.Dense(WIDTH, name='up')(inputs)
  x = keras.layers.Multiply()([gate, up])
  x = keras.layers.Dense(WIDTH, name='down')(x)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _residual():
  """The second layer reads the first's output plus the inputs."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((WIDTH,))
  x = keras.layers.Dense(WIDTH, activation='relu', name='first')(inputs)
  x = keras.layers.Add()([x, inputs])
  x = keras.layers.Dense(WIDTH, name='second')(x)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _shared():
  """One layer called twice, then one that reads it."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((WIDTH,))
  shared = keras.layers.Dense(WIDTH, activation='relu', name='shared')
  x = keras.layers.Dense(WIDTH, name='after')(shared(shared(inputs)))
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _penalised():
  """Weight penalties on split kernels."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((WIDTH,))
  x = inputs
  for i in range(2):
    x = keras.layers.Dense(WIDTH, activation='relu', name=f'hidden_{i}',
                           kernel_regularizer=keras.regularizers.L2(1e-3))(x)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


def _softmax():
  """A softmax between two layers: not elementwise."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((WIDTH,))
  x = keras.layers.Dense(WIDTH, activation='softmax', name='first')(inputs)
  x = keras.layers.Dense(WIDTH, name='second')(x)
  return keras.Model(inputs, keras.layers.Dense(2, name='out')(x))


@pytest.mark.parametrize('make, want', [
    (_gate, {'gate': (None, 'model'), 'up': (None, 'model'),
             'down': ('model', None)}),
    (_residual, {'first': (None, 'model'), 'second': (None, 'model')}),
    (_shared, {'shared': (None, 'model'), 'after': (None, 'model')}),
    (_softmax, {'first': (None, 'model'), 'second': (None, 'model')}),
], ids=['gated', 'residual', 'shared layer', 'softmax'])
def test_what_makes_a_row_kernel_and_what_does_not(make, want):
  found = _axes(make())
  assert {name: found[f'{name}/kernel'] for name in want} == want


class Subclassed(keras.Model):

  def __init__(self):
    super().__init__()
    self.first = keras.layers.Dense(WIDTH, activation='relu')
    self.second = keras.layers.Dense(WIDTH)

  def call(self, x):
    return self.second(self.first(x))


def test_a_subclassed_model_pairs_on_the_shape_it_was_built_on(caplog):
  model = Subclassed()
  model(np.zeros((2, WIDTH), np.float32))
  found = _axes(model)
  assert [found[model.first.kernel.path], found[model.second.kernel.path]
          ] == [(None, 'model'), ('model', None)]
  unbuilt = Subclassed()
  unbuilt.first.build((None, WIDTH))
  unbuilt.second.build((None, WIDTH))
  caplog.set_level('INFO', logger='absl')
  found = _axes(unbuilt)
  assert found[unbuilt.second.kernel.path] == (None, 'model')
  assert 'no input shapes to trace' in caplog.text


def test_what_cannot_split_stays_whole_and_is_logged(caplog):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((WIDTH,))
  x = keras.layers.Dense(129, name='odd')(inputs)  # 129 columns on 2.
  x = keras.layers.Dense(WIDTH, kernel_constraint='non_neg',
                         name='constrained')(x)
  x = keras.layers.BatchNormalization(name='norm')(x)
  model = keras.Model(inputs, x)
  caplog.set_level('INFO', logger='absl')
  found = _axes(model)
  assert found['odd/kernel'] is None
  assert found['constrained/kernel'] is None
  assert all(found[f'norm/{name}'] is None for name in
             ('gamma', 'beta', 'moving_mean', 'moving_variance'))
  assert ('odd/kernel (128, 129) (no dimension divides by its axis); '
          'constrained/kernel (129, 128) (a constraint reads it whole)'
          ) in caplog.text


def _llama():
  keras.utils.set_random_seed(0)
  return keras_hub.models.LlamaBackbone(
      vocabulary_size=64, num_layers=2, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)


def _gemma():
  keras.utils.set_random_seed(0)
  return keras_hub.models.GemmaBackbone(
      vocabulary_size=64, num_layers=2, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=16, intermediate_dim=64,
      head_dim=4)


@pytest.mark.parametrize('make, swapped', [(_llama, True), (_gemma, False)],
                         ids=['llama', 'gemma'])
def test_keras_hubs_own_maps_but_llamas_query_key_and_value(make, swapped):
  """keras-hub's maps (the Gemma team's): Gemma's query, key and value
  kernels are (heads, hidden, head size), split (model, batch, None):
  heads over 'model', as the derived map splits them. Llama's map copies
  those axes onto kernels of (hidden, heads, head size), so its hidden
  inputs go over 'model' (partial sums to add) and heads over 'batch';
  the derived map splits Llama's heads over 'model' too. Every other
  variable keras-hub names is laid out as keras-hub lays it out."""
  model = make()
  found = _axes(model, (2, 2), min_bytes=0)
  own = type(model).get_layout_map(mesh_layouts.VariableLayouts(
      (2, 2), ('batch', 'model')).mesh())
  named = 0
  for variable in model.variables:
    layout = own[variable.path]
    if layout is None:
      continue
    named += 1
    want = tuple(layout.axes)
    if swapped and any(f'{k}/kernel' in variable.path
                       for k in ('query', 'key', 'value')):
      want = (want[1], want[0], *want[2:])
    assert found[variable.path] == want, variable.path
  assert named == 1 + 2 * 7


def _data(rows=32):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, WIDTH)).astype(np.float32),
          rng.integers(0, 2, rows).astype(np.int32))


@pytest.mark.slow
@pytest.mark.parametrize('make, shape', [
    (_mlp, (2, 2)), (_gate, (1, 2)), (_residual, (2, 1)), (_shared, (1, 2)),
    (_penalised, (2, 2))], ids=['mlp (2, 2)', 'gated (1, 2)',
                                'residual (2, 1)', 'shared layer (1, 2)',
                                'weight penalties (2, 2)'])
def test_a_derived_map_trains_as_plain_fit(make, shape):
  """Momentum SGD: row kernels add their partial sums in another order,
  which Adam normalises past 1e-5 where a gradient nearly cancels (the
  docs' "Which number to compare")."""
  plain = make()
  want = meshes.fit_model(plain, _data(), optimizer='sgd')
  model = make()
  device_mesh = keras.distribution.DeviceMesh(
      shape, ['batch', 'model'],
      keras.distribution.list_devices()[:int(np.prod(shape))])
  towers = fit.TowersModel(model, keras.distribution.ModelParallel(
      layout_map=mesh_layouts.auto_layout_map(model, device_mesh)))
  got = meshes.fit_model(towers, _data(), optimizer='sgd')
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6,
                               err_msg=w.path)
  assert towers.towers.parts.storage.splits or shape[1] == 1
