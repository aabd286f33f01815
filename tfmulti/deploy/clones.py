"""Slim's clone building blocks: one clone's step, the clones, their sum.

`create_clones` runs each clone's forward pass, loss and gradient on its
own device and shard of the batch (through its stages, with `stages`);
`optimize_clones` sums them. `deploy.DeployedModel` builds its step from
these; they are also there for writing one's own loop, as in slim.
"""

import collections
import contextlib
import functools

import tensorflow as tf

from tfmulti import step_options
from tfmulti import trainer
from tfmulti.deploy import atoms
from tfmulti.deploy import towers_in_strategy

# A clone's share of one step (slim: Clone(outputs, scope, device)).
# `loss` is the clone's part of the total loss (its mean loss weighted by
# its share of the global batch, plus the regularization losses on clone 0);
# `gradients` are d loss / d trainable variable, computed on `device`;
# `non_trainable` is a list of (rows, values): the model's non-trainable
# variables as the forward pass of the clone's shard (or of each of its
# micro-batches) left them.
Clone = collections.namedtuple(
    'Clone', ['outputs', 'loss', 'regularization_loss', 'gradients',
              'non_trainable', 'scope', 'device'])


def clone_step(model, loss_fn, global_rows, trainable, non_trainable,
               images, labels, regularization_weight, loss_scale):
  """Forward pass, loss and gradient of one clone; changes no variable.

  `trainable` and `non_trainable` are the variables' values as tensors, so
  the computation can be compiled by XLA apart from the variables (XLA will
  not read a variable that lives on another device). `global_rows` counts
  the whole job's batch. The regularization losses count
  `regularization_weight` times (1 / num_workers on clone 0, else 0); the
  gradient is of `loss * loss_scale` (float16 loss scaling; 1 otherwise).
  """
  with tf.GradientTape() as tape:
    tape.watch(trainable)
    outputs, new_non_trainable, losses = model.stateless_call(
        trainable, non_trainable, images, training=True, return_losses=True)
    loss, regularization, scaled_loss = trainer.objective(
        loss_fn, labels, outputs, global_rows=global_rows, losses=losses,
        penalty_weight=regularization_weight, loss_scale=loss_scale)
  gradients = tape.gradient(scaled_loss, trainable)
  return outputs, loss, regularization, gradients, [new_non_trainable]


@contextlib.contextmanager
def on_clone(config, clone_index):
  """Places ops on the clone's device, under its name scope (if any)."""
  scope = config.clone_scope(clone_index)
  with tf.device(config.clone_device(clone_index)):
    if scope:
      with tf.name_scope(scope):
        yield
    else:
      yield


def split_batch(config, tensor, sizes=None):
  """Splits `tensor`'s rows over the clones, on the inputs device: evenly,
  or `sizes[i]` rows to clone i."""
  with tf.device(config.inputs_device()), tf.name_scope('split_batch'):
    return tf.split(tensor, sizes or config.num_clones, axis=0)


def values_of(variables):
  """The variables' current values, read on the current device."""
  return [tf.convert_to_tensor(v) for v in variables]


