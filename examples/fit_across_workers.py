"""Your own `fit` script across workers: the same file on every worker.

  python -m tfmulti.launch --num_workers=2 -- examples/fit_across_workers.py
  python examples/fit_across_workers.py --num_clones=2   # One process.
  python examples/fit_across_workers.py --plain          # Plain Keras fit.

Each worker joins the job it was started in (`workers.start()`: the
launcher's `TF_CONFIG`, a Slurm step, an Indexed Job; alone, a job of one),
builds the model in the workers' scope and fits a `TowersModel` on the same
global batches of 64 rows (the same data and seed everywhere), taking its
rows of each. The three commands train the same weights: the workers and
the one process to 1e-5 of plain Keras `fit` on one device, and bit for bit
each other with `--reproducible_rows`; `--layouts` shards the tables and
Dense kernels over each worker's clones (Keras's `ModelParallel`, a mesh
of them), and `--blocks` computes the Dense and convolution kernels where
their blocks live. Only worker 0 prints the epochs and writes to `--model_dir`
(history.csv, final.weights.h5). With `--backup_dir`, Ctrl-C to the
launcher (or SIGTERM to any worker) saves the step and the same command
resumes it, ending as if never stopped.
"""
# ruff: noqa: E402  The quiet start comes before Keras imports TensorFlow.
import sys

from tfmulti import native_logs

# TensorFlow imported with its C++ start-up lines held back, as train.py
# starts (`--verbosity=1` shows them).
native_logs.quiet_start(sys.argv)

import json
import os

from absl import app
from absl import flags
from absl import logging
import keras
import numpy as np
from sklearn import datasets

from tfmulti import deploy
from tfmulti import devices
from tfmulti.distribute import workers as workers_lib
from tfmulti.fit import TowersModel

_MODEL_DIR = flags.DEFINE_string('model_dir', '/tmp/fit_across_workers',
                                 "Where worker 0 writes the run's files.")
_EPOCHS = flags.DEFINE_integer('epochs', 3, 'Passes over the training rows.')
_NUM_CLONES = flags.DEFINE_integer('num_clones', 1,
                                   'Clones a worker, on logical CPUs.')
_REPRODUCIBLE_ROWS = flags.DEFINE_integer(
    'reproducible_rows', 0, 'Rows an atom: the same bits on every layout.')
_VARIABLES_DEVICE = flags.DEFINE_string(
    'variables_device', None, "Where each worker keeps its variables: its "
    "CPU (unset) or 'spread' over its clones by bytes.")
_ACCUMULATION_STEPS = flags.DEFINE_integer(
    'accumulation_steps', 1, 'Accumulation steps a global batch (one '
    'update).')
_MODEL = flags.DEFINE_enum(
    'model', 'cnn',
    ['cnn', 'sequential', 'subclassed', 'embedding', 'positions'],
    'The model: a functional CNN, the same as a keras.Sequential or a '
    'keras.Model subclass, or an Embedding of the pixels read as 17 token '
    'ids (its gradient: sparse slices), with their positions looked up in '
    'a table of their own too (positions).')
_OPTIMIZER = flags.DEFINE_enum(
    'optimizer', 'sgd', ['sgd', 'adam'],
    'SGD with momentum, or Adam (which applies each sparse slice alone).')
_BATCH_NORM = flags.DEFINE_bool(
    'batch_norm', False, 'Put a BatchNormalization after the convolution.')
_BATCH_NORM_POLICY = flags.DEFINE_enum(
    'batch_norm_policy', 'clone_0', ['clone_0', 'mean', 'full_batch'],
    "Which moving statistics a worker's clones keep.")
_STEPS_PER_EXECUTION = flags.DEFINE_integer(
    'steps_per_execution', 1, "Keras's compile option: steps in one "
    'compiled call.')
_LAYOUTS = flags.DEFINE_bool(
    'layouts', False, "Shard the tables and Dense kernels over each "
    "worker's clones (a mesh of them, each worker holding the shards).")
_BLOCKS = flags.DEFINE_bool(
    'blocks', False, "With --layouts: a mesh (1, N) of axes ('batch', "
    "'model'), over whose 'model' the Dense and convolution kernels are "
    'split and computed where their blocks live, not joined for each pass.')
flags.register_multi_flags_validator(
    ['blocks', 'layouts'],
    lambda given: given['layouts'] or not given['blocks'],
    message='--blocks lays out the --layouts map: give --layouts too.')
_PLAIN = flags.DEFINE_bool('plain', False, 'Train with plain Keras fit on '
                           'one device instead: the reference.')
_BACKUP_DIR = flags.DEFINE_string(
    'backup_dir', None, 'Make the run preemptible: SIGTERM or Ctrl-C saves '
    'the step there (keras.callbacks.BackupAndRestore) and the same command '
    'resumes it.')
_GLOBAL_BATCH_SIZE = 64  # Rows a step, of the whole job.
_TRAIN_ROWS = 1280  # 20 whole batches: each splits over 1, 2 or 4 workers.


def digits():
  """((train images, labels), (validation images, labels)), 8x8x1."""
  loaded = datasets.load_digits()
  images = loaded.images[..., None].astype(np.float32) / 16.0
  labels = loaded.target.astype(np.int32)
  return ((images[:_TRAIN_ROWS], labels[:_TRAIN_ROWS]),
          (images[_TRAIN_ROWS:], labels[_TRAIN_ROWS:]))


