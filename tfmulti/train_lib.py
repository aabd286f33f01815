"""The training job: data, model, deployment, loop, evaluation, metrics.

`train_and_evaluate(config, deploy_config)` is the one call `train.py`
makes. It builds the model and optimizer under the variables device, deploys
them over the clones (or hands them to a tf.distribute strategy on the same
devices, for comparison: one training contract, two ways to run the step),
trains for the requested steps with progress lines,
evaluates on the test split after every epoch and writes
`<model_dir>/metrics.json`.
"""

import dataclasses
import json
import os
import time
from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmulti import data
from tfmulti import deploy
from tfmulti import distribute
from tfmulti import models

OPTIMIZERS = ('sgd', 'momentum', 'adam')
TOWERS = 'towers'
STRATEGIES = (TOWERS,) + distribute.STRATEGIES
_MOMENTUM = 0.9  # Of the 'momentum' optimizer.
METRICS_FILE = 'metrics.json'


def _check_positive(name, value):
  if value is not None and not value > 0:
    raise ValueError(f'{name}={value!r}: must be > 0.')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """What to train, on what, for how long, and where to write.

  Attributes:
    model: a name in `models.names()`.
    dataset: a name in `data.DATASETS`.
    model_dir: output directory (metrics.json).
    data_dir: TFDS data directory; None for TFDS's default.
    batch_size: examples per clone per step (slim's meaning); the global
      batch is batch_size * num_clones.
    optimizer: one of `OPTIMIZERS`.
    learning_rate: the optimizer's step size.
    epochs: passes over the train split, unless `train_steps` is set.
    train_steps: global steps to train; overrides `epochs`.
    seed: seeds weights, dropout and shuffling.
    log_every_steps: steps between progress lines.
    batch_norm_policy: see `deploy.BATCH_NORM_POLICIES`.
    xla: compile each clone's computation with XLA.
    strategy: 'towers' (tfmulti.deploy), or a tf.distribute path from
      `distribute.STRATEGIES` on the same devices, for comparison.
  """
  model: str = 'lenet'
  dataset: str = 'digits'
  model_dir: str = 'runs/default'
  data_dir: Optional[str] = None
  batch_size: int = 64
  optimizer: str = 'adam'
  learning_rate: float = 1e-3
  epochs: int = 40
  train_steps: Optional[int] = None
  seed: int = 0
  log_every_steps: int = 10
  batch_norm_policy: str = deploy.BN_CLONE_0
  xla: bool = False
  strategy: str = TOWERS

  def __post_init__(self):
    if self.model not in models.names():
      raise ValueError(f'model={self.model!r} is not registered; choose one '
                       f'of {models.names()}.')
    if self.dataset not in data.DATASETS:
      raise ValueError(f'dataset={self.dataset!r} is not known; choose one '
                       f'of {data.DATASETS}.')
    if self.strategy not in STRATEGIES:
      raise ValueError(f'strategy={self.strategy!r}: choose one of '
                       f'{STRATEGIES}.')
    if self.xla and self.strategy != TOWERS:
      raise ValueError(f'xla=True works with the towers only, not '
                       f'strategy={self.strategy!r}.')
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f'optimizer={self.optimizer!r}: choose one of '
                       f'{OPTIMIZERS}.')
    if self.batch_norm_policy not in deploy.BATCH_NORM_POLICIES:
      raise ValueError(f'batch_norm_policy={self.batch_norm_policy!r}: '
                       f'choose one of {deploy.BATCH_NORM_POLICIES}.')
    for name in ('batch_size', 'learning_rate', 'epochs', 'train_steps',
                 'log_every_steps'):
      _check_positive(name, getattr(self, name))
    if not self.model_dir:
      raise ValueError("model_dir='': name an output directory.")


def make_optimizer(name, learning_rate):
  """A Keras optimizer by name; create it under the variables device."""
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


def evaluate(deployed, dataset, loss_fn):
  """{'accuracy', 'loss'} of `deployed.predict` over every test example."""
  correct, loss_sum, count = 0, 0.0, 0
  for images, labels in dataset:
    logits = deployed.predict(images)
    rows = int(labels.shape[0])
    loss_sum += float(loss_fn(labels, logits)) * rows
    correct += int(tf.reduce_sum(tf.cast(
        tf.argmax(logits, axis=-1, output_type=tf.int32) == labels,
        tf.int32)))
    count += rows
  return {'accuracy': correct / count, 'loss': loss_sum / count}


