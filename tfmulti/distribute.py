"""The tf.distribute path, run alongside the towers for comparison.

`mirrored` is `tf.distribute.MirroredStrategy` with one replica on each of
the config's clone devices: every variable is copied onto every replica and
the gradients are all-reduced. `central_storage` is
`CentralStorageStrategy`, the nearest TF 2 analogue of the towers: variables
on the variables device, replicas on the clone devices. `single` is
`OneDeviceStrategy` on clone 0's device: one device, the whole batch, the
reference. All use the towers' contract (`train_step_outputs`,
`train_step`, `distribute_dataset`, `predict`, `model`, `optimizer`,
`trace_count`) so one training loop drives any of them.

BatchNorm under MirroredStrategy: every replica updates its own copy of the
moving statistics from its shard; reads and checkpoints return replica 0's
copy, which is what the towers' `clone_0` policy keeps. Models built with
synchronized BatchNorm all-reduce the batch statistics instead.
"""

import keras
import tensorflow as tf

from tfmulti import deploy

MIRRORED = 'mirrored'
CENTRAL_STORAGE = 'central_storage'
SINGLE = 'single'
MULTI_WORKER = 'multi_worker'
MULTI_WORKER_MIRRORED = 'multi_worker_mirrored'
MULTI_WORKER_STRATEGIES = (MULTI_WORKER, MULTI_WORKER_MIRRORED)
STRATEGIES = (MIRRORED, CENTRAL_STORAGE, SINGLE) + MULTI_WORKER_STRATEGIES
# Where each strategy keeps the variables, for the log.
VARIABLES = {
    MIRRORED: 'a copy of every variable on each replica; gradients '
              'all-reduced',
    CENTRAL_STORAGE: 'variables on the parameter device; gradients reduced '
                     'there',
    SINGLE: 'variables and the whole batch on one device',
    MULTI_WORKER: "each worker's towers; the workers' summed gradients "
                  'all-reduced once a step',
    MULTI_WORKER_MIRRORED: 'a copy of every variable on each replica of '
                           'every worker; gradients all-reduced',
}


def worker_blocks(dataset, *, worker, num_workers, pieces):
  """Worker `worker`'s rows of each global batch, in `pieces` blocks.

  A global batch of B rows is cut into num_workers * pieces equal blocks;
  the worker gets blocks [worker * pieces, (worker + 1) * pieces), one
  dataset element each. Every worker reads the same pipeline (same seed),
  so a step of the whole job sees exactly the global batch one process
  would, split as one process's clones would split it.
  """
  def blocks(images, labels):
    rows = tf.shape(labels)[0] // (num_workers * pieces)
    first = worker * pieces * rows

    def block(k):
      start = first + tf.cast(k, tf.int32) * rows
      return images[start:start + rows], labels[start:start + rows]
    return tf.data.Dataset.range(pieces).map(block)
  return dataset.flat_map(blocks)


class UnsupportedError(ValueError):
  """A strategy cannot train this model in TF 2.21 / Keras 3."""


def check_supported(strategy_name, model, num_replicas):
  """Refuses what cannot work, before training starts.

  Raises:
    UnsupportedError: CentralStorageStrategy with Keras 3 BatchNormalization
      and more than one replica (its moving statistics have no aggregation
      method, and the first step fails deep inside TensorFlow).
  """
  if strategy_name != CENTRAL_STORAGE or num_replicas == 1:
    return
  batch_norms = [layer.name for layer in model._flatten_layers()  # pylint: disable=protected-access
                 if isinstance(layer, keras.layers.BatchNormalization)]
  if batch_norms:
    raise UnsupportedError(
        f'strategy={strategy_name!r} cannot train {model.name!r} on '
        f'{num_replicas} replicas: CentralStorageStrategy fails on Keras 3 '
        f'BatchNormalization ({batch_norms[0]}, ...) in TF 2.21; use '
        "strategy='towers' (its design) or 'mirrored', or num_clones=1.")


