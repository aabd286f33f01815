"""A device's step, its kernels split over 8 GPUs and joined in their
layers' calls, needs at most its shards and slots, three times its
largest layer's weights and its activations (FSDP's figure: one layer
running, one gathered ahead, one's gradient before its reduce-scatter),
as the dry run plans it; kept joins need the whole model."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti import plans
from tfmulti.deploy import placement
from tfmulti.deploy import towers
from tfmulti.mesh import mesh_layouts
from tfmulti.plan import dry_run
from tfmulti.plan import peaks

N = 8
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp():
  """Eight Dense layers 256 wide."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((64,))
  x = inputs
  for i in range(8):
    x = keras.layers.Dense(256, activation='relu', name=f'hidden_{i}')(x)
  return keras.Model(inputs, keras.layers.Dense(10, name='logits')(x))


def _mlp_data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(4 * N, 64)).astype('float32'),
          rng.integers(0, 10, 4 * N).astype('int32'))


def _llama():
  """keras-hub's Llama, small: 2 layers, 8 query heads, 128 wide."""
  keras_hub = pytest.importorskip('keras_hub')
  keras.utils.set_random_seed(0)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=1024, num_layers=2, num_query_heads=8,
      num_key_value_heads=2, hidden_dim=128, intermediate_dim=512)
  return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _llama_data():
  ids = np.random.default_rng(0).integers(1, 1024, (2 * N, 17))
  return ({'token_ids': ids[:, :-1].astype('int32'),
           'padding_mask': np.ones((2 * N, 16), 'int32')},
          ids[:, 1:].astype('int32'))


def _layouts(model, keep_joins, ahead):
  """Each kernel and table whose last dimension 8 divides split on it
  over the batch axis (FSDP's layout; a whole one's gradients from every
  clone would meet at its owner)."""
  rules = tuple(
      (re.escape(v.path), (None,) * (len(v.shape) - 1) + ('batch',))
      for v in model.trainable_variables
      if len(v.shape) > 1 and v.shape[-1] % N == 0)
  return mesh_layouts.VariableLayouts((N,), ('batch',), rules,
                                      keep_joins=keep_joins,
                                      gather_ahead=ahead)


def _activations(graph):
  """Bytes of clone 0's forward tensors its backward pass reads (a
  buffer once), joins and variable reads aside."""
  def backward(name):
    return name.startswith('gradient_tape/clone_0/') or (
        name.startswith('clone_0/') and '_backward/' in name)
  kept = {}
  for op in graph.get_operations():
    if (op.name.startswith('clone_0/') and not backward(op.name) and
        'gather_shards' not in op.name and op.type != 'ReadVariableOp'):
      for t in op.outputs:
        if t.shape.is_fully_defined() and any(
            backward(c.name) for c in t.consumers()):
          kept[peaks.buffer_of(t).name] = t.shape.num_elements() * (
              t.dtype.size)
  return sum(kept.values())


def _planned(make_model, data, keep_joins=False, ahead=1):
  """(the most a GPU needs, FSDP's figure for it) for `make_model()`
  under `_layouts` on 8 GPUs, with momentum SGD."""
  with plans.planning():
    model = make_model()
    config = placement.DeploymentConfig(
        num_clones=N, variable_layouts=_layouts(model, keep_joins, ahead))
    with tf.device(config.optimizer_variables_device()):
      optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    deployed = towers.deploy(config, model, LOSS, optimizer)
    graph = deployed.traced_step(*data).graph
    found = dry_run.read(deployed, *data).devices
  gpus = [r for d, r in found.items() if 'GPU' in d]
  largest = max(v.numpy().nbytes for v in model.trainable_variables)
  figure = (max(r.held_bytes for r in gpus) + 3 * largest +
            _activations(graph))
  return max(r.held_bytes + r.peak_bytes for r in gpus), figure


@pytest.mark.slow
@pytest.mark.parametrize('make_model, data, ahead', [
    (_mlp, _mlp_data, 0), (_llama, _llama_data, 0),
    (_llama, _llama_data, 1)], ids=['mlp', 'llama', 'llama one ahead'])
def test_a_device_needs_its_shards_and_three_layers(make_model, data,
                                                    ahead):
  needs, figure = _planned(make_model, data(), ahead=ahead)
  assert needs <= figure, (needs, figure)
  kept, _ = _planned(make_model, data(), keep_joins=True)
  assert kept > figure, (kept, figure)
