"""TF-Slim's model_deploy tower design, brought to TF 2 and Keras 3.

One `DeploymentConfig` says where everything lives: the variables (CPU:0, or a
chosen device), the clones (one per GPU, or one per logical CPU with
`clone_on_cpu`), the input split and the gradient sum. `deploy()` turns a
built functional Keras model, a loss and an optimizer into a `DeployedModel`
whose `train_step` splits a global batch of `batch_size * num_clones` rows
evenly over the clones, runs each clone's forward pass, loss and gradient on
its own device, sums the gradients on the optimizer device and applies them
once. The result equals one device training on the whole batch.

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
  * With parameter servers, worker devices carry `/task:<replica_id>`; slim
    left the task out, which broke multi-node runs (tensorflow/models#3945).
"""

import collections
import contextlib
import dataclasses
from typing import Optional

import keras
import tensorflow as tf

from tfmulti import devices

# Batch-norm moving statistics: which clones' values are kept each step.
BN_CLONE_0 = 'clone_0'  # slim's rule, and what MirroredStrategy reads back.
BN_MEAN = 'mean'  # The mean over clones (non-float state: clone 0's).
BATCH_NORM_POLICIES = (BN_CLONE_0, BN_MEAN)


def _check_count(name, value, minimum):
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f'{name}={value!r}: must be an integer >= {minimum}.')


def _normalise_device(device):
  """Returns `device` in canonical form ('/gpu:0' -> '/device:GPU:0')."""
  try:
    return tf.DeviceSpec.from_string(device).to_string()
  except (ValueError, TypeError) as e:
    raise ValueError(
        f'variables_device={device!r} is not a device string; use e.g. '
        "'/device:CPU:0' or '/device:GPU:0'.") from e


@dataclasses.dataclass(frozen=True, init=False)
class DeploymentConfig:
  """Where variables, clones, inputs and the optimizer live.

  Pure: it needs no TensorFlow runtime state, and every device string in
  tfmulti comes from here.

  Attributes:
    num_clones: model copies on this worker, one per device.
    clone_on_cpu: put clone i on CPU:i (logical CPU devices) instead of GPU:i.
    replica_id: this worker's index in a multi-worker job.
    num_replicas: number of workers; each runs num_clones clones, and the
      global batch is batch_size * num_clones * num_replicas.
    num_ps_tasks: parameter-server tasks; 0 keeps the variables local.
    worker_job_name: job name of the workers in the cluster spec.
    ps_job_name: job name of the parameter servers in the cluster spec.
  """
  num_clones: int
  clone_on_cpu: bool
  replica_id: int
  num_replicas: int
  num_ps_tasks: int
  worker_job_name: str
  ps_job_name: str
  _variables_device: Optional[str]

  def __init__(self, num_clones=1, clone_on_cpu=False, variables_device=None,
               replica_id=0, num_replicas=1, num_ps_tasks=0,
               worker_job_name='worker', ps_job_name='ps'):
    """Validates the arguments; raises `ValueError` naming the bad value."""
    _check_count('num_clones', num_clones, 1)
    _check_count('num_replicas', num_replicas, 1)
    _check_count('num_ps_tasks', num_ps_tasks, 0)
    _check_count('replica_id', replica_id, 0)
    if replica_id >= num_replicas:
      raise ValueError(f'replica_id={replica_id} must be in '
                       f'[0, num_replicas={num_replicas}).')
    if num_replicas > 1 or num_ps_tasks > 0:
      if not worker_job_name:
        raise ValueError(f'worker_job_name={worker_job_name!r}: a job name is '
                         'needed with replicas or parameter servers.')
      if not ps_job_name:
        raise ValueError(f'ps_job_name={ps_job_name!r}: a job name is needed '
                         'with replicas or parameter servers.')
    if variables_device is not None:
      if num_ps_tasks > 0:
        raise ValueError(
            f'variables_device={variables_device!r} cannot be combined with '
            f'num_ps_tasks={num_ps_tasks}: parameter servers hold the '
            'variables; leave variables_device unset.')
      variables_device = _normalise_device(variables_device)
    values = dict(num_clones=num_clones, clone_on_cpu=bool(clone_on_cpu),
                  replica_id=replica_id, num_replicas=num_replicas,
                  num_ps_tasks=num_ps_tasks, worker_job_name=worker_job_name,
                  ps_job_name=ps_job_name, _variables_device=variables_device)
    for name, value in values.items():
      object.__setattr__(self, name, value)

  def _worker_prefix(self):
    # With parameter servers the worker's own task must be named, or every
    # worker's ops land on task 0 (slim's bug, tensorflow/models#3945, #434).
    if self.num_ps_tasks > 0:
      return f'/job:{self.worker_job_name}/task:{self.replica_id}'
    return ''

  def _check_clone_index(self, clone_index):
    if (isinstance(clone_index, bool) or not isinstance(clone_index, int)
        or not 0 <= clone_index < self.num_clones):
      raise ValueError(f'clone_index={clone_index!r} must be in '
                       f'[0, num_clones={self.num_clones}).')

  def clone_device(self, clone_index):
    """Device of clone `clone_index`: GPU:i, or CPU:i with `clone_on_cpu`."""
    self._check_clone_index(clone_index)
    device_type = 'CPU' if self.clone_on_cpu else 'GPU'
    return f'{self._worker_prefix()}/device:{device_type}:{clone_index}'

  def clone_scope(self, clone_index):
    """Name scope of clone `clone_index`: '' for a single clone."""
    self._check_clone_index(clone_index)
    return '' if self.num_clones == 1 else f'clone_{clone_index}'

  def clone_devices(self):
    """All clone devices, in clone order."""
    return [self.clone_device(i) for i in range(self.num_clones)]

  def optimizer_device(self):
    """Where the clones' gradients are summed and applied."""
    return f'{self._worker_prefix()}/device:CPU:0'

  def inputs_device(self):
    """Where the input pipeline runs and the global batch is split."""
    return f'{self._worker_prefix()}/device:CPU:0'

  def summaries_device(self):
    """Where summaries and checkpoints are written from: the host CPU."""
    return f'{self._worker_prefix()}/device:CPU:0'

  def variables_device(self):
    """Where variables and optimizer slots are created.

    CPU:0 by default, the device given to the constructor, or the parameter
    servers' CPU. Spreading variables over several ps tasks (slim's
    round-robin device function) has no eager-mode equivalent.
    """
    if self.num_ps_tasks > 0:
      return f'/job:{self.ps_job_name}/device:CPU:0'
    return self._variables_device or '/device:CPU:0'


