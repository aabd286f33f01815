"""What every piece of a step computes on its own rows: the model's
`add_loss` terms weighted by rows on every layout and path (towers, atoms,
the lockstep clones, the tf.distribute strategies, 2 workers), against
one-device towers; synchronized BatchNorm for any BatchNormalization;
random layers that never repeat a mask across pieces (lockstep clones and
replicas included), advance their generators once a step, and keep the
same bits under `reproducible_rows`."""

import json
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.helpers import assert_same_steps
from tests.helpers import embedding_model
from tests.helpers import L2
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import make_loss
from tests.helpers import mlp
from tests.helpers import REPO
from tests.helpers import token_batches
from tests.helpers import weights
from tfmulti import deploy
from tfmulti import distribute
from tfmulti import step_options


class _Penalized(keras.layers.Layer):
  """A layer's own add_loss term: a mean over the rows."""

  def call(self, x):
    self.add_loss(0.5 * keras.ops.mean(keras.ops.square(x)))
    return x


def add_loss_mlp(seed=0):
  """6 -> 3 with an activity regularizer, a layer's add_loss, L2."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((6,))
  h = keras.layers.Dense(16, activation='tanh', name='d1',
                         kernel_regularizer=keras.regularizers.L2(L2),
                         activity_regularizer=keras.regularizers.L2(0.05))(x)
  h = _Penalized(name='penalized')(h)
  h = keras.layers.Dense(8, activation='tanh', name='d2')(h)
  return keras.Model(x, keras.layers.Dense(3, name='out')(h))


def _one_device():
  return make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                       model_fn=add_loss_mlp)


@pytest.mark.parametrize('config_fields, options', [
    (dict(num_clones=2), {}),
    pytest.param(dict(num_clones=4), {}, marks=pytest.mark.slow),
    (dict(num_clones=2), dict(clone_shares=(3, 1))),
    pytest.param(dict(num_clones=2), dict(accumulation_steps=2),
                 marks=pytest.mark.slow),
    pytest.param(dict(num_clones=2, num_stages=2), dict(num_microbatches=2),
                 marks=pytest.mark.slow),
    # Atoms of 4 rows, each its own forward pass (Keras divides an activity
    # penalty by the atom's rows).
    (dict(num_clones=2), dict(reproducible_rows=4)),
    # The clones in lockstep, replicas of a MirroredStrategy.
    (dict(num_clones=2), dict(sync_batch_norm=True)),
])
def test_add_loss_terms_count_over_every_row(config_fields, options):
  config = deploy.DeploymentConfig(clone_on_cpu=True, **config_fields)
  towers = make_deployed(config, model_fn=add_loss_mlp, **options)
  assert_same_steps(towers, _one_device(), rows=16)


@pytest.mark.parametrize('name, options', [
    ('mirrored', dict(accumulation_steps=2)),
    ('central_storage', {}),
    pytest.param('central_storage', dict(accumulation_steps=2),
                 marks=pytest.mark.slow),
])
def test_add_loss_terms_on_tf_distribute_replicas(name, options):
  """Against one-device towers: the replicas' add_loss terms (read as
  means, scaled by 1 / replicas under tf.distribute) weighted by rows."""
  strategy = distribute.make_strategy(
      name, deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True))
  with strategy.scope():
    model = add_loss_mlp()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  distributed = distribute.DistributedModel(
      strategy, model, make_loss(), optimizer,
      step_options.StepOptions(**options))
  assert_same_steps(distributed, _one_device(), rows=16)


# Each worker of the launcher's job: DistributedModel over its
# MultiWorkerMirroredStrategy (one replica a worker), 2 steps of 16 rows.
_WORKER = '''
import json, os, sys
sys.path.insert(0, os.getcwd())  # The repository: the launcher's cwd.
import keras
from tests.deploy.test_pieces import add_loss_mlp
from tests.helpers import make_batch, make_loss
from tfmulti import distribute, step_options
from tfmulti.distribute import workers as workers_lib

workers = workers_lib.start()  # Before TensorFlow runs an op.
with workers.scope():
  model = add_loss_mlp()
  optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
trainer = distribute.DistributedModel(
    workers.strategy, model, make_loss(), optimizer,
    step_options.StepOptions(accumulation_steps=2),
    worker_index=workers.index, num_workers=workers.num_workers)
for step in range(2):
  outputs = trainer.train_step_outputs(*make_batch(16, seed=step))
  print('losses', json.dumps([float(outputs.total),
                              float(outputs.regularization)]), flush=True)
print('weights', json.dumps([w.tolist() for w in model.get_weights()]),
      flush=True)
'''
_WORKERS_TIMEOUT_S = 300


@pytest.mark.slow
def test_add_loss_terms_on_two_workers_with_accumulation(tmp_path):
  """multi_worker_mirrored: 2 workers x 2 accumulation steps, against
  one-device towers on the same 16 rows a step."""
  script = tmp_path / 'worker.py'
  script.write_text(_WORKER)
  result = subprocess.run(
      [sys.executable, '-m', 'tfmulti.launch', '--num_workers=2', '--',
       str(script)], cwd=REPO, capture_output=True, text=True,
      timeout=_WORKERS_TIMEOUT_S)
  log = result.stdout + result.stderr
  assert result.returncode == 0, log[-3000:]
  reference = _one_device()
  want = []
  for step in range(2):
    outputs = reference.train_step_outputs(*make_batch(16, seed=step))
    want.append([float(outputs.total), float(outputs.regularization)])
  for worker in range(2):
    got = [json.loads(found) for found in re.findall(
        rf'\[worker {worker}\] losses (.*)', log)]
    np.testing.assert_allclose(got, want, atol=1e-5)
    (found,) = re.findall(rf'\[worker {worker}\] weights (.*)', log)
    for got, want_weights in zip(json.loads(found), weights(reference.model)):
      np.testing.assert_allclose(got, want_weights, atol=1e-5)


def test_sync_batch_norm_synchronizes_layers_built_unsynchronized():
  def bn_mlp():
    return mlp(batch_norm=True, synchronized=False)
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  synced = make_deployed(config, model_fn=bn_mlp, sync_batch_norm=True)
  reference = make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                            model_fn=bn_mlp)
  assert_same_steps(synced, reference, rows=16)
  # The moving statistics too, and the layers' config as the user built it.
  for got, want in zip(weights(synced.model), weights(reference.model)):
    np.testing.assert_allclose(got, want, atol=1e-5)
  layer = next(layer for layer in synced.model.layers
               if isinstance(layer, keras.layers.BatchNormalization))
  assert layer.get_config()['synchronized'] is False


def dropout_mlp(seed=0):
  return mlp(seed=seed, dropout=True)



def dropout_before_batch_norm():
  """Its generator's state comes before BatchNorm's moving statistics
  among the model's non-trainable variables."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,))
  x = keras.layers.Dropout(0.5)(inputs)
  x = keras.layers.Dense(16, activation='tanh')(x)
  x = keras.layers.BatchNormalization()(x)
  return keras.Model(inputs, keras.layers.Dense(3)(x))

