"""The variants `tfmulti.bench` times, built through the training code.

Every variant builds its model, optimizer and loss with `tfmulti.train.build`
(what `train.py` builds, regularization included) from the same seed, and
trains on the same global batch of synthetic data that already sits on its
devices (no input pipeline, as tf_cnn_benchmarks does by default):

  single              the real `--strategy=single` path: the reference
  towers              the real `--strategy=towers` path, variables on CPU:0
  towers_gpu_vars     the same, variables (and the update) on GPU:0
  towers_one_device   every clone on clone 0's device: what splitting costs
  towers_reproducible the towers with `reproducible_rows`: atoms run alone
                      and folded in order (what bit-identical layouts cost)
  independent         clones that never combine gradients: the upper bound
  mirrored_<op>       MirroredStrategy with each cross-device op available
  central_storage     the real `--strategy=central_storage` path, where it
                      can train the model

So single, towers and mirrored run the same computation, and their models
end equal (tested); only the time differs.
"""

import dataclasses
from typing import Callable

from absl import logging
import keras
import tensorflow as tf

from tfmulti import data
from tfmulti import errors
from tfmulti import step_options
from tfmulti import trainer
from tfmulti.deploy import placement
from tfmulti.distribute import distributed_model
from tfmulti.engine import registry
from tfmulti.train import build
from tfmulti.train import config as config_lib

INPUT_SHAPE = data.SYNTHETIC_SHAPE  # The synthetic dataset's: CIFAR-10's.
NUM_CLASSES = data.SYNTHETIC_CLASSES
_OPTIMIZER = 'momentum'  # SGD with momentum: one slot per variable.
_LEARNING_RATE = 0.01
_SEED = 0  # Every variant starts from the same weights.
# MirroredStrategy's cross-device ops by device type; NCCL needs GPUs.
_CROSS_DEVICE_OPS = {
    'CPU': {'reduce_to_one_device': tf.distribute.ReductionToOneDevice},
    'GPU': {'nccl': tf.distribute.NcclAllReduce,
            'hierarchical_copy': tf.distribute.HierarchicalCopyAllReduce,
            'reduce_to_one_device': tf.distribute.ReductionToOneDevice},
}


@dataclasses.dataclass
class Variant:
  """One way to run the step: `step()` runs it on its own batch.

  `model` is the model it trains (None where it trains several).
  """
  name: str
  step: Callable[[], tf.Tensor]
  trace_count: Callable[[], int]
  xla: bool
  model: keras.Model = None


class _OneDevice(placement.DeploymentConfig):
  """A deployment whose clones all run on clone 0's device."""

  def clone_device(self, clone_index):
    self._check_clone_index(clone_index)
    return super().clone_device(0)


def _setup(bench, deploy_config, strategy, **fields):
  """A `registry.Setup` as train.py would make it for this benchmark;
  `fields` are `StepOptions` fields."""
  train_config = config_lib.TrainConfig(
      model=bench.model, dataset='synthetic', optimizer=_OPTIMIZER,
      learning_rate=_LEARNING_RATE, mixed_precision=bench.mixed_precision,
      strategy=strategy, step_options=step_options.StepOptions(
          xla=bench.xla and 'xla' in registry.get(strategy).honours,
          **fields))
  make = build.model_and_optimizer(train_config, deploy_config,
                                   input_shape=INPUT_SHAPE,
                                   num_classes=NUM_CLASSES,
                                   learning_rate=_LEARNING_RATE)

  def seeded(model_scope=None):
    keras.utils.set_random_seed(_SEED)
    return make(model_scope)
  return registry.Setup(registry.check_options(
      strategy, train_config.step_options, deploy_config), deploy_config,
      seeded, build.make_loss())


def global_batch(rows, device):
  """The benchmark's batch of `rows` random images and labels on `device`."""
  with tf.device(device):
    images = tf.random.stateless_uniform((rows, *INPUT_SHAPE), seed=[_SEED, 0])
    labels = tf.random.stateless_uniform((rows,), seed=[_SEED, 1],
                                         maxval=NUM_CLASSES, dtype=tf.int32)
  return images, labels


def _path(name, bench, deploy_config, strategy, **fields):
  """A variant that runs the registered path `strategy` (with these
  `StepOptions` fields)."""
  setup = _setup(bench, deploy_config, strategy, **fields)
  run = registry.get(strategy).build(setup)
  rows = bench.batch_size * bench.num_clones
  device = (deploy_config.clone_device(0)
            if strategy == distributed_model.SINGLE
            else deploy_config.inputs_device())
  images, labels = global_batch(rows, device)
  if isinstance(run, distributed_model.DistributedModel):
    images, labels = (_per_replica(run.strategy, t) for t in (images, labels))
  return Variant(name, lambda: run.train_step(images, labels),
                 lambda: run.trace_count, setup.options.xla,
                 run.model)


def _per_replica(strategy, tensor):
  """`tensor`'s shards, placed once on their replicas' devices."""
  devices = strategy.extended.worker_devices
  shards = []
  for device, shard in zip(devices, tf.split(tensor, len(devices))):
    with tf.device(device):
      shards.append(tf.identity(shard))
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: shards[ctx.replica_id_in_sync_group])