# A clone's share of one step (slim: Clone(outputs, scope, device)).
# `loss` is the clone's part of the total loss (its mean loss divided by
# num_clones, plus the regularization losses on clone 0); `gradients` are
# d loss / d trainable variable, computed on `device`; `non_trainable` are the
# model's non-trainable variables as this clone's forward pass left them.
Clone = collections.namedtuple(
    'Clone', ['outputs', 'loss', 'regularization_loss', 'gradients',
              'non_trainable', 'scope', 'device'])

# What one training step reports: `total` is the loss that was minimised,
# `clones` each clone's share of it (summing to `total`); `gradients` maps
# each variable's path to its combined gradient, when asked for (else {}).
StepOutputs = collections.namedtuple(
    'StepOutputs', ['total', 'regularization', 'clones', 'gradients'])


def shard_loss(shard_mean, shard_rows, global_rows):
  """One shard's part of the mean loss over the global batch.

  Args:
    shard_mean: the mean loss over the shard's rows.
    shard_rows: rows in the shard.
    global_rows: rows in the global batch.

  Returns:
    shard_mean * shard_rows / global_rows.
  """
  # Gradients are summed over shards (the towers' central sum, or
  # tf.distribute's all-reduce), not averaged, so each shard's mean loss is
  # weighted by its share of the global batch (1 / num_clones for equal
  # shards): the sum is then the mean over the global batch, exactly as one
  # device would compute it.
  dtype = shard_mean.dtype
  return shard_mean * tf.cast(shard_rows, dtype) / tf.cast(global_rows, dtype)


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


def check_batch(images, labels, num_shards, shard_word='num_clones'):
  """Raises `ValueError` unless the batch splits evenly into `num_shards`."""
  rows, label_rows = images.shape[0], labels.shape[0]
  if rows is None or rows != label_rows:
    raise ValueError(f'images have {rows} rows and labels {label_rows}; '
                     'pass a batch with as many labels as images.')
  if rows % num_shards:
    raise ValueError(
        f'a batch of {rows} rows does not split evenly over '
        f'{shard_word}={num_shards}; pass batch_size * {shard_word} rows '
        '(batch the dataset with drop_remainder=True).')


