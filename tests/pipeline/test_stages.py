"""Stages and micro-batches: placement, exactness, BatchNorm, the partition."""

import importlib.util
import itertools
import os
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import assert_same_steps
from tests.helpers import L2
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import REPO
from tests.helpers import weights
from tfmulti import deploy
from tfmulti import errors
from tfmulti import pipeline
from tfmulti.pipeline import costs as costs_lib
from tfmulti.pipeline import partition


def skip_mlp(seed=0):
  """Five layers, a skip connection (d1 -> add) across the cuts, and L2."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((6,))
  h1 = keras.layers.Dense(8, activation='tanh', name='d1',
                          kernel_regularizer=keras.regularizers.L2(L2))(inputs)
  h2 = keras.layers.Dense(8, activation='tanh', name='d2')(h1)
  h3 = keras.layers.Dense(8, activation='tanh', name='d3')(h2)
  added = keras.layers.Add(name='add')([h1, h3])
  outputs = keras.layers.Dense(3, name='out',
                               kernel_regularizer=keras.regularizers.L2(L2))(added)
  return keras.Model(inputs, outputs)


def _pipelined(num_stages, num_microbatches=1, num_clones=1, **kwargs):
  config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True,
                                   num_stages=num_stages)
  return make_deployed(config, skip_mlp, summarize_gradients=True,
                       num_microbatches=num_microbatches, **kwargs)


def _assert_same_steps(deployed, steps=3, rows=8):
  """Every step's loss and gradients, and the weights, equal one device's."""
  reference = make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                            skip_mlp, summarize_gradients=True)
  assert_same_steps(deployed, reference, rows, steps)


_QUICK = ((2, 2),)  # The rest run in the slow suite.


@pytest.mark.parametrize('num_stages,num_microbatches', [
    pytest.param(k, m, marks=[] if (k, m) in _QUICK else [pytest.mark.slow])
    for k, m in itertools.product([2, 3, 4], [1, 2, 4, 8])])
def test_stages_and_microbatches_equal_one_device(num_stages,
                                                  num_microbatches):
  """With the default schedule, 1F1B (test_schedules.py: GPipe)."""
  for recompute in (False, True):
    deployed = _pipelined(num_stages, num_microbatches, recompute=recompute)
    assert len(deployed.stages.stages) == num_stages
    _assert_same_steps(deployed)


@pytest.mark.slow
def test_two_clones_of_two_stages_equal_one_device():
  _assert_same_steps(_pipelined(2, 2, num_clones=2))


def test_uneven_microbatches_weigh_their_rows():
  # 7 rows in 2 micro-batches: 4 and 3, each weighted by its rows.
  deployed = _pipelined(2, 2)
  assert deployed.layout_for(*make_batch(7)).microbatch_rows(0, 0, 0) == (
      4, 3)
  _assert_same_steps(deployed, steps=1, rows=7)


def test_skip_connection_crosses_the_cut():
  stages = _pipelined(2, stage_boundaries=('d2',)).stages.stages
  assert [s.first_layer for s in stages] == ['d1', 'd2']
  # d1's output is read by d2 and add, both in stage 1: sent once.
  assert len(stages[0].output_keys) == 1
  assert [len(s.input_keys) for s in stages] == [1, 1]
  stages = _pipelined(3, stage_boundaries=('d2', 'd3')).stages.stages
  # Stage 2 (d3, add, out) reads d2's output and d1's, across two cuts.
  assert len(stages[2].input_keys) == 2


def test_stage_ops_run_on_their_devices():
  deployed = _pipelined(2, 2, num_clones=2)
  graph = deployed.traced_step(*make_batch(8)).graph
  ops = graph.get_operations()
  config = deployed.config
  for c, s in itertools.product(range(2), range(2)):
    device = config.stage_device(c, s)
    assert device == f'/device:CPU:{2 * c + s}'
    for m in range(2):
      forward = f'clone_{c}/microbatch_{m}/stage_{s}/'
      backward = f'gradient_tape/{forward}'
      for prefix in (forward, backward):
        stage_ops = [op for op in ops if op.name.startswith(prefix)
                     and op.type not in ('ReadVariableOp', 'Placeholder')]
        assert 'MatMul' in {op.type for op in stage_ops}, prefix
        assert {op.device for op in stage_ops} == {device}, prefix
    # Its micro-batches' gradients are summed on the stage's device.
    summed = [op for op in ops if op.name.startswith(
        f'clone_{c}/stage_{s}_sum/') and op.type == 'AddN']
    assert summed and {op.device for op in summed} == {device}
  central = [op for op in ops if op.name.startswith('optimize_clones/')
             and op.type == 'AddN']
  writes = [op for op in ops if op.type.startswith('Assign')]
  assert central and writes
  assert {op.device for op in central + writes} == {
      config.optimizer_device()}


class TestBatchNorm:
  MOMENTUM = 0.5

  def _moving(self, policy, recompute=False, num_clones=1, num_stages=2,
              num_microbatches=4):
    config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True,
                                     num_stages=num_stages)
    with tf.device(config.variables_device()):
      inputs = keras.Input((2,))
      x = keras.layers.BatchNormalization(momentum=self.MOMENTUM)(inputs)
      model = keras.Model(inputs, keras.layers.Dense(2)(x))
    deployed = deploy.deploy(
        config, model, lambda y, out: tf.reduce_mean(out * y),
        keras.optimizers.SGD(0.0), batch_norm_policy=policy,
        num_microbatches=num_microbatches, recompute=recompute)
    deployed.train_step(self.IMAGES, np.ones((8, 2), np.float32))
    layer = model.layers[1]
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()

  IMAGES = np.array([[1., 2.], [3., 6.], [10., 0.], [20., 4.],
                     [-1., 0.5], [2., 2.], [7., -3.], [0., 1.]], np.float32)

  def _hand(self, rows):
    # From moving_mean=0, moving_variance=1, with the biased variance.
    m = self.MOMENTUM
    return (1 - m) * rows.mean(axis=0), m + (1 - m) * rows.var(axis=0)

  @pytest.mark.parametrize('recompute', [
      False, pytest.param(True, marks=pytest.mark.slow)])
  def test_full_batch_policy_equals_one_whole_batch_update(self, recompute):
    mean, variance = self._moving(deploy.BN_FULL_BATCH, recompute=recompute)
    want_mean, want_variance = self._hand(self.IMAGES)
    np.testing.assert_allclose(mean, want_mean, atol=1e-6)
    np.testing.assert_allclose(variance, want_variance, atol=1e-6)

  def test_full_batch_policy_over_clones_and_microbatches(self):
    mean, variance = self._moving(deploy.BN_FULL_BATCH, num_clones=2,
                                  num_microbatches=2)
    want_mean, want_variance = self._hand(self.IMAGES)
    np.testing.assert_allclose(mean, want_mean, atol=1e-6)
    np.testing.assert_allclose(variance, want_variance, atol=1e-6)

  def test_full_batch_policy_for_clones_without_stages(self):
    mean, variance = self._moving(deploy.BN_FULL_BATCH, num_clones=2,
                                  num_stages=1, num_microbatches=1)
    np.testing.assert_allclose(mean, self._hand(self.IMAGES)[0], atol=1e-6)
    np.testing.assert_allclose(variance, self._hand(self.IMAGES)[1],
                               atol=1e-6)

  @pytest.mark.slow
  def test_recomputation_updates_the_statistics_once(self):
    # clone_0 keeps micro-batch 0's update (rows 0-1), applied once: a
    # second update would give momentum**2 * 1 + ... in the variance.
    for recompute in (False, True):
      mean, variance = self._moving(deploy.BN_CLONE_0, recompute=recompute)
      want_mean, want_variance = self._hand(self.IMAGES[:2])
      np.testing.assert_allclose(mean, want_mean, atol=1e-6)
      np.testing.assert_allclose(variance, want_variance, atol=1e-6)


def _brute_force(costs, num_stages, speeds):
  best = None
  for cuts in itertools.combinations(range(1, len(costs)), num_stages - 1):
    starts = [0, *cuts]
    slowest = max(partition.stage_times(costs, starts, speeds))
    best = slowest if best is None else min(best, slowest)
  return best


def test_partition_is_optimal_against_brute_force():
  rng = random.Random(0)
  for _ in range(200):
    n = rng.randint(1, 8)
    num_stages = rng.randint(1, n)
    costs = [rng.choice([0, rng.randint(1, 20)]) for _ in range(n)]
    speeds = (None if rng.random() < 0.5 else
              [rng.choice([0.5, 1, 2, 3]) for _ in range(num_stages)])
    starts = partition.partition(costs, num_stages, speeds)
    assert starts[0] == 0 and len(starts) == num_stages
    assert all(a < b for a, b in zip(starts, starts[1:]))
    assert max(partition.stage_times(costs, starts, speeds)) == \
        pytest.approx(_brute_force(costs, num_stages, speeds))


def test_partition_gives_a_faster_device_more_layers():
  assert partition.partition([1] * 8, 2) == [0, 4]
  assert partition.partition([1] * 8, 2, speeds=[3, 1]) == [0, 6]
  assert partition.partition([1] * 8, 2, speeds=[1, 3]) == [0, 2]


def test_automatic_cut_balances_estimated_costs():
  # d1, d2 and d3 cost 6*8+8*8+8*8 multiply-adds; the cut falls after d2.
  costs = dict(costs_lib.estimated_costs(skip_mlp()))
  assert costs['d1'] == 8 * (1 + 48 / 8) and costs['add'] == 8
  stages = _pipelined(2).stages.stages
  assert [s.first_layer for s in stages] == ['d1', 'd3']


class TestClearErrors:

  def test_more_stages_than_layers(self):
    with pytest.raises(errors.ConfigError, match='num_stages=6: .* 5 layers'):
      _pipelined(6)

  @pytest.mark.parametrize('num_stages,boundaries,match', [
      (2, ('nope',), "no layer 'nope'"),
      (3, ('d3', 'd2'), "'d2' must come after 'd3'"),
      (3, ('d2',), r'name the first layer of stages 1\.\.2'),
  ])
  def test_bad_boundaries(self, num_stages, boundaries, match):
    with pytest.raises(errors.ConfigError, match=match):
      _pipelined(num_stages, stage_boundaries=boundaries)

  def test_more_microbatches_than_rows(self):
    deployed = _pipelined(2, 4)
    with pytest.raises(errors.ConfigError, match='num_microbatches=4 is more'):
      deployed.train_step(*make_batch(3))
    assert int(deployed.optimizer.iterations) == 0

  def test_bad_speeds(self):
    with pytest.raises(errors.ConfigError, match='one factor per stage'):
      _pipelined(2, stage_speeds=(1.0,))
    with pytest.raises(errors.ConfigError, match='stage_speeds=0'):
      _pipelined(2, stage_speeds=(1.0, 0))

  def test_xla_and_lockstep_refused(self):
    config = deploy.DeploymentConfig(clone_on_cpu=True, num_stages=2)
    for option in ('xla', 'sync_batch_norm'):
      with pytest.raises(errors.UnsupportedError,
                         match=f'{option}=True runs whole clones'):
        make_deployed(config, **{option: True})

  def test_missing_stage_devices(self):
    config = deploy.DeploymentConfig(num_clones=3, clone_on_cpu=True,
                                     num_stages=3)
    with pytest.raises(errors.DeviceError, match='CPU:8'):
      make_deployed(config, skip_mlp)

  def test_a_layer_called_twice(self):
    inputs = keras.Input((4,))
    dense = keras.layers.Dense(4)
    model = keras.Model(inputs, dense(dense(inputs)))
    with pytest.raises(errors.ConfigError, match='called 2 times'):
      pipeline.Stages(model, 2)


def test_stage_devices_in_the_config():
  config = deploy.DeploymentConfig(num_clones=2, num_stages=3)
  assert config.stage_devices(1) == [
      '/device:GPU:3', '/device:GPU:4', '/device:GPU:5']
  assert config.clone_devices() == ['/device:GPU:0', '/device:GPU:3']
  assert len(config.compute_devices()) == 6
  with pytest.raises(errors.ConfigError, match='stage_index=3'):
    config.stage_device(0, 3)
  with pytest.raises(errors.ConfigError, match='num_stages=0'):
    deploy.DeploymentConfig(num_stages=0)


def test_pipelined_predict_equals_the_model():
  deployed = _pipelined(2, 2, num_clones=2)
  images, _ = make_batch(5)
  np.testing.assert_allclose(deployed.predict(images),
                             deployed.model(images), atol=1e-6)


def test_the_toy_example_equals_one_device():
  path = os.path.join(REPO, 'examples', 'toy_model_parallel.py')
  spec = importlib.util.spec_from_file_location('toy_model_parallel', path)
  toy = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(toy)
  stages = pipeline.Stages(toy.toy_model(), 2, deploy.StepOptions(
      stage_boundaries=('net2',))).stages
  assert [[layer.name for layer in s.model.layers[1:]] for s in stages] == [
      ['net1', 'relu'], ['net2']]
  two_stages = toy.train(deploy.DeploymentConfig(clone_on_cpu=True,
                                                 num_stages=2), steps=3)
  one_device = toy.train(deploy.DeploymentConfig(clone_on_cpu=True), steps=3)
  np.testing.assert_allclose(two_stages, one_device, atol=1e-6)
  assert two_stages[0] != two_stages[1]  # It trains: the loss moves.


def test_measured_costs_time_every_layer_and_change_nothing():
  config = deploy.DeploymentConfig(clone_on_cpu=True)
  with tf.device(config.variables_device()):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.BatchNormalization(name='bn')(inputs)
    x = keras.layers.Dense(2048, name='wide')(x)
    outputs = keras.layers.Dense(3, name='narrow')(
        keras.layers.Dense(4, name='small')(x))
    model = keras.Model(inputs, outputs)
  before = weights(model)
  measured = dict(costs_lib.measured_costs(model))
  assert list(measured) == ['bn', 'wide', 'small', 'narrow']
  # Times, not a comparison of them: this machine is shared and noisy.
  assert all(seconds > 0 for seconds in measured.values())
  for got, want in zip(weights(model), before):  # BatchNorm kept its state.
    np.testing.assert_array_equal(got, want)
  cut = pipeline.Stages(model, 2, deploy.StepOptions(
      stage_costs=costs_lib.MEASURED))
  assert len(cut.stages) == 2


def test_unknown_stage_costs():
  with pytest.raises(errors.ConfigError, match="stage_costs='guessed'"):
    deploy.StepOptions(stage_costs='guessed')


@pytest.mark.slow
def test_a_refused_cut_leaves_the_model_dir_without_a_record(run_train,
                                                             tmp_path):
  model_dir = tmp_path / 'run'
  with pytest.raises(SystemExit, match="'lenet' has no layer 'nope'"):
    run_train(model_dir=str(model_dir), num_stages=2,
              stage_boundaries=['nope'])
  assert not (model_dir / 'job.json').exists()
  assert not list(model_dir.glob('ckpt-*'))


def test_a_float64_model_runs_in_stages_like_one_device():
  def model_fn():
    return skip_mlp_float64()
  config = deploy.DeploymentConfig(clone_on_cpu=True, num_stages=2)
  staged = make_deployed(config, model_fn, summarize_gradients=True,
                         num_microbatches=2)
  reference = make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                            model_fn, summarize_gradients=True)
  assert_same_steps(staged, reference, rows=8)
  assert staged.model.trainable_variables[0].dtype == 'float64'


def skip_mlp_float64():
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy('float64')
  try:
    return skip_mlp()
  finally:
    keras.config.set_dtype_policy(previous)
