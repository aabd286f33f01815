"""The towers inside a tf.distribute strategy: the two adapters, side by side.

The towers (`tfmulti.deploy`) place their clones and sum their gradients
themselves. Twice they need a `tf.distribute.Strategy` for one thing it
alone provides, and keep everything else their own:

* Clones in lockstep (`run_clones_in_lockstep`): Keras's synchronized
  BatchNorm all-reduces its batch statistics in a tf.distribute replica
  context, so every clone's forward pass must run at once. The clones run as
  the replicas of a `MirroredStrategy` over the same clone devices; the
  variables, the central gradient sum and the one update stay the towers'.
* Towers on every worker (`WorkerTowers`): each worker of a
  `MultiWorkerMirroredStrategy` job runs its towers' step in its one
  replica; Keras's `apply_gradients` all-reduces the workers' summed
  gradients once before the update, which every worker applies to its copy.

Keras's `fit` across workers (`TowersModel(..., workers=)`) runs the
second in its own step: `check_workers` first, then `step_on_workers` a
step (after the workers agree they read one batch: `batch_fingerprint`,
`batches_agreed`) and `evaluate_on_workers` an evaluation batch.

Neither imports `deploy.towers`: the towers hand in what they need.
"""

import contextlib

import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import rows
from tfmulti import trainer


def lockstep_strategy(config):
  """The `MirroredStrategy` whose replicas run `config`'s clones at once:
  its all-reduces (synchronized BatchNorm's statistics, three a layer and
  two in its gradient) are collective ops, which keep the trace linear in
  the model's depth (`devices.collective_strategy`)."""
  return devices.collective_strategy(config)


def run_clones_in_lockstep(lockstep, body, variables, shards, terms):
  """Runs clone i's `body` as replica i of `lockstep`, all at once.

  Args:
    lockstep: a `tf.distribute.MirroredStrategy` over the clone devices.
    body: a `pieces.Body`.
    variables: (trainable values, non-trainable values), read once.
    shards: per clone, (images, labels, penalty_weight, offset): its rows
      (nests) and its piece's part of the penalties and first row.
    terms: the step's `pieces.StepTerms`, passed to every clone.

  Returns:
    Per clone, `body`'s results.
  """
  trainable, non_trainable = variables
  per_clone = lockstep.experimental_distribute_values_from_function(
      lambda ctx: tf.nest.map_structure(tf.convert_to_tensor,
                                        shards[ctx.replica_id_in_sync_group]))

  def replica_fn(shard):
    images, labels, weight, offset = shard
    return body(trainable, non_trainable, images, labels, weight, offset,
                terms)
  per_replica = lockstep.run(replica_fn, args=(per_clone,))
  num_clones = len(shards)
  columns = []
  for value in tf.nest.flatten(per_replica):
    local = lockstep.experimental_local_results(value)
    # An output that every replica computed alike comes back once.
    columns.append(local if len(local) == num_clones else local * num_clones)
  return [tf.nest.pack_sequence_as(per_replica, list(values))
          for values in zip(*columns)]


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


class WorkerTowers(trainer.Trainer):
  """Each worker's towers, with the workers' gradients all-reduced.

  Runs a `deploy.DeployedModel` step in the one replica that a
  `cluster.make_strategy(one_replica_per_worker=True)` strategy gives each
  worker: the worker's clones run on its devices and their gradients are
  summed on its optimizer device, then Keras's `apply_gradients` all-reduces
  the workers' sums (TF's collective ops) once before the update, which every
  worker applies to its copy of the variables. N workers x K clones then
  train like one device on the whole global batch.
  """

  def __init__(self, strategy, towers):
    """`towers`: a `deploy.DeployedModel` built in `strategy.scope()`."""
    self.strategy = strategy
    self.towers = towers
    self.model = towers.model
    self.optimizer = towers.optimizer
    self.step_function = tf.function(self._train_step_graph)

  @property
  def clone_shares(self):
    """Each of the worker's clones' share of its rows; None for equal."""
    return self.towers.clone_shares

  def _train_step_graph(self, images, labels, layout):
    outputs = self.strategy.run(
        lambda x, y: self.towers.step_graph(x, y, layout),
        args=(images, labels))
    local = self.strategy.experimental_local_results
    total = tf.distribute.ReduceOp.SUM
    return trainer.StepOutputs(
        self.strategy.reduce(total, outputs.total, None),
        self.strategy.reduce(total, outputs.regularization, None),
        [local(loss)[0] for loss in outputs.clones],
        {path: local(g)[0] for path, g in outputs.gradients.items()})

  def distribute_dataset(self, dataset):
    """This worker's rows of each global batch.

    Worker i of N takes rows [i * B/N, (i + 1) * B/N) of every global batch
    of B rows: every worker reads the same pipeline (same seed), so the
    job's step sees exactly the global batch a single process would.
    """
    config = self.towers.config
    return rows.worker_shards(dataset, worker=config.worker_index,
                              num_workers=config.num_workers,
                              shards_per_worker=1)

  def train_step_outputs(self, images, labels):
    """One step on this worker's rows; returns the job's `StepOutputs`."""
    images, labels = tf.convert_to_tensor(images), tf.convert_to_tensor(labels)
    return self.step_function(images, labels,
                              self.towers.layout_for(images, labels))

  def predict(self, images):
    """Inference outputs for `images`, over this worker's clones."""
    return self.towers.predict(images)
