"""Sharded variables joined late and let go early (`mesh.releases`): a
plain layer's sharded variables are joined in its call and again in its
backward pass, no op of the backward pass reads the forward's join, the
planned peak falls, and training equals plain one-device `fit`; with
`keep_joins`, the join before the pass, kept through the step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.mesh import meshes
from tfmulti import errors
from tfmulti import fit
from tfmulti import plans
from tfmulti.deploy import keras_distribution
from tfmulti.deploy import towers
from tfmulti.mesh import mesh_layouts
from tfmulti.mesh import releases
from tfmulti.plan import dry_run
from tfmulti.plan import peaks

WIDTH = 16
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp(output_activation=None, regularized=False, shared=False,
         width=WIDTH, depth=2):
  """`depth` Dense layers `width` wide (the first with a weight penalty
  where `regularized`; the last called twice where `shared`), then 4
  outputs."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input(shape=(6,))
  penalty = keras.regularizers.L2(0.01) if regularized else None
  x = keras.layers.Dense(width, activation='relu', name='d1',
                         kernel_regularizer=penalty)(inputs)
  for i in range(2, depth + 1):
    layer = keras.layers.Dense(width, activation='relu', name=f'd{i}')
    x = layer(layer(x)) if shared and i == depth else layer(x)
  outputs = keras.layers.Dense(4, activation=output_activation,
                               name='out')(x)
  return keras.Model(inputs, outputs)


def _data():
  rng = np.random.default_rng(2)
  return (rng.normal(size=(32, 6)).astype('float32'),
          rng.integers(0, 4, 32).astype('int32'))


def _fit(model, from_logits=True):
  model.compile(optimizer=keras.optimizers.Adam(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=from_logits))
  return model.fit(*_data(), batch_size=8, epochs=2, shuffle=False,
                   verbose=0).history['loss']


# Every kernel split by its outputs over the batch axis: storage alone,
# joined for the pass (FSDP's layout).
JOINED = {'.*/kernel': (None, 'batch')}


def _towers(model, keep_joins=False):
  return fit.TowersModel(model, _config(keep_joins))


def _config(keep_joins=False, gather_ahead=1):
  return keras_distribution.from_model_parallel(
      meshes.parallel(JOINED, (4,), ('batch',)), keep_joins=keep_joins,
      gather_ahead=gather_ahead)


def _assert_same(model, plain, got, want):
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


@pytest.mark.parametrize('case', [
    'plain', 'softmax output',
    *(pytest.param(case, marks=pytest.mark.slow)
      for case in ('weight penalty', 'shared layer', 'joins kept'))])
def test_released_joins_train_as_one_device(case):
  options = {'softmax output': dict(output_activation='softmax'),
             'weight penalty': dict(regularized=True),
             'shared layer': dict(shared=True)}.get(case, {})
  from_logits = case != 'softmax output'
  plain = _mlp(**options)
  want = _fit(plain, from_logits)
  model = _mlp(**options)
  got = _fit(_towers(model, keep_joins=case == 'joins kept'), from_logits)
  _assert_same(model, plain, got, want)


def _deployed(keep_joins=False, xla=False, gather_ahead=1, **shape):
  """The MLP (`_mlp(**shape)`) deployed under `_config(keep_joins,
  gather_ahead)`, with Adam."""
  config = _config(keep_joins, gather_ahead)
  with plans.planning():
    model = _mlp(**shape)
    with tf.device(config.optimizer_variables_device()):
      optimizer = keras.optimizers.Adam(0.01)
    return towers.deploy(config, model, LOSS, optimizer, xla=xla)


def _graph(keep_joins=False, xla=False, gather_ahead=1):
  images, labels = _data()
  deployed = _deployed(keep_joins, xla, gather_ahead)
  with plans.planning():
    return deployed.traced_step(images[:8], labels[:8]).graph


def _ops(graph):
  """Every op of `graph`, inside its function bodies too."""
  for op in graph.get_operations():
    yield op
    for body in peaks.bodies(op):
      yield from _ops(body)


def _backward(op):
  return 'gradient_tape/' in op.name or '_backward/' in op.name


def test_no_backward_op_reads_the_forwards_join():
  """Each forward join of a kernel is read by its layer's forward alone;
  the backward pass joins the kernel again. Kept joins: the backward reads
  the forward's."""
  for keep_joins, kept in ((False, False), (True, True)):
    joins = [op for op in _ops(_graph(keep_joins))
             if 'gather_shards' in op.name and op.type == 'ConcatV2']
    forward = [op for op in joins if not _backward(op)]
    read_later = [op.name for op in forward
                  if any(_backward(c) for out in op.outputs
                         for c in out.consumers())]
    assert forward and bool(read_later) == kept, read_later
    assert any(_backward(op) for op in joins) != kept


