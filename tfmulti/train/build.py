"""What every path trains: the model, its optimizer, loss and schedule.

The command line, the strategy registry and the benchmark all build through
these functions, so a comparison between paths changes only the path.
"""

import contextlib

import keras

from tfmulti import errors
from tfmulti import models
from tfmulti.train import learning_rates

OPTIMIZERS = ('sgd', 'momentum', 'adam')
_MOMENTUM = 0.9  # Of the 'momentum' optimizer.
MIXED_GPU = 'mixed_float16'
MIXED_CPU = 'mixed_bfloat16'


def make_optimizer(name, learning_rate):
  """A Keras optimizer by name; create it where the variables live.

  `learning_rate` is a float or a `keras.optimizers.schedules` schedule.
  """
  errors.check_choice('optimizer', name, OPTIMIZERS)
  if name == 'adam':
    return keras.optimizers.Adam(learning_rate)
  return keras.optimizers.SGD(learning_rate,
                              momentum=_MOMENTUM if name == 'momentum' else 0.0)


def make_loss():
  """Mean cross-entropy over the examples given, from logits."""
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dtype_policy(mixed_precision, clone_on_cpu):
  """The Keras dtype policy of the model: None (float32) or a mixed one."""
  if not mixed_precision:
    return None
  # float16 has the GPUs' fast kernels but needs loss scaling; bfloat16 has
  # float32's range and is what CPUs accelerate.
  return MIXED_CPU if clone_on_cpu else MIXED_GPU


def model_and_optimizer(config, deploy_config, *, input_shape, num_classes,
                        learning_rate):
  """A callable that builds (model, optimizer) in the current scope.

  Call it under the optimizer's device (towers) or a strategy's scope; its
  argument, a context to build the model in (the towers'
  `variables_scope()`, which may spread the variables), leaves the
  optimizer out of it, so Keras puts each slot beside its variable.

  Args:
    config: a `config.TrainConfig` (model, optimizer, precision, BatchNorm).
    deploy_config: a `deploy.DeploymentConfig` (CPU or GPU clones).
    input_shape: (height, width, channels) of one image.
    num_classes: number of labels.
    learning_rate: a float or a schedule.
  """
  policy = dtype_policy(config.mixed_precision, deploy_config.clone_on_cpu)

  def build(model_scope=None):
    with model_scope or contextlib.nullcontext():
      model = models.get_model(
          config.model, input_shape=input_shape, num_classes=num_classes,
          dtype_policy=policy,
          sync_batch_norm=config.step_options.sync_batch_norm,
          weights=config.weights,
          batch_norm_momentum=config.batch_norm_momentum)
    optimizer = make_optimizer(config.optimizer, learning_rate)
    if policy == MIXED_GPU:  # float16 gradients underflow without it.
      optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return model, optimizer
  return build


def make_schedule(config, job_clones, total_steps):
  """The learning-rate schedule of a run of `total_steps` global steps.

  `job_clones` counts the clones of every worker (linear scaling's factor).

  Raises:
    errors.ConfigError: a warm-up as long as the run, named with the run's
      length.
  """
  peak = learning_rates.peak_learning_rate(
      config.learning_rate, config.lr_scaling, job_clones)
  return learning_rates.Schedule(peak, total_steps, kind=config.lr_schedule,
                                 warmup_steps=config.warmup_steps)
