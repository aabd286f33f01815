"""TensorBoard event files, with the same tags on every strategy path.

Scalars: `losses/total` (the loss minimised), `losses/clone_<i>` (clone or
replica i's share of it; they sum to the total), `losses/regularization`,
`learning_rate` (the rate the step used), `images_per_sec` (global images
per second of training), `eval/accuracy` and `eval/loss`; a progress
line's `engine.readings.Reading` (`step_time`, `examples_per_sec`, `mfu`,
`memory/<device>/...`). With gradient
summaries, slim's `gradients/<variable>` histograms and
`gradient_norms/<variable>` scalars, plus `gradient_norms/global`.
"""

import numpy as np
import tensorflow as tf

TOTAL_LOSS = 'losses/total'
REGULARIZATION_LOSS = 'losses/regularization'
LEARNING_RATE = 'learning_rate'
IMAGES_PER_SEC = 'images_per_sec'
EVAL_ACCURACY = 'eval/accuracy'
EVAL_LOSS = 'eval/loss'
GLOBAL_GRADIENT_NORM = 'gradient_norms/global'


def clone_loss_tag(index):
  return f'losses/clone_{index}'


class Summaries:
  """Writes the scalars above into `directory`, from the host CPU device."""

  def __init__(self, directory, *, device):
    self._device = device
    with tf.device(device):
      self._writer = tf.summary.create_file_writer(directory)

  def _scalars(self, step, values):
    with tf.device(self._device), self._writer.as_default(step=step):
      for tag, value in values.items():
        tf.summary.scalar(tag, value)

  def train(self, step, outputs, *, learning_rate, images_per_sec,
            reading=None):
    """The losses of step `step` (a step's outputs), its rate and speed,
    and a `readings.Reading`'s scalars (its time, memory, MFU)."""
    values = {TOTAL_LOSS: float(outputs.total),
              REGULARIZATION_LOSS: float(outputs.regularization),
              LEARNING_RATE: float(learning_rate)}
    for i, loss in enumerate(outputs.clones):
      values[clone_loss_tag(i)] = float(loss)
    if np.isfinite(images_per_sec):  # Unknown until a step has been timed.
      values[IMAGES_PER_SEC] = images_per_sec
    if reading is not None:
      values.update(reading.scalars())
    self._scalars(step, values)

  def evaluation(self, step, evaluation):
    """`evaluation['accuracy']` and `['loss']` after step `step`."""
    self._scalars(step, {EVAL_ACCURACY: evaluation['accuracy'],
                         EVAL_LOSS: evaluation['loss']})

  def gradients(self, step, gradients):
    """Histograms and norms of `gradients`, a {variable path: value} dict."""
    with tf.device(self._device), self._writer.as_default(step=step):
      norms = []
      for path, gradient in sorted(gradients.items()):
        norm = tf.norm(tf.cast(gradient, tf.float32))
        norms.append(norm)
        tf.summary.histogram(f'gradients/{path}', gradient)
        tf.summary.scalar(f'gradient_norms/{path}', norm)
      if norms:
        tf.summary.scalar(GLOBAL_GRADIENT_NORM, tf.linalg.global_norm(norms))

  def close(self):
    self._writer.close()