@pytest.mark.slow
def test_a_pass_that_joins_in_its_layers_calls_is_not_compiled():
  """A compiled pass receives every shard as it starts, so the joins are
  kept as before: with xla on, the pass is compiled only where the joins
  are kept (`keep_joins`)."""
  for keep_joins in (False, True):
    compiled = [op for op in _ops(_graph(keep_joins, xla=True))
                if '_XlaMustCompile' in op.node_def.attr]
    assert bool(compiled) == keep_joins


@pytest.mark.slow
def test_the_planned_peak_falls_to_the_layers_in_flight():
  """Eight 128-wide layers on 4 devices: joined once and kept, every
  device's step holds every kernel whole; released, the kernels in
  flight alone, and a layer more for each layer gathered ahead."""
  images, labels = _data()
  found = {}
  for keep_joins, ahead in ((True, 1), (False, 0), (False, 1)):
    with plans.planning():
      report = dry_run.read(
          _deployed(keep_joins, gather_ahead=ahead, width=128, depth=8),
          images[:8], labels[:8])
    found[keep_joins, ahead] = max(r.peak_bytes
                                   for r in report.devices.values())
  kernels, kernel = (6 + 7 * 128 + 4) * 128 * 4, 128 * 128 * 4
  assert found[True, 1] > kernels
  assert found[False, 0] < found[True, 1] - kernels / 2, found
  assert found[False, 0] < found[False, 1] <= found[False, 0] + 2 * kernel


def test_each_layer_gathers_its_shards_while_the_one_before_computes():
  """Gathered one layer ahead, the reads of d2's shards wait for d1's
  inputs, not d2's; for its gradient, for the gradient of `out`'s
  outputs, not of its own (which `out`'s backward pass makes)."""
  found = {}
  for ahead in (0, 1):
    reads = [op for op in _ops(_graph(gather_ahead=ahead))
             if op.type == 'ReadVariableOp' and op.control_inputs and
             op.name.startswith(('clone_0/d2_1/', 'clone_0/d2_backward/'))]
    found[ahead] = {op.name.split('/')[1]: op.control_inputs[0].name
                    for op in reads}
  assert found[0]['d2_1'] == 'clone_0/d1_1/Relu'
  assert found[1]['d2_1'].startswith('split_batch/')  # The model's input.
  assert 'out_backward' in found[0]['d2_backward']
  assert '_backward' not in found[1]['d2_backward'], found


def test_plain_keras_layers_release_their_variables_and_no_other():
  """Keras's own Dense, EinsumDense and convolutions (inside a wrapper
  too) release; a call of a subclass's own, LoRA, rematerialization, a
  layer with state and a table do not (joined as any variable is)."""

  class OwnCall(keras.layers.Dense):

    def call(self, inputs):
      return super().call(inputs) + 1.0

  keras.utils.set_random_seed(0)
  inputs = keras.Input((3, 4, 4, 2))
  x = keras.layers.TimeDistributed(
      keras.layers.Conv2D(2, 3, name='conv'))(inputs)
  x = keras.layers.Reshape((3, 8))(x)
  x = keras.layers.EinsumDense('abc,cd->abd', (3, 4), name='einsum')(x)
  x = keras.layers.BatchNormalization(name='norm')(x)
  x = OwnCall(4, name='own')(keras.layers.Dense(4, name='plain')(x))
  lora = keras.layers.Dense(4, name='lora')
  x = lora(x)
  lora.enable_lora(2)
  with keras.RematScope(mode='full'):  # Keras's own recompute_grad.
    x = keras.layers.Dense(4, name='remat')(x)
  ids = keras.Input((2,), dtype='int32')
  y = keras.layers.Embedding(5, 4, name='table')(ids)
  model = keras.Model([inputs, ids], [x, y])
  found = releases.layers(model, {id(v) for v in model.variables})
  assert sorted(layer.name for layer, _ in found) == ['conv', 'einsum',
                                                      'plain']


@pytest.mark.parametrize('fields, message', [
    (dict(gather_ahead=-1), 'gather_ahead=-1: give a count of layers'),
    (dict(gather_ahead=True), 'gather_ahead=True: give a count of layers'),
    (dict(gather_ahead=2, keep_joins=True),
     'gather_ahead=2 with keep_joins: kept joins are gathered once'),
])
def test_a_bad_gather_ahead_is_refused_in_one_line(fields, message):
  with pytest.raises(errors.ConfigError, match=message):
    mesh_layouts.VariableLayouts((2,), ('batch',), **fields)


def test_a_join_for_a_gradient_waits_for_the_gradient_before_it_cut():
  """Else it arrives beside the whole gradient the layer before made:
  d2's reads for its gradient wait for `out`'s gradient's pieces (with
  `gather_ahead` 0), d1's (1)."""
  for ahead, layer in ((0, 'd2'), (1, 'd1')):
    reads = [op for op in _ops(_graph(gather_ahead=ahead))
             if op.type == 'ReadVariableOp' and
             op.name.startswith(f'clone_0/{layer}_backward/')]
    assert reads and all(
        any('out_backward/cut_shards' in c.name for c in op.control_inputs)
        for op in reads), ahead
