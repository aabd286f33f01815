"""Learning-rate schedules counted in global steps of the global batch.

A global step consumes one global batch (`batch_size * num_clones` rows), so
a run of E epochs has `E * (train_examples // global_batch_size)` steps. The
schedule's length is that number, computed by the caller: with 4 clones a run
has a quarter of the steps, and the schedule spans the same epochs. (slim
counted decay in steps of one clone's batch, so adding clones stretched it:
tensorflow/models#2903, #3498, #4065.)
"""

import math

import keras
import tensorflow as tf

from tfmulti import errors

CONSTANT = 'constant'
COSINE = 'cosine'
STEP = 'step'
LR_SCHEDULES = (CONSTANT, COSINE, STEP)
NO_SCALING = 'none'
LINEAR = 'linear'
LR_SCALINGS = (NO_SCALING, LINEAR)
# The step schedule multiplies the rate by STEP_FACTOR at each of these
# fractions of the run (He et al.'s CIFAR schedule: 32k and 48k of 64k).
STEP_BOUNDARIES = (0.5, 0.75)
STEP_FACTOR = 0.1


def peak_learning_rate(learning_rate, scaling, num_clones):
  """The rate after warm-up: `learning_rate`, or times `num_clones`.

  Linear scaling (Goyal et al. 2017): a global batch k times larger takes a
  k times larger step, so that an epoch moves the weights as far.
  """
  errors.check_choice('lr_scaling', scaling, LR_SCALINGS)
  return learning_rate * (num_clones if scaling == LINEAR else 1)


@keras.saving.register_keras_serializable('tfmulti')
class Schedule(keras.optimizers.schedules.LearningRateSchedule):
  """Linear warm-up from 0 to `peak`, then constant, cosine or step decay.

  Step s (0-based, the optimizer's iteration count) gets
  `peak * (s + 1) / warmup_steps` during warm-up, so the first update is
  already non-zero and step `warmup_steps - 1` reaches the peak. Decay then
  runs over the remaining steps up to `total_steps`: cosine reaches 0 at
  `total_steps`; step multiplies by `STEP_FACTOR` at each of
  `STEP_BOUNDARIES` of `total_steps`.
  """

  def __init__(self, peak, total_steps, *, kind=CONSTANT, warmup_steps=0):
    errors.check_choice('lr_schedule', kind, LR_SCHEDULES)
    errors.check_positive('learning_rate', peak)
    errors.check_count('total_steps', total_steps, 1)
    if not 0 <= warmup_steps < total_steps:
      raise errors.ConfigError(
          f'warmup_steps={warmup_steps} must be in [0, total_steps='
          f'{total_steps}): the run has {total_steps} global steps; shorten '
          'the warm-up or train longer.')
    self.peak = float(peak)
    self.total_steps = int(total_steps)
    self.kind = kind
    self.warmup_steps = int(warmup_steps)

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    peak, total = self.peak, float(self.total_steps)
    warmup = float(self.warmup_steps)
    if self.kind == COSINE:
      progress = (step - warmup) / (total - warmup)
      progress = tf.clip_by_value(progress, 0.0, 1.0)
      rate = 0.5 * peak * (1.0 + tf.cos(math.pi * progress))
    elif self.kind == STEP:
      drops = tf.add_n([tf.cast(step >= b * total, tf.float32)
                        for b in STEP_BOUNDARIES])
      rate = peak * tf.pow(STEP_FACTOR, drops)
    else:
      rate = tf.constant(peak, tf.float32)
    if self.warmup_steps:
      rate = tf.where(step < warmup, peak * (step + 1.0) / warmup, rate)
    return rate

  def get_config(self):
    return {'peak': self.peak, 'total_steps': self.total_steps,
            'kind': self.kind, 'warmup_steps': self.warmup_steps}
