"""Tests for tfmulti.deploy: device strings, equivalence, placement, BN."""

import functools
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import assert_same_steps
from tests.helpers import L2
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import make_loss
from tests.helpers import mlp
from tests.helpers import weights
from tfmulti import deploy
from tfmulti import devices
from tfmulti import errors

CPU0 = '/device:CPU:0'
class TestDeploymentConfig:

  def test_defaults(self):
    config = deploy.DeploymentConfig()
    assert config.clone_device(0) == '/device:GPU:0'
    assert config.clone_scope(0) == ''
    assert config.optimizer_device() == CPU0
    assert config.inputs_device() == CPU0
    assert config.variables_device() == CPU0

  def test_clones_on_gpus(self):
    config = deploy.DeploymentConfig(num_clones=3)
    assert config.clone_devices() == [
        '/device:GPU:0', '/device:GPU:1', '/device:GPU:2']
    assert [config.clone_scope(i) for i in range(3)] == [
        'clone_0', 'clone_1', 'clone_2']

  def test_clone_on_cpu_spreads_over_logical_cpus(self):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
    assert config.clone_device(0) == CPU0
    assert config.clone_device(1) == '/device:CPU:1'
    assert config.variables_device() == CPU0

  @pytest.mark.parametrize('given, expected', [
      ('/device:GPU:0', '/device:GPU:0'),
      ('/gpu:1', '/device:GPU:1'),
      ('/device:CPU:3', '/device:CPU:3'),
  ])
  def test_chosen_variables_device(self, given, expected):
    config = deploy.DeploymentConfig(num_clones=2, variables_device=given)
    assert config.variables_device() == expected
    # The update reads and writes every variable: it runs beside them.
    assert config.optimizer_device() == expected
    assert config.inputs_device() == CPU0

  def test_parameter_servers_prefix_worker_devices_with_task(self):
    config = deploy.DeploymentConfig(num_clones=2, replica_id=1,
                                     num_replicas=3, num_ps_tasks=2)
    prefix = '/job:worker/task:1'
    assert config.clone_device(1) == prefix + '/device:GPU:1'
    assert config.optimizer_device() == prefix + '/device:CPU:0'
    assert config.inputs_device() == prefix + '/device:CPU:0'
    assert config.variables_device() == '/job:ps/device:CPU:0'

  def test_custom_job_names(self):
    config = deploy.DeploymentConfig(num_clones=1, clone_on_cpu=True,
                                     num_ps_tasks=1, worker_job_name='trainer',
                                     ps_job_name='store')
    assert config.clone_device(0) == '/job:trainer/task:0/device:CPU:0'
    assert config.variables_device() == '/job:store/device:CPU:0'

  def test_slim_replicas_are_workers(self):
    config = deploy.DeploymentConfig(num_replicas=3, replica_id=2)
    assert (config.num_workers, config.worker_index) == (3, 2)

  @pytest.mark.parametrize('kwargs, prefetches', [
      (dict(num_clones=2), True),  # GPU clones: the copies hide.
      (dict(num_clones=2, clone_on_cpu=True), False),  # One memory.
      (dict(num_clones=2, num_ps_tasks=1), False),
      (dict(num_clones=2, clone_on_cpu=True, prefetch_to_clones=True), True),
      (dict(num_clones=2, prefetch_to_clones=False), False),
  ])
  def test_each_clones_shard_is_prefetched_to_gpus_by_default(
      self, kwargs, prefetches):
    assert deploy.DeploymentConfig(**kwargs).prefetches_to_clones() is (
        prefetches)

  def test_is_frozen(self):
    config = deploy.DeploymentConfig()
    with pytest.raises(AttributeError):
      config.num_clones = 2

  def test_all_reduce_workers_keep_local_device_strings(self):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                     num_replicas=2, replica_id=1)
    assert config.clone_devices() == ['/device:CPU:0', '/device:CPU:1']
    assert config.variables_device() == CPU0

  @pytest.mark.parametrize('kwargs, named', [
      (dict(num_clones=0), 'num_clones=0'),
      (dict(num_clones=-2), 'num_clones=-2'),
      (dict(num_clones=1.5), 'num_clones=1.5'),
      (dict(num_replicas=2, replica_id=2), 'replica_id=2'),
      (dict(num_replicas=2, num_ps_tasks=1, worker_job_name=''),
       "worker_job_name=''"),
      (dict(num_ps_tasks=1, ps_job_name=''), "ps_job_name=''"),
      (dict(num_replicas=2, num_ps_tasks=1, replica_id=2), 'replica_id=2'),
      (dict(replica_id=-1), 'replica_id=-1'),
      (dict(num_ps_tasks=-1), 'num_ps_tasks=-1'),
      (dict(variables_device='banana'), "variables_device='banana'"),
      (dict(num_ps_tasks=1, variables_device='/device:GPU:0'),
       "variables_device='/device:GPU:0'"),
      (dict(prefetch_to_clones='yes'), "prefetch_to_clones='yes'"),
      (dict(num_ps_tasks=1, prefetch_to_clones=True),
       'prefetch_to_clones=True'),
  ])
  def test_bad_values_raise_naming_the_value(self, kwargs, named):
    with pytest.raises(errors.ConfigError, match=named.replace('.', r'\.')):
      deploy.DeploymentConfig(**kwargs)

  @pytest.mark.parametrize('index', [-1, 2, 7])
  def test_clone_index_out_of_range(self, index):
    config = deploy.DeploymentConfig(num_clones=2)
    with pytest.raises(ValueError, match=f'clone_index={index}'):
      config.clone_device(index)
    with pytest.raises(ValueError, match=f'clone_index={index}'):
      config.clone_scope(index)