def _clone_step(model, loss_fn, num_clones, trainable, non_trainable,
                images, labels, regularization_weight, loss_scale):
  """Forward pass, loss and gradient of one clone; changes no variable.

  `trainable` and `non_trainable` are the variables' values as tensors, so
  the computation can be compiled by XLA apart from the variables (XLA will
  not read a variable that lives on another device). The regularization
  losses count `regularization_weight` times (1 on clone 0, else 0); the
  gradient is of `loss * loss_scale` (float16 loss scaling; 1 otherwise).
  """
  with tf.GradientTape() as tape:
    tape.watch(trainable)
    outputs, new_non_trainable, losses = model.stateless_call(
        trainable, non_trainable, images, training=True, return_losses=True)
    rows = tf.shape(labels)[0]
    loss = shard_loss(mean_loss(loss_fn, labels, outputs), rows,
                      rows * num_clones)
    regularization = tf.zeros([], loss.dtype)
    if losses and not (isinstance(regularization_weight, (int, float))
                       and regularization_weight == 0):
      # The variables are shared, so their penalty is counted once (clone 0).
      regularization = tf.add_n([tf.cast(l, loss.dtype) for l in losses])
      regularization *= tf.cast(regularization_weight, loss.dtype)
    loss += regularization
    scaled_loss = loss * tf.cast(loss_scale, loss.dtype)
  gradients = tape.gradient(scaled_loss, trainable)
  return outputs, loss, regularization, gradients, new_non_trainable


@contextlib.contextmanager
def _on_clone(config, clone_index):
  """Places ops on the clone's device, under its name scope (if any)."""
  scope = config.clone_scope(clone_index)
  with tf.device(config.clone_device(clone_index)):
    if scope:
      with tf.name_scope(scope):
        yield
    else:
      yield


def split_batch(config, tensor):
  """Splits `tensor`'s rows evenly over the clones, on the inputs device."""
  with tf.device(config.inputs_device()), tf.name_scope('split_batch'):
    return tf.split(tensor, config.num_clones, axis=0)


def _clones_in_lockstep(config, model, clone_fn, image_shards, label_shards,
                        loss_scale, lockstep):
  """Runs the clones as the replicas of `lockstep`, a MirroredStrategy.

  Keras's synchronized BatchNorm all-reduces its batch statistics in a
  tf.distribute replica context, which needs every clone's forward pass to
  run at once; the strategy's replicas do. The variables, the gradient sum
  and the update stay the towers' own.
  """
  with tf.device(config.variables_device()):
    trainable = [tf.convert_to_tensor(v) for v in model.trainable_variables]
    non_trainable = [tf.convert_to_tensor(v)
                     for v in model.non_trainable_variables]
  weight = 1.0 / config.num_replicas
  shards = lockstep.experimental_distribute_values_from_function(
      lambda ctx: (image_shards[ctx.replica_id_in_sync_group],
                   label_shards[ctx.replica_id_in_sync_group],
                   tf.constant(weight if ctx.replica_id_in_sync_group == 0
                               else 0.0)))
  per_replica = lockstep.run(
      lambda shard: clone_fn(trainable, non_trainable, *shard, loss_scale),
      args=(shards,))
  n = config.num_clones
  columns = []
  for value in tf.nest.flatten(per_replica):
    local = lockstep.experimental_local_results(value)
    # An output that every replica computed alike comes back once.
    columns.append(local if len(local) == n else local * n)
  return [tf.nest.pack_sequence_as(per_replica, list(values))
          for values in zip(*columns)]