def _training_outputs(towers, images, labels):
  return towers.train_step_outputs(images, labels, with_outputs=True).outputs


def _twin_batch():
  """8 rows twice over: 16 rows whose second 8 repeat the first."""
  images, labels = make_batch(8)
  return np.concatenate([images, images]), np.concatenate([labels, labels])


def _twin_rows_draw_apart(towers):
  """Trains a step on `_twin_batch()` (the second 8 rows in another piece)
  and asserts the two halves' training outputs differ: their pieces drew
  different masks. Returns the batch."""
  doubled = _twin_batch()
  outputs = np.array(_training_outputs(towers, *doubled))
  assert not np.allclose(outputs[:8], outputs[8:])
  return doubled


def _generator_counter(model):
  """The counter of the model's one random generator (`[seed, counter]`)."""
  (state,) = [v for v in model.non_trainable_variables
              if 'seed_generator' in v.path]
  return int(state[1])


# The clones one by one, and in lockstep (replicas of a MirroredStrategy,
# each passed its clone's offset).
@pytest.mark.parametrize('options', [{}, dict(sync_batch_norm=True)],
                         ids=['clones', 'lockstep'])
def test_clones_draw_their_own_masks(options):
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  towers = make_deployed(config, model_fn=dropout_mlp, **options)
  _twin_rows_draw_apart(towers)  # Clone 0 and clone 1 get identical rows.
  # The generator advanced once a step from its unfolded state.
  assert _generator_counter(towers.model) == 1