def _reference_steps(model, optimizer, batches):
  """One device, whole batch, plain Keras: the ground truth."""
  losses = []
  loss_fn = make_loss()
  for images, labels in batches:
    with tf.GradientTape() as tape:
      loss = loss_fn(labels, model(images, training=True)) + tf.add_n(
          model.losses)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    losses.append(float(loss))
  return losses


@pytest.mark.parametrize('num_clones', [1, 2, 3])
def test_clones_equal_one_device_on_the_whole_batch(num_clones):
  batches = [make_batch(12, seed=s) for s in range(4)]
  reference = mlp()
  reference_losses = _reference_steps(
      reference, keras.optimizers.SGD(0.1, momentum=0.9), batches)

  config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True)
  deployed = make_deployed(config)
  losses = [float(deployed.train_step(x, y)) for x, y in batches]

  np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
  for got, want in zip(weights(deployed.model), weights(reference)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_worker_scales_its_clones_by_the_whole_job():
  """With 2 workers, each clone holds 1/4 of the 4-shard global batch."""
  images, labels = make_batch(8)
  alone = make_deployed(deploy.DeploymentConfig(num_clones=2,
                                                clone_on_cpu=True))
  worker = make_deployed(deploy.DeploymentConfig(
      num_clones=2, clone_on_cpu=True, num_replicas=2, replica_id=0))
  want, got = (d.train_step_outputs(images, labels) for d in (alone, worker))
  # Both the data term and clone 0's share of the penalty halve.
  np.testing.assert_allclose([2 * float(c) for c in got.clones],
                             [float(c) for c in want.clones], rtol=1e-5)
  np.testing.assert_allclose(2 * float(got.regularization),
                             float(want.regularization), rtol=1e-5)


def test_step_losses_split_over_clones():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  deployed = make_deployed(config)
  images, labels = make_batch(8)
  expected_reg = sum(L2 * float(tf.reduce_sum(tf.square(w)))
                     for w in deployed.model.trainable_variables
                     if 'kernel' in w.path)
  losses = deployed.train_step_outputs(images, labels)
  assert len(losses.clones) == 2
  np.testing.assert_allclose(float(losses.regularization), expected_reg,
                             rtol=1e-5)
  np.testing.assert_allclose(float(losses.total),
                             float(tf.add_n(losses.clones)), rtol=1e-6)


def test_loss_falls_on_a_learnable_problem():
  images, labels = _learnable()
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  deployed = make_deployed(config, model_fn=lambda: mlp(dropout=True))
  first = float(deployed.train_step(images, labels))
  for _ in range(40):
    last = float(deployed.train_step(images, labels))
  assert last < first / 4


class TestPlacement:

  @pytest.mark.parametrize('variables_device', [None, '/device:CPU:3'])
  def test_variables_and_slots_live_on_variables_device(self,
                                                        variables_device):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                     variables_device=variables_device)
    deployed = make_deployed(config, optimizer_fn=keras.optimizers.Adam)
    deployed.train_step(*make_batch(4))
    optimizer_variables = deployed.optimizer.variables
    assert any('momentum' in v.path for v in optimizer_variables)  # Slots.
    wanted = variables_device or CPU0
    for variable in deployed.model.variables + optimizer_variables:
      assert devices.device_of(variable).endswith(wanted), variable.path

  def test_clone_ops_run_on_their_devices(self):
    config = deploy.DeploymentConfig(num_clones=3, clone_on_cpu=True)
    deployed = make_deployed(config)
    graph = deployed.traced_step(*make_batch(6)).graph
    ops = graph.get_operations()
    for i in range(3):
      # Forward ops are named clone_i/..., gradients gradient_tape/clone_i/...
      clone_ops = [op for op in ops
                   if op.name.startswith((f'clone_{i}/',
                                          f'gradient_tape/clone_{i}/'))]
      compute = {op.type for op in clone_ops
                 if op.device == f'/device:CPU:{i}'}
      assert {'MatMul', 'SparseSoftmaxCrossEntropyWithLogits',
              'BiasAddGrad'} <= compute
      # Every clone op is pinned to its clone's device, but for the reads of
      # the captured variables, which the runtime puts on their device.
      assert {op.device for op in clone_ops if op.type not in (
          'ReadVariableOp', 'Placeholder')} == {f'/device:CPU:{i}'}
    split = [op for op in ops if op.name.startswith('split_batch')]
    summed = [op for op in ops if op.name.startswith('optimize_clones/')
              and op.type == 'AddN']
    assert split and summed
    assert {op.device for op in split + summed} == {CPU0}


  def test_the_update_runs_on_the_chosen_variables_device(self):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                     variables_device='/device:CPU:2')
    deployed = make_deployed(config)
    graph = deployed.traced_step(*make_batch(4)).graph
    ops = graph.get_operations()
    # Every variable (weights, slots, iteration count) is captured from
    # CPU:2, and every op that writes one is placed there.
    captured = {t.device for t, _ in graph.captures if t.dtype == tf.resource}
    assert captured == {'/job:localhost/replica:0/task:0/device:CPU:2'}
    writes = [op for op in ops if op.type in (
        'AssignVariableOp', 'AssignAddVariableOp', 'AssignSubVariableOp')]
    assert len(writes) >= 2 * len(deployed.model.trainable_variables)
    assert {op.device for op in writes} == {'/device:CPU:2'}
    summed = [op for op in ops if op.name.startswith('optimize_clones/')
              and op.type == 'AddN']
    assert summed and {op.device for op in summed} == {'/device:CPU:2'}