def create_clones(config, model, loss_fn, images, labels, *,
                  jit_compile=False, loss_scale=1.0, lockstep=None):
  """Runs every clone on its device and its shard of the batch.

  Args:
    config: a `DeploymentConfig`.
    model: a built functional `keras.Model` whose variables live on
      `config.variables_device()`.
    loss_fn: `loss_fn(labels, outputs)` -> mean loss over those examples.
    images: the global batch, `batch_size * num_clones` rows.
    labels: its labels, as many rows.
    jit_compile: compile each clone's forward and backward pass with XLA,
      one cluster per clone on that clone's device (compiling the whole
      step would fuse every clone into one cluster on one device).
    loss_scale: multiplies each clone's loss before its gradient (the
      float16 loss scale of a `keras.optimizers.LossScaleOptimizer`).
    lockstep: None, or a `tf.distribute.MirroredStrategy` over the clone
      devices whose replicas run the clones at once (for synchronized
      BatchNorm; see `_clones_in_lockstep`).

  Returns:
    A list of `Clone`, one per clone.
  """
  def clone_fn(*args):
    # Shards of the whole job's batch: every clone of every worker.
    return _clone_step(model, loss_fn, config.num_clones * config.num_replicas,
                       *args)
  if jit_compile:
    clone_fn = tf.function(clone_fn, jit_compile=True)
  image_shards = split_batch(config, images)
  label_shards = split_batch(config, labels)
  if lockstep is not None:
    results = _clones_in_lockstep(config, model, clone_fn, image_shards,
                                  label_shards, loss_scale, lockstep)
  else:
    results = []
    for i in range(config.num_clones):
      with _on_clone(config, i):
        # Each clone reads the variables from the variables device.
        trainable = [tf.convert_to_tensor(v)
                     for v in model.trainable_variables]
        non_trainable = [tf.convert_to_tensor(v)
                         for v in model.non_trainable_variables]
        # Each worker's clone 0 carries its share of the penalty.
        weight = 1.0 / config.num_replicas if i == 0 else 0.0
        results.append(clone_fn(trainable, non_trainable, image_shards[i],
                                label_shards[i], weight, loss_scale))
  return [Clone(*result, scope=config.clone_scope(i),
                device=config.clone_device(i))
          for i, result in enumerate(results)]


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


def combine_non_trainable(clones, policy):
  """The non-trainable values to keep after a step, under `policy`."""
  if policy == BN_CLONE_0:
    return list(clones[0].non_trainable)
  combined = []
  for values in zip(*(c.non_trainable for c in clones)):
    if values[0].dtype.is_floating:
      combined.append(tf.add_n(list(values)) / len(values))
    else:  # Random-generator state and counters are not averaged.
      combined.append(values[0])
  return combined


def loss_scale_of(optimizer):
  """The dynamic loss scale of a `LossScaleOptimizer`; None for others."""
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    return optimizer.dynamic_scale
  return None


def gradients_by_path(grads_and_vars, scale=None):
  """{variable path: gradient}, divided by the loss `scale` if given."""
  return {variable.path: gradient if scale is None else gradient / scale
          for gradient, variable in grads_and_vars}


class DeployedModel:
  """A model deployed over clones, with its compiled training step.

  Slim's DeployedModel held a train_op and summary_op; in TF 2 it holds the
  `tf.function` that runs one step. Attributes: `config`, `model`,
  `loss_fn`, `optimizer`, `batch_norm_policy`, `jit_compile`,
  `return_gradients` (steps also return the summed gradients), `lockstep`
  (see `create_clones`).
  """

  def __init__(self, config, model, loss_fn, optimizer, *,
               batch_norm_policy, jit_compile, return_gradients=False,
               lockstep=None):
    self.config = config
    self.model = model
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.batch_norm_policy = batch_norm_policy
    self.jit_compile = jit_compile
    self.return_gradients = return_gradients
    self.lockstep = lockstep
    self._step = tf.function(self.step_graph)
    self._predict = tf.function(self._predict_graph)

  def step_graph(self, images, labels):
    """The step, untraced: for `tf.function`, or inside a replica context
    (each worker of a multi-worker job runs it; Keras's `apply_gradients`
    then all-reduces the workers' summed gradients before the update)."""
    config, model = self.config, self.model
    loss_scale = loss_scale_of(self.optimizer)
    with tf.device(config.variables_device()):
      scale = 1.0 if loss_scale is None else tf.identity(loss_scale)
    clones = create_clones(config, model, self.loss_fn, images, labels,
                           jit_compile=self.jit_compile, loss_scale=scale,
                           lockstep=self.lockstep)
    with tf.device(config.optimizer_device()):
      total_loss, grads_and_vars = optimize_clones(
          clones, model.trainable_variables)
      # A LossScaleOptimizer divides by the scale, and skips the update
      # (halving the scale) when a gradient is not finite.
      self.optimizer.apply_gradients(grads_and_vars)
      gradients = {}
      if self.return_gradients:
        gradients = gradients_by_path(
            grads_and_vars, None if loss_scale is None else scale)
    with tf.device(config.variables_device()), tf.name_scope('update_state'):
      new_values = combine_non_trainable(clones, self.batch_norm_policy)
      for variable, value in zip(model.non_trainable_variables, new_values):
        variable.assign(value)
    return StepOutputs(total_loss, clones[0].regularization_loss,
                       [clone.loss for clone in clones], gradients)

  @property
  def trace_count(self):
    """How many times the training step has been traced (one per signature)."""
    return self._step.experimental_get_tracing_count()

  def distribute_dataset(self, dataset):
    """`dataset` itself: each step splits its global batch over the clones."""
    return dataset

  def train_step_outputs(self, images, labels):
    """One step on the global batch; returns its `StepOutputs`."""
    images, labels = tf.convert_to_tensor(images), tf.convert_to_tensor(labels)
    check_batch(images, labels, self.config.num_clones)
    return self._step(images, labels)

  def train_step(self, images, labels):
    """One step on the global batch; returns the total loss (a scalar)."""
    return self.train_step_outputs(images, labels).total

  def _predict_graph(self, images):
    rows, n = images.shape[0], self.config.num_clones
    # Inference may see a short last batch: shards differ by one row at most.
    sizes = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
    with tf.device(self.config.inputs_device()):
      shards = tf.split(images, sizes, axis=0)
    outputs = []
    for i in range(n):
      with _on_clone(self.config, i):
        outputs.append(self.model(shards[i], training=False))
    with tf.device(self.config.inputs_device()):
      return tf.concat(outputs, axis=0)

  def predict(self, images):
    """Inference outputs for `images`, computed over the clones."""
    return self._predict(tf.convert_to_tensor(images))


