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
second in its own step (`fit.across_workers`).

Neither imports `deploy.towers`: the towers hand in what they need.
"""


import tensorflow as tf

from tfmulti import devices
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


class WorkerTowers(trainer.Trainer):
  """Each worker's towers, with the workers' gradients all-reduced.

  Runs a `deploy.DeployedModel` step in the one replica that
  `cluster.multi_worker_strategy(one_replica_per_worker=True)` gives each
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
    self.step_function = tf.function(self._train_step_graph,
                                     autograph=False)

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
    of B rows (or its part of `worker_parts`, where the parts differ):
    every worker reads the same pipeline (same seed), so the job's step
    sees exactly the global batch a single process would.
    """
    config = self.towers.config
    return rows.worker_shards(dataset, worker=config.worker_index,
                              num_workers=config.num_workers,
                              shards_per_worker=1,
                              parts=self.towers.options.worker_parts)

  def train_step_outputs(self, images, labels):
    """One step on this worker's rows; returns the job's `StepOutputs`."""
    images, labels = tf.convert_to_tensor(images), tf.convert_to_tensor(labels)
    return self.step_function(images, labels,
                              self.towers.layout_for(images, labels))

  def predict(self, images):
    """Inference outputs for `images`, over this worker's clones."""
    return self.towers.predict(images)