@pytest.mark.slow
@pytest.mark.parametrize('options', [
    dict(accumulation_steps=2),
    dict(accumulation_steps=2, clone_shares=(3, 1)),
    dict(accumulation_steps=2, reproducible_rows=4),
], ids=['summed', 'shares', 'atoms'])
def test_accumulation_steps_draw_their_own_masks_and_advance_once(options):
  """Accumulation steps fed identical rows draw different masks (their
  offsets differ), and the step advances the generators once, however
  many accumulation steps it has."""
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  towers = make_deployed(config, model_fn=dropout_mlp, **options)
  doubled = _twin_rows_draw_apart(towers)
  assert _generator_counter(towers.model) == 1
  towers.train_step_outputs(*doubled)
  assert _generator_counter(towers.model) == 2


@pytest.mark.slow
def test_each_new_state_goes_to_its_own_variable():
  """A random layer before BatchNorm: the step assigns every new value to
  its own variable (the generators' once, at the end), as the atoms'
  path, which assigns them all together, does with one atom of the same
  rows (the same offset, so the same mask)."""
  runs = [make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                        model_fn=dropout_before_batch_norm, **atoms)
          for atoms in ({}, dict(reproducible_rows=16))]
  batch = make_batch(16)
  for run in runs:
    run.train_step_outputs(*batch)
  states = [run.model.non_trainable_variables for run in runs]
  assert 'seed_generator' in states[0][0].path
  assert _generator_counter(runs[0].model) == 1
  for got, want in zip(*states, strict=True):
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6,
                               err_msg=got.path)


@pytest.mark.parametrize('config_fields, options', [
    pytest.param(dict(num_clones=2), {}, marks=pytest.mark.slow),
    (dict(num_clones=2), dict(clone_shares=(3, 1))),
    pytest.param(dict(num_clones=2), dict(accumulation_steps=2),
                 marks=pytest.mark.slow),
    pytest.param(dict(num_clones=2, num_stages=2), dict(num_microbatches=2),
                 marks=pytest.mark.slow),
    pytest.param(dict(num_clones=4), {}, marks=pytest.mark.slow),
    pytest.param(dict(num_stages=2), dict(
        num_microbatches=4, pipeline_schedule='zb_h1', recompute=True),
                 marks=pytest.mark.slow),
])
def test_dropout_keeps_the_same_bits_on_every_layout(config_fields, options):
  _assert_the_same_bits_as_one_clone(
      dropout_mlp, 4, [make_batch(16, seed=step) for step in range(3)],
      config_fields, options)


def _assert_the_same_bits_as_one_clone(model_fn, atom_rows, batches,
                                       config_fields, options):
  """Atoms of `atom_rows` on the layout of `config_fields` and `options`
  train `batches` to one clone's losses and weights, bit for bit."""
  atoms = dict(reproducible_rows=atom_rows)
  reference = make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                            model_fn=model_fn, **atoms)
  config = deploy.DeploymentConfig(clone_on_cpu=True, **config_fields)
  towers = make_deployed(config, model_fn=model_fn, **atoms, **options)
  for images, labels in batches:
    want = reference.train_step_outputs(images, labels)
    got = towers.train_step_outputs(images, labels)
    np.testing.assert_array_equal(got.total, want.total)
  for got, want in zip(weights(towers.model), weights(reference.model)):
    np.testing.assert_array_equal(got, want)


def flip_cnn():
  """RandomFlip on 4x4 images, then a Dense head."""
  keras.utils.set_random_seed(0)
  inputs = keras.Input((4, 4, 1))
  x = keras.layers.RandomFlip('horizontal', name='flip')(inputs)
  x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(3, name='out')(x))


@pytest.mark.slow
@pytest.mark.parametrize('config_fields, options', [
    (dict(num_clones=2), {}),
    (dict(num_clones=4), dict(accumulation_steps=2)),
])
def test_random_flip_keeps_the_same_bits_on_every_layout(config_fields,
                                                         options):
  """RandomFlip's decisions, like Dropout's masks, depend on each atom's
  place in the global batch alone."""
  rng = np.random.default_rng(0)
  batches = [(rng.normal(size=(16, 4, 4, 1)).astype(np.float32),
              rng.integers(0, 3, size=16).astype(np.int32))
             for _ in range(3)]
  _assert_the_same_bits_as_one_clone(flip_cnn, 2, batches, config_fields,
                                     options)


