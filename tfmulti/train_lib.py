"""The training job: data, model, deployment, loop, evaluation, metrics.

`train_and_evaluate(config, deploy_config)` is the one call `train.py`
makes. It builds the model and optimizer under the variables device, deploys
them over the clones (or hands them to a tf.distribute strategy on the same
devices, for comparison: one training contract, two ways to run the step),
resumes from the latest checkpoint in `model_dir`, trains to the requested
global step with progress lines, TensorBoard summaries and checkpoints,
evaluates on the test split after every epoch and writes
`<model_dir>/metrics.json`. SIGTERM or Ctrl-C stops it after the current
step with a checkpoint; a NaN loss stops it before anything is saved.
"""

import dataclasses
import hashlib
import json
import os
from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmulti import checkpoints
from tfmulti import cluster
from tfmulti import data
from tfmulti import deploy
from tfmulti import distribute
from tfmulti import loop
from tfmulti import models
from tfmulti import schedules
from tfmulti import summaries

OPTIMIZERS = ('sgd', 'momentum', 'adam')
TOWERS = 'towers'
STRATEGIES = (TOWERS,) + distribute.STRATEGIES
_MOMENTUM = 0.9  # Of the 'momentum' optimizer.
METRICS_FILE = 'metrics.json'
MIXED_GPU = 'mixed_float16'
MIXED_CPU = 'mixed_bfloat16'


def _check_positive(name, value):
  if value is not None and not value > 0:
    raise ValueError(f'{name}={value!r}: must be > 0.')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """What to train, on what, for how long, and where to write.

  Attributes:
    model: a name in `models.names()`.
    dataset: a name in `data.DATASETS`.
    model_dir: output directory: checkpoints, event files, metrics.json.
      A directory holding checkpoints resumes from the latest.
    data_dir: TFDS data directory; None for TFDS's default.
    batch_size: examples per clone per step (slim's meaning); the global
      batch is batch_size * num_clones.
    optimizer: one of `OPTIMIZERS`.
    learning_rate: the one-device base rate (see `lr_scaling`).
    lr_scaling: 'none', or 'linear' (times num_clones, Goyal et al.).
    lr_schedule: one of `schedules.LR_SCHEDULES`, over the run's global
      steps.
    warmup_steps: global steps of linear warm-up from 0 to the peak rate.
    epochs: passes over the train split, unless `train_steps` is set.
    train_steps: global steps to train; overrides `epochs`.
    seed: seeds weights, dropout and shuffling.
    deterministic: also make every op deterministic (bit-identical reruns).
    log_every_steps: steps between progress lines and summaries.
    checkpoint_steps: global steps between checkpoints (and one at the end).
    keep_checkpoints: how many recent checkpoints to keep.
    summarize_gradients: write gradient histograms and norms.
    batch_norm_policy: see `deploy.BATCH_NORM_POLICIES`.
    synchronized_batch_norm: BatchNorm over the global batch's statistics,
      all-reduced over the clones or replicas (the towers then run their
      clones in lockstep, see `deploy.create_clones`).
    mixed_precision: compute in float16 on GPUs (with loss scaling) or
      bfloat16 on CPUs; variables stay float32.
    xla: compile each clone's computation with XLA.
    strategy: 'towers' (tfmulti.deploy), a tf.distribute path from
      `distribute.STRATEGIES` on the same devices, for comparison, or
      'multi_worker' (towers on every worker of TF_CONFIG's cluster).
    peer_timeout_s: seconds a multi-worker task waits for its peers, and
      for each collective, before it fails.
  """
  model: str = 'lenet'
  dataset: str = 'digits'
  model_dir: str = 'runs/default'
  data_dir: Optional[str] = None
  batch_size: int = 64
  optimizer: str = 'adam'
  learning_rate: float = 1e-3
  lr_scaling: str = schedules.NO_SCALING
  lr_schedule: str = schedules.CONSTANT
  warmup_steps: int = 0
  epochs: int = 40
  train_steps: Optional[int] = None
  seed: int = 0
  deterministic: bool = False
  log_every_steps: int = 10
  checkpoint_steps: int = 500
  keep_checkpoints: int = 5
  summarize_gradients: bool = False
  batch_norm_policy: str = deploy.BN_CLONE_0
  synchronized_batch_norm: bool = False
  mixed_precision: bool = False
  xla: bool = False
  strategy: str = TOWERS
  peer_timeout_s: float = 120.0

  def __post_init__(self):
    choices = [('model', models.names()), ('dataset', data.DATASETS),
               ('strategy', STRATEGIES), ('optimizer', OPTIMIZERS),
               ('batch_norm_policy', deploy.BATCH_NORM_POLICIES),
               ('lr_scaling', schedules.LR_SCALINGS),
               ('lr_schedule', schedules.LR_SCHEDULES)]
    for name, allowed in choices:
      if getattr(self, name) not in allowed:
        raise ValueError(f'{name}={getattr(self, name)!r}: choose one of '
                         f'{tuple(allowed)}.')
    if self.xla and self.strategy != TOWERS:
      raise ValueError(f'xla=True works with the towers only, not '
                       f'strategy={self.strategy!r}.')
    if self.synchronized_batch_norm and not models.has_batch_norm(self.model):
      raise ValueError(f'synchronized_batch_norm=True, but model='
                       f'{self.model!r} has no BatchNorm; drop it or pick a '
                       'ResNet.')
    if self.synchronized_batch_norm and self.strategy in (
        distribute.MULTI_WORKER_STRATEGIES):
      raise ValueError('synchronized_batch_norm=True is not available with '
                       "strategy='multi_worker'; use it on one machine.")
    if self.synchronized_batch_norm and self.xla:
      raise ValueError(
          'synchronized_batch_norm=True cannot be combined with xla=True: '
          'XLA compiles each clone alone, and synchronized clones exchange '
          'statistics mid-pass.')
    for name in ('batch_size', 'learning_rate', 'epochs', 'train_steps',
                 'log_every_steps', 'checkpoint_steps', 'keep_checkpoints',
                 'peer_timeout_s'):
      _check_positive(name, getattr(self, name))
    if self.warmup_steps < 0:
      raise ValueError(f'warmup_steps={self.warmup_steps}: must be >= 0.')
    if not self.model_dir:
      raise ValueError("model_dir='': name an output directory.")


