"""Dense and EinsumDense layers (convolutions: `test_tensor_parallel_conv`)
computed where their kernels' blocks live:
training equal to plain `fit`, each device holding its part of a split
block's activations (read from the traced step), and each block's
products on its device of the clone's mesh row."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.mesh import meshes
from tfmulti import devices
from tfmulti import fit
from tfmulti.mesh import mesh_layouts
from tfmulti.mesh import tensor_parallel
from tfmulti.plan import peaks
from tfmulti.plan import traffic

FEATURES, HIDDEN, OUT = 6, 20, 3

# Keras-hub Llama's feed-forward map on (batch, model): the input
# projections split by output features over 'model' (and stored split
# over 'batch'), the output projection by input features.
FEED_FORWARD = {'up/kernel': ('batch', 'model'),
                'gate/kernel': ('batch', 'model'),
                'down/kernel': ('model', 'batch')}


def _model(gated=False, activation='relu', penalty=None):
  """Features to classes through a feed-forward block (column-parallel
  `up`, with the weight `penalty` given, row-parallel `down`), gated as
  Llama's where asked."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((FEATURES,))
  hidden = keras.layers.Dense(HIDDEN, activation=activation, name='up',
                              kernel_regularizer=penalty)(inputs)
  if gated:
    gate = keras.layers.Dense(HIDDEN, use_bias=False, name='gate')(inputs)
    hidden = keras.layers.Multiply()(
        [keras.layers.Activation('silu')(gate), hidden])
  x = keras.layers.Dense(12, name='down')(hidden)
  return keras.Model(inputs, keras.layers.Dense(OUT, name='out')(x))


