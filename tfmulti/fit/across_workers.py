"""How `TowersModel`'s steps run: in one process, or across workers.

`TowersModel` chooses one of two, once, when it is made; `compile` hands
it the towers (`bind`), and every step asks it:

* `Local`: the towers' step and inference as `deploy()` built them.
* `AcrossWorkers` (`TowersModel(..., workers=)`): each worker of a
  `MultiWorkerMirroredStrategy` job runs its towers' step on its rows of
  the global batch in its one replica (`step_on_workers`); Keras's
  `apply_gradients` all-reduces the workers' summed gradients once before
  the update. The workers first agree that they read the same global batch
  (`batch_fingerprint`, `batches_agreed`); the outputs are gathered, so
  Keras's metrics read the whole batch on every worker; evaluation splits
  each batch over the workers (`evaluate_on_workers`).

`check_workers` refuses, before anything is built, a strategy that does
not match the config's workers or a model made outside its scope.
"""

import contextlib

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import layouts
from tfmulti import rows
from tfmulti.engine import registry

# Callbacks that write files: the chief's alone across workers (the
# backup's writes are its own: every worker reads it).
CHIEF_WRITES = (keras.callbacks.ModelCheckpoint, keras.callbacks.TensorBoard,
                keras.callbacks.CSVLogger)


def steps_for(workers, config):
  """How `fit`'s steps run, chosen once: `AcrossWorkers` on the workers
  `workers.start()` gave (with a strategy), else `Local`."""
  if workers is None or workers.strategy is None:
    return Local(config)
  return AcrossWorkers(workers, config)


class Local:
  """`fit` in one process: the towers' own step and inference.

  `gate` names the command line's strategy whose step options it runs
  (`registry.check_options`)."""
  gate = registry.TOWERS
  strategy = None

  def __init__(self, config):
    self.config = config
    self.towers = None  # The `DeployedModel` `compile` builds.

  def check(self, model):
    """Refuses a `config` or `model` these steps cannot run
    (`check_workers`)."""
    check_workers(self.strategy, self.config, model)

  def bind(self, towers):
    """The towers `compile` built, which the steps run."""
    self.towers = towers

  def scope(self):
    """Where the optimizer and the towers are built: here."""
    return contextlib.nullcontext()

  def agreed_stop(self):
    """Alone, a signal stops this process at its step: no agreement."""
    return None

  def for_this_worker(self, arguments):
    """`fit`'s arguments (a dict) as this process runs them: as given."""
    return arguments

  def mine(self, batch):
    """This process's rows of a global batch: all of them."""
    return batch

  def train(self, images, targets, layout, whole):
    """One towers step: (the total loss, the outputs in row order)."""
    del whole  # Nothing to agree on alone.
    result = self.towers.step_graph(images, targets, layout,
                                    with_outputs=True)
    return result.total, result.outputs

  def evaluate(self, images):
    """(outputs, the model's losses) of an evaluation batch."""
    return self.towers.evaluate_outputs(images)

  def check_input(self, arguments):
    """Nothing to refuse alone: every input `fit` takes trains."""
    del arguments

  def guard(self, step):
    """No peers to lose alone."""
    del step
    return contextlib.nullcontext()


class AcrossWorkers(Local):
  """`fit` on every worker of `workers` (what `workers.start()` gave):
  each takes its rows of the global batch; see the module."""
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

  def mine(self, batch):
    """This worker's rows of a global batch (`rows.worker_part`)."""
    return rows.worker_part(batch, worker=self.config.worker_index,
                            num_workers=self.config.num_workers)

  def train(self, images, targets, layout, whole):
    return step_on_workers(self.strategy, self.towers, images, targets,
                           layout, whole)

  def evaluate(self, images):
    return evaluate_on_workers(self.strategy, self.towers, images,
                               worker=self.config.worker_index,
                               num_workers=self.config.num_workers)

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