class TestBatchNorm:
  MOMENTUM = 0.5

  def _bn_model(self):
    inputs = keras.Input((2,))
    outputs = keras.layers.BatchNormalization(momentum=self.MOMENTUM)(inputs)
    return keras.Model(inputs, outputs)

  def _step(self, policy, images):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
    with tf.device(config.variables_device()):
      model = self._bn_model()
      optimizer = keras.optimizers.SGD(0.0)
    deployed = deploy.deploy(config, model,
                             lambda y, out: tf.reduce_mean(out * y),
                             optimizer, batch_norm_policy=policy)
    deployed.train_step(images, np.ones((4, 2), np.float32))
    layer = model.layers[-1]
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()

  # Clone 0 gets rows 0-1, clone 1 rows 2-3.
  IMAGES = np.array([[1., 2.], [3., 6.], [10., 0.], [20., 4.]], np.float32)

  def _expected(self, shards):
    # moving = momentum * moving + (1 - momentum) * batch statistic,
    # from moving_mean=0, moving_variance=1; Keras uses the biased variance.
    m = self.MOMENTUM
    means = [s.mean(axis=0) for s in shards]
    variances = [s.var(axis=0) for s in shards]
    return (np.mean([(1 - m) * mu for mu in means], axis=0),
            np.mean([m + (1 - m) * v for v in variances], axis=0))

  def test_clone_0_policy_updates_once_from_clone_0(self):
    mean, variance = self._step(deploy.BN_CLONE_0, self.IMAGES)
    want_mean, want_var = self._expected([self.IMAGES[:2]])
    np.testing.assert_allclose(mean, want_mean, rtol=1e-6)  # [1, 2]
    np.testing.assert_allclose(variance, want_var, rtol=1e-6)

  def test_mean_policy_averages_the_clones(self):
    mean, variance = self._step(deploy.BN_MEAN, self.IMAGES)
    want_mean, want_var = self._expected([self.IMAGES[:2], self.IMAGES[2:]])
    np.testing.assert_allclose(mean, want_mean, rtol=1e-6)
    np.testing.assert_allclose(variance, want_var, rtol=1e-6)

  def test_unknown_policy(self):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
    with pytest.raises(errors.ConfigError,
                       match="batch_norm_policy='median'"):
      make_deployed(config, batch_norm_policy='median')


