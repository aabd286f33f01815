"""The training job: data, trainer, loop, evaluation, metrics.

`train_and_evaluate(config, deploy_config)` is the one call the command line
makes. It checks the job and the directories, takes the model_dir's lock
(`run_dir`), builds the trainer of the path `config.strategy` names
(`registry`), resumes from the latest intact checkpoint, trains to the
requested global step (`loop`), evaluates on the test split after every
epoch and writes `<model_dir>/metrics.json` (`metrics`). Tests hand it
their own data and trainer (`data_override`, `trainer_override`).
"""

import dataclasses
import time

from absl import logging
import keras
import tensorflow as tf

from tfmulti import data
from tfmulti import device_kinds
from tfmulti import errors
from tfmulti import layouts
from tfmulti import phases
from tfmulti.distribute import cluster
from tfmulti.distribute import preemption
from tfmulti.engine import checkpoints
from tfmulti.engine import readings
from tfmulti.engine import registry
from tfmulti.train import build
from tfmulti.train import export
from tfmulti.train import loop
from tfmulti.train import metrics
from tfmulti.train import run_dir
from tfmulti.train import summaries


def global_batch_size(config, deploy_config):
  """Rows of one step (one update) of the whole job: every clone of every
  worker, every accumulation step (the workers' parts, where they
  differ)."""
  if config.step_options.worker_parts:
    return sum(config.step_options.worker_parts)
  return (config.batch_size * deploy_config.num_clones *
          deploy_config.num_workers * config.step_options.accumulation_steps)


def keep_global_batch(config, deploy_config):
  """`config` with the global batch its job.json recorded at the job's
  first start, on this start's workers and clones: its `batch_size` is
  that batch's share of a clone; where the batch does not split evenly
  over the workers, each takes a part of whole atoms of its accumulation
  steps (`StepOptions.worker_parts`). Only an elastic start
  (`config.elastic_start`) changes it; elsewhere another global batch is
  another job, which `run_dir.check_job` refuses.

  Raises:
    errors.ConfigError: the recorded batch cannot be cut over this start's
      workers (fewer whole atoms than workers).
  """
  recorded = config.elastic_start is not None and (
      run_dir.recorded_job(config.model_dir) or {}).get('global_batch_size')
  if not recorded or recorded == global_batch_size(config, deploy_config):
    return config
  options = config.step_options
  a_worker = deploy_config.num_clones * options.accumulation_steps
  if recorded % (a_worker * deploy_config.num_workers) == 0:
    batch_size, parts = recorded // (a_worker * deploy_config.num_workers), None
  else:
    parts = layouts.worker_parts(
        recorded, deploy_config.num_workers,
        options.accumulation_steps * max(options.reproducible_rows, 1))
    batch_size = min(parts) // a_worker
  logging.info('elastic start %d on %d workers: the job\'s global batch of '
               '%d rows is kept, %s', config.elastic_start,
               deploy_config.num_workers, recorded,
               f'{batch_size} rows a clone' if parts is None else
               f'the workers\' parts {"/".join(map(str, parts))} rows')
  return dataclasses.replace(
      config, batch_size=max(batch_size, 1),
      step_options=dataclasses.replace(options, worker_parts=parts))


