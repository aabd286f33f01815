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

The second is the one multi-worker adapter: the command line's
`--strategy=multi_worker` and Keras's `fit` across workers
(`TowersModel(..., workers=)`) both train through it.

Neither imports `deploy.towers`: the towers hand in what they need.
"""


import tensorflow as tf

from tfmulti import devices
from tfmulti import keras_internals
from tfmulti import layouts
from tfmulti import plans
from tfmulti import rows
from tfmulti import trainer


def lockstep_strategy(config):
  """The `MirroredStrategy` whose replicas run `config`'s clones at once:
  its all-reduces (synchronized BatchNorm's statistics, three a layer and
  two in its gradient) are collective ops, which keep the trace linear in
  the model's depth (`devices.collective_strategy`). In a dry run the
  strategy's own small variables (its collectives' ordering tokens, made
  as it is made) go to the host (`plans.on_the_host_if_absent`)."""
  if plans.active():
    with plans.on_the_host_if_absent():
      return devices.collective_strategy(config)
  return devices.collective_strategy(config)


def run_clones_in_lockstep(lockstep, body, variables, shards, terms, scopes):
  """Runs clone i's `body` as replica i of `lockstep`, all at once.

  Args:
    lockstep: a `tf.distribute.MirroredStrategy` over the clone devices.
    body: a `pieces.Body`.
    variables: `variables(i)`: clone i's (trainable values, non-trainable
      values), called in its replica, on its device.
    shards: per clone, (images, labels, penalty_weight, offset): its rows
      (nests) and its piece's part of the penalties and first row.
    terms: the step's `pieces.StepTerms`, passed to every clone.
    scopes: per clone, the name scope of its ops (the strategy's own
      would be 'replica_i', but a clone's are named as in any step).

  Returns:
    Per clone, `body`'s results.
  """
  per_clone = lockstep.experimental_distribute_values_from_function(
      lambda ctx: tf.nest.map_structure(
          tf.convert_to_tensor,
          _tensors(shards[ctx.replica_id_in_sync_group])))

  state = keras_internals.keras_state()  # The caller's, on every clone.

  def replica_fn(shard):
    images, labels, offset = shard
    me = int(tf.get_static_value(
        tf.distribute.get_replica_context().replica_id_in_sync_group))
    weight = shards[me][2]  # A Python 0 skips the penalties' pass.
    with keras_internals.keras_state_of(state), tf.name_scope(
        scopes[me] + '/'):  # From the root.
      return body(*variables(me), images, labels, weight, offset, terms)

  per_replica = lockstep.run(replica_fn, args=(per_clone,))
  num_clones = len(shards)
  columns = []
  for value in tf.nest.flatten(per_replica):
    local = lockstep.experimental_local_results(value)
    # An output that every replica computed alike comes back once.
    columns.append(local if len(local) == num_clones else local * num_clones)
  return [tf.nest.pack_sequence_as(per_replica, list(values))
          for values in zip(*columns)]


def _tensors(shard):
  """What of a clone's `shard` goes in as tensors: its rows and first
  row."""
  images, labels, _, offset = shard
  return images, labels, offset


class WorkerTowers(trainer.Trainer):
  """Each worker's towers, with the workers' gradients all-reduced: the one
  multi-worker adapter, under the command line (`--strategy=multi_worker`)
  and Keras's `fit` across workers alike.

  Runs a `deploy.DeployedModel` step in the one replica that
  `cluster.multi_worker_strategy(one_replica_per_worker=True)` gives each
  worker: the worker's clones run on its devices and their gradients are
  summed on its optimizer device, then Keras's `apply_gradients` all-reduces
  the workers' sums (TF's collective ops) once before the update, which every
  worker applies to its copy of the variables. N workers x K clones then
  train like one device on the whole global batch.

  Fed the whole global batch (`whole_batch=True`: Keras's `fit` reads it
  on every worker), each worker takes its rows of it (`rows.worker_part`,
  the one cut) after the workers agree that they read the same batch
  (`batch_fingerprint`, gathered from every worker; a disagreement fails
  the step before it changes anything, with `BATCHES_DIFFER`). Outputs
  asked for are gathered in worker order, so every worker holds the whole
  batch's, as one process would.
  """

  def __init__(self, strategy, towers):
    """`towers`: a `deploy.DeployedModel` built in `strategy.scope()`."""
    self.strategy = strategy
    self.towers = towers
    self.config = towers.config
    self.model = towers.model
    self.optimizer = towers.optimizer
    self.step_function = tf.function(self._train_step_graph,
                                     autograph=False)

  @property
  def clone_shares(self):
    """Each of the worker's clones' share of its rows; None for equal."""
    return self.towers.clone_shares

  def _part(self, global_rows):
    """(first row, rows) of this worker's part of a global batch."""
    return layouts.worker_span(global_rows, self.config.worker_index,
                               self.config.num_workers,
                               self.towers.options.worker_parts)

  def _train_step_graph(self, images, labels, layout, with_outputs,
                        whole_batch):
    fingerprint = []
    if whole_batch:  # The workers agree on the batch, then take their rows.
      fingerprint = [batch_fingerprint((images, labels))]
      images, labels = (rows.worker_part(
          nest, worker=self.config.worker_index,
          num_workers=self.config.num_workers,
          parts=self.towers.options.worker_parts) for nest in (images, labels))

    def replica_fn(images, labels, *fingerprint):
      checks = [_agreed(fingerprint[0])] if fingerprint else []
      with tf.control_dependencies(checks):  # Every op of the step.
        result = self.towers.step_graph(images, labels, layout,
                                        with_outputs=with_outputs)
      return result._replace(outputs=_gathered(result.outputs))
    with self.strategy.scope():  # Keras's fit runs outside it.
      outputs = self.strategy.run(replica_fn,
                                  args=(images, labels, *fingerprint))
      total = tf.distribute.ReduceOp.SUM
      return trainer.StepOutputs(
          self.strategy.reduce(total, outputs.total, None),
          self.strategy.reduce(total, outputs.regularization, None),
          [self._local(loss) for loss in outputs.clones],
          {path: self._local(g) for path, g in outputs.gradients.items()},
          None if outputs.outputs is None else tf.nest.map_structure(
              self._local, outputs.outputs))

  def _local(self, value):
    """This worker's one replica's `value`."""
    return self.strategy.experimental_local_results(value)[0]

  def distribute_dataset(self, dataset):
    """This worker's rows of each global batch (`rows.worker_shards`, the
    one cut: its part of `worker_parts` where the parts differ). Every
    worker reads the same pipeline (same seed), so the job's step sees
    exactly the global batch a single process would."""
    return rows.worker_shards(dataset, worker=self.config.worker_index,
                              num_workers=self.config.num_workers,
                              shards_per_worker=1,
                              parts=self.towers.options.worker_parts)

  def check_batch(self, global_rows, partial=False):
    """Raises `ConfigError` for a global batch whose rows do not cut over
    the workers, or whose worker's part the towers' step cannot cut."""
    self.towers.check_batch(self._part(global_rows)[1], partial)

  def train_step_outputs(self, images, labels, *, partial=False,
                         with_outputs=False, whole_batch=False):
    """One step on this worker's rows (or, `whole_batch`, on the global
    batch every worker read); returns the job's `StepOutputs`."""
    images, labels = tf.nest.map_structure(tf.convert_to_tensor,
                                           (images, labels))
    worker_rows = rows.batch_rows(images, labels)
    if whole_batch:
      worker_rows = self._part(worker_rows)[1]
    layout = layouts.for_step(self.config, self.towers.options, worker_rows,
                              shares=self.towers.clone_shares,
                              partial=partial)
    result = self.step_function(images, labels, layout, with_outputs,
                                whole_batch)
    # Its outputs a `keras_internals.with_logits` nest: logits on them here.
    return result._replace(outputs=keras_internals.logits_kept(
        result.outputs))

  def predict(self, images):
    """Inference outputs for `images`, over this worker's clones."""
    return self.towers.predict(images)

  def evaluate_outputs(self, images):
    """An evaluation batch split over the workers
    (`rows.evaluation_part`): each runs its rows on its clones, then the
    outputs are gathered in worker order and the model's losses summed,
    each weighted by its rows, so every worker holds what one process
    computes on the whole batch (a batch of fewer rows than workers runs
    whole on each). Collectives: every worker evaluates the same batches.
    """
    mine, share = rows.evaluation_part(images,
                                       worker=self.config.worker_index,
                                       num_workers=self.config.num_workers)
    whole = share == 1.0

    def replica_fn(mine):
      outputs, regularization = self.towers.evaluate_outputs(mine)
      outputs = keras_internals.with_logits(outputs)
      if whole:
        return outputs, regularization
      # The penalties count once in every worker's; the shares sum to 1.
      return _gathered(outputs), tf.distribute.get_replica_context(
          ).all_reduce(tf.distribute.ReduceOp.SUM, regularization * share)
    with self.strategy.scope():
      outputs, regularization = tf.nest.map_structure(
          self._local, self.strategy.run(replica_fn, args=(mine,)))
      return keras_internals.logits_kept(outputs), regularization