def _einsum_model():
  """A sequence through per-head projections: EinsumDense by heads
  (column), then back to features (row, two contracted labels)."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((5, FEATURES))
  heads = keras.layers.EinsumDense('btm,mnh->btnh', (5, 4, 3),
                                   bias_axes='nh', activation='gelu',
                                   name='heads')(inputs)
  x = keras.layers.EinsumDense('btnh,nhm->btm', (5, 8), name='merge')(heads)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(OUT, name='out')(x))


def _data(sequence=False):
  rng = np.random.default_rng(0)
  shape = (32, 5, FEATURES) if sequence else (32, FEATURES)
  return (rng.normal(size=shape).astype('float32'),
          rng.integers(0, OUT, 32).astype('int32'))


def _assert_trains_as_one_device(make, layouts, sequence=False,
                                 optimizer='adam', fields=(), **kwargs):
  plain = make()
  want = meshes.fit_model(plain, _data(sequence), optimizer=optimizer)
  model = make()
  towers = fit.TowersModel(model, meshes.parallel(layouts, **kwargs),
                           **dict(fields))
  np.testing.assert_allclose(
      meshes.fit_model(towers, _data(sequence), optimizer=optimizer), want,
      rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)
  return towers


@pytest.fixture(scope='module')
def gated():
  """A gated block trained by Llama's feed-forward map, checked equal to
  plain `fit` (the two quick tests read one training)."""
  return _assert_trains_as_one_device(lambda: _model(gated=True),
                                      FEED_FORWARD)


def test_a_gated_feed_forward_block_trains_as_one_device(gated):
  splits = gated.towers.parts.storage.splits
  assert sorted(layer.name for layer, *_ in splits.values()) == [
      'down', 'gate', 'up']


@pytest.mark.slow
def test_a_weight_penalty_on_a_split_kernel_trains_as_one_device():
  """The penalty reads the kernel whole: its gradient's blocks join the
  blocks' own where they live, before a mesh row's meet."""
  _assert_trains_as_one_device(
      lambda: _model(penalty=keras.regularizers.L2(0.05)),
      {'up/kernel': ('batch', 'model'), 'down/kernel': ('model', 'batch')})


def test_a_short_batch_leaves_clones_empty_and_trains_as_one_device():
  """17 rows in batches of 16: the last batch's one row is clone 0's
  alone, so its mesh row's meet has one term and the other row none."""
  x, y = (part[:17] for part in _data())
  plain = _model()
  want = meshes.fit_model(plain, (x, y), epochs=1)
  model = _model()
  towers = fit.TowersModel(model, meshes.parallel(FEED_FORWARD))
  np.testing.assert_allclose(meshes.fit_model(towers, (x, y), epochs=1),
                             want, rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


class _Branched(keras.layers.Layer):
  """A Dense called inside a branch (`tf.cond`): a graph of its own,
  where the clones' strategy cannot merge."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.inner = keras.layers.Dense(HIDDEN, activation='relu', name='up')

  def build(self, input_shape):
    self.inner.build(input_shape)

  def call(self, x):
    return tf.cond(tf.reduce_sum(x) > -1e9, lambda: self.inner(x),
                   lambda: self.inner(-x))


@pytest.mark.slow
def test_a_split_layer_in_a_branch_trains_as_one_device():
  """In a branch's graph each clone makes its own blocks' products; the
  rest of the step still runs its clones at once."""
  def make():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(12, name='down')(_Branched(name='branched')(inputs))
    return keras.Model(inputs, keras.layers.Dense(OUT, name='out')(x))
  towers = _assert_trains_as_one_device(
      make, {'branched/up/kernel': (None, 'model'),
             'down/kernel': ('model', None)})
  assert len(towers.towers.parts.storage.splits) == 2


@pytest.mark.slow
@pytest.mark.parametrize('layouts, shape, names', [
    ({'up/kernel': (None, 'model')}, (1, 4), ('batch', 'model')),  # Column.
    ({'down/kernel': ('model', None)}, (2, 2), ('batch', 'model')),  # Row.
    ({'up/kernel': (None, 'model'), 'up/bias': ('model',),
      'down/kernel': ('model', None)}, (2, 4), ('data', 'model')),
])
def test_each_split_trains_as_one_device(layouts, shape, names):
  _assert_trains_as_one_device(_model, layouts, shape=shape, names=names)


@pytest.mark.slow
@pytest.mark.parametrize('optimizer, fields', [
    ('sgd', ()), ('adagrad', ()),
    ('adam', (('accumulation_steps', 2),)),
    ('adam', (('clone_shares', (3, 1, 2, 2)),))])
def test_optimizers_accumulation_and_shares_train_as_one_device(optimizer,
                                                                fields):
  _assert_trains_as_one_device(lambda: _model(gated=True), FEED_FORWARD,
                               optimizer=optimizer, fields=fields)


@pytest.mark.slow
def test_einsum_dense_by_heads_trains_as_one_device():
  _assert_trains_as_one_device(
      _einsum_model, {'heads/kernel': (None, 'model', None),
                      'merge/kernel': ('model', None, 'batch')},
      sequence=True)


def test_a_split_blocks_activations_never_meet_on_one_device(gated):
  """Read from the traced step: of the ops it runs, none makes a matrix
  of the hidden width (each device's parts are half of it: activations,
  kernels and their gradients; the bias, which the map leaves whole, is
  a vector), through the gate's product, forward and backward. A mesh
  row is one clone spanning its devices: its leader (clone (b, 0)) takes
  the row's rows, each block's product runs once on its device of the
  row ((b, 0) and (b, 1)), and the leader adds the row-parallel partial
  sums on its own device; the row's other clone takes no rows."""
  x, y = _data()
  graph = gated.towers.traced_step(tf.constant(x[:16]),
                                    (tf.constant(y[:16]),)).graph
  runs = peaks.reachable(graph)
  ran = [op for op in graph.get_operations() if op.name in runs]
  assert HIDDEN not in {d for op in ran for t in op.outputs
                        if t.shape.rank and t.shape.rank > 1
                        for d in t.shape}
  cpu = [devices.canonical(f'/device:CPU:{i}') for i in range(4)]
  products = {}  # device -> the clones whose rows its products take
  for op in ran:
    if op.type == 'MatMul' and tuple(op.inputs[1].shape) == (
        FEATURES, HIDDEN // 2):
      products.setdefault(devices.canonical(op.device), []).append(
          meshes.clone_of(op.inputs[0]))
  assert products == {cpu[d]: [0, 0] if d < 2 else [2, 2]
                      for d in range(4)}  # The gate's and up's blocks.
  sums = {op.name.split('/')[0]: devices.canonical(op.device) for op in ran
          if op.type == 'AddN' and '/down' in op.name}
  assert sums == {'clone_0': cpu[0], 'clone_2': cpu[2]}
  # The backward pass runs where the forward did: no part of the hidden
  # activations (8 rows a leader), nor of their gradients, crosses
  # devices.
  crossing = {tuple(t.shape) for t, *_ in traffic.crossings(graph)}
  assert (8, HIDDEN // 2) not in crossing
  assert (8, FEATURES) in crossing  # The rows, to each block's device.


def test_a_blocks_gradients_meet_once_a_mesh_row(gated):
  """Read from the traced step: a mesh row's leader computes block j on
  one device as one product of the row's rows, so its gradient is made
  there once, of the row's rows, and cut into its shards' pieces once a
  row (2 rows x 2 blocks of each of 3 kernels), not once a device."""
  x, y = _data()
  graph = gated.towers.traced_step(tf.constant(x[:16]),
                                    (tf.constant(y[:16]),)).graph
  runs = peaks.reachable(graph)
  blocks = {(FEATURES, HIDDEN // 2), (HIDDEN // 2, 12)}
  cuts = [op for op in graph.get_operations() if op.name in runs
          and op.type in ('Split', 'SplitV')
          and tuple(op.inputs[-1 if op.type == 'Split' else 0].shape) in
          blocks]
  assert len(cuts) == 12
  cpu = [devices.canonical(f'/device:CPU:{i}') for i in range(4)]
  for op in cuts:
    made = op.inputs[1 if op.type == 'Split' else 0].op
    assert made.type == 'MatMul' and made.get_attr('transpose_a')
    assert devices.canonical(made.device) == devices.canonical(op.device)
    row = cpu.index(devices.canonical(op.device)) // 2  # Device (row, j).
    assert meshes.clone_of(made.inputs[0]) == 2 * row


@pytest.mark.parametrize('layer, shape, dim, product', [
    # Llama's query (column-parallel) and attention output (row).
    (lambda: keras.layers.EinsumDense('btm,mnh->btnh', (5, 4, 2)),
     (5, 6), 1, 'MatMul'),
    (lambda: keras.layers.EinsumDense('btnh,nhm->btm', (5, 6)),
     (5, 4, 2), 0, 'MatMul'),
    (lambda: keras.layers.Dense(4), (5, 6), 1, 'MatMul'),  # Rows of rows.
    # Convolutions by output and by input channels.
    (lambda: keras.layers.Conv2D(4, 3, strides=2, padding='same'),
     (6, 6, 3), 3, 'Conv2D'),
    (lambda: keras.layers.Conv3D(3, 2), (4, 4, 4, 4), 3, 'Conv3D'),
    (lambda: keras.layers.Conv3D(4, 2), (4, 4, 4, 3), 4, 'Conv3D'),
    (lambda: keras.layers.Conv2D(4, 3, activation='softmax'), (5, 5, 2), 3,
     'Conv2D'),  # Applied to the joined outputs.
    # Not a matmul of rows (a transposed input): Keras's einsum.
    (lambda: keras.layers.EinsumDense('bmt,mh->bth', (7, 6)), (5, 7), 1,
     'Einsum')])
def test_a_split_layer_computes_as_keras_does(layer, shape, dim, product):
  """A split layer's blocks give Keras's outputs, for any number of rows
  (traced with none known), each block one 2-D matmul of the inputs'
  rows where the subscripts contract the inputs' last dimensions with
  the kernel's first (a batched matmul of small blocks costs several
  times as much), else Keras's einsum."""
  layer = layer()
  layer.build((None, *shape))
  x = tf.constant(np.random.default_rng(0).normal(size=(3, *shape)),
                  tf.float32)
  want = layer(x)
  homes = ['/device:CPU:0', '/device:CPU:1']
  blocks = tf.split(tf.convert_to_tensor(layer.kernel), 2, axis=dim)
  with tensor_parallel.computing([(layer, dim, blocks, homes)]):
    traced = tf.function(layer).get_concrete_function(
        tf.TensorSpec((None, *shape), tf.float32))
    got = traced(x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  types = {op.type for op in traced.graph.get_operations()}
  assert product in types and 'BatchMatMulV2' not in types


@pytest.mark.slow
def test_predict_computes_the_blocks_too():
  model = _model(gated=True)
  towers = fit.TowersModel(model, meshes.parallel(FEED_FORWARD))
  meshes.fit_model(towers, _data(), epochs=1)
  x = tf.constant(_data()[0][:16])
  np.testing.assert_allclose(towers.towers.predict(x), model(x), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize('activation', [
    'softmax', keras.layers.Softmax(), 'gelu'])
def test_a_column_parallel_layer_gives_keras_outputs(activation):
  """Traced and eagerly, with sparse inputs too: a softmax (or an
  activation not known to act elementwise: a layer) reads every output
  feature, so it is applied to the joined outputs; sparse inputs take
  Keras's own product."""
  layer = keras.layers.Dense(4, activation=activation)
  layer.build((None, 3))
  blocks = tf.split(tf.convert_to_tensor(layer.kernel), 2, axis=1)
  homes = ['/device:CPU:0', '/device:CPU:1']
  x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) / 6)
  want = layer(x)
  with tensor_parallel.computing([(layer, 1, blocks, homes)]):
    got, traced = layer(x), tf.function(layer)(x)
    from_sparse = layer(tf.sparse.from_dense(x))
  for outputs in (got, traced, from_sparse):
    np.testing.assert_allclose(outputs, want, rtol=1e-6)


@pytest.mark.slow
def test_reproducible_rows_join_the_kernels():
  """Row-parallel partial sums round otherwise than one product: under
  `reproducible_rows` (the same bits on every layout) nothing splits."""
  towers = fit.TowersModel(_model(), meshes.parallel(FEED_FORWARD),
                           reproducible_rows=4)
  meshes.fit_model(towers, _data(), epochs=1)
  assert not towers.towers.parts.storage.splits


@pytest.mark.slow
def test_a_split_layer_places_on_gpus_with_every_kernel():
  """Traced for 4 GPUs (none here: `plans.planning`): each op of the
  split blocks and their parts has a GPU kernel for its dtypes."""
  layouts = mesh_layouts.VariableLayouts(
      (2, 2), ('batch', 'model'), tuple(FEED_FORWARD.items()))
  gpus = meshes.planned_on_gpus(layouts, lambda: _model(gated=True), _data())
  assert len(gpus) == 4
  assert not [line for r in gpus.values() for line in r.missing_kernels]
