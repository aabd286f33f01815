"""The tf.distribute path, run alongside the towers for comparison.

`mirrored` is `tf.distribute.MirroredStrategy` with one replica on each of
the config's clone devices: every variable is copied onto every replica and
the gradients are all-reduced. `single` is `OneDeviceStrategy` on clone 0's
device: one device, the whole batch, the reference. Both use the towers'
contract (`train_step_losses`, `train_step`, `predict`, `model`,
`optimizer`, `trace_count`) so one training loop drives either.

BatchNorm under MirroredStrategy: every replica updates its own copy of the
moving statistics from its shard; reads and checkpoints return replica 0's
copy, which is what the towers' `clone_0` policy keeps.
"""

import keras
import tensorflow as tf

from tfmulti import deploy

MIRRORED = 'mirrored'
SINGLE = 'single'
STRATEGIES = (MIRRORED, SINGLE)


def make_strategy(name, config):
  """The `tf.distribute.Strategy` `name` over `config`'s clone devices."""
  if name == MIRRORED:
    cross_device_ops = None  # TF's choice: NCCL all-reduce on GPUs.
    if config.clone_on_cpu:
      # On CPUs TF picks collective ops, whose instance keys clash between
      # two MirroredStrategy objects in one process; a reduction onto the
      # optimizer device is what the towers do anyway.
      cross_device_ops = tf.distribute.ReductionToOneDevice(
          reduce_to_device=config.optimizer_device())
    return tf.distribute.MirroredStrategy(devices=config.clone_devices(),
                                          cross_device_ops=cross_device_ops)
  if name == SINGLE:
    return tf.distribute.OneDeviceStrategy(config.clone_device(0))
  raise ValueError(f'strategy={name!r}: choose one of {STRATEGIES}.')


def mean_loss(loss_fn, labels, outputs):
  """`loss_fn`'s mean over these examples, in a replica context too.

  A `keras.losses.Loss` with mean reduction also divides by the number of
  replicas when called in a tf.distribute replica context (Keras 3's
  `scale_loss_for_distribution`), which would count the replica scaling
  twice here; its `call()` gives the unreduced per-example losses.
  """
  if isinstance(loss_fn, keras.losses.Loss):
    return tf.reduce_mean(loss_fn.call(labels, outputs))
  return loss_fn(labels, outputs)


class DistributedModel:
  """A model trained by a `tf.distribute.Strategy`, like `DeployedModel`.

  Build the model and the optimizer under `strategy.scope()` first: a Keras
  optimizer whose slots are first created inside the step fails under
  MirroredStrategy ("You must feed a value for placeholder tensor"), so the
  constructor builds them.
  """

  def __init__(self, strategy, model, loss_fn, optimizer):
    self.strategy = strategy
    self.model = model
    self.loss_fn = loss_fn
    self.optimizer = optimizer
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
    with tf.GradientTape() as tape:
      outputs = model(images, training=True)
      loss = deploy.shard_loss(mean_loss(self.loss_fn, labels, outputs),
                               tf.shape(labels)[0], global_rows)
      regularization = tf.zeros([], loss.dtype)
      if model.losses:
        # Every replica adds its share; summed, the penalty counts once.
        regularization = tf.add_n(model.losses) / self.num_replicas
      loss += regularization
    gradients = tape.gradient(loss, model.trainable_variables)
    self.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss, regularization

  def _train_step_graph(self, images, labels):
    global_rows = tf.shape(labels)[0]
    shards = self._shard(images), self._shard(labels)
    losses, regularization = self.strategy.run(
        self._replica_step, args=(*shards, global_rows))
    total = self.strategy.reduce(tf.distribute.ReduceOp.SUM, losses, None)
    regularization = self.strategy.reduce(tf.distribute.ReduceOp.SUM,
                                          regularization, None)
    return deploy.StepLosses(
        total, regularization,
        list(self.strategy.experimental_local_results(losses)))

  def _shard(self, tensor):
    """Replica i gets the i-th of num_replicas equal row blocks."""
    blocks = tf.split(tensor, self.num_replicas)  # Once, not per replica.
    return self.strategy.experimental_distribute_values_from_function(
        lambda ctx: blocks[ctx.replica_id_in_sync_group])

  def train_step_losses(self, images, labels):
    """One step on the global batch; returns its `deploy.StepLosses`."""
    images, labels = tf.convert_to_tensor(images), tf.convert_to_tensor(labels)
    deploy.check_batch(images, labels, self.num_replicas, 'num_replicas')
    return self._step(images, labels)

  def train_step(self, images, labels):
    """One step on the global batch; returns the total loss (a scalar)."""
    return self.train_step_losses(images, labels).total

  def _predict_graph(self, images):
    return self.model(images, training=False)

  def predict(self, images):
    """Inference outputs for `images` (on the default replica's copy)."""
    return self._predict(tf.convert_to_tensor(images))