def step_on_workers(strategy, towers, images, targets, layout, whole):
  """One towers step of every worker's rows, in the strategy's replica.

  The workers first agree that they read the same global batch `whole`
  (its fingerprint gathered from every worker; `batches_agreed` turns a
  disagreement into one line): each takes its rows of it, so workers fed
  other batches (arrays shuffled by unseeded generators) would train on
  rows no one process would. The check runs before the step changes
  anything, and every worker reaches the same verdict.

  Returns:
    (the job's total loss, the job's outputs): the loss all-reduced, the
    outputs of every worker's rows gathered in worker order, as one process
    would have them, so Keras's metrics read the whole global batch on
    every worker.
  """
  def replica_fn(images, targets, fingerprint):
    context = tf.distribute.get_replica_context()
    everyone = context.all_gather(fingerprint[None], axis=0)
    agreed = tf.debugging.assert_equal(everyone, everyone[0],
                                       message=BATCHES_DIFFER)
    with tf.control_dependencies([agreed]):  # Every op of the step.
      result = towers.step_graph(images, targets, layout, with_outputs=True)
    return result.total, _gathered(result.outputs)
  with strategy.scope():  # Keras's fit runs outside it.
    total, outputs = strategy.run(
        replica_fn, args=(images, targets, batch_fingerprint(whole)))
    return (strategy.reduce(tf.distribute.ReduceOp.SUM, total, None),
            _this_workers(strategy, outputs))


def evaluate_on_workers(strategy, towers, images, *, worker, num_workers):
  """Inference of an evaluation batch split over the workers
  (`rows.evaluation_part`): each runs its rows on its clones, then the
  outputs are gathered in worker order and the model's losses summed, each
  weighted by its rows, so every worker holds what one process computes on
  the whole batch (a batch of fewer rows than workers runs whole on each).

  Returns:
    (the batch's outputs, the model's losses on it), as
    `towers.evaluate_outputs` gives them for the whole batch.
  """
  mine, share = rows.evaluation_part(images, worker=worker,
                                     num_workers=num_workers)
  whole = share == 1.0

  def replica_fn(mine):
    outputs, regularization = towers.evaluate_outputs(mine)
    if whole:
      return outputs, regularization
    # The penalties count once in every worker's, and the shares sum to 1.
    return _gathered(outputs), tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, regularization * share)
  with strategy.scope():
    return _this_workers(strategy, strategy.run(replica_fn, args=(mine,)))


def _gathered(outputs):
  """In a replica: every worker's `outputs` (a nest), in worker order."""
  context = tf.distribute.get_replica_context()
  return tf.nest.map_structure(lambda t: context.all_gather(t, axis=0),
                               outputs)


def _this_workers(strategy, values):
  """This worker's one replica's `values` (a nest of per-replica ones)."""
  return tf.nest.map_structure(
      lambda value: strategy.experimental_local_results(value)[0], values)


BATCHES_DIFFER = 'the workers read different global batches'


def batch_fingerprint(batch):
  """A 64-bit fingerprint (int64) of `batch`, a nest of row-major tensors:
  the FarmHash of every row's bytes in order, so equal batches give equal
  fingerprints on every machine (no floating-point sum to round)."""
  columns = [tf.fingerprint(t) for t in tf.nest.flatten(batch)
             if t is not None]
  whole = tf.fingerprint(tf.reshape(tf.concat(columns, axis=1), [1, -1]))
  return tf.bitcast(tf.reshape(whole, [8]), tf.int64)


@contextlib.contextmanager
def batches_agreed(step):
  """Around `fit` across workers: the step's failed agreement check
  (`step_on_workers`, on this worker or aborting a peer's collective)
  becomes one `errors.ClusterError` line; `step()` is the step it
  failed at."""
  try:
    yield
  except tf.errors.OpError as e:
    if BATCHES_DIFFER not in str(e):
      raise
    raise errors.ClusterError(
        f'{BATCHES_DIFFER} at step {step()}, each taking its rows of its '
        'own: seed Keras alike on every worker before fit '
        '(keras.utils.set_random_seed(0)), or feed the same tf.data '
        'pipeline with a fixed shuffle seed.') from None
