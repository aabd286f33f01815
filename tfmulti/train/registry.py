"""The strategy registry: `--strategy` name -> how its step is built.

Every path implements the one trainer contract (`trainer.Trainer`), and each
is a `Path`: a builder of a dozen lines, the checks that belong to that path
alone (run before anything is built), and what it needs from the cluster.
Adding a path adds an entry here, not a branch elsewhere.

  towers                  tfmulti.deploy: clones, central sum, one update
  mirrored                MirroredStrategy over the same devices
  central_storage         CentralStorageStrategy (variables on one device)
  single                  OneDeviceStrategy: the one-device reference
  multi_worker            the towers on every worker, sums all-reduced
  multi_worker_mirrored   MultiWorkerMirroredStrategy
"""

import dataclasses
from typing import Callable, Optional

import keras
import tensorflow as tf
from absl import logging

from tfmulti.deploy import balance
from tfmulti import deploy
from tfmulti import distribute
from tfmulti import errors
from tfmulti import pipeline
from tfmulti.deploy import towers_in_strategy
from tfmulti import trainer

TOWERS = 'towers'
MULTI_WORKER = 'multi_worker'
MULTI_WORKER_MIRRORED = 'multi_worker_mirrored'


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a builder gets.

  Attributes:
    config: the `config.TrainConfig`.
    deploy_config: the `deploy.DeploymentConfig`.
    build_model: builds (model, optimizer) in the current device or
      strategy scope (`build.model_and_optimizer`).
    loss_fn: the loss.
    workers: the `MultiWorkerMirroredStrategy` of a multi-worker path
      (made before TensorFlow ran an op), else None.
  """
  config: object
  deploy_config: deploy.DeploymentConfig
  build_model: Callable[[], tuple]
  loss_fn: keras.losses.Loss
  workers: Optional[tf.distribute.Strategy] = None


def _towers(setup):
  config, deploy_config = setup.config, setup.deploy_config
  with tf.device(deploy_config.variables_device()):
    model, optimizer = setup.build_model()
  lockstep = None
  if config.synchronized_batch_norm:  # The clones run as replicas at once.
    lockstep = distribute.make_strategy(distribute.MIRRORED, deploy_config)
  towers = deploy.deploy(deploy_config, model, setup.loss_fn, optimizer,
                         batch_norm_policy=config.batch_norm_policy,
                         jit_compile=config.xla,
                         return_gradients=config.summarize_gradients,
                         lockstep=lockstep, pipeline=config.pipeline(),
                         clone_shares=_fixed_shares(config),
                         accumulation_steps=config.accumulation_steps)
  if towers.pipeline is not None:
    for s, stage in enumerate(towers.pipeline.stages):
      logging.info('stage %d: from layer %r, on %s', s, stage.first_layer,
                   [deploy_config.stage_device(c, s)
                    for c in range(deploy_config.num_clones)])
  if config.auto_shares:
    return balance.Balanced(towers, config.rebalance_every_steps)
  return towers


def _fixed_shares(config):
  return None if config.auto_shares else config.clone_shares


def _pipelined(config, deploy_config):
  return deploy_config.num_stages > 1 or config.num_microbatches > 1


def _check_towers(config, deploy_config):
  if _pipelined(config, deploy_config):
    pipeline.check_pipeline_options(
        jit_compile=config.xla, lockstep=config.synchronized_batch_norm)
  if config.synchronized_batch_norm:
    towers_in_strategy.check_lockstep_options(config.xla)


def _local_strategy(name):
  """The builder of a one-process tf.distribute path."""
  def build(setup):
    strategy = distribute.make_strategy(name, setup.deploy_config)
    with strategy.scope():
      model, optimizer = setup.build_model()
    distribute.check_supported(name, model, strategy.num_replicas_in_sync)
    return distribute.DistributedModel(
        strategy, model, setup.loss_fn, optimizer,
        return_gradients=setup.config.summarize_gradients,
        clone_shares=setup.config.clone_shares,
        accumulation_steps=setup.config.accumulation_steps)
  return build


def _worker_towers(setup):
  with setup.workers.scope():  # Variables on each worker's CPU.
    model, optimizer = setup.build_model()
    towers = deploy.deploy(
        setup.deploy_config, model, setup.loss_fn, optimizer,
        batch_norm_policy=setup.config.batch_norm_policy,
        return_gradients=setup.config.summarize_gradients,
        accumulation_steps=setup.config.accumulation_steps)
  return towers_in_strategy.WorkerTowers(setup.workers, towers)


def _worker_mirrored(setup):
  with setup.workers.scope():
    model, optimizer = setup.build_model()
  return distribute.DistributedModel(
      setup.workers, model, setup.loss_fn, optimizer,
      return_gradients=setup.config.summarize_gradients,
      worker_index=setup.deploy_config.worker_index,
      num_workers=setup.deploy_config.num_workers)


def _check_workers(config, deploy_config):
  if config.synchronized_batch_norm:
    raise errors.ConfigError(
        f'synchronized_batch_norm=True is not available with strategy='
        f'{config.strategy!r}; use it on one machine.')
  if deploy_config.variables_device() != deploy_config.inputs_device():
    raise errors.ConfigError(
        f'variables_device={deploy_config.variables_device()!r}: a '
        "multi-worker job keeps the variables on each worker's CPU; drop "
        '--variables_device.')


def _check_worker_mirrored(config, deploy_config):
  _check_workers(config, deploy_config)
  if config.accumulation_steps > 1:
    raise errors.UnsupportedError(
        f'accumulation_steps={config.accumulation_steps} is not available '
        f'with strategy={MULTI_WORKER_MIRRORED!r}; use --strategy='
        f'{MULTI_WORKER} (the towers on every worker).')
  if deploy_config.clone_on_cpu and deploy_config.num_clones != 1:
    raise errors.ConfigError(
        f'num_clones={deploy_config.num_clones}: multi_worker_mirrored on '
        'CPUs runs one replica per worker (MultiWorkerMirroredStrategy does '
        'not use logical CPUs); use --num_clones=1, or '
        '--strategy=multi_worker.')


@dataclasses.dataclass(frozen=True)
class Path:
  """One `--strategy`.

  Attributes:
    build: `build(Setup)` -> a `trainer.Trainer`.
    check: `check(train_config, deploy_config)`: this path's own rules.
    variables: where it keeps the variables, for the log.
    xla: whether it compiles clones with XLA (`--xla`).
    multi_worker: it runs on every worker of TF_CONFIG's cluster.
    one_replica_per_worker: (multi-worker) the strategy gives each worker
      one replica and the path places its clones itself.
  """
  build: Callable[[Setup], trainer.Trainer]
  check: Callable[[object, deploy.DeploymentConfig], None]
  variables: str
  xla: bool = False
  multi_worker: bool = False
  one_replica_per_worker: bool = False


def _no_check(config, deploy_config):
  del config, deploy_config  # Nothing of this path's own to check.


PATHS = {
    TOWERS: Path(_towers, _check_towers, xla=True,
                 variables='one copy on the variables device; the clones '
                 'read it, their gradients are summed there, one update'),
    distribute.MIRRORED: Path(
        _local_strategy(distribute.MIRRORED), _no_check,
        variables='a copy of every variable on each replica; gradients '
        'all-reduced'),
    distribute.CENTRAL_STORAGE: Path(
        _local_strategy(distribute.CENTRAL_STORAGE), _no_check,
        variables='variables on the parameter device; gradients reduced '
        'there'),
    distribute.SINGLE: Path(
        _local_strategy(distribute.SINGLE), _no_check,
        variables='variables and the whole batch on one device'),
    MULTI_WORKER: Path(
        _worker_towers, _check_workers, multi_worker=True,
        one_replica_per_worker=True,
        variables="each worker's towers; the workers' summed gradients "
        'all-reduced once a step'),
    MULTI_WORKER_MIRRORED: Path(
        _worker_mirrored, _check_worker_mirrored, multi_worker=True,
        variables='a copy of every variable on each replica of every '
        'worker; gradients all-reduced'),
}
NAMES = tuple(PATHS)


_SHARES_PATHS = (TOWERS, distribute.MIRRORED)


def _check_shares(config, deploy_config):
  """Clone shares run on the towers and mirrored; 'auto' on the towers."""
  if config.clone_shares is None:
    return
  if config.strategy not in _SHARES_PATHS or (
      config.auto_shares and config.strategy != TOWERS):
    raise errors.UnsupportedError(
        f'clone_shares={config.clone_shares!r} is not available with '
        f'strategy={config.strategy!r}; use --strategy=towers' + (
            '.' if config.auto_shares else ' or mirrored.'))
  if config.synchronized_batch_norm:
    raise errors.UnsupportedError(
        'clone_shares with synchronized BatchNorm is not supported: its '
        'replicas all-reduce equal batches; drop --sync_batch_norm.')
  if not config.auto_shares:
    trainer.check_shares(config.clone_shares, deploy_config.num_clones)


def get(name):
  """The `Path` of strategy `name`; raises `ConfigError` for others."""
  errors.check_choice('strategy', name, NAMES)
  return PATHS[name]


def check(config, deploy_config):
  """Raises `UserError` if `config.strategy` cannot run this job.

  The rules every path shares, then the path's own; run before anything is
  built.
  """
  path = get(config.strategy)
  if config.strategy != TOWERS and _pipelined(config, deploy_config):
    raise errors.UnsupportedError(
        f'strategy={config.strategy!r} runs whole model copies; stages and '
        f'micro-batches (num_stages={deploy_config.num_stages}, '
        f'num_microbatches={config.num_microbatches}) run on '
        f'--strategy={TOWERS}.')
  _check_shares(config, deploy_config)
  if config.accumulation_steps > 1 and config.synchronized_batch_norm:
    raise errors.UnsupportedError(
        'accumulation_steps with synchronized BatchNorm is not supported: '
        'drop --sync_batch_norm or --accumulation_steps.')
  if config.xla and not path.xla:
    raise errors.ConfigError(
        f'xla=True works with the towers only, not strategy='
        f'{config.strategy!r}.')
  if deploy_config.num_workers > 1 and not path.multi_worker:
    raise errors.ConfigError(
        f'{deploy_config.num_workers} workers need a multi-worker strategy: '
        f'use --strategy={MULTI_WORKER} (or {MULTI_WORKER_MIRRORED}) with '
        'TF_CONFIG.')
  path.check(config, deploy_config)
