"""The training job: data, trainer, loop, evaluation, metrics.

`train_and_evaluate(config, deploy_config)` is the one call the command line
makes. It checks the job and the directories, takes the model_dir's lock
(`run_dir`), builds the trainer of the path `config.strategy` names
(`registry`), resumes from the latest intact checkpoint, trains to the
requested global step (`loop`), evaluates on the test split after every
epoch and writes `<model_dir>/metrics.json` (`metrics`). Tests hand it
their own data and trainer (`data_override`, `trainer_override`).
"""

import contextlib
import time

import keras
import tensorflow as tf
from absl import logging

from tfmulti.train import build
from tfmulti.train import checkpoints
from tfmulti.distribute import cluster
from tfmulti import data
from tfmulti import errors
from tfmulti.train import export
from tfmulti.train import loop
from tfmulti.train import metrics
from tfmulti.train import run_dir
from tfmulti.train import registry
from tfmulti.train import summaries


def global_batch_size(config, deploy_config):
  """Rows of one step (one update) of the whole job: every clone of every
  worker, every accumulation step."""
  return (config.batch_size * deploy_config.num_clones *
          deploy_config.num_workers * config.step_options.accumulation_steps)


def _log_deployment(config, deploy_config, path):
  options = config.step_options
  logging.info('batch_size %d per clone x %d clones x %d workers x %d '
               'accumulation steps = global batch %d; the clones run on %s',
               config.batch_size, deploy_config.num_clones,
               deploy_config.num_workers, options.accumulation_steps,
               global_batch_size(config, deploy_config),
               deploy_config.clone_devices())
  if options.clone_shares:
    logging.info('clone shares: %s', options.clone_shares)
  if config.strategy == registry.TOWERS:
    logging.info('towers: variables and optimizer slots on %s; batch split '
                 'on %s; gradients summed and applied on %s',
                 deploy_config.variables_device(),
                 deploy_config.inputs_device(),
                 deploy_config.optimizer_device())
  else:
    logging.info('%s: %s', config.strategy, path.variables)


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


def _job(config, deploy_config, dataset):
  """What the checkpoints are of: a resume must keep it (`run_dir`)."""
  return {'model': config.model, 'dataset': config.dataset,
          'optimizer': config.optimizer,
          'global_batch_size': global_batch_size(config, deploy_config),
          'dtype_policy': build.dtype_policy(config.mixed_precision,
                                             deploy_config.clone_on_cpu),
          'input_shape': list(dataset.input_shape),
          'num_classes': dataset.num_classes}


def _settings(config, deploy_config, total_steps):
  """What may change on resume (and is logged when it does)."""
  return {'learning_rate': config.learning_rate,
          'lr_scaling': config.lr_scaling, 'lr_schedule': config.lr_schedule,
          'warmup_steps': config.warmup_steps, 'total_steps': total_steps,
          'strategy': config.strategy,
          'num_clones': deploy_config.num_clones,
          'num_workers': deploy_config.num_workers}


def _load(config, deploy_config):
  with tf.device(deploy_config.inputs_device()):
    return data.load(config.dataset,
                     global_batch_size=global_batch_size(config,
                                                         deploy_config),
                     data_dir=config.data_dir, seed=config.seed)