def _log_deployment(config, deploy_config, path):
  options = config.step_options
  logging.info('batch_size %d per clone x %d clones x %d workers x %d '
               'accumulation steps = global batch %d; the clones run on %s',
               config.batch_size, deploy_config.num_clones,
               deploy_config.num_workers, options.accumulation_steps,
               global_batch_size(config, deploy_config),
               deploy_config.clone_devices())
  if options.auto_shares:
    logging.info('clone shares: measured and balanced at the first step and '
                 'every %d steps', options.rebalance_every_steps)
  elif options.clone_shares:
    step_rows = config.batch_size * deploy_config.num_clones
    logging.info('clone shares %s: %s rows of each %d-row batch',
                 ':'.join(f'{share:g}' for share in options.clone_shares),
                 '/'.join(map(str, layouts.split_rows(step_rows,
                                                   options.clone_shares))),
                 step_rows)
  mesh = deploy_config.variable_layouts
  if mesh is not None:
    logging.info('%s: a mesh %s of axes %s over %s: each variable its '
                 'layout splits as shards, each clone gathering them and '
                 'each shard summed and updated on its device; the rest '
                 'spread by bytes%s', config.strategy, mesh.mesh_shape,
                 mesh.axis_names, deploy_config.variable_devices(),
                 ', the tables planned' if mesh.plan_tables else '')
  elif config.strategy != registry.TOWERS:
    logging.info('%s: %s', config.strategy, path.variables)
  elif deploy_config.spread_variables:
    logging.info('towers: variables spread over %s by bytes, each with '
                 'its slots, gradient sum and update; batch split on %s',
                 deploy_config.variable_devices(),
                 deploy_config.inputs_device())
  else:
    logging.info('towers: variables and optimizer slots on %s; batch '
                 'split on %s; gradients summed and applied on %s',
                 deploy_config.variables_device(),
                 deploy_config.inputs_device(),
                 deploy_config.optimizer_device())


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
  return cluster.multi_worker_strategy(
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
          'input_options': run_dir.as_json(
              dataclasses.asdict(config.input_options)),
          'input_shape': list(dataset.input_shape),
          'num_classes': dataset.num_classes,
          'train_examples': dataset.train_examples,
          'test_examples': dataset.test_examples}


def _settings(config, deploy_config, total_steps):
  """What may change on resume (logged when it does, and recorded for each
  stretch of steps it trained)."""
  return {'weights': config.weights,
          'batch_norm_momentum': config.batch_norm_momentum,
          'learning_rate': config.learning_rate,
          'lr_scaling': config.lr_scaling, 'lr_schedule': config.lr_schedule,
          'warmup_steps': config.warmup_steps, 'total_steps': total_steps,
          'strategy': config.strategy,
          'num_clones': deploy_config.num_clones,
          'num_workers': deploy_config.num_workers,
          'num_stages': deploy_config.num_stages,
          'step_options': dataclasses.asdict(config.step_options)}


def load_shapes(config, deploy_config):
  """The job's `data.Data`, for its shapes and counts (a dry run)."""
  return _load(config, deploy_config)


def _load(config, deploy_config):
  with tf.device(deploy_config.inputs_device()):
    return data.load(config.dataset,
                     global_batch_size=global_batch_size(config,
                                                         deploy_config),
                     data_dir=config.data_dir, seed=config.seed,
                     options=config.input_options,
                     known=_known_counts(config),
                     worker=(deploy_config.worker_index,
                             deploy_config.num_workers))


def _known_counts(config):
  """What a resumed job recorded of its data (rows, classes, image shape),
  so TFRecords are not read whole again; None for a new job."""
  job = (run_dir.recorded_job(config.model_dir)
         if checkpoints.numbered_checkpoints(config.model_dir) else None)
  if not job or job.get('dataset') != config.dataset or (
      job.get('input_options') != run_dir.as_json(
          dataclasses.asdict(config.input_options))):
    return None
  try:
    return (job['num_classes'], tuple(job['input_shape']),
            job['train_examples'], job['test_examples'])
  except KeyError:
    return None


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
  # The job's start (for the start-up phase in metrics), and the
  # process's age then (the process before the job).
  started = (time.perf_counter(), metrics.process_age())
  path = registry.get(config.strategy)
  if config.deterministic:  # Before `xla` is resolved: the rule reads it.
    tf.config.experimental.enable_op_determinism()
  # The options as the path runs them (the towers' `xla` resolved),
  # checked here once, and recorded so.
  config = dataclasses.replace(config, step_options=registry.check(
      config, deploy_config))
  chief = cluster_info is None or cluster_info.is_chief
  if config.data_dir and not data_override:
    run_dir.check_directory('data_dir', config.data_dir)
  with run_dir.claimed(config.model_dir, lock=chief):
    workers = _start_workers(config, deploy_config, path, cluster_info)
    _log_deployment(config, deploy_config, path)
    plan, dataset = _prepare(config, deploy_config, data_override)
    trainer = trainer_override or _build(plan, deploy_config, path,
                                         dataset, workers)
    settings = _settings(plan.config, deploy_config, plan.total_steps)
    _record_start(plan, deploy_config, dataset, settings,
                  chief=chief, workers=workers)
    _log_job(plan, deploy_config, trainer, dataset)
    result = _train(plan, deploy_config, trainer, dataset, cluster_info,
                    started, settings=settings if chief else None)
    logging.info('final weights sha256 %s (every worker of a job logs the '
                 'same)', metrics.fingerprint(trainer.model))
    if chief:
      return _record(plan.config, trainer, result, dataset.input_shape)
  return result


