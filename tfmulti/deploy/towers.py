"""TF-Slim's model_deploy tower design, brought to TF 2 and Keras 3.

One `DeploymentConfig` says where everything lives: the variables (CPU:0, or a
chosen device), the clones (one per GPU, or one per logical CPU with
`clone_on_cpu`), the input split and the gradient sum. `deploy()` turns a
built functional Keras model, a loss and an optimizer into a `DeployedModel`
whose `train_step` splits this worker's batch of `batch_size * num_clones`
rows evenly over the clones, runs each clone's forward pass, loss and
gradient on its own device, sums the gradients on the optimizer device and
applies them once. The result equals one device training on the whole batch.

Three options keep that equality: `clone_shares` splits the rows unevenly
(for unequal devices; `balance` measures and sets them), `pipeline` cuts
each clone into stages on `DeploymentConfig.num_stages` devices fed with
micro-batches (`tfmulti.pipeline`), and `accumulation_steps` sums several
micro-steps into one update (`trainer.sum_microsteps`).

How this differs from slim (graph-mode TF 1):
  * `create_clones` records each clone under its own `tf.GradientTape` and
    computes that clone's gradient on its device at once; slim built only
    the forward pass there and took gradients later in `optimize_clones`.
  * `optimize_clones` sums the clones' losses and gradients; it does not
    compute them, and nothing goes through graph collections.
  * Clones run `model.stateless_call`, so Keras 3 BatchNorm returns its new
    moving statistics instead of assigning them once per clone; they are
    assigned once per step by `batch_norm_policy`.
  * With `clone_on_cpu`, clone i runs on CPU:i (logical CPU devices, see
    `devices.create_logical_cpus`); slim put every clone on CPU:0.
  * With a chosen variables device, the gradient sum and the update run
    there too, next to the variables and slots they read and write.
  * With parameter servers, worker devices carry `/task:<replica_id>`; slim
    left the task out, which broke multi-node runs (tensorflow/models#3945).

This module knows nothing of the tf.distribute paths; the one place where
the towers meet a strategy (clones in lockstep, for synchronized BatchNorm)
is `towers_in_strategy`.
"""

import functools

import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti.deploy import towers_in_strategy
from tfmulti import trainer
# The BatchNorm policies, where slim users look for them: deploy.BN_*.
from tfmulti.deploy.batch_norm import (  # noqa: F401
    BATCH_NORM_POLICIES, BN_CLONE_0, BN_FULL_BATCH, BN_MEAN,
    combine_non_trainable, moments_of)
# Slim's building blocks, where its users look for them: deploy.<name>.
from tfmulti.deploy.clones import (  # noqa: F401
    Clone, clone_step, create_clones, on_clone, optimize_clones, split_batch,
    values_of)
from tfmulti.pipeline.stages import (
    check_pipeline_options, Pipeline, PipelineConfig)
# Slim's config, where its users look for it: deploy.DeploymentConfig.
from tfmulti.deploy.placement import DeploymentConfig  # noqa: F401
# The loss rules every path shares, also reachable as deploy.<name>.
from tfmulti.trainer import mean_loss, shard_loss  # noqa: F401