def train_and_evaluate(config, deploy_config, *, data_override=None,
                       trainer_override=None, cluster_info=None):
  """Trains `config.model` on `config.dataset` on `config.strategy`'s path.

  Resumes from the latest intact checkpoint in `config.model_dir`, if any.

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
    errors.UserError: a problem the user can fix, before training or (a
      non-finite loss or weight, a failed write) during it; its message
      names the value and the fix.
    loop.TrainingInterrupted: SIGTERM or SIGINT; a checkpoint was saved.
  """
  started = time.perf_counter()  # For the start-up phase in metrics.
  path = registry.get(config.strategy)
  registry.check(config, deploy_config)
  chief = cluster_info is None or cluster_info.is_chief
  if config.data_dir and not data_override:
    run_dir.check_directory('data_dir', config.data_dir)
  run_dir.check_directory('model_dir', config.model_dir)
  with run_dir.Lock(config.model_dir) if chief else contextlib.nullcontext():
    workers = _start_workers(config, deploy_config, path, cluster_info)
    _log_deployment(config, deploy_config, path)
    if config.deterministic:
      tf.config.experimental.enable_op_determinism()
    dataset = data_override or _load(config, deploy_config)
    # Seeded after the data: preparing a data set the first time draws from
    # the global generators, and the weights must not depend on whether
    # this run prepared it.
    keras.utils.set_random_seed(config.seed)
    batch = global_batch_size(config, deploy_config)
    total_steps = config.train_steps or (
        config.epochs * (dataset.train_examples // batch))
    schedule = build.make_schedule(
        config, deploy_config.num_clones * deploy_config.num_workers,
        total_steps)
    trainer = trainer_override or path.build(registry.Setup(
        config, deploy_config, build.model_and_optimizer(
            config, deploy_config, input_shape=dataset.input_shape,
            num_classes=dataset.num_classes, learning_rate=schedule),
        build.make_loss(), workers))
    if chief:  # Recorded once the trainer exists: a refused build (a bad
      # cut, a strategy that cannot train the model) leaves no record.
      run_dir.check_job(
          config.model_dir, _job(config, deploy_config, dataset),
          _settings(config, deploy_config, total_steps),
          resuming=bool(checkpoints.numbered_checkpoints(config.model_dir)))
    if workers is not None:  # Before the first collective step.
      cluster.check_agreement(workers, dict(
          _job(config, deploy_config, dataset), total_steps=total_steps))
    logging.info('%s: %d parameters; %s: %d train, %d test examples; %d '
                 'steps of %d', config.model, trainer.model.count_params(),
                 config.dataset, dataset.train_examples,
                 dataset.test_examples, total_steps, batch)
    out_dir = cluster.output_dir(config.model_dir, cluster_info)
    try:
      with cluster.lost_peers_as_errors(cluster_info):
        result = _train_into(config, deploy_config, started, _run(
            config, deploy_config, trainer, dataset, schedule, total_steps,
            out_dir))
    finally:
      cluster.remove_output_dir(out_dir, config.model_dir)
    logging.info('final weights sha256 %s (every worker of a job logs the '
                 'same)', metrics.fingerprint(trainer.model))
    if chief:
      if config.export:
        result['export'] = export.export(trainer.model, config.model_dir,
                                         result['steps'])
      metrics.write(config.model_dir, result)
  return result


def _run(config, deploy_config, trainer, dataset, schedule, total_steps,
         out_dir):
  """The loop's `Run`: it saves into `out_dir` and restores from the
  model_dir (the chief's, in a multi-worker job)."""
  device = deploy_config.summaries_device()
  return loop.Run(
      trainer=trainer, dataset=dataset, loss_fn=build.make_loss(),
      schedule=schedule, checkpointer=checkpoints.Checkpointer(
          out_dir, model=trainer.model, optimizer=trainer.optimizer,
          max_to_keep=config.keep_checkpoints, device=device,
          restore_directory=config.model_dir),
      summaries=summaries.Summaries(out_dir, device=device),
      global_batch_size=global_batch_size(config, deploy_config),
      total_steps=total_steps, log_every_steps=config.log_every_steps,
      checkpoint_steps=config.checkpoint_steps,
      profile_steps=config.profile_steps, profile_dir=out_dir)


def _train_into(config, deploy_config, started, run):
  """Restores the latest checkpoint, runs the loop; returns the metrics."""
  restored = run.checkpointer.restore_latest()
  if restored and restored.step >= run.total_steps:
    logging.info('%s already holds step %d of %d: nothing left to train; '
                 'evaluating', config.model_dir, restored.step,
                 run.total_steps)
  try:
    outcome = loop.train(run, restored or checkpoints.Position(0, 0, 0))
  finally:
    run.summaries.close()
  return metrics.collect(config, deploy_config, run, outcome, restored,
                         started)
