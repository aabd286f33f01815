"""Model parallelism in ten lines: the classic toy, on two devices.

PyTorch's model-parallel tutorial puts `Dense 10->10` and a ReLU on one GPU
and `Dense 10->5` on another, and moves the activations between them. With
tfmulti the model stays one functional Keras model; `num_stages=2` and a
stage boundary say where it is cut, and `DeploymentConfig` names the
devices (GPU:0 and GPU:1, or logical CPU:0 and CPU:1 with `clone_on_cpu`).

  python examples/toy_model_parallel.py

runs 5 steps of mean squared error on random data on two logical CPUs, and
the same steps on one device, and logs both losses: they are equal.
"""
# ruff: noqa: E402  The quiet start comes before Keras imports TensorFlow.
import sys

from tfmulti import native_logs

# TensorFlow imported with its C++ start-up lines held back, as train.py
# starts (`--verbosity=1` shows them).
native_logs.quiet_start(sys.argv)

from absl import app
from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmulti import deploy
from tfmulti import devices


def toy_model():
  """Dense 10->10, ReLU, Dense 10->5, with fixed initial weights."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((10,))
  x = keras.layers.ReLU(name='relu')(keras.layers.Dense(10, name='net1')(
      inputs))
  return keras.Model(inputs, keras.layers.Dense(5, name='net2')(x))


def train(config, steps=5, microbatches=1):
  """Trains `toy_model` over `config`; returns the step losses."""
  with tf.device(config.optimizer_variables_device()):
    model = toy_model()
    optimizer = keras.optimizers.SGD(0.001)
  # Stage 1 starts at net2: net1 and the ReLU run on stage 0's device.
  cut = deploy.StepOptions(num_microbatches=microbatches,
                           stage_boundaries=('net2',))
  deployed = deploy.deploy(config, model, keras.losses.MeanSquaredError(),
                           optimizer, cut if config.num_stages > 1 else None)
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(steps):
    images = rng.normal(size=(20, 10)).astype(np.float32)
    labels = rng.normal(size=(20, 5)).astype(np.float32)
    losses.append(float(deployed.train_step(images, labels)))
  return losses


def main(argv):
  del argv  # Unused.
  two_devices = train(deploy.DeploymentConfig(clone_on_cpu=True,
                                              num_stages=2))
  one_device = train(deploy.DeploymentConfig(clone_on_cpu=True))
  logging.info('two stages: %s', np.round(two_devices, 6).tolist())
  logging.info('one device: %s', np.round(one_device, 6).tolist())


if __name__ == '__main__':
  devices.create_logical_cpus(2)  # Before TensorFlow starts.
  app.run(main)