class DeployedModel(trainer.Trainer):
  """A model deployed over clones, with its compiled training step.

  Slim's DeployedModel held a train_op and summary_op; in TF 2 it holds the
  `tf.function` that runs one step. Attributes: `config`, `model`,
  `loss_fn`, `optimizer`, `batch_norm_policy`, `jit_compile`,
  `return_gradients` (steps also return the summed gradients), `lockstep`
  and `pipeline` (see `create_clones`), `clone_shares` (each clone's
  share of a step's rows; None for equal; settable between steps, see
  `balance`) and `accumulation_steps`.
  """

  def __init__(self, config, model, loss_fn, optimizer, *,
               batch_norm_policy, jit_compile, return_gradients=False,
               lockstep=None, pipeline=None, clone_shares=None,
               accumulation_steps=1):
    self.config = config
    self.model = model
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.batch_norm_policy = batch_norm_policy
    self.jit_compile = jit_compile
    self.return_gradients = return_gradients
    self.lockstep = lockstep
    self.pipeline = pipeline
    self.clone_shares = clone_shares
    self.accumulation_steps = accumulation_steps
    self._moments = moments_of(model)
    self._probes = {}  # Clone index -> its timing function.
    self._step = tf.function(self.step_graph)
    self._predict = tf.function(self._predict_graph)

  def step_graph(self, images, labels, sizes=None):
    """The step, untraced: for `tf.function`, or inside a replica context
    (each worker of a multi-worker job runs it; Keras's `apply_gradients`
    then all-reduces the workers' summed gradients before the update).

    `sizes`: each clone's rows of a micro-step (None: equal). With
    `accumulation_steps` K the batch holds K micro-steps; their gradients
    are summed on the optimizer device and applied once.
    """
    config, model = self.config, self.model
    variables = model.trainable_variables
    loss_scale = trainer.loss_scale_of(self.optimizer)
    with tf.device(config.variables_device()):
      scale = 1.0 if loss_scale is None else tf.identity(loss_scale)
    # Every micro-step of every worker is a part of the job's batch.
    global_rows = tf.shape(labels)[0] * config.num_workers

    def microstep(images, labels, first):
      clones = create_clones(config, model, self.loss_fn, images, labels,
                             jit_compile=self.jit_compile, loss_scale=scale,
                             lockstep=self.lockstep, pipeline=self.pipeline,
                             shard_sizes=sizes, global_rows=global_rows,
                             regularization=first)
      with tf.device(config.optimizer_device()):
        total_loss, grads_and_vars = optimize_clones(clones, variables)
      self._update_state(clones)
      by_variable = {id(v): g for g, v in grads_and_vars}
      return ([by_variable.get(id(v)) for v in variables],
              [total_loss, clones[0].regularization_loss] +
              [clone.loss for clone in clones])

    gradients, (total_loss, regularization, *clone_losses) = (
        trainer.sum_microsteps(microstep, images, labels,
                               self.accumulation_steps,
                               config.optimizer_device()))
    with tf.device(config.optimizer_device()):
      grads_and_vars = [(g, v) for g, v in zip(gradients, variables)
                        if g is not None]
      # A LossScaleOptimizer divides by the scale, and skips the update
      # (halving the scale) when a gradient is not finite.
      self.optimizer.apply_gradients(grads_and_vars)
      summed = {}
      if self.return_gradients:
        summed = trainer.gradients_by_path(
            grads_and_vars, None if loss_scale is None else scale)
    return trainer.StepOutputs(total_loss, regularization, clone_losses,
                               summed)

  def _update_state(self, clones):
    """Assigns the non-trainable variables once, under the BN policy."""
    model = self.model
    with tf.device(self.config.variables_device()), \
        tf.name_scope('update_state'):
      new_values = combine_non_trainable(clones, self.batch_norm_policy,
                                         self._moments)
      for variable, value in zip(model.non_trainable_variables, new_values):
        variable.assign(value)

  def distribute_dataset(self, dataset):
    """`dataset` itself: each step splits its batch over the clones."""
    return dataset

  def clone_rows(self, rows):
    """Each clone's rows of a micro-step of a worker batch of `rows`, or
    None for equal rows; raises `ConfigError` for a batch that cannot be
    split so."""
    steps, n = self.accumulation_steps, self.config.num_clones
    if rows % steps:
      raise errors.ConfigError(
          f'a batch of {rows} rows does not split into accumulation_steps='
          f'{steps} equal micro-steps; pass a multiple of {steps}.')
    sizes = trainer.shard_rows(rows // steps, self.clone_shares, n)
    if sizes is None and rows // steps % n:
      raise errors.ConfigError(
          f'a micro-step of {rows // steps} rows does not split evenly over '
          f'num_clones={n}; pass batch_size * num_clones * '
          f'accumulation_steps rows.')
    if self.pipeline is not None:  # Raises if a micro-batch would be empty.
      for size in sizes or [rows // steps // n]:
        self.pipeline.microbatch_rows(size)
    return sizes

  def train_step_outputs(self, images, labels):
    """One step on this worker's batch; returns its `StepOutputs`."""
    images, labels = tf.convert_to_tensor(images), tf.convert_to_tensor(labels)
    trainer.check_batch(images, labels, 1 if self.clone_shares else
                        self.config.num_clones)
    # One trace per distinct split: `sizes` is a tuple of Python ints.
    return self._step(images, labels, self.clone_rows(images.shape[0]))

  def _probe_graph(self, clone_index, images, labels):
    """Clone `clone_index` alone: its forward and backward pass on its
    device(s), reduced to one number so nothing is pruned."""
    config, model = self.config, self.model
    rows = tf.shape(labels)[0]
    with on_clone(config, clone_index):
      args = (values_of(model.trainable_variables),
              values_of(model.non_trainable_variables), images, labels, 0.0,
              1.0)
      if self.pipeline is None:
        _, loss, _, gradients, _ = clone_step(model, self.loss_fn, rows,
                                               *args)
      else:
        _, loss, _, gradients, _ = self.pipeline.clone_step(
            config.stage_devices(clone_index), self.loss_fn, rows, *args)
      return loss + tf.add_n([tf.reduce_sum(g) for g in gradients
                              if g is not None])

  def probe(self, clone_index):
    """A `tf.function(images, labels)` of clone `clone_index` alone, for
    timing it (`balance.clone_throughputs`)."""
    if clone_index not in self._probes:
      self._probes[clone_index] = tf.function(
          functools.partial(self._probe_graph, clone_index))
    return self._probes[clone_index]

  def _predict_graph(self, images):
    rows, n = images.shape[0], self.config.num_clones
    # Inference may see a short last batch: shards differ by one row at most,
    # and a batch of fewer rows than clones leaves the last clones idle.
    sizes = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
    with tf.device(self.config.inputs_device()):
      shards = tf.split(images, sizes, axis=0)
    outputs = []
    for i in range(n):
      if not sizes[i]:
        continue
      with on_clone(self.config, i):
        if self.pipeline is None:
          outputs.append(self.model(shards[i], training=False))
        else:
          outputs.append(self.pipeline.predict(
              self.config.stage_devices(i), shards[i]))
    with tf.device(self.config.inputs_device()):
      return tf.concat(outputs, axis=0)

  def predict(self, images):
    """Inference outputs for `images`, computed over the clones."""
    return self._predict(tf.convert_to_tensor(images))


def deploy(config, model, loss_fn, optimizer, *,
           batch_norm_policy=BN_CLONE_0, jit_compile=False,
           return_gradients=False, lockstep=None, pipeline=None,
           clone_shares=None, accumulation_steps=1):
  """Deploys `model` over `config`'s clones.

  Builds the optimizer's slot variables on the variables device, and checks,
  before anything runs, that every device exists and every variable lives on
  `config.variables_device()`.

  Args:
    config: a `DeploymentConfig`.
    model: a functional `keras.Model` built under
      `tf.device(config.variables_device())`.
    loss_fn: `loss_fn(labels, outputs)` -> mean loss (any `keras.losses`
      object with its default reduction).
    optimizer: a Keras optimizer created under the variables device.
    batch_norm_policy: one of `BATCH_NORM_POLICIES`; see
      `combine_non_trainable`.
    jit_compile: compile each clone's forward and backward pass with XLA.
    return_gradients: steps also return the summed gradients (for
      summaries).
    lockstep: a `tf.distribute.MirroredStrategy` over exactly the clone
      devices, to run the clones at once; needed by Keras's synchronized
      BatchNorm, which all-reduces batch statistics between replicas.
    pipeline: a `pipeline.PipelineConfig`: cut each clone into
      `config.num_stages` stages and its rows into micro-batches. None is
      one stage and one micro-batch (no pipeline).
    clone_shares: each clone's share of the rows of every step, e.g.
      (3, 1) for a device three times as fast (split by largest
      remainder); None splits evenly. A step still equals one device on
      the whole batch: each clone's loss is weighted by its rows. The
      shares are a `deploy()` argument, not a `DeploymentConfig` field:
      they say how rows are split, not where anything lives, and an
      automatic balance changes them during training.
    accumulation_steps: K: each step's batch holds K micro-steps whose
      summed gradients make one update (gradient accumulation): one device
      on the K micro-steps' rows.

  Returns:
    A `DeployedModel`.

  Raises:
    errors.UserError: a missing device, a misplaced variable, an unknown
      policy, a model that is not built, or a lockstep strategy that does
      not fit.
  """
  errors.check_choice('batch_norm_policy', batch_norm_policy,
                      BATCH_NORM_POLICIES)
  trainer.check_shares(clone_shares, config.num_clones)
  errors.check_count('accumulation_steps', accumulation_steps, 1)
  if lockstep is not None and (accumulation_steps > 1 or clone_shares):
    raise errors.UnsupportedError(
        'clone_shares and accumulation_steps are not supported with '
        'synchronized BatchNorm (lockstep clones): drop one or the other.')
  if not model.built:
    raise errors.ConfigError(
        f'model {model.name!r} is not built; build a functional model '
        '(keras.Input) under the variables device.')
  if lockstep is not None:
    towers_in_strategy.check_lockstep(lockstep, config.clone_devices(),
                                      jit_compile)
  stages = None
  pipeline = pipeline or PipelineConfig()
  if config.num_stages > 1 or pipeline.num_microbatches > 1:
    check_pipeline_options(jit_compile=jit_compile,
                           lockstep=lockstep is not None)
    stages = Pipeline(model, config.num_stages, pipeline)
  devices.check_devices_exist(
      [config.variables_device(), config.optimizer_device(),
       config.inputs_device()] + config.compute_devices())
  if not optimizer.built:
    with tf.device(config.variables_device()):
      optimizer.build(model.trainable_variables)
  devices.check_placement(model.variables + optimizer.variables,
                          config.variables_device())
  return DeployedModel(config, model, loss_fn, optimizer,
                       batch_norm_policy=batch_norm_policy,
                       jit_compile=jit_compile,
                       return_gradients=return_gradients, lockstep=lockstep,
                       pipeline=stages, clone_shares=clone_shares,
                       accumulation_steps=accumulation_steps)