def _mirrored(name, bench, deploy_config, cross_device_ops):
  setup = _setup(bench, deploy_config, distributed_model.MIRRORED)
  strategy = distributed_model.make_strategy(
      distributed_model.MIRRORED, deploy_config,
      cross_device_ops=cross_device_ops)
  with strategy.scope():
    model, optimizer = setup.build_model()
  run = distributed_model.DistributedModel(strategy, model, setup.loss_fn,
                                           optimizer)
  images, labels = (_per_replica(strategy, t) for t in global_batch(
      bench.batch_size * bench.num_clones, deploy_config.inputs_device()))
  return Variant(name, lambda: run.train_step(images, labels),
                 lambda: run.trace_count, False, model)


def _plain_step(model, optimizer, loss_fn, xla):
  """One device's step: forward, mean loss plus penalties, update."""
  def step(images, labels):
    with tf.GradientTape() as tape:
      loss = loss_fn(labels, model(images, training=True))
      if model.losses:
        loss += tf.add_n(model.losses)
      scaled = loss * trainer.loss_scale_of(optimizer)
    gradients = tape.gradient(scaled, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss
  return tf.function(step, jit_compile=xla)


def _independent(bench, deploy_config):
  """Each clone trains its own model on its own shard; nothing is combined."""
  setup = _setup(bench, deploy_config, registry.TOWERS)
  steps = []
  for device in deploy_config.clone_devices():
    with tf.device(device):
      model, optimizer = setup.build_model()
      optimizer.build(model.trainable_variables)
    steps.append((device, _plain_step(model, optimizer, setup.loss_fn,
                                      setup.options.xla),
                  global_batch(bench.batch_size, device)))

  @tf.function
  def step():
    losses = []
    for device, clone_step, batch in steps:
      with tf.device(device):
        losses.append(clone_step(*batch))
    return tf.add_n(losses)
  return Variant('independent', step, step.experimental_get_tracing_count,
                 setup.options.xla)


def towers(bench, num_clones=None):
  """The towers variant, at `num_clones` (default: the benchmark's)."""
  bench = dataclasses.replace(bench, num_clones=num_clones or bench.num_clones)
  return _path('towers', bench, placement.DeploymentConfig(
      num_clones=bench.num_clones, clone_on_cpu=bench.clone_on_cpu),
               registry.TOWERS)


def build_variants(bench, names=None):
  """(variants, {skipped name: reason}) for the devices present; only
  those in `names` where given."""
  deploy_config = placement.DeploymentConfig(num_clones=bench.num_clones,
                                             clone_on_cpu=bench.clone_on_cpu)
  spread = placement.DeploymentConfig(num_clones=bench.num_clones,
                                      clone_on_cpu=bench.clone_on_cpu,
                                      variables_device=placement.SPREAD)
  one_device = _OneDevice(num_clones=bench.num_clones,
                          clone_on_cpu=bench.clone_on_cpu)
  builders = [
      ('single', lambda: _path('single', bench, deploy_config,
                               distributed_model.SINGLE)),
      ('towers', lambda: towers(bench)),
      ('towers_one_device', lambda: _path('towers_one_device', bench,
                                          one_device, registry.TOWERS)),
      ('towers_reproducible', lambda: _path(
          'towers_reproducible', bench, deploy_config, registry.TOWERS,
          reproducible_rows=bench.reproducible_rows)),
      ('towers_spread', lambda: _path(
          'towers_spread', bench, spread, registry.TOWERS)),
      ('towers_spread_packs', lambda: _path(
          'towers_spread_packs', bench, spread, registry.TOWERS,
          gradient_packs=step_options.AUTO)),
      ('independent', lambda: _independent(bench, deploy_config)),
  ]
  if not bench.clone_on_cpu:
    builders.append(('towers_gpu_vars', lambda: _path(
        'towers_gpu_vars', bench, placement.DeploymentConfig(
            num_clones=bench.num_clones, variables_device='/gpu:0'),
        registry.TOWERS)))
  device_type = 'CPU' if bench.clone_on_cpu else 'GPU'
  for op_name, op in _CROSS_DEVICE_OPS[device_type].items():
    def mirrored(op_name=op_name, op=op):
      kwargs = {}
      if op is tf.distribute.ReductionToOneDevice:
        kwargs = dict(reduce_to_device=deploy_config.optimizer_device())
      return _mirrored(f'mirrored_{op_name}', bench, deploy_config,
                       op(**kwargs))
    builders.append((f'mirrored_{op_name}', mirrored))
  builders.append(('central_storage', lambda: _path(
      'central_storage', bench, deploy_config,
      distributed_model.CENTRAL_STORAGE)))
  variants, skipped = [], {}
  for name, make in builders:
    if names is not None and name not in names:
      continue
    try:
      variants.append(make())
    except errors.UnsupportedError as e:
      skipped[name] = str(e)
      logging.warning('skipping %s: %s', name, e)
  return variants, skipped