def make_strategy(name, config, *, cross_device_ops=None):
  """The `tf.distribute.Strategy` `name` over `config`'s clone devices.

  `cross_device_ops` overrides MirroredStrategy's choice of all-reduce.
  """
  if name == MIRRORED:
    if cross_device_ops is None and config.clone_on_cpu:
      # On CPUs TF picks collective ops, whose instance keys clash between
      # two MirroredStrategy objects in one process; a reduction onto the
      # optimizer device is what the towers do anyway.
      cross_device_ops = tf.distribute.ReductionToOneDevice(
          reduce_to_device=config.optimizer_device())
    # None: TF's choice (NCCL all-reduce on GPUs).
    return tf.distribute.MirroredStrategy(devices=config.clone_devices(),
                                          cross_device_ops=cross_device_ops)
  if name == CENTRAL_STORAGE:
    return tf.distribute.experimental.CentralStorageStrategy(
        compute_devices=config.clone_devices(),
        parameter_device=config.variables_device())
  if name == SINGLE:
    return tf.distribute.OneDeviceStrategy(config.clone_device(0))
  raise ValueError(f'strategy={name!r}: choose one of {STRATEGIES}.')


class DistributedModel:
  """A model trained by a `tf.distribute.Strategy`, like `DeployedModel`.

  Build the model and the optimizer under `strategy.scope()` first: a Keras
  optimizer whose slots are first created inside the step fails under
  MirroredStrategy ("You must feed a value for placeholder tensor"), so the
  constructor builds them.
  """

  def __init__(self, strategy, model, loss_fn, optimizer, *,
               return_gradients=False, worker=0, num_workers=1):
    """`worker` and `num_workers`: this task's place in a multi-worker job
    (MultiWorkerMirroredStrategy), whose replicas span the workers."""
    self.worker = worker
    self.num_workers = num_workers
    self.strategy = strategy
    self.model = model
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.return_gradients = return_gradients
    with strategy.scope():
      if not optimizer.built:
        optimizer.build(model.trainable_variables)
    self._step = tf.function(self._train_step_graph)
    self._predict = tf.function(self._predict_graph)

  @property
  def num_replicas(self):
    return self.strategy.num_replicas_in_sync

  @property
  def trace_count(self):
    """How many times the training step has been traced."""
    return self._step.experimental_get_tracing_count()

  def _replica_step(self, images, labels, global_rows):
    model = self.model
    loss_scale = deploy.loss_scale_of(self.optimizer)
    with tf.GradientTape() as tape:
      outputs = model(images, training=True)
      mean = deploy.mean_loss(self.loss_fn, labels, outputs)
      loss = deploy.shard_loss(mean, tf.shape(labels)[0], global_rows)
      regularization = tf.zeros([], loss.dtype)
      if model.losses:
        # Every replica adds its share; summed, the penalty counts once.
        regularization = tf.add_n(model.losses) / self.num_replicas
      loss += regularization
      scaled_loss = loss if loss_scale is None else loss * loss_scale
    gradients = tape.gradient(scaled_loss, model.trainable_variables)
    # Keras all-reduces (sums) the replicas' gradients inside
    # apply_gradients; a LossScaleOptimizer also unscales them.
    self.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    if not self.return_gradients:
      gradients = []
    elif loss_scale is not None:
      gradients = [g / loss_scale for g in gradients]
    return loss, regularization, gradients

  def _train_step_graph(self, images, labels, global_rows):
    losses, regularization, gradients = self.strategy.run(
        self._replica_step, args=(images, labels, global_rows))
    total = self.strategy.reduce(tf.distribute.ReduceOp.SUM, losses, None)
    regularization = self.strategy.reduce(tf.distribute.ReduceOp.SUM,
                                          regularization, None)
    # Only for summaries: a second sum of the gradients, off the update path.
    summed = [self.strategy.reduce(tf.distribute.ReduceOp.SUM, g, None)
              for g in gradients]
    return deploy.StepOutputs(
        total, regularization,
        list(self.strategy.experimental_local_results(losses)),
        deploy.gradients_by_path(zip(summed, self.model.trainable_variables)))

  def _shard(self, tensor):
    """Replica i gets the i-th of num_replicas equal row blocks."""
    blocks = tf.split(tensor, self.num_replicas)  # Once, not per replica.
    return self.strategy.experimental_distribute_values_from_function(
        lambda ctx: blocks[ctx.replica_id_in_sync_group])

  def distribute_dataset(self, dataset):
    """`dataset`'s global batches, split over the replicas by tf.distribute.

    Replica i gets the i-th of num_replicas equal row blocks, prefetched to
    its device (on several workers, through `worker_blocks`).
    """
    if self.num_workers == 1:
      return self.strategy.experimental_distribute_dataset(dataset)
    local = self.num_replicas // self.num_workers
    return self.strategy.distribute_datasets_from_function(
        lambda context: worker_blocks(dataset, worker=self.worker,
                                      num_workers=self.num_workers,
                                      pieces=local))

  def train_step_outputs(self, images, labels):
    """One step on a global batch; returns its `deploy.StepOutputs`.

    `images` and `labels` are the global batch, or one element of
    `distribute_dataset` (already split over the replicas).
    """
    if isinstance(labels, tf.distribute.DistributedValues):
      local_rows = tf.add_n([tf.shape(shard)[0] for shard in
                             self.strategy.experimental_local_results(labels)])
      global_rows = local_rows * self.num_workers  # Equal blocks per worker.
      return self._step(images, labels, global_rows)
    images, labels = tf.convert_to_tensor(images), tf.convert_to_tensor(labels)
    deploy.check_batch(images, labels, self.num_replicas, 'num_replicas')
    return self._step(self._shard(images), self._shard(labels),
                      tf.shape(labels)[0])

  def train_step(self, images, labels):
    """One step on the global batch; returns the total loss (a scalar)."""
    return self.train_step_outputs(images, labels).total

  def _predict_graph(self, images):
    return self.model(images, training=False)

  def predict(self, images):
    """Inference outputs for `images` (on the default replica's copy)."""
    return self._predict(tf.convert_to_tensor(images))