def _check_lockstep(config, lockstep, jit_compile):
  if jit_compile:
    raise ValueError('jit_compile=True cannot be combined with lockstep: XLA '
                     "compiles each clone alone, and lockstep clones exchange "
                     'statistics mid-pass; drop one of them.')
  wanted = [tf.DeviceSpec.from_string(d) for d in config.clone_devices()]
  have = [tf.DeviceSpec.from_string(d)
          for d in lockstep.extended.worker_devices]
  if [(d.device_type, d.device_index) for d in wanted] != [
      (d.device_type, d.device_index) for d in have]:
    raise ValueError(
        f'lockstep replicas on {list(lockstep.extended.worker_devices)} are '
        f'not the clone devices {config.clone_devices()}; build the strategy '
        'over config.clone_devices().')


def deploy(config, model, loss_fn, optimizer, *,
           batch_norm_policy=BN_CLONE_0, jit_compile=False,
           return_gradients=False, lockstep=None):
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
    batch_norm_policy: `BN_CLONE_0` (slim) or `BN_MEAN`; see the module doc.
    jit_compile: compile each clone's forward and backward pass with XLA.
    return_gradients: steps also return the summed gradients (for
      summaries).
    lockstep: a `tf.distribute.MirroredStrategy` over exactly the clone
      devices, to run the clones at once; needed by Keras's synchronized
      BatchNorm, which all-reduces batch statistics between replicas.

  Returns:
    A `DeployedModel`.

  Raises:
    ValueError: a missing device, a misplaced variable, an unknown policy or
      a model that is not built.
  """
  if batch_norm_policy not in BATCH_NORM_POLICIES:
    raise ValueError(f'batch_norm_policy={batch_norm_policy!r}: use one of '
                     f'{BATCH_NORM_POLICIES}.')
  if not model.built:
    raise ValueError(f'model {model.name!r} is not built; build a functional '
                     'model (keras.Input) under the variables device.')
  if lockstep is not None:
    _check_lockstep(config, lockstep, jit_compile)
  devices.check_devices_exist(
      [config.variables_device(), config.optimizer_device(),
       config.inputs_device()] + config.clone_devices())
  if not optimizer.built:
    with tf.device(config.variables_device()):
      optimizer.build(model.trainable_variables)
  devices.check_placement(model.variables + optimizer.variables,
                          config.variables_device())
  return DeployedModel(config, model, loss_fn, optimizer,
                       batch_norm_policy=batch_norm_policy,
                       jit_compile=jit_compile,
                       return_gradients=return_gradients, lockstep=lockstep)