class ConfigError(ValueError):
  """Settings that conflict with the data (known once it is loaded)."""


def make_optimizer(name, learning_rate):
  """A Keras optimizer by name; create it under the variables device.

  `learning_rate` is a float or a `keras.optimizers.schedules` schedule.
  """
  if name == 'sgd':
    return keras.optimizers.SGD(learning_rate)
  if name == 'momentum':
    return keras.optimizers.SGD(learning_rate, momentum=_MOMENTUM)
  if name == 'adam':
    return keras.optimizers.Adam(learning_rate)
  raise ValueError(f'optimizer={name!r}: choose one of {OPTIMIZERS}.')


def make_loss():
  """Mean cross-entropy over the examples given, from logits."""
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dtype_policy(config, deploy_config):
  """The Keras dtype policy of the model: None (float32) or a mixed one."""
  if not config.mixed_precision:
    return None
  # float16 has the GPUs' fast kernels but needs loss scaling; bfloat16 has
  # float32's range and is what CPUs accelerate.
  return MIXED_CPU if deploy_config.clone_on_cpu else MIXED_GPU


def _log_deployment(deploy_config, train_config, global_batch_size):
  logging.info('batch_size %d per clone x %d clones = global batch %d, split '
               'evenly on %s', train_config.batch_size,
               deploy_config.num_clones, global_batch_size,
               deploy_config.inputs_device())
  if train_config.strategy == TOWERS:
    logging.info('towers: variables and optimizer slots on %s; clones on %s; '
                 'gradients summed and applied on %s',
                 deploy_config.variables_device(),
                 deploy_config.clone_devices(),
                 deploy_config.optimizer_device())


def make_schedule(config, num_clones, total_steps):
  """The learning-rate schedule of a run of `total_steps` global steps."""
  peak = schedules.peak_learning_rate(config.learning_rate, config.lr_scaling,
                                      num_clones)
  return schedules.Schedule(peak, total_steps, kind=config.lr_schedule,
                            warmup_steps=config.warmup_steps)


def _worker_towers(config, deploy_config, build, loss_fn, strategy,
                   cluster_info):
  """This worker's towers in a MultiWorkerMirroredStrategy job."""
  logging.info('multi_worker: worker %d of %d; %s', cluster_info.index,
               cluster_info.num_workers,
               distribute.VARIABLES[distribute.MULTI_WORKER])
  with strategy.scope():
    model, optimizer = build()
    towers = deploy.deploy(deploy_config, model, loss_fn, optimizer,
                           batch_norm_policy=config.batch_norm_policy,
                           return_gradients=config.summarize_gradients)
  return distribute.WorkerTowers(strategy, towers)