class _Progress:
  """Progress lines: loss over the window, images/sec and ETA.

  Training time excludes the first step (tracing) and evaluation, so
  images/sec is the steady-state throughput of the step and its input.
  """

  def __init__(self, total_steps, global_batch_size, log_every_steps):
    self.total_steps = total_steps
    self.global_batch_size = global_batch_size
    self.log_every_steps = log_every_steps
    self.window = []  # Total losses since the last progress line.
    self.last_window_loss = float('nan')
    self.train_seconds = 0.0
    self.timed_steps = 0
    self._started = None

  def start(self):
    self._started = time.perf_counter()

  def stop(self):
    if self._started is not None:
      self.train_seconds += time.perf_counter() - self._started
      self._started = None

  @property
  def images_per_sec(self):
    if not self.train_seconds:
      return float('nan')
    return self.timed_steps * self.global_batch_size / self.train_seconds

  def record(self, step, total_loss, epoch):
    """Records step `step` (1-based); logs a line every log_every_steps."""
    self.window.append(total_loss)
    if step == 1:  # The first step traces the function: leave it untimed.
      float(total_loss)
      self.start()
      return
    self.timed_steps += 1
    if step % self.log_every_steps and step != self.total_steps:
      return
    self.last_window_loss = float(np.mean([float(l) for l in self.window]))
    self.window = []
    self.stop()
    eta = (self.total_steps - step) * self.global_batch_size / max(
        self.images_per_sec, 1e-9)
    logging.info('step %d/%d (epoch %d) loss %.4f | %.0f images/sec | ETA %s',
                 step, self.total_steps, epoch, self.last_window_loss,
                 self.images_per_sec, time.strftime('%M:%S', time.gmtime(eta)))
    self.start()


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


def build_trainer(config, deploy_config, *, input_shape, num_classes,
                  loss_fn):
  """The model, its optimizer and step, on the path `config.strategy` names.

  Returns a `deploy.DeployedModel` or a `distribute.DistributedModel`; both
  have `train_step_losses`, `predict`, `model` and `optimizer`.
  """
  def build():
    model = models.get_model(config.model, input_shape=input_shape,
                             num_classes=num_classes)
    return model, make_optimizer(config.optimizer, config.learning_rate)
  if config.strategy == TOWERS:
    with tf.device(deploy_config.variables_device()):
      model, optimizer = build()
    return deploy.deploy(deploy_config, model, loss_fn, optimizer,
                         batch_norm_policy=config.batch_norm_policy,
                         jit_compile=config.xla)
  strategy = distribute.make_strategy(config.strategy, deploy_config)
  logging.info('%s: tf.distribute replicas on %s, each with its own copy of '
               'the variables; gradients all-reduced', config.strategy,
               strategy.extended.worker_devices)
  with strategy.scope():
    model, optimizer = build()
  return distribute.DistributedModel(strategy, model, loss_fn, optimizer)


def _write_metrics(model_dir, metrics):
  """Writes metrics.json atomically (a reader never sees half a file)."""
  path = os.path.join(model_dir, METRICS_FILE)
  with open(path + '.tmp', 'w') as f:
    json.dump(metrics, f, indent=2, sort_keys=True)
  os.replace(path + '.tmp', path)
  return path


def train_and_evaluate(config, deploy_config, *, data_override=None):
  """Trains `config.model` on `config.dataset` over the clones; evaluates.

  Args:
    config: a `TrainConfig`.
    deploy_config: a `deploy.DeploymentConfig`.
    data_override: a `data.Data` to use instead of loading `config.dataset`
      (tests inject small data this way).

  Returns:
    The metrics dict also written to `<model_dir>/metrics.json`.
  """
  global_batch_size = config.batch_size * deploy_config.num_clones
  _log_deployment(deploy_config, config, global_batch_size)
  keras.utils.set_random_seed(config.seed)
  with tf.device(deploy_config.inputs_device()):
    dataset = data_override or data.load(
        config.dataset, global_batch_size=global_batch_size,
        data_dir=config.data_dir, seed=config.seed)
  loss_fn = make_loss()
  deployed = build_trainer(config, deploy_config,
                           input_shape=dataset.input_shape,
                           num_classes=dataset.num_classes, loss_fn=loss_fn)
  logging.info('%s: %d parameters; %s: %d train, %d test examples',
               config.model, deployed.model.count_params(), config.dataset,
               dataset.train_examples, dataset.test_examples)

  steps_per_epoch = dataset.train_examples // global_batch_size
  total_steps = config.train_steps or config.epochs * steps_per_epoch
  progress = _Progress(total_steps, global_batch_size, config.log_every_steps)
  step, epoch, evaluation = 0, 0, {}
  while step < total_steps:
    epoch += 1
    for images, labels in dataset.train.take(total_steps - step):
      step += 1
      progress.record(step, deployed.train_step(images, labels), epoch)
    progress.stop()
    evaluation = evaluate(deployed, dataset.test, loss_fn)
    logging.info('epoch %d: eval accuracy %.4f, eval loss %.4f', epoch,
                 evaluation['accuracy'], evaluation['loss'])

  os.makedirs(config.model_dir, exist_ok=True)
  metrics = {
      'eval_accuracy': evaluation['accuracy'],
      'eval_loss': evaluation['loss'],
      'train_loss': progress.last_window_loss,
      'steps': step,
      'epochs': epoch,
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
      'seed': config.seed,
  }
  path = _write_metrics(config.model_dir, metrics)
  logging.info('done: %d steps, eval accuracy %.4f, train loss %.4f, %.0f '
               'images/sec; metrics in %s', step, evaluation['accuracy'],
               progress.last_window_loss, progress.images_per_sec, path)
  return metrics
