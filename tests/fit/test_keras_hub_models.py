"""keras-hub's own layout maps honoured: a small Llama and a small Gemma,
built from their configuration (no download), trained as causal LMs
through `TowersModel` with the backbone's `get_layout_map` on a (2, 2)
mesh of 4 logical CPUs, equal to plain `fit` on one device, each shard on
the device the map names."""

import keras
import keras_hub
import numpy as np
import pytest

from tfmulti import fit
from tfmulti.mesh import sharding

ROWS, TOKENS, VOCABULARY = 16, 8, 64


def _llama():
  keras.utils.set_random_seed(0)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
  return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _gemma():
  keras.utils.set_random_seed(0)
  backbone = keras_hub.models.GemmaBackbone(
      vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=16, intermediate_dim=64, head_dim=4)
  return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _data():
  """Next-token labels, weighted 0 on each row's closing padding."""
  rng = np.random.default_rng(6)
  ids = rng.integers(1, VOCABULARY, size=(ROWS, TOKENS + 1)).astype(np.int32)
  lengths = rng.integers(3, TOKENS + 1, size=ROWS)
  padding = (np.arange(TOKENS)[None] < lengths[:, None]).astype(np.int32)
  return ({'token_ids': ids[:, :-1] * padding, 'padding_mask': padding},
          ids[:, 1:], padding.astype(np.float32))


def _fit(model):
  """Two epochs of Adam, its epsilon 1e-4: at Keras's 1e-7 a weight
  whose gradients nearly cancel carries their round-off past 1e-5 (the
  docs' "Which number to compare"; Gemma's table by 1.1e-5 on a Xeon)."""
  model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=1e-4),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), weighted_metrics=['accuracy'])
  x, y, weights = _data()
  return model.fit(x, y, sample_weight=weights, batch_size=8, epochs=2,
                   shuffle=False, verbose=0).history


def _devices(variable):
  value = variable._value
  assert isinstance(value, sharding.ShardedValue), variable.path
  return [shard.device.split('device:')[-1] for shard in value.shards]


@pytest.mark.slow
@pytest.mark.parametrize('make, backbone, embedding, query', [
    (_llama, keras_hub.models.LlamaBackbone, (32, 8),
     'transformer_layer_0/self_attention/query/kernel'),
    (_gemma, keras_hub.models.GemmaBackbone, (32, 8),
     'decoder_block_0/attention/query/kernel'),
])
def test_a_keras_hub_layout_map_trains_as_one_device(make, backbone,
                                                     embedding, query):
  plain = make()
  want = _fit(plain)
  mesh = keras.distribution.DeviceMesh(
      (2, 2), ['batch', 'model'], keras.distribution.list_devices()[:4])
  model = make()
  towers = fit.TowersModel(model, keras.distribution.ModelParallel(
      layout_map=backbone.get_layout_map(mesh), batch_dim_name='batch'))
  got = _fit(towers)
  for key, values in want.items():
    np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)
  for g, w in zip(model.weights, plain.weights):
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5,
                               err_msg=w.path)
  # ('model', 'batch'): a quarter of the table a device; shard (m, b) on
  # the device at mesh coordinates (batch=b, model=m), device 2b + m.
  table = model.backbone.token_embedding
  assert _devices(table.embeddings) == ['CPU:0', 'CPU:2', 'CPU:1', 'CPU:3']
  assert {tuple(s.shape) for s in table.embeddings._value.shards} == {
      embedding}
  kernel = next(v for v in model.weights if v.path == query)
  assert sorted(_devices(kernel)) == ['CPU:0', 'CPU:1', 'CPU:2', 'CPU:3']
  # Its attention and feed-forward projections compute where their
  # blocks live (tensor parallelism over 'model'), stored split over
  # 'batch' too.
  split = {layer.kernel.path for layer, *_ in
           towers.towers.parts.storage.splits.values()}
  assert query in split
  assert len(split) == 7 * 2  # Seven projections a layer, two layers.
