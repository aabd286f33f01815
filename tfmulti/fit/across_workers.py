"""How `TowersModel`'s `fit` runs: in one process, or across workers.

`TowersModel` chooses one of two, once, when it is made (`door_for`); it
builds the trainer from the strategy registry, as the command line does
(`engine.registry`: `towers` alone, `multi_worker` across workers), and
drives it through the trainer contract alone. What differs here is
Keras's side of a run:

* `Local`: one process; nothing to agree on.
* `AcrossWorkers` (`TowersModel(..., workers=)`): every worker of a
  `MultiWorkerMirroredStrategy` job runs the same `fit`; the trainer
  (`deploy.towers_in_strategy.WorkerTowers`, the one multi-worker adapter)
  takes each worker's rows of the global batch, checks that the workers
  read the same one, and gathers the outputs, so Keras's metrics read the
  whole batch on every worker. Here: only the chief shows progress and
  keeps the callbacks that write files, inputs the workers cannot share
  are refused, and a lost peer or a disagreement becomes one line
  (`guard`).

`check_workers` refuses, before anything is built, a strategy that does
not match the config's workers or a model made outside its scope.
"""

import contextlib

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import layouts
from tfmulti.deploy import towers_in_strategy
from tfmulti.engine import registry

# Callbacks that write files: the chief's alone across workers (the
# backup's writes are its own: every worker reads it).
CHIEF_WRITES = (keras.callbacks.ModelCheckpoint, keras.callbacks.TensorBoard,
                keras.callbacks.CSVLogger)


def door_for(workers, config):
  """How `fit` runs, chosen once: `AcrossWorkers` on the workers
  `workers.start()` gave (with a strategy), else `Local`."""
  if workers is None or workers.strategy is None:
    return Local(config)
  return AcrossWorkers(workers, config)


class Local:
  """`fit` in one process.

  `gate` names the registry's strategy whose trainer it builds and whose
  step options it runs (`registry.check_options`)."""
  gate = registry.TOWERS
  strategy = None

  def __init__(self, config):
    self.config = config

  def check(self, model):
    """Refuses a `config` or `model` this run cannot train
    (`check_workers`)."""
    check_workers(self.strategy, self.config, model)

  def scope(self):
    """Where the optimizer is built: here."""
    return contextlib.nullcontext()

  def build(self, model, loss_fn, optimizer, options):
    """The trainer of `model`, from the registry (`gate`'s builder), for
    `options` that `registry.check_options` gave."""
    return registry.get(self.gate).build(registry.Setup(
        options, self.config, lambda scope=None: (model, optimizer),
        loss_fn, self.strategy))

  def agreed_stop(self):
    """Alone, a signal stops this process at its step: no agreement."""
    return None

  def for_this_worker(self, arguments):
    """`fit`'s arguments (a dict) as this process runs them: as given."""
    return arguments

  def check_input(self, arguments):
    """Nothing to refuse alone: every input `fit` takes trains."""
    del arguments

  def guard(self, step):
    """No peers to lose alone."""
    del step
    return contextlib.nullcontext()


class AcrossWorkers(Local):
  """`fit` on every worker of `workers` (what `workers.start()` gave);
  see the module."""
  gate = registry.MULTI_WORKER

  def __init__(self, workers, config):
    super().__init__(config)
    self.workers = workers
    self.strategy = workers.strategy

  def scope(self):
    """The workers' strategy's scope: the optimizer's variables are the
    strategy's, as the model's."""
    return self.workers.scope()

  def agreed_stop(self):
    """The workers' `preemption.AgreedStop`: every worker stops at one
    step."""
    return self.workers.agreed_stop()

  def for_this_worker(self, arguments):
    """Only the chief shows progress and keeps the callbacks that write
    files; the others drop them, so nothing is written twice."""
    if self.config.worker_index:
      arguments['verbose'] = 0
      arguments['callbacks'] = [c for c in arguments['callbacks']
                                if not isinstance(c, CHIEF_WRITES)]
    return arguments

  def check_input(self, arguments):
    """Refuses, before training, an input the workers cannot share: one
    of unknown length without `steps_per_epoch` (a worker whose epoch ended
    first would leave the others in a collective), or arrays whose batches
    (the last one too) do not split evenly over the workers."""
    x, steps_per_epoch = arguments.get('x'), arguments.get('steps_per_epoch')
    if isinstance(x, tf.data.Dataset):
      known = int(x.cardinality()) >= 0
    else:
      known = x is None or hasattr(x, 'shape') or isinstance(
          x, (list, tuple, dict))
    if not known and steps_per_epoch is None:
      raise errors.ConfigError(
          f'fit across workers on {type(x).__name__} input of unknown '
          'length: every worker must take as many steps; pass '
          'steps_per_epoch.')
    if x is None or not known or isinstance(x, tf.data.Dataset):
      return
    trained, *full_and_last = fit_batches(arguments)
    for batch in full_and_last:
      layouts.check_worker_split(
          batch, self.config.num_workers, f' (fit with batch_size='
          f'{arguments.get("batch_size") or 32} on {trained} rows)')

  @contextlib.contextmanager
  def guard(self, step):
    """Around `fit`: a collective that failed for want of a peer, or
    workers that read different batches, becomes one
    `errors.ClusterError` line; `step()` is the step it failed at."""
    with self.workers.lost_peers_as_errors(), batches_agreed(step):
      yield


def fit_batches(arguments):
  """(rows trained, the full batch's, the last batch's) of `fit` on its
  array input (`layouts.fit_batches`, with Keras's defaults)."""
  return layouts.fit_batches(
      tf.nest.flatten(arguments.get('x'))[0].shape[0],
      arguments.get('batch_size') or 32,
      arguments.get('validation_split', 0.0))


def check_workers(strategy, config, model):
  """Refuses a strategy that does not match `config`'s workers, or a model
  whose variables were made outside its scope (they would not meet the
  other workers' in the all-reduce)."""
  num_workers = 1 if strategy is None else strategy.num_replicas_in_sync
  if num_workers != config.num_workers:
    raise errors.ConfigError(
        f'the DeploymentConfig has num_replicas={config.num_workers} '
        f'workers and the strategy {num_workers}; make the config with '
        'DeploymentConfig(..., replica_id=workers.index, '
        'num_replicas=workers.num_workers) from the same workers.start().')
  if strategy is None:
    return
  outside = [v.path for v in model.variables
             if not strategy.extended.variable_created_in_scope(v.value)]
  if outside:
    raise errors.ConfigError(
        f'{len(outside)} of model {model.name!r}\'s variables ({outside[0]}, '
        '...) were made outside the workers\' strategy; build the model in '
        '`with workers.scope(), config.variables_scope():`.')


@contextlib.contextmanager
def batches_agreed(step):
  """Around `fit` across workers: the step's failed agreement check
  (`towers_in_strategy.BATCHES_DIFFER`, on this worker or aborting a
  peer's collective) becomes one `errors.ClusterError` line; `step()` is
  the step it failed at."""
  try:
    yield
  except tf.errors.OpError as e:
    if towers_in_strategy.BATCHES_DIFFER not in str(e):
      raise
    raise errors.ClusterError(
        f'{towers_in_strategy.BATCHES_DIFFER} at step {step()}, each taking '
        'its rows of its own: seed Keras alike on every worker before fit '
        '(keras.utils.set_random_seed(0)), or feed the same tf.data '
        'pipeline with a fixed shuffle seed.') from None
