"""Tests for tfmulti.distribute: towers, mirrored and single agree."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import assert_same_steps
from tests.helpers import embedding_model
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import make_loss
from tests.helpers import mlp
from tests.helpers import token_batches
from tests.helpers import weights
from tfmulti import deploy
from tfmulti import distribute
from tfmulti import errors
from tfmulti import trainer

CLONES = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)


def _distributed(name, config=CLONES, model_fn=mlp, optimizer_fn=None):
  strategy = distribute.make_strategy(name, config)
  with strategy.scope():
    model = model_fn()
    optimizer = (optimizer_fn or (
        lambda: keras.optimizers.SGD(0.1, momentum=0.9)))()
  return distribute.DistributedModel(strategy, model, make_loss(), optimizer)


def _sequential():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, 'tanh'),
                           keras.layers.Dense(3)])


class _Subclassed(keras.Model):
  def __init__(self):
    super().__init__(name='subclassed')
    self.hidden = keras.layers.Dense(8, activation='tanh')
    self.out = keras.layers.Dense(3)

  def call(self, inputs):
    return self.out(self.hidden(inputs))


def _subclassed():
  keras.utils.set_random_seed(0)
  model = _Subclassed()
  model(np.zeros((1, 6), np.float32))
  return model


@pytest.mark.parametrize('model_fn', [_sequential, _subclassed])
def test_sequential_and_subclassed_models_agree_on_every_path(model_fn):
  batches = [make_batch(12, seed=s) for s in range(3)]
  runs = {'towers': make_deployed(CLONES, model_fn=model_fn),
          'mirrored': _distributed('mirrored', model_fn=model_fn),
          'single': _distributed('single', model_fn=model_fn)}
  for x, y in batches:
    for run in runs.values():
      run.train_step(x, y)
  for name in ('towers', 'mirrored'):
    for got, want in zip(weights(runs[name].model),
                         weights(runs['single'].model)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                 err_msg=name)


@pytest.mark.slow
def test_an_embedding_under_adam_agrees_on_every_path():
  """The table's gradient stays slices on every path (tf.distribute joins
  the replicas' slices), so Adam applies the slices one device would."""
  adam = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
  runs = {'towers': make_deployed(CLONES, model_fn=embedding_model,
                                  optimizer_fn=adam),
          'mirrored': _distributed('mirrored', model_fn=embedding_model,
                                   optimizer_fn=adam),
          'single': _distributed('single', model_fn=embedding_model,
                                 optimizer_fn=adam)}
  plain = embedding_model()
  plain.compile(optimizer=adam(), loss=make_loss())
  for x, y in token_batches(rows=12):
    plain.train_on_batch(x, y)
    for run in runs.values():
      run.train_step(x, y)
  for name, run in runs.items():
    for got, want in zip(weights(run.model), weights(plain)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                 err_msg=name)


def test_strategies_use_the_config_devices():
  mirrored = distribute.make_strategy('mirrored', CLONES)
  assert mirrored.extended.worker_devices == (
      '/job:localhost/replica:0/task:0/device:CPU:0',
      '/job:localhost/replica:0/task:0/device:CPU:1')
  single = distribute.make_strategy('single', CLONES)
  assert single.num_replicas_in_sync == 1
  with pytest.raises(errors.ConfigError, match="strategy='horovod'"):
    distribute.make_strategy('horovod', CLONES)


def test_towers_mirrored_and_single_agree():
  batches = [make_batch(12, seed=s) for s in range(4)]
  runs = {'towers': make_deployed(CLONES),
          'mirrored': _distributed('mirrored'),
          'single': _distributed('single')}
  losses = {name: [float(run.train_step(x, y)) for x, y in batches]
            for name, run in runs.items()}
  for name in ('towers', 'mirrored'):
    np.testing.assert_allclose(losses[name], losses['single'], rtol=1e-5)
    for got, want in zip(weights(runs[name].model),
                         weights(runs['single'].model)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_synchronized_batch_norm_equals_one_device_on_both_paths():
  """Statistics of the global batch: 2 clones train like one device."""
  def model_fn():
    return mlp(batch_norm=True, synchronized=True)
  runs = {name: _distributed(name, model_fn=model_fn)
          for name in ('mirrored', 'single')}
  runs['towers'] = make_deployed(CLONES, model_fn=model_fn,
                                 sync_batch_norm=True)
  for x, y in [make_batch(12, seed=s) for s in range(3)]:
    losses = {name: float(run.train_step(x, y)) for name, run in runs.items()}
    for name in ('towers', 'mirrored'):
      assert losses[name] == pytest.approx(losses['single'], rel=1e-5), name
  for name in ('towers', 'mirrored'):
    for got, want in zip(runs[name].model.variables,
                         runs['single'].model.variables):
      np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5,
                                 atol=1e-6, err_msg=f'{name}: {got.path}')


