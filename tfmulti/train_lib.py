"""The training job: data, trainer, loop, evaluation, metrics.

`train_and_evaluate(config, deploy_config)` is the one call the command line
makes. It checks the job, builds the trainer of the path `config.strategy`
names (`strategies`), resumes from the latest checkpoint in `model_dir`,
trains to the requested global step (`loop`), evaluates on the test split
after every epoch and writes `<model_dir>/metrics.json`. Tests hand it their
own data and trainer (`data_override`, `trainer_override`).
"""

import hashlib
import json
import os

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmulti import build
from tfmulti import checkpoints
from tfmulti import cluster
from tfmulti import data
from tfmulti import errors
from tfmulti import loop
from tfmulti import strategies
from tfmulti import summaries

METRICS_FILE = 'metrics.json'


def global_batch_size(config, deploy_config):
  """Rows of one step of the whole job: every clone of every worker."""
  return (config.batch_size * deploy_config.num_clones *
          deploy_config.num_workers)


def _log_deployment(config, deploy_config, path):
  logging.info('batch_size %d per clone x %d clones x %d workers = global '
               'batch %d; the clones run on %s', config.batch_size,
               deploy_config.num_clones, deploy_config.num_workers,
               global_batch_size(config, deploy_config),
               deploy_config.clone_devices())
  logging.info('%s: %s', config.strategy, path.variables)
  if config.strategy == strategies.TOWERS:
    logging.info('towers: variables and optimizer slots on %s; batch split '
                 'on %s; gradients summed and applied on %s',
                 deploy_config.variables_device(),
                 deploy_config.inputs_device(),
                 deploy_config.optimizer_device())


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


def _start_workers(config, deploy_config, path, cluster_info):
  """The multi-worker strategy, made before TensorFlow runs an op; or None.

  Raises:
    errors.ClusterError: a multi-worker path without a cluster, or a
      cluster without one.
  """
  if path.multi_worker != (cluster_info is not None):
    raise errors.ClusterError(
        f'strategy={config.strategy!r} with cluster_info={cluster_info}: the '
        'multi-worker paths need a cluster (TF_CONFIG), and only they.')
  if cluster_info is None:
    return None
  # The towers place their own clones: one replica (the host) per worker;
  # on CPUs MultiWorkerMirroredStrategy has one replica per worker anyway.
  return cluster.make_strategy(
      cluster_info, timeout_s=config.peer_timeout_s,
      one_replica_per_worker=(path.one_replica_per_worker
                              or deploy_config.clone_on_cpu))


def train_and_evaluate(config, deploy_config, *, data_override=None,
                       trainer_override=None, cluster_info=None):
  """Trains `config.model` on `config.dataset` on `config.strategy`'s path.

  Resumes from the latest checkpoint in `config.model_dir`, if any.

  Args:
    config: a `config.TrainConfig`.
    deploy_config: a `deploy.DeploymentConfig`.
    data_override: a `data.Data` to use instead of loading `config.dataset`.
    trainer_override: a `trainer.Trainer` to use instead of building the
      path's (its model and optimizer are checkpointed).
    cluster_info: this task's `cluster.Cluster` (multi-worker paths): only
      the chief writes to model_dir.

  Returns:
    The metrics dict also written to `<model_dir>/metrics.json`.

  Raises:
    errors.UserError: a problem the user can fix, before training or (a NaN
      loss) during it; its message names the value and the fix.
    loop.TrainingInterrupted: SIGTERM or SIGINT; a checkpoint was saved.
  """
  path = strategies.get(config.strategy)
  strategies.check(config, deploy_config)
  workers = _start_workers(config, deploy_config, path, cluster_info)
  batch = global_batch_size(config, deploy_config)
  _log_deployment(config, deploy_config, path)
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()
  keras.utils.set_random_seed(config.seed)
  with tf.device(deploy_config.inputs_device()):
    dataset = data_override or data.load(
        config.dataset, global_batch_size=batch, data_dir=config.data_dir,
        seed=config.seed)
  total_steps = config.train_steps or (
      config.epochs * (dataset.train_examples // batch))
  schedule = build.make_schedule(
      config, deploy_config.num_clones * deploy_config.num_workers,
      total_steps)
  loss_fn = build.make_loss()
  trainer = trainer_override or path.build(strategies.Setup(
      config, deploy_config, build.model_and_optimizer(
          config, deploy_config, input_shape=dataset.input_shape,
          num_classes=dataset.num_classes, learning_rate=schedule),
      loss_fn, workers))
  logging.info('%s: %d parameters; %s: %d train, %d test examples; %d steps '
               'of %d', config.model, trainer.model.count_params(),
               config.dataset, dataset.train_examples, dataset.test_examples,
               total_steps, batch)
  os.makedirs(config.model_dir, exist_ok=True)
  out_dir = cluster.output_dir(config.model_dir, cluster_info)
  try:
    metrics = _train_into(config, deploy_config, loop.Run(
        trainer=trainer, dataset=dataset, loss_fn=loss_fn, schedule=schedule,
        checkpointer=checkpoints.Checkpointer(
            out_dir, model=trainer.model, optimizer=trainer.optimizer,
            max_to_keep=config.keep_checkpoints,
            device=deploy_config.summaries_device(),
            restore_directory=config.model_dir),
        summaries=summaries.Summaries(
            out_dir, device=deploy_config.summaries_device()),
        global_batch_size=batch, total_steps=total_steps,
        log_every_steps=config.log_every_steps,
        checkpoint_steps=config.checkpoint_steps))
  finally:
    cluster.remove_output_dir(out_dir, config.model_dir)
  logging.info('final weights sha256 %s (every worker of a job logs the '
               'same)', _fingerprint(trainer.model))
  if cluster_info is None or cluster_info.is_chief:
    metrics_path = _write_metrics(config.model_dir, metrics)
    logging.info('done: %d steps, eval accuracy %.4f, train loss %.4f, %.0f '
                 'images/sec; metrics in %s', metrics['steps'],
                 metrics['eval_accuracy'], metrics['train_loss'],
                 metrics['images_per_sec'], metrics_path)
  return metrics


def _train_into(config, deploy_config, run):
  """Restores the latest checkpoint, runs the loop; returns the metrics."""
  restored = run.checkpointer.restore_latest()
  try:
    outcome = loop.train(run, restored or checkpoints.Position(0, 0, 0))
  finally:
    run.summaries.close()
  return {
      'eval_accuracy': outcome.evaluation['accuracy'],
      'eval_loss': outcome.evaluation['loss'],
      'train_loss': outcome.progress.last_window_loss,
      'steps': outcome.position.step,
      'resumed_from_step': restored.step if restored else None,
      'epochs': outcome.position.step / (run.dataset.train_examples //
                                         run.global_batch_size),
      'images_per_sec': outcome.progress.images_per_sec,
      'train_seconds': outcome.progress.train_seconds,
      'strategy': config.strategy,
      'num_clones': deploy_config.num_clones,
      'num_workers': deploy_config.num_workers,
      'batch_size': config.batch_size,
      'global_batch_size': run.global_batch_size,
      'variables_device': deploy_config.variables_device(),
      'clone_devices': deploy_config.clone_devices(),
      'model': config.model,
      'dataset': config.dataset,
      'optimizer': config.optimizer,
      'learning_rate': config.learning_rate,
      'peak_learning_rate': run.schedule.peak,
      'lr_schedule': config.lr_schedule,
      'mixed_precision': build.dtype_policy(config.mixed_precision,
                                            deploy_config.clone_on_cpu),
      'seed': config.seed,
      'checkpoint': run.checkpointer.latest,
  }
