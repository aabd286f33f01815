"""The strategy registry: `--strategy` name -> how its step is built.

Every path implements the one trainer contract (`trainer.Trainer`), and each
is a `StrategyBuilder`: a builder of a few lines, the step options it
honours, the checks that belong to it alone (run before anything is built),
and what it needs from the cluster. The registry refuses, in one line, any
step option a strategy does not honour. Adding a path adds an entry here,
not a branch elsewhere; adding a step option adds a field to
`StepOptions`, its name to the builders that honour it, and its use.

  towers                  tfmulti.deploy: clones, central sum, one update
  mirrored                MirroredStrategy over the same devices
  central_storage         CentralStorageStrategy (variables on one device)
  single                  OneDeviceStrategy: the one-device reference
  multi_worker            the towers on every worker, sums all-reduced
  multi_worker_mirrored   MultiWorkerMirroredStrategy
"""

import collections
import dataclasses
from typing import Callable, FrozenSet, Optional

from absl import logging
import keras
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import layouts
from tfmulti import step_options
from tfmulti.deploy import placement
from tfmulti.deploy import towers
from tfmulti.deploy import towers_in_strategy
from tfmulti.distribute import distributed_model
from tfmulti.mesh import sharding

TOWERS = 'towers'
MULTI_WORKER = 'multi_worker'
MULTI_WORKER_MIRRORED = 'multi_worker_mirrored'


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a builder gets.

  Attributes:
    options: the `StepOptions`, checked by `check_options` (whose
      result it is): passed whole.
    deploy_config: the `placement.DeploymentConfig`.
    build_model: builds (model, optimizer) in the current device or
      strategy scope, the model in the context it is given, if any
      (`build.model_and_optimizer`).
    loss_fn: the loss.
    workers: the `MultiWorkerMirroredStrategy` of a multi-worker path
      (made before TensorFlow ran an op), else None.
  """
  options: step_options.StepOptions
  deploy_config: placement.DeploymentConfig
  build_model: Callable[..., tuple]
  loss_fn: keras.losses.Loss
  workers: Optional[tf.distribute.Strategy] = None


def _towers(setup):
  deploy_config = setup.deploy_config
  with tf.device(deploy_config.optimizer_variables_device()):
    model, optimizer = setup.build_model(deploy_config.variables_scope())
  deployed = towers.build(deploy_config, model, setup.loss_fn, optimizer,
                          setup.options)
  _log_stages(deployed)
  return deployed


def _log_stages(deployed):
  """Where each stage (each chunk, under interleaved 1F1B and ZB-V) runs,
  a line each: chunk c of clone i is on `chunk_devices(i, ...)[c]`."""
  config, stages = deployed.config, deployed.stages
  if stages is None:
    return
  chunk_devices = [config.chunk_devices(i, stages.chunk_devices)
                   for i in range(config.num_clones)]
  for s, stage in enumerate(stages.stages):
    logging.info('stage %d: from layer %r, on %s', s, stage.first_layer,
                 [devices_of_clone[s] for devices_of_clone in chunk_devices])


def _local_strategy(name):
  """The builder of a one-process tf.distribute path."""
  def build(setup):
    strategy = distributed_model.make_strategy(name, setup.deploy_config)
    with strategy.scope():
      model, optimizer = setup.build_model()
    distributed_model.check_supported(name, model,
                                      strategy.num_replicas_in_sync)
    return distributed_model.DistributedModel(
        strategy, model, setup.loss_fn, optimizer, setup.options)
  return build


def _worker_towers(setup):
  deploy_config = setup.deploy_config
  # Each worker's copy of the variables: on its CPU, or spread over its
  # clone devices.
  with setup.workers.scope():
    model, optimizer = setup.build_model(
        deploy_config.variables_scope() if deploy_config.spread_variables
        else None)
    deployed = towers.build(setup.deploy_config, model, setup.loss_fn,
                            optimizer, setup.options)
  held = collections.Counter(devices.device_of(v) for v in
                             sharding.stored_variables(deployed))
  logging.info('this worker\'s variables and slots: %s', ', '.join(
      f'{count} on {device}' for device, count in sorted(held.items())))
  return towers_in_strategy.WorkerTowers(setup.workers, deployed)


def _worker_mirrored(setup):
  with setup.workers.scope():
    model, optimizer = setup.build_model()
  return distributed_model.DistributedModel(
      setup.workers, model, setup.loss_fn, optimizer, setup.options,
      worker_index=setup.deploy_config.worker_index,
      num_workers=setup.deploy_config.num_workers)


def _check_workers(config, deploy_config):
  """Each worker keeps its variables on its CPU, or (the towers', checked
  before) spread over its clone devices."""
  where = deploy_config.variables_device()
  if where != deploy_config.inputs_device() and not (
      deploy_config.spread_variables):
    raise errors.ConfigError(
        f'variables_device={where!r}: a multi-worker job keeps the '
        "variables on each worker's CPU, or spreads them over its clones; "
        f'drop --variables_device, or pass --variables_device='
        f'{placement.SPREAD}.')


def _check_worker_mirrored(config, deploy_config):
  _check_workers(config, deploy_config)
  if deploy_config.clone_on_cpu and deploy_config.num_clones != 1:
    raise errors.ConfigError(
        f'num_clones={deploy_config.num_clones}: multi_worker_mirrored on '
        'CPUs runs one replica per worker (MultiWorkerMirroredStrategy does '
        'not use logical CPUs); use --num_clones=1, or '
        '--strategy=multi_worker.')


def _no_check(config, deploy_config):
  del config, deploy_config  # Nothing of this path's own to check.


# The step options each kind of path honours (`StepOptions.in_use` names).
_ALL = frozenset(f.name for f in dataclasses.fields(step_options.StepOptions))
_TOWERS = (_ALL - {'worker_parts'}) | {f'clone_shares={step_options.AUTO}'}
_WHOLE_COPIES = frozenset({'sync_batch_norm', 'accumulation_steps',
                           'summarize_gradients'})


@dataclasses.dataclass(frozen=True)
class StrategyBuilder:
  """One `--strategy`: how its trainer is built, and what it can run.

  Attributes:
    build: `build(Setup)` -> a `trainer.Trainer`.
    honours: the `StepOptions` it runs (names as `StepOptions.in_use`
      gives them); any other set away from its default is refused.
    variables: where it keeps the variables, for the log.
    check: `check(train_config, deploy_config)`: this path's own rules.
    multi_worker: it runs on every worker of TF_CONFIG's cluster.
    one_replica_per_worker: (multi-worker) the strategy gives each worker
      one replica and the path places its clones itself.
  """
  build: Callable[[Setup], object]
  honours: FrozenSet[str]
  variables: str
  check: Callable[[object, placement.DeploymentConfig], None] = _no_check
  multi_worker: bool = False
  one_replica_per_worker: bool = False


BUILDERS = {
    TOWERS: StrategyBuilder(
        _towers, _TOWERS,
        variables='one copy on the variables device; the clones read it, '
        'their gradients are summed there, one update'),
    distributed_model.MIRRORED: StrategyBuilder(
        _local_strategy(distributed_model.MIRRORED),
        _WHOLE_COPIES | {'clone_shares'},
        variables='a copy of every variable on each replica; gradients '
        'all-reduced'),
    distributed_model.CENTRAL_STORAGE: StrategyBuilder(
        _local_strategy(distributed_model.CENTRAL_STORAGE), _WHOLE_COPIES,
        variables='variables on the parameter device; gradients reduced '
        'there'),
    distributed_model.SINGLE: StrategyBuilder(
        _local_strategy(distributed_model.SINGLE), _WHOLE_COPIES,
        variables='variables and the whole batch on one device'),
    MULTI_WORKER: StrategyBuilder(
        _worker_towers, frozenset({'batch_norm_policy', 'accumulation_steps',
                                   'summarize_gradients',
                                   'reproducible_rows', 'worker_parts'}),
        check=_check_workers, multi_worker=True,
        one_replica_per_worker=True,
        variables="each worker's towers; the workers' summed gradients "
        'all-reduced once a step'),
    MULTI_WORKER_MIRRORED: StrategyBuilder(
        _worker_mirrored, frozenset({'summarize_gradients'}),
        check=_check_worker_mirrored, multi_worker=True,
        variables='a copy of every variable on each replica of every '
        'worker; gradients all-reduced'),
}
NAMES = tuple(BUILDERS)


def get(name):
  """The `StrategyBuilder` of strategy `name`; raises `ConfigError` for
  others."""
  errors.check_choice('strategy', name, NAMES)
  return BUILDERS[name]


def honouring(option):
  """The strategies that honour step option `option`, for messages."""
  return [name for name, builder in BUILDERS.items()
          if option in builder.honours]


def check(config, deploy_config):
  """Raises `UserError` if `config.strategy` cannot run this job.

  The step options the strategy does not run (`check_options`), the
  layout's rules, the workers, then the path's own; run before anything
  is built.

  Returns:
    The step options as the strategy runs them (`check_options`'), for
    `Setup.options`.
  """
  builder = get(config.strategy)
  options = check_options(config.strategy, config.step_options,
                          deploy_config)
  check_layout(config, deploy_config)
  if deploy_config.num_workers > 1 and not builder.multi_worker:
    raise errors.ConfigError(
        f'{deploy_config.num_workers} workers need a multi-worker strategy: '
        f'use --strategy={MULTI_WORKER} (or {MULTI_WORKER_MIRRORED}) with '
        'TF_CONFIG.')
  builder.check(config, deploy_config)
  return options


def check_options(name, options, deploy_config):
  """Raises `UserError` for step options strategy `name` does not run on
  `deploy_config`'s devices: the one gate of both front doors (the
  command line, and `TowersModel`, whose towers are `towers` in one
  process and `multi_worker` across workers).

  Options it does not honour (each in one line naming the strategies that
  do), stages or spread variables on a path that runs whole copies or
  places its own, then the towers' rules that need both records: each
  checked here once, and nowhere after.

  Returns:
    `options` as the strategy runs them: the towers' with `xla` resolved
    (`deploy.towers.checked_options`), what the builder takes.
  """
  builder = get(name)
  for option in options.in_use():
    if option not in builder.honours:
      shown = option if '=' in option else (
          f'{option}={getattr(options, option)!r}')
      raise errors.UnsupportedError(
          f'{shown} is not available with strategy={name!r}; '
          f'use --strategy={" or ".join(honouring(option))}, or drop it.')
  if name != TOWERS and deploy_config.num_stages > 1:
    raise errors.UnsupportedError(
        f'strategy={name!r} runs whole model copies; stages '
        f'(num_stages={deploy_config.num_stages}) run on '
        f'--strategy={TOWERS}.')
  if name not in (TOWERS, MULTI_WORKER) and deploy_config.spread_variables:
    raise errors.UnsupportedError(
        f'variables_device={placement.SPREAD!r} spreads the towers\' '
        f'variables over their clones; strategy={name!r} places '
        f'its own: use --strategy={TOWERS} (or {MULTI_WORKER}), or drop '
        '--variables_device.')
  if name in (TOWERS, MULTI_WORKER):
    return towers.checked_options(deploy_config, options)
  return options


def check_layout(config, deploy_config):
  """Raises `ConfigError` for a batch the step's layout cannot cut (the
  layout's own rules, checked before anything is built or written)."""
  options = config.step_options
  for worker_rows in options.worker_parts or [
      config.batch_size * deploy_config.num_clones *
      options.accumulation_steps]:
    layouts.for_step(deploy_config, options, worker_rows)
