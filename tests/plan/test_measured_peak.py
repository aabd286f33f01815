"""The plan's peak beside the runtime's own, where a device's memory can be
measured: one clone, alone on its device (logical CPUs share one
allocator and run their clones unsynchronized, so several clones' sum is
no device's). The runtime's CPU allocator counts its buffers where oneDNN
is on (TensorFlow's default on x86); elsewhere it has no figure, and the
test is skipped. Where the activations lead the step, the two agree;
docs/design.md has the cases that do not yet."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.deploy import placement
from tfmulti.deploy import towers
from tfmulti.plan import dry_run

CPU = '/device:CPU:0'


def _mlp():
  """Eight Dense layers 1024 wide: at 1024 rows, their activations lead."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((64,))
  x = inputs
  for _ in range(8):
    x = keras.layers.Dense(1024, activation='relu')(x)
  return keras.Model(inputs, keras.layers.Dense(10)(x))


def _measured(step, batch):
  """The most bytes the device's buffers took over three runs of the
  step, beyond what it held before them."""
  try:
    tf.config.experimental.reset_memory_stats(CPU)
  except ValueError:
    pytest.skip('the CPU allocator keeps no figures (oneDNN off)')
  before = tf.config.experimental.get_memory_info(CPU)['current']
  for _ in range(3):
    step(*batch)
  return tf.config.experimental.get_memory_info(CPU)['peak'] - before


@pytest.mark.slow
def test_the_planned_peak_is_the_measured_one_within_a_tenth():
  config = placement.DeploymentConfig(num_clones=1, clone_on_cpu=True)
  deployed = towers.deploy(
      config, _mlp(), keras.losses.SparseCategoricalCrossentropy(
          from_logits=True), keras.optimizers.SGD(0.1, momentum=0.9))
  rng = np.random.default_rng(0)
  batch = (tf.constant(rng.normal(size=(1024, 64)), tf.float32),
           tf.constant(rng.integers(0, 10, 1024), tf.int32))
  planned = dry_run.read(deployed, *batch).devices[CPU].peak_bytes
  deployed.train_step(*batch)  # Traced and run once: its first buffers.
  measured = _measured(deployed.train_step, batch)
  assert abs(planned - measured) <= 0.1 * measured, (planned, measured)