def test_recomputation_replays_the_forward_passs_masks():
  """A stage recomputed in its backward pass draws the masks its forward
  pass drew (its piece's folded seed): the same step as without."""
  def model_fn():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(16, activation='tanh', name='d1')(inputs)
    x = keras.layers.Dropout(0.5, name='drop')(x)  # In stage 0: recomputed.
    return keras.Model(inputs, keras.layers.Dense(3, name='out')(x))

  def trained(recompute):
    config = deploy.DeploymentConfig(clone_on_cpu=True, num_stages=2)
    towers = make_deployed(config, model_fn=model_fn, num_microbatches=2,
                           recompute=recompute, stage_boundaries=('out',))
    for step in range(2):
      towers.train_step_outputs(*make_batch(16, seed=step))
    return weights(towers.model)
  for got, want in zip(trained(True), trained(False)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_piece_draws_from_its_offset_alone():
  # The atoms of a step under one generator state: every atom a new mask.
  towers = make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                         model_fn=dropout_mlp, reproducible_rows=2)
  images, labels = make_batch(2)
  same_rows = np.tile(images, (4, 1)), np.tile(labels, 4)
  outputs = np.array(_training_outputs(towers, *same_rows))
  atoms = [outputs[i:i + 2] for i in range(0, 8, 2)]
  assert all(not np.allclose(atoms[0], other) for other in atoms[1:])


def bn_cnn_float64(seed=0):
  """A small BatchNorm CNN in float64, its BatchNorm unsynchronized."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((6, 6, 1), dtype='float64')
  h = keras.layers.Conv2D(4, 3, dtype='float64')(x)
  h = keras.layers.BatchNormalization(dtype='float64')(h)
  h = keras.layers.Flatten(dtype='float64')(keras.layers.ReLU(
      dtype='float64')(h))
  return keras.Model(x, keras.layers.Dense(3, dtype='float64')(h))


def test_sync_batch_norm_equals_one_device_in_float64():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  runs = [make_deployed(c, model_fn=bn_cnn_float64, **options)
          for c, options in ((config, dict(sync_batch_norm=True)),
                             (deploy.DeploymentConfig(clone_on_cpu=True), {}))]
  rng = np.random.default_rng(0)
  for _ in range(2):
    images = rng.normal(size=(8, 6, 6, 1))
    labels = rng.integers(0, 3, size=8).astype(np.int32)
    losses = [float(run.train_step(images, labels)) for run in runs]
    np.testing.assert_allclose(*losses, rtol=1e-10)
  for got, want in zip(*(weights(run.model) for run in runs)):
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('options', [{}, dict(accumulation_steps=2)])
def test_mirrored_replicas_draw_their_own_masks(options):
  """tf.distribute replicas fold their generators too: two replicas fed
  identical rows do not repeat a mask, and the generator advances once a
  step, with accumulation steps too."""
  strategy = distribute.make_strategy(
      'mirrored', deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True))
  with strategy.scope():
    model = dropout_mlp()
    optimizer = keras.optimizers.SGD(0.1)
  mirrored = distribute.DistributedModel(
      strategy, model, make_loss(), optimizer,
      step_options.StepOptions(**options))
  replica_losses = mirrored.train_step_outputs(*_twin_batch()).clones
  assert not np.allclose(replica_losses[0], replica_losses[1])
  assert _generator_counter(model) == 1


@pytest.mark.parametrize('config_fields, options', [
    (dict(num_clones=2), {}),
    pytest.param(dict(num_clones=4), {}, marks=pytest.mark.slow),
    pytest.param(dict(num_clones=2), dict(accumulation_steps=2),
                 marks=pytest.mark.slow),
    pytest.param(dict(num_clones=2, num_stages=2), dict(num_microbatches=2),
                 marks=pytest.mark.slow),
    pytest.param(dict(num_clones=2, variables_device='spread'),
                 dict(gradient_packs='auto'), marks=pytest.mark.slow),
])
def test_an_embedding_keeps_the_same_bits_on_every_layout(config_fields,
                                                          options):
  """An Embedding's slices are joined, never added: atoms keep their bits
  on every layout."""
  _assert_the_same_bits_as_one_clone(embedding_model, 4, token_batches(),
                                     config_fields, options)