def _prepare(config, deploy_config, data_override):
  """(the `_Plan`, the `data.Data`): the data loaded (or given), the
  random generators seeded after it (preparing it draws from them)."""
  dataset = data_override or _load(config, deploy_config)
  keras.utils.set_random_seed(config.seed)
  return _plan(config, deploy_config, dataset), dataset


def _train(plan, deploy_config, trainer, dataset, cluster_info, started, *,
           settings):
  """Trains into this task's output directory (`_train_into`); the
  metrics. A lost peer ends it as one `ClusterError`."""
  config = plan.config
  out_dir = _output_dir(config, cluster_info, cluster_info is None or
                        cluster_info.is_chief)
  try:
    with cluster.lost_peers_as_errors(cluster_info):
      return _train_into(config, deploy_config, started, _run(
          plan, deploy_config, trainer, dataset, out_dir, cluster_info),
                         settings=settings)
  finally:
    cluster.remove_output_dir(out_dir, config.model_dir)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What the job trains, worked out before the trainer is built: the
  config (its `xla` resolved), the steps and the learning-rate schedule."""
  config: object
  total_steps: int
  schedule: object


def _plan(config, deploy_config, dataset):
  """The `_Plan` of this job on `dataset`."""
  total_steps = config.train_steps or (
      config.epochs * (dataset.train_examples //
                       global_batch_size(config, deploy_config)))
  _check_profile_steps(config.profile_steps, total_steps)
  return _Plan(config, total_steps, build.make_schedule(
      config, deploy_config.num_clones * deploy_config.num_workers,
      total_steps))


def _build(plan, deploy_config, path, dataset, workers):
  """The trainer of `path` (a `registry.StrategyBuilder`) for the plan."""
  config = plan.config
  return path.build(registry.Setup(
      config.step_options, deploy_config, build.model_and_optimizer(
          config, deploy_config, input_shape=dataset.input_shape,
          num_classes=dataset.num_classes, learning_rate=plan.schedule),
      build.make_loss(), workers))


def _log_job(plan, deploy_config, trainer, dataset):
  config = plan.config
  logging.info('%s: %d parameters; %s: %d train, %d test examples; %d '
               'steps of %d', config.model, trainer.model.count_params(),
               config.dataset, dataset.train_examples, dataset.test_examples,
               plan.total_steps, global_batch_size(config, deploy_config))


def _record_start(plan, deploy_config, dataset, settings, *, chief,
                  workers):
  """Once the trainer exists (a refused build, a bad cut or a strategy
  that cannot train the model, leaves no record): the chief records the
  job, and the workers agree they run the same one before the first
  collective step."""
  config = plan.config
  if chief:
    run_dir.check_job(
        config.model_dir, _job(config, deploy_config, dataset), settings,
        resuming=bool(checkpoints.numbered_checkpoints(config.model_dir)))
    if config.command:
      run_dir.write_flags(config.model_dir, config.command)
  if workers is not None:
    cluster.check_agreement(workers, dict(
        _job(config, deploy_config, dataset), total_steps=plan.total_steps))


def _check_profile_steps(profile_steps, total_steps):
  """Refuses a profile of steps the run will not reach."""
  if profile_steps and profile_steps[1] > total_steps:
    raise errors.ConfigError(
        f'profile_steps={profile_steps[0]},{profile_steps[1]}: the run ends '
        f'at step {total_steps}; profile steps up to {total_steps}, or train '
        'longer.')


def _output_dir(config, cluster_info, chief):
  """Where this worker writes (`cluster.output_dir`), logged as it is."""
  out_dir = cluster.output_dir(config.model_dir, cluster_info)
  logging.info('writing to %s%s', out_dir, '' if chief else (
      f' (worker files, removed at the end; the chief writes '
      f'{config.model_dir})'))
  return out_dir


def _record(config, trainer, result, input_shape):
  """Exports and writes metrics.json, beside the weights they describe; a
  session that trained nothing keeps the figures of the one that did."""
  if config.export:
    exporting = time.perf_counter()
    with phases.phase('exporting the model for one device'):
      result['export'] = export.export(trainer.model, config.model_dir,
                                       result['steps'], input_shape)
    result['phases_seconds']['export'] = time.perf_counter() - exporting
  kept = metrics.read(config.model_dir)
  if result['resumed_from_step'] == result['steps'] and kept:
    logging.info('nothing was trained: %s keeps the figures of the run that '
                 'trained step %d', metrics.METRICS_FILE, kept['steps'])
    return kept
  result['phases_seconds'] = metrics.with_the_rest(result['phases_seconds'])
  metrics.write(config.model_dir, result)
  return result


def _run(plan, deploy_config, trainer, dataset, out_dir, cluster_info):
  """The loop's `Run`: it saves into `out_dir` and restores from the
  model_dir (the chief's, in a multi-worker job, whose workers stop after
  the same step)."""
  config, device = plan.config, deploy_config.summaries_device()
  return loop.Run(
      trainer=trainer, dataset=dataset, loss_fn=build.make_loss(),
      schedule=plan.schedule, checkpointer=checkpoints.Checkpointer(
          out_dir, model=trainer.model, optimizer=trainer.optimizer,
          max_to_keep=config.keep_checkpoints, device=device,
          restore_directory=config.model_dir,
          in_background=config.async_checkpoint),
      summaries=summaries.Summaries(out_dir, device=device),
      global_batch_size=global_batch_size(config, deploy_config),
      total_steps=plan.total_steps, log_every_steps=config.log_every_steps,
      checkpoint_steps=config.checkpoint_steps,
      profile_steps=config.profile_steps, profile_dir=out_dir,
      steps_per_loop=config.resolved_steps_per_loop(),
      agreed_stop=cluster_info and preemption.AgreedStop(
          cluster_info, timeout_s=config.peer_timeout_s),
      meter=readings.Meter(
          trainer.step_function, global_batch_size(config, deploy_config),
          compute_dtype=trainer.model.dtype_policy.compute_dtype,
          kind=device_kinds.peak_rate(config.device_peak_flops),
          device_memory=device_kinds.memory_bytes(config.device_memory),
          devices=len(deploy_config.compute_devices())))


def _train_into(config, deploy_config, started, run, *, settings):
  """Restores the latest checkpoint, runs the loop; returns the metrics.
  `started`: (the job's perf_counter start, the process's age then).

  With `settings` (the chief's), job.json records that the steps trained
  now are trained with them, and the metrics carry every stretch.
  """
  restored = run.checkpointer.restore_latest()
  start = restored.step if restored else 0
  stretches = None
  if start >= run.total_steps:
    logging.info('%s already holds step %d of %d: nothing left to train; '
                 'evaluating', config.model_dir, start, run.total_steps)
  elif settings is not None:
    stretches = run_dir.record_stretch(config.model_dir, start, settings)
  try:
    outcome = loop.train(run, restored or checkpoints.Position(0, 0, 0))
  finally:
    run.summaries.close()
  result = metrics.collect(config, deploy_config, run, outcome, restored,
                           *started)
  if stretches is not None:
    result['stretches'] = stretches
  return result
