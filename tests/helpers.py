"""What several test modules share: a tiny model, batches, readers."""

import glob
import os
import re

import keras
import numpy as np
import tensorflow as tf

from tfmulti import deploy
from tfmulti.fit import readings as fit_readings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L2 = 0.01  # Weight decay of the equivalence model, so regularization counts.
INDEXED_JOB_MANIFEST = os.path.join(REPO, 'docs', 'indexed_job.yaml')

# TensorFlow's C++ start-up lines on a machine without a GPU (the quiet start
# holds them back; tests/test_native_logs.py tests how).
CHATTER = ('absl::InitializeLog', 'cudart_stub', 'cuInit')


def mlp(seed=0, batch_norm=False, dropout=False, synchronized=False,
        dtype=None):
  """A small functional model: 6 features -> 3 classes, with L2."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((6,))
  x = keras.layers.Dense(16, activation='tanh', dtype=dtype,
                         kernel_regularizer=keras.regularizers.L2(L2))(inputs)
  if batch_norm:
    x = keras.layers.BatchNormalization(synchronized=synchronized)(x)
  if dropout:
    x = keras.layers.Dropout(0.5)(x)
  outputs = keras.layers.Dense(
      3, kernel_regularizer=keras.regularizers.L2(L2), dtype=dtype)(x)
  return keras.Model(inputs, outputs)


def embedding_model(seed=0):
  """Five token ids of 30 -> an Embedding (a sparse gradient) -> 3 logits."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((5,), dtype='int32')
  x = keras.layers.Embedding(30, 4)(inputs)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(3)(x))


def token_batches(count=3, rows=16, seed=0):
  """`count` batches of `rows` token ids for `embedding_model`: few ids,
  so each batch looks some up several times."""
  rng = np.random.default_rng(seed)
  return [(rng.integers(0, 8, size=(rows, 5)).astype(np.int32),
           rng.integers(0, 3, size=rows).astype(np.int32))
          for _ in range(count)]


def make_loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_batch(rows, seed=1):
  """`rows` random (features, labels) for `mlp`."""
  rng = np.random.default_rng(seed)
  images = rng.normal(size=(rows, 6)).astype(np.float32)
  labels = rng.integers(0, 3, size=rows).astype(np.int32)
  return images, labels


def make_deployed(config, model_fn=mlp, optimizer_fn=None, **kwargs):
  """`model_fn()` deployed over `config`, with SGD + momentum by default."""
  optimizer_fn = optimizer_fn or (
      lambda: keras.optimizers.SGD(0.1, momentum=0.9))
  with tf.device(config.optimizer_variables_device()):
    with config.variables_scope():
      model = model_fn()
    optimizer = optimizer_fn()
  return deploy.deploy(config, model, make_loss(), optimizer, **kwargs)


def readings_apart(history):
  """A `TowersModel.fit` History's figures without the steps' readings
  (time, rows, memory: `fit.readings.KEYS`), which plain `fit` lacks."""
  return {k: v for k, v in history.items() if k not in fit_readings.KEYS}


def weights(model):
  return [np.array(w) for w in model.get_weights()]


def checkpoint_tensors(path, prefixes=('model/', 'optimizer/')):
  """{key: value} of a checkpoint's tensors under `prefixes`: by default
  the model's and the optimizer's (a checkpoint files each variable once,
  under its first path: trainable weights under the optimizer's
  `_trainable_variables`, the rest under the model). Never empty, so a
  comparison of two checkpoints cannot pass by comparing nothing."""
  reader = tf.train.load_checkpoint(path)
  found = {key: reader.get_tensor(key)
           for key in reader.get_variable_to_shape_map()
           if key.startswith(prefixes)}
  assert found, f'{path} holds nothing under {prefixes}'
  return found


def assert_same_checkpoints(got_path, want_path, exact=False):
  """Two checkpoints hold the same tensors, to 1e-5 (or bit for bit)."""
  got, want = checkpoint_tensors(got_path), checkpoint_tensors(want_path)
  assert got.keys() == want.keys()
  for key, value in want.items():
    if exact:
      np.testing.assert_array_equal(got[key], value, err_msg=key)
    else:
      np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6,
                                 err_msg=key)


def scalars(model_dir):
  """{tag: {step: value}} from the event files in `model_dir`."""
  found = {}
  for path in glob.glob(os.path.join(model_dir, 'events.out.tfevents.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        found.setdefault(value.tag, {})[event.step] = tf.make_ndarray(
            value.tensor)
  return found


def assert_same_steps(run, reference, rows, steps=2):
  """`steps` steps of `run` and `reference` on the same batches of `rows`
  give the same losses and gradients (in variable order), and weights."""
  for step in range(steps):
    images, labels = make_batch(rows, seed=step)
    want = reference.train_step_outputs(images, labels)
    got = run.train_step_outputs(images, labels)
    np.testing.assert_allclose(got.total, want.total, atol=1e-5)
    np.testing.assert_allclose(got.regularization, want.regularization,
                               atol=1e-6)
    # The same variables in the same order (their paths differ by model).
    assert len(got.gradients) == len(want.gradients)
    for path, mine, theirs in zip(want.gradients, got.gradients.values(),
                                  want.gradients.values()):
      np.testing.assert_allclose(mine, theirs, atol=1e-5, err_msg=path)
  for got, want in zip(weights(run.model), weights(reference.model)):
    np.testing.assert_allclose(got, want, atol=1e-5)


def manifest_command(path=INDEXED_JOB_MANIFEST):
  """The items of the `command:` list in a Kubernetes manifest, read line
  by line (PyYAML is not a dependency): plain or quoted scalars, one a
  line, as docs/indexed_job.yaml writes them."""
  with open(path) as f:
    lines = f.read().splitlines()
  start = next(i for i, line in enumerate(lines)
               if re.fullmatch(r'\s*command:\s*', line))
  command = []
  for line in lines[start + 1:]:
    item = re.fullmatch(r'\s*- (.+?)\s*(?:#.*)?', line)
    if not item:
      break
    command.append(re.sub(r'^([\'"])(.*)\1$', r'\2', item[1]))
  return command


def indexed_job_flags(worker_hosts):
  """The flags of docs/indexed_job.yaml's command, which the indexed-job
  test runs: its pods' `--worker_hosts` replaced by `worker_hosts`, its
  `--model_dir` left to the test."""
  flags = []
  for flag in manifest_command()[1:]:
    if flag.startswith('--worker_hosts='):
      flags.append(f'--worker_hosts={worker_hosts}')
    elif not flag.startswith('--model_dir='):
      flags.append(flag)
  return flags
