"""Convolutions computed where their kernels' blocks live: split by
output channels (column-parallel) or input channels (row-parallel),
training equal to plain `fit`, each block's convolution once a mesh row
on its device (read from the traced step); a kernel split along its
window, or a layer that is not a plain channels-last convolution,
joined for the pass instead."""

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

OUT = 3

# Output channels over 'model' (column), then input channels over
# 'model' and output channels stored over 'batch' (row).
CONVOLUTIONS = {'up/kernel': (None, None, None, 'model'),
                'down/kernel': (None, None, 'model', 'batch')}


def _model():
  """Images to classes through a column-parallel convolution, a relu and
  a row-parallel strided one without a bias."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((8, 8, 3))
  x = keras.layers.Conv2D(8, 3, padding='same', activation='relu',
                          name='up')(inputs)
  x = keras.layers.Conv2D(6, 3, strides=2, use_bias=False, name='down')(x)
  x = keras.layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, keras.layers.Dense(OUT, name='out')(x))


def _data():
  """32 images of 8 x 8 x 3 and their classes."""
  rng = np.random.default_rng(0)
  return (rng.normal(size=(32, 8, 8, 3)).astype('float32'),
          rng.integers(0, OUT, 32).astype('int32'))


@pytest.fixture(scope='module')
def towers():
  """The model trained by `CONVOLUTIONS` on a (2, 2) mesh, checked equal
  to plain `fit` (the tests below read one training)."""
  plain = _model()
  want = meshes.fit_model(plain, _data())
  model = _model()
  trained = fit.TowersModel(model, meshes.parallel(CONVOLUTIONS))
  np.testing.assert_allclose(meshes.fit_model(trained, _data()), want,
                             rtol=1e-5)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)
  return trained


def test_split_convolutions_train_as_one_device(towers):
  splits = towers.towers.parts.storage.splits
  assert sorted((layer.name, dim) for layer, dim, _ in splits.values()) == [
      ('down', 2), ('up', 3)]


def test_each_blocks_convolution_runs_once_a_mesh_row_on_its_device(towers):
  """Read from the traced step: each block's convolution, forward and
  its kernel's gradient, runs once a mesh row on its device of the row
  ((b, 0) and (b, 1) for the clones (b, m)), on the rows of the row's
  leader, clone (b, 0) (the row-parallel one's: as the column-parallel
  one made them, not joined again); no clone convolves with a whole
  kernel."""
  x, y = _data()
  graph = towers.towers.traced_step(tf.constant(x[:16]),
                                    (tf.constant(y[:16]),)).graph
  runs = peaks.reachable(graph)
  ran = [op for op in graph.get_operations() if op.name in runs]
  cpu = [devices.canonical(f'/device:CPU:{i}') for i in range(4)]
  blocks = {(3, 3, 3, 4), (3, 3, 4, 6)}
  for kind in ('Conv2D', 'Conv2DBackpropFilter'):
    found = {}
    for op in ran:
      if op.type == kind:
        kernel = tuple((op.inputs[1] if kind == 'Conv2D' else
                        op.outputs[0]).shape)
        assert kernel in blocks, (op.name, kernel)
        found.setdefault(devices.canonical(op.device), []).append(
            _clones_behind(op.inputs[0]))
        if kernel == (3, 3, 4, 6):  # Its rows as `up` made them, there.
          made = op.inputs[0].op
          assert made.type != 'ConcatV2' and devices.canonical(
              made.device) == devices.canonical(op.device), made.name
    assert found == {cpu[d]: [0, 0] if d < 2 else [2, 2]
                     for d in range(4)}, kind


def _clones_behind(rows):
  """The clone whose rows made `rows`: the first one named, by an op or
  its consumers, back through the first input of each op before it."""
  while True:
    try:
      return meshes.clone_of(rows)
    except StopIteration:  # No clone's scope names it: one step back.
      rows = rows.op.inputs[0]


class _Standardized(keras.layers.Conv2D):
  """A weight-standardized convolution (keras.io's BiT): its kernel's
  statistics span its input channels, so it reads the kernel whole."""

  def convolution_op(self, inputs, kernel):
    mean, variance = tf.nn.moments(kernel, axes=[0, 1, 2], keepdims=True)
    return super().convolution_op(
        inputs, (kernel - mean) / tf.sqrt(variance + 1e-10))


BY_OUTPUTS, BY_INPUTS = (None, None, None, 'model'), (None, None, 'model', None)


@pytest.mark.parametrize('make, axes, split', [
    (lambda: keras.layers.Conv2D(4, 2), BY_OUTPUTS, 3),
    (lambda: keras.layers.Conv2D(4, 2, use_bias=False), BY_INPUTS, 2),
    (lambda: keras.layers.Conv3D(4, 2), (None,) + BY_OUTPUTS, 4),
    (lambda: keras.layers.Conv2D(4, 2), (None, 'model', None, None), None),
    (lambda: keras.layers.Conv2D(4, 2, data_format='channels_first'),
     BY_OUTPUTS, None),
    (lambda: keras.layers.Conv2D(4, 2, groups=2), BY_OUTPUTS, None),
    (lambda: keras.layers.Conv1D(4, 2), (None, None, 'model'), None),
    (lambda: keras.layers.Conv2DTranspose(4, 2), BY_OUTPUTS, None),
    (lambda: _Standardized(4, 2), BY_INPUTS, None)])
def test_a_plain_channels_last_convolution_splits_by_channels(make, axes,
                                                              split):
  """Conv2D and Conv3D by either channels; not along the window, nor
  channels-first, grouped, another convolution (its own call), or one
  with its own `convolution_op`: those are joined."""
  layer = make()
  layer.build((None,) + (4,) * (len(axes) - 1))
  found = tensor_parallel.layers(keras.Sequential([layer]),
                                 {id(layer.kernel): axes}, ('model',))
  assert found == ({} if split is None else
                   {id(layer.kernel): (layer, split)})


@pytest.mark.slow
def test_split_convolutions_place_on_gpus_with_every_kernel():
  """Traced for 4 GPUs (none here: `plans.planning`): each op of the
  convolutions' blocks has a GPU kernel for its dtypes."""
  layouts = mesh_layouts.VariableLayouts(
      (2, 2), ('batch', 'model'), tuple(CONVOLUTIONS.items()))
  gpus = meshes.planned_on_gpus(layouts, _model, _data())
  assert len(gpus) == 4
  assert not [line for r in gpus.values() for line in r.missing_kernels]
