"""The tf.distribute paths, run alongside the towers for comparison.

`mirrored` is `tf.distribute.MirroredStrategy` with one replica on each of
the config's clone devices: every variable is copied onto every replica and
the gradients are all-reduced. `central_storage` is
`CentralStorageStrategy`, the nearest TF 2 analogue of the towers: variables
on the variables device, replicas on the clone devices. `single` is
`OneDeviceStrategy` on clone 0's device: one device, the whole batch, the
reference. `DistributedModel` runs any of them, and
`MultiWorkerMirroredStrategy` (`tfmulti.distribute.cluster`),
under the one trainer contract (`trainer.Trainer`).

BatchNorm under MirroredStrategy: every replica updates its own copy of the
moving statistics from its shard; reads and checkpoints return replica 0's
copy, which is what the towers' `clone_0` policy keeps. Models built with
synchronized BatchNorm all-reduce the batch statistics instead.
"""

import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import layouts
from tfmulti import pieces
from tfmulti import rows
from tfmulti import step_options
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
  batch_norms = [layer.name for layer in keras_internals.batch_norms(model)]
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
    return devices.mirrored_strategy(config, cross_device_ops)
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

  def __init__(self, strategy, model, loss_fn, optimizer,
               options=step_options.DEFAULTS, *, worker_index=0,
               num_workers=1):
    """`options`: the `StepOptions` (here `clone_shares`, one process
    only: each replica's share of a step's rows; `accumulation_steps`,
    all-reduced once a step; `summarize_gradients`). `worker_index` and
    `num_workers`: this process's place in a multi-worker job
    (MultiWorkerMirroredStrategy), whose replicas span the workers.

    Raises:
      errors.UserError: shares that do not match the replicas, a loss over
        a Keras mask or a loss that is not a mean.
    """
    layouts.check_share_count(options.fixed_shares,
                           strategy.num_replicas_in_sync, 'num_replicas')
    trainer.check_no_mask(model)
    trainer.check_loss(loss_fn)
    self.options = options
    self.worker_index = worker_index
    self.num_workers = num_workers
    self.strategy = strategy
    self.model = model
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    with strategy.scope():
      if not optimizer.built:
        optimizer.build(model.trainable_variables)
    self._body = pieces.Body(model, loss_fn, 'replica')
    self.step_function = tf.function(self._train_step_graph,
                                     autograph=False)
    self._predict = tf.function(self._predict_graph, autograph=False)

  @property
  def clone_shares(self):
    """Each replica's share of a step's rows; None for equal."""
    return self.options.clone_shares

  @property
  def num_replicas(self):
    """tf.distribute replicas in sync, over every worker."""
    return self.strategy.num_replicas_in_sync

  def _accumulation_step(self, images, labels, first, penalty, offset,
                         terms, advanced):
    """One accumulation step of a replica (`pieces.Body` on its rows):
    (gradients, [loss, regularization], no outputs). `penalty` and
    `offset` are its piece's (`layouts.replica_terms`): the weight
    penalties count on each replica's `first` one only; random layers draw
    from their generators folded with `offset`, which no other replica or
    accumulation step of the step has, so no two repeat a mask. The
    `first` puts their states advanced from the unfolded one in
    `advanced`, for the step to assign once."""
    model = self.model
    non_trainable = [tf.convert_to_tensor(v.value)
                     for v in model.non_trainable_variables]
    _, loss, regularization, gradients, new_values = self._body(
        [tf.convert_to_tensor(v.value) for v in model.trainable_variables],
        non_trainable, images, labels, penalty, offset, terms)
    seeds = keras_internals.seed_indices(model)
    if first:
      advanced[:] = [new_values[i] for i in seeds]
    # As the layers' own calls would: what the step changed (BatchNorm's
    # statistics), assigned in the replica's context.
    for i, (variable, value, passed) in enumerate(zip(
        model.non_trainable_variables, new_values, non_trainable)):
      if value is not passed and i not in seeds:
        variable.assign(value)
    return gradients, [loss, regularization], []

  def _replica_step(self, images, labels, global_rows):
    model = self.model
    loss_scale = trainer.loss_scale_of(self.optimizer)
    # The sums live on the replica's device, beside its copy of the
    # variables (device None: the replica's own).
    layout = layouts.step_layout(
        rows.batch_rows(images, labels),
        layouts.Cut(accumulation_steps=self.options.accumulation_steps))
    replica = tf.cast(
        tf.distribute.get_replica_context().replica_id_in_sync_group,
        tf.int64)
    advanced = []  # The generators' states, advanced once for the step.

    def accumulation_step(x, y, k, shift):
      offset, penalty = layouts.replica_terms(
          replica, self.num_replicas, tf.cast(global_rows, tf.int64),
          layout.of(0, k)[0], k == 0)
      return self._accumulation_step(
          x[0], y[0], k == 0, penalty, offset + tf.cast(shift, tf.int64),
          pieces.StepTerms(global_rows, loss_scale), advanced)
    gradients, (loss, regularization), _ = rows.accumulate(
        accumulation_step, (images,), (labels,), layout)
    for i, value in zip(keras_internals.seed_indices(model), advanced):
      model.non_trainable_variables[i].assign(value)
    # Keras all-reduces (sums) the replicas' gradients inside
    # apply_gradients, once a step; a LossScaleOptimizer also unscales them.
    self.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    if not self.options.summarize_gradients:
      gradients = []
    else:  # Read whole, unscaled (a slice's rows made dense).
      gradients = [tf.convert_to_tensor(g) / loss_scale for g in gradients]
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
    """Replica i gets the i-th of num_replicas equal shards, or the i-th
    shard of `sizes[i]` rows."""
    # Split once, not per replica.
    shards = tf.split(tensor, sizes or self.num_replicas)
    return self.strategy.experimental_distribute_values_from_function(
        lambda ctx: shards[ctx.replica_id_in_sync_group])

  def distribute_dataset(self, dataset):
    """`dataset`'s global batches, split over the replicas by tf.distribute.

    Replica i gets the i-th of num_replicas equal shards, prefetched to
    its device (on several workers, through `rows.worker_shards`). With
    clone shares, the global batches themselves: each step splits them.
    """
    if self.options.clone_shares is not None:
      return dataset
    if self.num_workers == 1:
      return self.strategy.experimental_distribute_dataset(dataset)
    local_replicas = self.num_replicas // self.num_workers
    return self.strategy.distribute_datasets_from_function(
        lambda context: rows.worker_shards(
            dataset, worker=self.worker_index, num_workers=self.num_workers,
            shards_per_worker=local_replicas))

  def train_step_outputs(self, images, labels, *, partial=False,
                         with_outputs=False, whole_batch=False):
    """One step on a global batch; returns its `trainer.StepOutputs`.

    `images` and `labels` are the global batch, or one element of
    `distribute_dataset` (already split over the replicas). Keras's `fit`
    runs the towers, not these paths: a partial batch, the outputs or a
    batch read whole on every worker are refused.
    """
    if partial or with_outputs or whole_batch:
      raise errors.UnsupportedError(
          'the tf.distribute paths train the command line\'s full batches; '
          "Keras's fit runs the towers: use fit.TowersModel.")
    if isinstance(labels, tf.distribute.DistributedValues):
      worker_rows = tf.add_n(
          [tf.shape(shard)[0] for shard in
           self.strategy.experimental_local_results(labels)])
      global_rows = worker_rows * self.num_workers  # Equal rows a worker.
      return self.step_function(images, labels, global_rows)
    images, labels = tf.convert_to_tensor(images), tf.convert_to_tensor(labels)
    steps = self.options.accumulation_steps
    layout = layouts.step_layout(rows.batch_rows(images, labels), layouts.Cut(
        num_clones=self.num_replicas, shares=self.options.clone_shares,
        accumulation_steps=steps))
    sizes = list(layout.clone_rows(0, 0))
    # Replica i takes steps * sizes[i] consecutive rows: its part of each
    # accumulation step (the update sees every row of the batch once).
    sizes = [steps * size for size in sizes]
    return self.step_function(self._shard(images, sizes),
                      self._shard(labels, sizes), tf.shape(labels)[0])

  def _predict_graph(self, images):
    return self.model(images, training=False)

  def predict(self, images):
    """Inference outputs for `images` (on the default replica's copy)."""
    return self._predict(tf.convert_to_tensor(images))

  def evaluate_outputs(self, images):
    """(inference outputs, the model's losses on them), on the default
    replica's copy: the weight penalties and the `add_loss` terms of the
    call, as Keras's `evaluate` counts them."""
    outputs = self.model(tf.nest.map_structure(tf.convert_to_tensor, images),
                         training=False)
    losses = [tf.cast(loss, tf.float32) for loss in self.model.losses]
    return outputs, tf.add_n(losses) if losses else tf.zeros([])