def build_trainer(config, deploy_config, *, input_shape, num_classes,
                  loss_fn, learning_rate, workers=None):
  """The model, its optimizer and step, on the path `config.strategy` names.

  Returns a `deploy.DeployedModel`, `distribute.DistributedModel` or
  `distribute.WorkerTowers`; all have `train_step_outputs`,
  `distribute_dataset`, `predict`, `model` and `optimizer`.

  `workers` is (strategy, cluster) for multi_worker: the strategy must
  exist before TensorFlow runs its first op.

  Raises:
    distribute.UnsupportedError: the strategy cannot train this model.
  """
  policy = dtype_policy(config, deploy_config)

  def build():
    model = models.get_model(
        config.model, input_shape=input_shape, num_classes=num_classes,
        dtype_policy=policy,
        synchronized_batch_norm=config.synchronized_batch_norm)
    optimizer = make_optimizer(config.optimizer, learning_rate)
    if policy == MIXED_GPU:  # float16 gradients underflow without it.
      optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return model, optimizer
  if config.strategy == TOWERS:
    with tf.device(deploy_config.variables_device()):
      model, optimizer = build()
    lockstep = None
    if config.synchronized_batch_norm:
      lockstep = distribute.make_strategy(distribute.MIRRORED, deploy_config)
    return deploy.deploy(deploy_config, model, loss_fn, optimizer,
                         batch_norm_policy=config.batch_norm_policy,
                         jit_compile=config.xla,
                         return_gradients=config.summarize_gradients,
                         lockstep=lockstep)
  if config.strategy == distribute.MULTI_WORKER:
    return _worker_towers(config, deploy_config, build, loss_fn, *workers)
  if config.strategy == distribute.MULTI_WORKER_MIRRORED:
    strategy, cluster_info = workers
    with strategy.scope():
      model, optimizer = build()
    return distribute.DistributedModel(
        strategy, model, loss_fn, optimizer,
        return_gradients=config.summarize_gradients,
        worker=cluster_info.index, num_workers=cluster_info.num_workers)
  strategy = distribute.make_strategy(config.strategy, deploy_config)
  logging.info('%s: tf.distribute replicas on %s; %s', config.strategy,
               strategy.extended.worker_devices,
               distribute.VARIABLES[config.strategy])
  with strategy.scope():
    model, optimizer = build()
  distribute.check_supported(config.strategy, model,
                             strategy.num_replicas_in_sync)
  return distribute.DistributedModel(
      strategy, model, loss_fn, optimizer,
      return_gradients=config.summarize_gradients)


def _write_metrics(model_dir, metrics):
  """Writes metrics.json atomically (a reader never sees half a file)."""
  path = os.path.join(model_dir, METRICS_FILE)
  with open(path + '.tmp', 'w') as f:
    json.dump(metrics, f, indent=2, sort_keys=True)
  os.replace(path + '.tmp', path)
  return path


def _fingerprint(model):
  """A digest of every weight, to compare workers' copies in the log."""
  digest = hashlib.sha256()
  for weight in model.get_weights():
    digest.update(np.ascontiguousarray(weight).tobytes())
  return digest.hexdigest()[:16]