@pytest.mark.parametrize('rows, num_clones', [(7, 2), (3, 4)])
def test_uneven_and_short_batches_train_as_one_device(rows, num_clones):
  # 7 rows on 2 clones go 4:3; 3 rows on 4 clones (a short last batch)
  # leave clone 3 empty, which runs nothing and adds exactly 0.
  config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True)
  deployed = make_deployed(config)
  reference = make_deployed(deploy.DeploymentConfig(clone_on_cpu=True))
  step = functools.partial(deployed.train_step_outputs, partial=True)
  assert_same_steps(types.SimpleNamespace(train_step_outputs=step,
                                          model=deployed.model),
                    reference, rows)


def test_an_empty_clone_leaves_batch_norm_finite():
  config = deploy.DeploymentConfig(num_clones=4, clone_on_cpu=True)
  deployed = make_deployed(config, model_fn=lambda: mlp(batch_norm=True),
                           batch_norm_policy='full_batch')
  with pytest.raises(errors.ConfigError, match='leaves clone 3 of 4 no rows'):
    deployed.train_step(*make_batch(3))  # A full batch must fill clones.
  deployed.train_step_outputs(*make_batch(3), partial=True)
  assert all(np.isfinite(w).all() for w in weights(deployed.model))


class TestClearErrors:

  def test_mismatched_labels(self):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
    deployed = make_deployed(config)
    images, labels = make_batch(8)
    with pytest.raises(ValueError, match=r'\[6, 8\] rows'):
      deployed.train_step(images, labels[:6])

  @pytest.mark.parametrize('kwargs, missing', [
      (dict(num_clones=10, clone_on_cpu=True),
       "'/device:CPU:8', '/device:CPU:9'"),
      (dict(num_clones=1), "'/device:GPU:0'"),
  ])
  def test_missing_devices_named_before_any_change(self, kwargs, missing):
    config = deploy.DeploymentConfig(**kwargs)
    model = mlp()
    before = weights(model)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    with pytest.raises(errors.DeviceError, match=missing) as error:
      deploy.deploy(config, model, make_loss(), optimizer)
    assert 'logical CPU' in str(error.value)
    assert not optimizer.built
    for got, want in zip(weights(model), before):
      np.testing.assert_array_equal(got, want)

  def test_misplaced_variables(self):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
    with tf.device('/device:CPU:1'):
      model = mlp()
    with pytest.raises(errors.DeviceError,
                       match='not on the variables device'):
      deploy.deploy(config, model, make_loss(), keras.optimizers.SGD(0.1))