class WorkerTowers:
  """Each worker's towers, with the workers' gradients all-reduced.

  Runs a `deploy.DeployedModel` step in the one replica that a
  `cluster.make_strategy(one_replica_per_worker=True)` strategy gives each
  worker: the worker's clones run on its devices and their gradients are
  summed on its optimizer device, then Keras's `apply_gradients` all-reduces
  the workers' sums (TF's collective ops) once before the update, which every
  worker applies to its copy of the variables. N workers x K clones then
  train like one device on the whole global batch. Same contract as
  `DistributedModel`.
  """

  def __init__(self, strategy, towers):
    """`towers`: a `deploy.DeployedModel` built in `strategy.scope()`."""
    self.strategy = strategy
    self.towers = towers
    self.model = towers.model
    self.optimizer = towers.optimizer
    self._step = tf.function(self._train_step_graph)

  @property
  def trace_count(self):
    return self._step.experimental_get_tracing_count()

  def _train_step_graph(self, images, labels):
    outputs = self.strategy.run(self.towers.step_graph, args=(images, labels))
    local = self.strategy.experimental_local_results
    return deploy.StepOutputs(
        self.strategy.reduce(tf.distribute.ReduceOp.SUM, outputs.total, None),
        self.strategy.reduce(tf.distribute.ReduceOp.SUM,
                             outputs.regularization, None),
        [local(loss)[0] for loss in outputs.clones],
        {path: local(g)[0] for path, g in outputs.gradients.items()})

  def distribute_dataset(self, dataset):
    """This worker's block of rows of each global batch.

    Worker i of N takes rows [i * B/N, (i + 1) * B/N) of every global batch
    of B rows: every worker reads the same pipeline (same seed), so the
    job's step sees exactly the global batch a single process would.
    """
    config = self.towers.config
    return worker_blocks(dataset, worker=config.replica_id,
                         num_workers=config.num_replicas, pieces=1)

  def train_step_outputs(self, images, labels):
    """One step on this worker's block; returns the job's `StepOutputs`."""
    images, labels = tf.convert_to_tensor(images), tf.convert_to_tensor(labels)
    deploy.check_batch(images, labels, self.towers.config.num_clones)
    return self._step(images, labels)

  def train_step(self, images, labels):
    return self.train_step_outputs(images, labels).total

  def predict(self, images):
    """Inference outputs for `images`, over this worker's clones."""
    return self.towers.predict(images)