def train_and_evaluate(config, deploy_config, *, data_override=None,
                       cluster_info=None):
  """Trains `config.model` on `config.dataset` over the clones; evaluates.

  Resumes from the latest checkpoint in `config.model_dir`, if any.

  Args:
    config: a `TrainConfig`.
    deploy_config: a `deploy.DeploymentConfig`.
    data_override: a `data.Data` to use instead of loading `config.dataset`
      (tests inject small data this way).
    cluster_info: this task's `cluster.Cluster` (strategy multi_worker):
      only the chief writes to model_dir.

  Returns:
    The metrics dict also written to `<model_dir>/metrics.json`.

  Raises:
    loop.TrainingInterrupted: SIGTERM or SIGINT; a checkpoint was saved.
    ConfigError: a warm-up as long as the run.
    loop.NonFiniteLossError: the loss became NaN or infinite.
    checkpoints.CheckpointMismatchError: model_dir holds another model.
    distribute.UnsupportedError: the strategy cannot train this model.
  """
  multi_worker = config.strategy in distribute.MULTI_WORKER_STRATEGIES
  if multi_worker != (cluster_info is not None):
    raise ValueError(f'strategy={config.strategy!r} with cluster_info='
                     f'{cluster_info}: multi_worker needs a cluster, and '
                     'only it.')
  workers = None
  if cluster_info is not None:
    # Collective ops must be configured before TensorFlow runs an op.
    # The towers place their own clones: one replica (the host) per worker.
    workers = (cluster.make_strategy(
        cluster_info,
        one_replica_per_worker=(config.strategy == distribute.MULTI_WORKER
                                or deploy_config.clone_on_cpu),
        timeout_s=config.peer_timeout_s), cluster_info)
  global_batch_size = (config.batch_size * deploy_config.num_clones *
                       deploy_config.num_replicas)
  _log_deployment(deploy_config, config, global_batch_size)
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()
  keras.utils.set_random_seed(config.seed)
  with tf.device(deploy_config.inputs_device()):
    dataset = data_override or data.load(
        config.dataset, global_batch_size=global_batch_size,
        data_dir=config.data_dir, seed=config.seed)
  steps_per_epoch = dataset.train_examples // global_batch_size
  total_steps = config.train_steps or config.epochs * steps_per_epoch
  try:
    # Linear scaling counts every clone of every worker.
    schedule = make_schedule(
        config, deploy_config.num_clones * deploy_config.num_replicas,
        total_steps)
  except ValueError as e:
    raise ConfigError(f'{e} The run has {total_steps} steps of '
                      f'{global_batch_size} examples.') from e
  loss_fn = make_loss()
  trainer = build_trainer(config, deploy_config,
                          input_shape=dataset.input_shape,
                          num_classes=dataset.num_classes, loss_fn=loss_fn,
                          learning_rate=schedule, workers=workers)
  logging.info('%s: %d parameters; %s: %d train, %d test examples; %d steps '
               'of %d', config.model, trainer.model.count_params(),
               config.dataset, dataset.train_examples, dataset.test_examples,
               total_steps, global_batch_size)

  os.makedirs(config.model_dir, exist_ok=True)
  out_dir = cluster.output_dir(config.model_dir, cluster_info)
  try:
    metrics = _train_into(config, deploy_config, trainer, dataset, loss_fn,
                          schedule, out_dir, global_batch_size, total_steps)
  finally:
    cluster.remove_output_dir(out_dir, config.model_dir)
  metrics['num_workers'] = deploy_config.num_replicas
  logging.info('final weights sha256 %s (every worker of a job logs the '
               'same)', _fingerprint(trainer.model))
  if cluster_info is None or cluster_info.is_chief:
    path = _write_metrics(config.model_dir, metrics)
    logging.info('done: %d steps, eval accuracy %.4f, train loss %.4f, %.0f '
                 'images/sec; metrics in %s', metrics['steps'],
                 metrics['eval_accuracy'], metrics['train_loss'],
                 metrics['images_per_sec'], path)
  return metrics


def _train_into(config, deploy_config, trainer, dataset, loss_fn, schedule,
                out_dir, global_batch_size, total_steps):
  """Runs the loop writing to `out_dir`; returns the metrics dict."""
  device = deploy_config.summaries_device()
  checkpointer = checkpoints.Checkpointer(
      out_dir, model=trainer.model, optimizer=trainer.optimizer,
      max_to_keep=config.keep_checkpoints, device=device,
      restore_directory=config.model_dir)
  restored = checkpointer.restore_latest()
  progress = loop.Progress(total_steps, global_batch_size,
                           config.log_every_steps)
  run = loop.Run(trainer, dataset, loss_fn, schedule, checkpointer,
                 summaries.Summaries(out_dir, device=device),
                 progress, global_batch_size, total_steps,
                 config.log_every_steps, config.checkpoint_steps)
  try:
    position, evaluation = loop.train(
        run, restored or checkpoints.Position(0, 0, 0))
  finally:
    run.summaries.close()
  steps_per_epoch = dataset.train_examples // global_batch_size

  metrics = {
      'eval_accuracy': evaluation['accuracy'],
      'eval_loss': evaluation['loss'],
      'train_loss': progress.last_window_loss,
      'steps': position.step,
      'resumed_from_step': restored.step if restored else None,
      'epochs': position.step / steps_per_epoch,
      'images_per_sec': progress.images_per_sec,
      'train_seconds': progress.train_seconds,
      'strategy': config.strategy,
      'num_clones': deploy_config.num_clones,
      'batch_size': config.batch_size,
      'global_batch_size': global_batch_size,
      'variables_device': deploy_config.variables_device(),
      'clone_devices': deploy_config.clone_devices(),
      'model': config.model,
      'dataset': config.dataset,
      'optimizer': config.optimizer,
      'learning_rate': config.learning_rate,
      'peak_learning_rate': schedule.peak,
      'lr_schedule': config.lr_schedule,
      'mixed_precision': dtype_policy(config, deploy_config),
      'seed': config.seed,
      'checkpoint': checkpointer.latest,
  }
  return metrics
