"""One checkpoint content under both doors: what the command line writes
restores into `TowersModel`, and what `fit`'s backup writes resumes the
command line, with the same weights and position."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import weights
from tfmulti import deploy
from tfmulti import errors
from tfmulti import fit
from tfmulti.engine import checkpoints
from tfmulti.fit import backup
from tfmulti.train import build
from tfmulti.train import config as config_lib

STEPS = 4
CLONES = 2
SHAPE = (28, 28, 1)  # The digits', as train.py gives them.


def _flags():
  """train.py's flags for the runs here: LeNet on digits, SGD with
  momentum (slots to restore), 2 clones."""
  return dict(num_clones=CLONES, optimizer='momentum', train_steps=STEPS,
              checkpoint_steps=STEPS, async_checkpoint=False)


def _make():
  """(model, optimizer) as train.py builds them for `_flags()`."""
  train_config = config_lib.TrainConfig(optimizer='momentum',
                                        train_steps=STEPS)
  deploy_config = deploy.DeploymentConfig(num_clones=CLONES,
                                          clone_on_cpu=True)
  make = build.model_and_optimizer(
      train_config, deploy_config, input_shape=SHAPE, num_classes=10,
      learning_rate=build.make_schedule(train_config, CLONES, STEPS))
  with tf.device(deploy_config.optimizer_variables_device()):
    return make(deploy_config.variables_scope())


def _towers():
  model, optimizer = _make()
  towers = fit.TowersModel(model, deploy.DeploymentConfig(
      num_clones=CLONES, clone_on_cpu=True))
  towers.compile(optimizer=optimizer, loss=build.make_loss())
  return towers


def _restored_by_the_command_line(directory):
  """A fresh model restored by the command line's own `Checkpointer`:
  (its weights, the `Position`)."""
  model, optimizer = _make()
  optimizer.build(model.trainable_variables)
  position = checkpoints.Checkpointer(
      str(directory), model=model, optimizer=optimizer, max_to_keep=1,
      device='CPU:0').restore_latest()
  return weights(model), position


@pytest.mark.slow
def test_a_command_line_checkpoint_restores_into_towers_model(run_train):
  ran = run_train(**_flags())
  towers = _towers()
  fresh = weights(towers.model)
  position = backup.restore(towers, os.path.dirname(ran['checkpoint']))
  want, want_position = _restored_by_the_command_line(
      os.path.dirname(ran['checkpoint']))
  assert position == want_position and position.step == STEPS
  for got, expected in zip(weights(towers.model), want):
    np.testing.assert_array_equal(got, expected)
  assert any(not np.array_equal(w, f) for w, f in zip(want, fresh))
  assert int(towers.optimizer.iterations.numpy()) == STEPS


@pytest.mark.slow
def test_a_fit_backup_resumes_the_command_line(run_train, tmp_path):
  towers = _towers()
  rng = np.random.default_rng(0)
  images = rng.uniform(0, 255, (16 * STEPS, *SHAPE)).astype(np.float32)
  labels = rng.integers(0, 10, 16 * STEPS).astype(np.int32)
  directory = tmp_path / 'backup'
  towers.fit(images, labels, batch_size=16, epochs=1, verbose=0,
             shuffle=False, callbacks=[keras.callbacks.BackupAndRestore(
                 str(directory), save_freq=2, delete_checkpoint=False)])
  got, position = _restored_by_the_command_line(directory)
  assert position == checkpoints.Position(STEPS, 0, 16 * STEPS)
  for mine, theirs in zip(weights(towers.model), got):
    np.testing.assert_array_equal(mine, theirs)
  resumed = run_train(**dict(_flags(), train_steps=STEPS + 2,
                             model_dir=str(directory)))
  assert resumed['resumed_from_step'] == STEPS


def test_a_checkpoint_of_another_model_is_one_line(tmp_path):
  other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  optimizer.build(other.trainable_variables)
  checkpoints.Checkpointer(str(tmp_path), model=other, optimizer=optimizer,
                           max_to_keep=1, device='CPU:0').save(
                               checkpoints.Position(1, 0, 4))
  with pytest.raises(errors.CheckpointMismatchError,
                     match='does not fit model'):
    backup.restore(_towers(), str(tmp_path))


def test_a_backup_without_a_step_is_one_line(tmp_path):
  """A fit backup of an earlier tfmulti (its epoch and steps, no step)."""
  old = tf.train.Checkpoint(epoch=tf.Variable(1, dtype=tf.int64),
                            steps=tf.Variable(3, dtype=tf.int64))
  checkpoints.Writer(str(tmp_path), old, max_to_keep=1).write(23)
  with pytest.raises(errors.CheckpointMismatchError, match='holds no step'):
    backup.restore(_towers(), str(tmp_path))
