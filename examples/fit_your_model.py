"""Your own Keras model and data, trained by the towers through `fit`.

  python examples/fit_your_model.py --model_dir=/tmp/fit_your_model

A `keras.applications` MobileNetV2 (BatchNorm, depthwise convolutions),
built as any Keras user builds it, learns scikit-learn's offline digits
(resized to 32x32 RGB) on 2 clones on logical CPUs, with Keras's own
`compile` / `fit` / `evaluate`, validation data and a ModelCheckpoint whose
file plain Keras loads without tfmulti. Swap `DeploymentConfig` for GPUs
(`clone_on_cpu=False`) and nothing else changes. `devices.share_cores`
gives the clones their share of the cores, as `train.py` does: on this
project's 2-core Xeon the whole process took 18-19 s against 20-22 s
without it (2026-11-26, `time python examples/fit_your_model.py`, three
alternating runs each; the steps after the first epoch 39-73 ms against
73-86 ms; most of the first epoch's 10 s is tracing), and reached 0.84
validation accuracy in 4 epochs.
"""
# ruff: noqa: E402  The quiet start comes before Keras imports TensorFlow.
import sys

from tfmulti import native_logs

# TensorFlow imported with its C++ start-up lines held back, as train.py
# starts (`--verbosity=1` shows them).
native_logs.quiet_start(sys.argv)

import os

from absl import app
from absl import flags
from absl import logging
import keras
import numpy as np
from sklearn import datasets
import tensorflow as tf

from tfmulti import deploy
from tfmulti import devices
from tfmulti import fit

_MODEL_DIR = flags.DEFINE_string('model_dir', '/tmp/fit_your_model',
                                 'Where the best model is checkpointed.')
_EPOCHS = flags.DEFINE_integer('epochs', 4, 'Passes over the training rows.')
_NUM_CLONES = 2
_BATCH_SIZE = 64  # Global: 32 rows a clone.
_SIDE = 32  # MobileNetV2's smallest input.
_TEST_ROWS = 453  # The rest, 1,344, make 21 whole batches: no odd last
# batch to trace again (TowersModel trains one exactly, but each new shape
# of a model this deep costs seconds of tracing).
_VALIDATION_BATCH_SIZE = 151  # 3 whole batches of the 453.
_BATCH_NORM_MOMENTUM = 0.9  # Moving statistics that settle in ~20 steps.


def digits():
  """((train images, labels), (test images, labels)): 32x32x3 in [0, 1]."""
  loaded = datasets.load_digits()
  images = loaded.images[..., None].astype(np.float32) / 16.0
  images = tf.image.resize(images, (_SIDE, _SIDE)).numpy()
  images = np.repeat(images, 3, axis=-1)
  labels = loaded.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(labels))
  images, labels = images[order], labels[order]
  return ((images[_TEST_ROWS:], labels[_TEST_ROWS:]),
          (images[:_TEST_ROWS], labels[:_TEST_ROWS]))


def train(model_dir, epochs):
  """Fits MobileNetV2 over the towers; returns (towers, history)."""
  config = deploy.DeploymentConfig(num_clones=_NUM_CLONES, clone_on_cpu=True)
  with tf.device(config.optimizer_variables_device()):  # CPU:0 here.
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=(_SIDE, _SIDE, 3), classes=10, alpha=0.35)
  for layer in model.layers:  # ImageNet's 0.999 needs thousands of steps
    if isinstance(layer, keras.layers.BatchNormalization):  # to settle.
      layer.momentum = _BATCH_NORM_MOMENTUM
  towers = fit.TowersModel(model, config)
  towers.compile(optimizer=keras.optimizers.Adam(3e-3),
                 loss=keras.losses.SparseCategoricalCrossentropy(),
                 metrics=['accuracy'])
  (train_images, train_labels), test = digits()
  history = towers.fit(
      train_images, train_labels, batch_size=_BATCH_SIZE, epochs=epochs,
      validation_data=test, validation_batch_size=_VALIDATION_BATCH_SIZE,
      verbose=2, callbacks=[
          keras.callbacks.ModelCheckpoint(
              os.path.join(model_dir, 'best.keras'),
              monitor='val_accuracy', save_best_only=True)])
  return towers, history


def main(argv):
  del argv  # Flags only.
  devices.create_logical_cpus(_NUM_CLONES)  # Before TensorFlow starts.
  devices.share_cores(_NUM_CLONES)  # As train.py: the clones side by side.
  _, history = train(_MODEL_DIR.value, _EPOCHS.value)
  logging.info('validation accuracy by epoch: %s; best model in %s',
               history.history['val_accuracy'],
               os.path.join(_MODEL_DIR.value, 'best.keras'))


if __name__ == '__main__':
  app.run(main)