def test_lockstep_clones_still_run_on_their_devices():
  deployed = make_deployed(
      CLONES, model_fn=lambda: mlp(batch_norm=True, synchronized=True),
      sync_batch_norm=True)
  images, labels = make_batch(8)
  graph = deployed.traced_step(images, labels).graph
  matmul_devices = {op.device for op in graph.get_operations()
                    if op.type == 'MatMul'}
  assert {d.split('/device:')[-1] for d in matmul_devices} == {
      'CPU:0', 'CPU:1'}


def test_lockstep_replicas_are_the_clone_devices():
  three = deploy.DeploymentConfig(num_clones=3, clone_on_cpu=True)
  deployed = make_deployed(
      three, model_fn=lambda: mlp(batch_norm=True, synchronized=True),
      sync_batch_norm=True)
  assert [d.split('/device:')[-1]
          for d in deployed.parts.runner.strategy.extended.worker_devices] == [
              'CPU:0', 'CPU:1', 'CPU:2']
  with pytest.raises(errors.UnsupportedError,
                     match='xla=True cannot be combined with '
                     'sync_batch_norm=True'):
    make_deployed(CLONES, sync_batch_norm=True, xla=True)


@pytest.mark.slow
def test_batch_norm_towers_equal_mirrored():
  """Both normalise each shard by its own statistics and keep shard 0's."""
  def model_fn():
    return mlp(batch_norm=True)
  runs = {'towers': make_deployed(CLONES, model_fn=model_fn),
          'mirrored': _distributed('mirrored', model_fn=model_fn)}
  for x, y in [make_batch(12, seed=s) for s in range(3)]:
    losses = {name: float(run.train_step(x, y)) for name, run in runs.items()}
    assert losses['towers'] == pytest.approx(losses['mirrored'], rel=1e-5)
  for got, want in zip(runs['towers'].model.variables,
                       runs['mirrored'].model.variables):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5,
                               atol=1e-6, err_msg=got.path)


def test_unsynchronized_batch_norm_differs_from_one_device():
  """Why the flag exists: per-replica statistics change the result."""
  runs = {name: _distributed(name, model_fn=lambda: mlp(batch_norm=True))
          for name in ('mirrored', 'single')}
  x, y = make_batch(12)
  for run in runs.values():
    run.train_step(x, y)
  assert not np.allclose(weights(runs['mirrored'].model)[0],
                         weights(runs['single'].model)[0], rtol=1e-5)


def test_central_storage_keeps_variables_on_the_variables_device():
  central = _distributed('central_storage')
  assert {v.value.device for v in central.model.variables} == {
      '/job:localhost/replica:0/task:0/device:CPU:0'}
  losses = central.train_step_outputs(*make_batch(8))
  assert len(losses.clones) == 2


def test_central_storage_refuses_batch_norm_before_training():
  strategy = distribute.make_strategy('central_storage', CLONES)
  with strategy.scope():
    model = mlp(batch_norm=True)
  with pytest.raises(errors.UnsupportedError,
                     match="'central_storage' cannot train .* on 2 replicas"):
    distribute.check_supported('central_storage', model, 2)
  distribute.check_supported('mirrored', model, 2)  # No error.


def test_distributed_dataset_steps_equal_global_batch_steps():
  x, y = make_batch(8)
  by_step = _distributed('mirrored')
  by_dataset = _distributed('mirrored')
  dataset = tf.data.Dataset.from_tensors((x, y))
  for images, labels in by_dataset.distribute_dataset(dataset):
    got = by_dataset.train_step_outputs(images, labels)
  want = by_step.train_step_outputs(x, y)
  np.testing.assert_allclose([float(c) for c in got.clones],
                             [float(c) for c in want.clones], rtol=1e-6)
  for a, b in zip(weights(by_dataset.model), weights(by_step.model)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_mirrored_step_losses_sum_over_replicas():
  mirrored = _distributed('mirrored')
  losses = mirrored.train_step_outputs(*make_batch(8))
  assert len(losses.clones) == 2
  np.testing.assert_allclose(float(losses.total),
                             float(tf.add_n(losses.clones)), rtol=1e-6)
  assert float(losses.regularization) > 0
  assert mirrored.trace_count == 1


def test_mirrored_splits_an_indivisible_batch_as_one_device():
  # 5 rows on 2 replicas go 3:2, each replica's loss weighted by its rows.
  mirrored = _distributed('mirrored')
  single = _distributed('single')
  assert_same_steps(mirrored, single, rows=5, steps=1)


def test_mean_loss_undoes_keras_replica_scaling():
  strategy = distribute.make_strategy('mirrored', CLONES)
  labels = tf.constant([0, 1])
  logits = tf.constant([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
  want = float(make_loss()(labels, logits))  # No strategy: the plain mean.

  def in_replica():
    loss_fn = make_loss()
    return loss_fn(labels, logits), trainer.mean_loss(loss_fn, labels,
                                                         logits)
  keras_loss, ours = (strategy.experimental_local_results(value)[0]
                      for value in strategy.run(in_replica))
  assert float(keras_loss) == pytest.approx(want / 2)  # Keras's own scaling.
  assert float(ours) == pytest.approx(want)