def create_clones(config, model, loss_fn, images, labels, *,
                  options=step_options.DEFAULTS, loss_scale=1.0,
                  lockstep=None, stages=None, shard_sizes=None,
                  global_rows=None, regularization=True):
  """Runs every clone on its device and its shard of the batch.

  Args:
    config: a `DeploymentConfig`.
    model: a built functional `keras.Model` whose variables live on
      `config.variables_device()`.
    loss_fn: `loss_fn(labels, outputs)` -> mean loss over those examples.
    images: this worker's batch, `batch_size * num_clones` rows (the global
      batch, on one worker).
    labels: its labels, as many rows.
    options: the `StepOptions`; here `xla` compiles each clone's forward
      and backward pass with XLA, one cluster per clone on that clone's
      device (compiling the whole step would fuse every clone into one
      cluster on one device), and `reproducible_rows` runs each atom of a
      clone alone: each `Clone` then holds its atoms' losses and
      gradients stacked, atom first, unsummed (`deploy.atoms`).
    loss_scale: multiplies each clone's loss before its gradient (the
      float16 loss scale of a `keras.optimizers.LossScaleOptimizer`).
    lockstep: None, or a `tf.distribute.MirroredStrategy` over the clone
      devices whose replicas run the clones at once (for synchronized
      BatchNorm; see `towers_in_strategy.run_clones_in_lockstep`).
    stages: None, or a `pipeline.Stages`: each clone runs its shard in
      micro-batches through its stages, on `config.stage_devices(clone)`.
    shard_sizes: rows of each clone (uneven clone shares); None for equal.
    global_rows: rows of the whole job's batch that the clones' losses are
      a part of; None for this batch on every worker (an accumulation step
      passes the rows of all the update's accumulation steps).
    regularization: count the regularization losses (on clone 0); with
      gradient accumulation, the first accumulation step counts them.

  Returns:
    A list of `Clone`, one per clone.
  """
  if global_rows is None:  # Each worker brings a batch of as many rows.
    global_rows = tf.shape(labels)[0] * config.num_workers

  def clone_fn(*args):
    return clone_step(model, loss_fn, global_rows, *args)
  if options.xla:
    clone_fn = tf.function(clone_fn, jit_compile=True)
  if options.reproducible_rows and stages is None:
    clone_fn = atoms.per_atom(clone_fn, options.reproducible_rows)
  image_shards = split_batch(config, images, shard_sizes)
  label_shards = split_batch(config, labels, shard_sizes)
  # Each worker's clone 0 carries its share of the penalty; with atoms,
  # the job's atom 0 (worker 0's) carries all of it.
  penalty = 1.0 / config.num_workers
  if options.reproducible_rows:
    penalty = float(config.worker_index == 0)
  weights = [penalty if regularization else 0.0] + [
      0.0] * (config.num_clones - 1)
  if lockstep is not None:
    with tf.device(config.variables_device()):
      variables = (values_of(model.trainable_variables),
                   values_of(model.non_trainable_variables))
    results = towers_in_strategy.run_clones_in_lockstep(
        lockstep, clone_fn, variables,
        list(zip(image_shards, label_shards, weights)), loss_scale)
  else:
    results = []
    for i in range(config.num_clones):
      if stages is not None:
        clone_fn = functools.partial(stages.clone_step,
                                     config.stage_devices(i), loss_fn,
                                     global_rows)
      with on_clone(config, i):
        # Each clone reads the variables from the variables device.
        results.append(clone_fn(
            values_of(model.trainable_variables),
            values_of(model.non_trainable_variables), image_shards[i],
            label_shards[i], weights[i], loss_scale))
  clones = []
  for i, result in enumerate(results):
    *result, states = result
    rows = image_shards[i].shape[0]
    part_rows = [rows] if stages is None else stages.microbatch_rows(rows)
    if options.reproducible_rows:
      part_rows = [options.reproducible_rows] * (
          rows // options.reproducible_rows)
    clones.append(Clone(*result, list(zip(part_rows, states)),
                        scope=config.clone_scope(i),
                        device=config.clone_device(i)))
  return clones


def optimize_clones(clones, variables):
  """Sums the clones' losses and gradients on the current device.

  Call it under `tf.device(config.optimizer_device())`.

  Args:
    clones: the list `create_clones` returned.
    variables: the trainable variables, in the order of the gradients.

  Returns:
    (total_loss, grads_and_vars), skipping variables that no clone reached.
  """
  with tf.name_scope('optimize_clones'):
    total_loss = tf.add_n([clone.loss for clone in clones], name='total_loss')
    grads_and_vars = []
    for k, variable in enumerate(variables):
      grads = [c.gradients[k] for c in clones if c.gradients[k] is not None]
      if grads:
        grads_and_vars.append((tf.add_n(grads, name='sum_gradients'),
                               variable))
  return total_loss, grads_and_vars