def test_step_traces_once_per_input_signature():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  deployed = make_deployed(config)
  for seed in range(3):
    deployed.train_step(*make_batch(8, seed=seed))
  assert deployed.trace_count == 1
  deployed.train_step(*make_batch(4))  # A new batch shape is a new signature.
  assert deployed.trace_count == 2


@pytest.mark.parametrize('optimizer_fn', [
    None, lambda: keras.optimizers.Adam(0.01)], ids=['momentum', 'adam'])
def test_the_update_reads_its_slots_once_its_gradient_is_made(optimizer_fn):
  """Else the runtime reads them as the step starts and computes what it
  can (momentum's decay) before the gradient exists, holding a slot's
  worth through the pass: each read of a slot (a tensor of a variable's
  shape, not a scalar) waits for the gradient."""
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  deployed = make_deployed(config, optimizer_fn=optimizer_fn)
  graph = deployed.traced_step(*make_batch(8)).graph
  reads = [op for op in graph.get_operations()
           if op.type == 'ReadVariableOp' and op.outputs[0].shape.rank and
           op.name.startswith(deployed.optimizer.name + '/')]
  assert reads and all(op.control_inputs for op in reads), [
      op.name for op in reads if not op.control_inputs]


@pytest.mark.slow
def test_xla_clones_train_like_the_plain_step():
  batches = [make_batch(8, seed=s) for s in range(3)]
  results = []
  for xla in (False, True):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
    deployed = make_deployed(config, xla=xla)
    results.append([float(deployed.train_step(x, y)) for x, y in batches])
  np.testing.assert_allclose(results[1], results[0], rtol=1e-4)


def test_xla_clones_share_one_compiled_pass():
  """Four compiled clones call a pass traced once for the clones without
  the penalty (and once for the one with it), each call on its clone's
  device: the offsets that differ go in as tensors."""
  config = deploy.DeploymentConfig(num_clones=4, clone_on_cpu=True)
  deployed = make_deployed(config, xla=True)
  graph = deployed.traced_step(*make_batch(8)).graph
  compiled = [op for op in graph.get_operations()
              if op.node_def.attr['_XlaMustCompile'].b]
  assert sorted(devices.canonical(op.device) for op in compiled) == [
      devices.canonical(f'/device:CPU:{i}') for i in range(4)]
  assert len({op.get_attr('f').name for op in compiled}) == 2


def _learnable(rows=64):
  rng = np.random.default_rng(0)
  centers = rng.normal(scale=3.0, size=(3, 6)).astype(np.float32)
  labels = rng.integers(0, 3, size=rows).astype(np.int32)
  return centers[labels] + rng.normal(size=(rows, 6)).astype(np.float32), labels


@pytest.mark.slow
def test_float16_clones_train_with_dynamic_loss_scaling():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  deployed = make_deployed(
      config, model_fn=lambda: mlp(dtype='mixed_float16'),
      optimizer_fn=lambda: keras.optimizers.LossScaleOptimizer(
          keras.optimizers.SGD(0.1)),
      summarize_gradients=True)
  scale = deployed.optimizer.dynamic_scale
  assert devices.device_of(scale) == '/job:localhost/replica:0/task:0' + CPU0
  images, labels = _learnable()
  outputs = deployed.train_step_outputs(images, labels)
  first = float(outputs.total)
  # The summed gradients come back unscaled: float32-sized, not x32768.
  assert float(tf.linalg.global_norm(list(outputs.gradients.values()))) < 100
  for _ in range(30):
    last = float(deployed.train_step(images, labels))
  assert last < first / 4
  assert deployed.model.layers[1].compute_dtype == 'float16'
  assert deployed.model.layers[1].kernel.dtype == 'float32'


@pytest.mark.parametrize('rows', [7, 2])
def test_predict_covers_a_short_batch_over_the_clones(rows):
  config = deploy.DeploymentConfig(num_clones=3, clone_on_cpu=True)
  deployed = make_deployed(config)
  images, _ = make_batch(rows)  # Shards of 3, 2, 2 rows; or 1, 1 and none.
  np.testing.assert_allclose(deployed.predict(images),
                             deployed.model(images, training=False),
                             rtol=1e-6, atol=1e-6)
