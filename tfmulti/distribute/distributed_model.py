"""The tf.distribute paths, run alongside the towers for comparison.

`mirrored` is `tf.distribute.MirroredStrategy` with one replica on each of
the config's clone devices: every variable is copied onto every replica and
the gradients are all-reduced. `central_storage` is
`CentralStorageStrategy`, the nearest TF 2 analogue of the towers: variables
on the variables device, replicas on the clone devices. `single` is
`OneDeviceStrategy` on clone 0's device: one device, the whole batch, the
reference. `DistributedModel` runs any of them, and
`MultiWorkerMirroredStrategy` (`tfmulti.cluster`), under the one trainer
contract (`trainer.Trainer`).

BatchNorm under MirroredStrategy: every replica updates its own copy of the
moving statistics from its shard; reads and checkpoints return replica 0's
copy, which is what the towers' `clone_0` policy keeps. Models built with
synchronized BatchNorm all-reduce the batch statistics instead.
"""

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import trainer

MIRRORED = 'mirrored'
CENTRAL_STORAGE = 'central_storage'
SINGLE = 'single'


def check_supported(strategy_name, model, num_replicas):
  """Refuses what cannot work, before training starts.

  Raises:
    errors.UnsupportedError: CentralStorageStrategy with Keras 3
      BatchNormalization and more than one replica (its moving statistics
      have no aggregation method, and the first step fails deep inside
      TensorFlow).
  """
  if strategy_name != CENTRAL_STORAGE or num_replicas == 1:
    return
  batch_norms = [layer.name for layer in model._flatten_layers()
                 if isinstance(layer, keras.layers.BatchNormalization)]
  if batch_norms:
    raise errors.UnsupportedError(
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
  errors.check_choice('strategy', name, (MIRRORED, CENTRAL_STORAGE, SINGLE))
  return tf.distribute.OneDeviceStrategy(config.clone_device(0))


class DistributedModel(trainer.Trainer):
  """A model trained by a `tf.distribute.Strategy`, like the towers.

  Build the model and the optimizer under `strategy.scope()` first: a Keras
  optimizer whose slots are first created inside the step fails under
  MirroredStrategy ("You must feed a value for placeholder tensor"), so the
  constructor builds them.
  """

  def __init__(self, strategy, model, loss_fn, optimizer, *,
               return_gradients=False, worker_index=0, num_workers=1,
               clone_shares=None, accumulation_steps=1):
    """`worker_index` and `num_workers`: this process's place in a
    multi-worker job (MultiWorkerMirroredStrategy), whose replicas span the
    workers. `clone_shares`: each replica's share of a step's rows (one
    process only; None for equal). `accumulation_steps`: micro-steps a
    step (see `trainer.sum_microsteps`), all-reduced once."""
    trainer.check_shares(clone_shares, strategy.num_replicas_in_sync,
                         'num_replicas')
    errors.check_count('accumulation_steps', accumulation_steps, 1)
    self.clone_shares = clone_shares
    self.accumulation_steps = accumulation_steps
    self.worker_index = worker_index
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
    """tf.distribute replicas in sync, over every worker."""
    return self.strategy.num_replicas_in_sync

  def _microstep(self, images, labels, first, global_rows):
    """One micro-step of a replica: (gradients, [loss, regularization]).

    The regularization counts on the `first` micro-step only: the weights
    do not change between micro-steps.
    """
    model = self.model
    loss_scale = trainer.loss_scale_of(self.optimizer)
    with tf.GradientTape() as tape:
      outputs = model(images, training=True)
      mean = trainer.mean_loss(self.loss_fn, labels, outputs)
      loss = trainer.shard_loss(mean, tf.shape(labels)[0], global_rows)
      regularization = tf.zeros([], loss.dtype)
      if model.losses and first:
        # Every replica adds its share; summed, the penalty counts once.
        regularization = tf.add_n(model.losses) / self.num_replicas
      loss += regularization
      scaled_loss = loss if loss_scale is None else loss * loss_scale
    return (tape.gradient(scaled_loss, model.trainable_variables),
            [loss, regularization])

  def _replica_step(self, images, labels, global_rows):
    model = self.model
    loss_scale = trainer.loss_scale_of(self.optimizer)
    # The sums live on the replica's device, beside its copy of the
    # variables (device None: the replica's own).
    gradients, (loss, regularization) = trainer.sum_microsteps(
        lambda x, y, first: self._microstep(x, y, first, global_rows),
        images, labels, self.accumulation_steps, None)
    # Keras all-reduces (sums) the replicas' gradients inside
    # apply_gradients, once a step; a LossScaleOptimizer also unscales them.
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
    return trainer.StepOutputs(
        total, regularization,
        list(self.strategy.experimental_local_results(losses)),
        trainer.gradients_by_path(zip(summed, self.model.trainable_variables)))

  def _shard(self, tensor, sizes=None):
    """Replica i gets the i-th of num_replicas equal row blocks, or the
    i-th block of `sizes[i]` rows."""
    # Split once, not per replica.
    blocks = tf.split(tensor, sizes or self.num_replicas)
    return self.strategy.experimental_distribute_values_from_function(
        lambda ctx: blocks[ctx.replica_id_in_sync_group])

  def distribute_dataset(self, dataset):
    """`dataset`'s global batches, split over the replicas by tf.distribute.

    Replica i gets the i-th of num_replicas equal row blocks, prefetched to
    its device (on several workers, through `trainer.worker_blocks`). With
    clone shares, the global batches themselves: each step splits them.
    """
    if self.clone_shares is not None:
      return dataset
    if self.num_workers == 1:
      return self.strategy.experimental_distribute_dataset(dataset)
    local_replicas = self.num_replicas // self.num_workers
    return self.strategy.distribute_datasets_from_function(
        lambda context: trainer.worker_blocks(
            dataset, worker=self.worker_index, num_workers=self.num_workers,
            pieces=local_replicas))

  def train_step_outputs(self, images, labels):
    """One step on a global batch; returns its `trainer.StepOutputs`.

    `images` and `labels` are the global batch, or one element of
    `distribute_dataset` (already split over the replicas).
    """
    if isinstance(labels, tf.distribute.DistributedValues):
      worker_rows = tf.add_n(
          [tf.shape(shard)[0] for shard in
           self.strategy.experimental_local_results(labels)])
      global_rows = worker_rows * self.num_workers  # Equal blocks a worker.
      return self._step(images, labels, global_rows)
    images, labels = tf.convert_to_tensor(images), tf.convert_to_tensor(labels)
    steps = self.accumulation_steps
    trainer.check_batch(
        images, labels, 1 if self.clone_shares else self.num_replicas * steps,
        'num_replicas' if steps == 1 else 'num_replicas * accumulation_steps')
    if images.shape[0] % steps:
      raise errors.ConfigError(
          f'a batch of {images.shape[0]} rows does not split into '
          f'accumulation_steps={steps} equal micro-steps.')
    sizes = trainer.shard_rows(images.shape[0] // steps, self.clone_shares,
                               self.num_replicas)
    # Replica i takes steps * sizes[i] consecutive rows: its part of each
    # micro-step (the update sees every row of the batch once).
    sizes = sizes and [steps * size for size in sizes]
    return self._step(self._shard(images, sizes),
                      self._shard(labels, sizes), tf.shape(labels)[0])

  def _predict_graph(self, images):
    return self.model(images, training=False)

  def predict(self, images):
    """Inference outputs for `images` (on the default replica's copy)."""
    return self._predict(tf.convert_to_tensor(images))