def _cnn_layers():
  return ([keras.layers.Conv2D(16, 3, activation='relu')] +
          ([keras.layers.BatchNormalization(name='batch_norm')]
           if _BATCH_NORM.value else []) +
          [keras.layers.Flatten(), keras.layers.Dense(32, activation='relu'),
           keras.layers.Dense(10)])


class AddPositions(keras.layers.Layer):
  """Adds each position's row of a table of its own, looked up by
  `arange`: once a batch, as keras.io's text transformer does."""

  def __init__(self, maxlen, dim, **kwargs):
    super().__init__(**kwargs)
    self.table = keras.layers.Embedding(maxlen, dim)

  def call(self, x):
    return x + self.table(keras.ops.arange(keras.ops.shape(x)[1]))


class DigitsCnn(keras.Model):
  """The CNN as a subclass, as Keras's guide writes one."""

  def __init__(self):
    super().__init__(name='digits_cnn')
    self.stack = _cnn_layers()

  def call(self, images):
    for layer in self.stack:
      images = layer(images)
    return images


def make_model():
  """The `--model` this worker trains, built."""
  inputs = keras.Input((8, 8, 1))
  if _MODEL.value == 'sequential':
    return keras.Sequential([inputs, *_cnn_layers()], name='digits_cnn')
  if _MODEL.value == 'subclassed':
    model = DigitsCnn()
    model(np.zeros((1, 8, 8, 1), np.float32))
    return model
  if _MODEL.value in ('embedding', 'positions'):  # Pixels as token ids.
    ids = keras.ops.cast(keras.ops.round(
        keras.layers.Flatten()(inputs) * 16), 'int32')
    x = keras.layers.Embedding(17, 8)(ids)
    if _MODEL.value == 'positions':
      x = AddPositions(64, 8)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name='digits_ids')
  x = inputs
  for layer in _cnn_layers():
    x = layer(x)
  return keras.Model(inputs, x, name='digits_cnn')


def model_parallel():
  """Keras's ModelParallel on a mesh of this worker's clones: the tables
  by columns, the Dense kernels by output features (`--layouts`); with
  `--blocks`, the convolutions' by output channels too, on a mesh whose
  'model' axis is not the batch's: computed where their blocks live."""
  count = _NUM_CLONES.value
  shape, axes = ((1, count), ['batch', 'model']) if _BLOCKS.value else (
      (count,), ['model'])
  mesh = keras.distribution.DeviceMesh(
      shape, axes, keras.distribution.list_devices()[:count])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['.*embedding.*/embeddings'] = (None, 'model')
  layout_map['.*dense.*/kernel'] = (None, 'model')
  if _BLOCKS.value:
    layout_map['.*conv2d.*/kernel'] = (None, None, None, 'model')
  return keras.distribution.ModelParallel(layout_map=layout_map,
                                          batch_dim_name=axes[0])


def fit(model_dir, epochs, callbacks=()):
  """Fits on this process's place in the job; returns (model, history).
  `callbacks`: more Keras callbacks."""
  workers = workers_lib.start()  # Before TensorFlow runs an op.
  config = deploy.DeploymentConfig(
      num_clones=_NUM_CLONES.value, clone_on_cpu=True,
      variables_device=_VARIABLES_DEVICE.value,
      replica_id=workers.index, num_replicas=workers.num_workers)
  keras.utils.set_random_seed(0)  # The same weights and shuffles everywhere.
  with workers.scope(), config.variables_scope():
    model = make_model()
  trained = model if _PLAIN.value else TowersModel(
      model, model_parallel() if _LAYOUTS.value else config, workers=workers,
      reproducible_rows=_REPRODUCIBLE_ROWS.value,
      accumulation_steps=_ACCUMULATION_STEPS.value,
      batch_norm_policy=_BATCH_NORM_POLICY.value)
  callbacks = [keras.callbacks.CSVLogger(
      os.path.join(model_dir, 'history.csv')), *callbacks]
  if _BACKUP_DIR.value:
    callbacks.append(keras.callbacks.BackupAndRestore(_BACKUP_DIR.value))
  trained.compile(
      optimizer=(keras.optimizers.Adam(0.01) if _OPTIMIZER.value == 'adam'
                 else keras.optimizers.SGD(0.05, momentum=0.9)),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=['accuracy'], steps_per_execution=_STEPS_PER_EXECUTION.value)
  # A sharded variable lives on several devices: its slots show where.
  held = trained.optimizer.variables + (
      [] if _LAYOUTS.value else model.variables)
  logging.info('variables and slots on %s',
               sorted({devices.device_of(v) for v in held}))
  train, validation = digits()
  os.makedirs(model_dir, exist_ok=True)
  history = trained.fit(
      *train, batch_size=_GLOBAL_BATCH_SIZE, epochs=epochs,
      validation_data=validation, validation_batch_size=len(validation[1]),
      verbose=2, callbacks=callbacks)
  if workers.is_chief:
    model.save_weights(os.path.join(model_dir, 'final.weights.h5'))
  return model, history


def main(argv):
  del argv  # Flags only.
  devices.create_logical_cpus(_NUM_CLONES.value)  # Before TensorFlow starts.
  _, history = fit(_MODEL_DIR.value, _EPOCHS.value)
  logging.info('history %s', json.dumps(history.history))


if __name__ == '__main__':
  app.run(main)