BATCHES_DIFFER = 'the workers read different global batches'


def batch_fingerprint(batch):
  """A 64-bit fingerprint (int64) of `batch`, a nest of row-major tensors:
  the FarmHash of every row's bytes in order, so equal batches give equal
  fingerprints on every machine (no floating-point sum to round)."""
  columns = [tf.fingerprint(t) for t in tf.nest.flatten(batch)
             if t is not None]
  whole = tf.fingerprint(tf.reshape(tf.concat(columns, axis=1), [1, -1]))
  return tf.bitcast(tf.reshape(whole, [8]), tf.int64)


def _agreed(fingerprint):
  """In a replica: fails with `BATCHES_DIFFER` unless every worker's
  `fingerprint` is worker 0's."""
  everyone = tf.distribute.get_replica_context().all_gather(
      fingerprint[None], axis=0)
  return tf.debugging.assert_equal(everyone, everyone[0],
                                   message=BATCHES_DIFFER)


def _gathered(outputs):
  """In a replica: every worker's `outputs` (a nest, or None: a
  `keras_internals.with_logits` one keeps the logits), in worker
  order."""
  if outputs is None:
    return None
  context = tf.distribute.get_replica_context()
  return tf.nest.map_structure(lambda t: context.all_gather(t, axis=0),
                               outputs)
