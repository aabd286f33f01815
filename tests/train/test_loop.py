"""Tests for tfmulti.train.loop (and the job's overrides) with a fake trainer.

No flags, no subprocesses, no real model step: a fake `Trainer` records the
rows it is given and returns scripted losses, and the data is ten rows made
here, so each test checks the loop's own promises: every batch of every
epoch in order, checkpoints and evaluations on schedule, a resume that
continues the epoch, a NaN stop and a signal stop that save the right step.
"""

import json
import os
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import scalars
from tfmulti import data
from tfmulti import deploy
from tfmulti import errors
from tfmulti import trainer
from tfmulti.engine import checkpoints
from tfmulti.train import config
from tfmulti.train import job
from tfmulti.train import loop
from tfmulti.train import metrics as metrics_lib
from tfmulti.train import summaries

ROWS = 10  # Train examples; row i's first feature is i.
BATCH = 2  # Rows per global step: 5 steps an epoch.
HOST = '/device:CPU:0'


def _rows_of_epoch(epoch):
  """The order of epoch `epoch`: rotated by the epoch, fixed (resumable)."""
  return [(i + epoch) % ROWS for i in range(ROWS)]


def _tiny_data():
  def dataset(order):
    images = np.zeros((len(order), 2), np.float32)
    images[:, 0] = order
    labels = np.array(order, np.int32) % 3
    return tf.data.Dataset.from_tensor_slices((images, labels))

  def train_epoch(epoch, skip_batches=0):
    return dataset(_rows_of_epoch(epoch)).batch(
        BATCH, drop_remainder=True).skip(skip_batches)
  return data.Data(train_epoch=train_epoch,
                   test=dataset(list(range(6))).batch(4), input_shape=(2,),
                   num_classes=3, train_examples=ROWS, test_examples=6)


class FakeTrainer(trainer.Trainer):
  """Records the rows of each step; its loss at step s is `losses(s)`."""

  def __init__(self, losses=lambda step: 1.0 / step, on_step=None):
    with tf.device(HOST):
      inputs = keras.Input((2,))
      self.model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
      self.optimizer = keras.optimizers.SGD(0.1)
      self.optimizer.build(self.model.trainable_variables)
    self.rows = []  # Per step, the first feature of each row.
    self._losses = losses
    self._on_step = on_step or (lambda step: None)
    self.step_function = tf.function(lambda: 0)

  def distribute_dataset(self, dataset):
    return dataset

  def train_step_outputs(self, images, labels, **unused):
    self.rows.append([int(v) for v in images[:, 0]])
    step = len(self.rows)
    self._on_step(step)
    loss = tf.constant(self._losses(step), tf.float32)
    return trainer.StepOutputs(loss, tf.constant(0.0), [loss], {})

  def predict(self, images):
    return self.model(images)

  def evaluate_outputs(self, images):
    return self.model(images), tf.zeros([])


def _run(tmp_path, fake, total_steps, checkpoint_steps=4):
  return loop.Run(
      trainer=fake, dataset=_tiny_data(),
      loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      schedule=lambda step: 0.1,
      checkpointer=checkpoints.Checkpointer(
          str(tmp_path), model=fake.model, optimizer=fake.optimizer,
          max_to_keep=10, device=HOST),
      summaries=summaries.Summaries(str(tmp_path), device=HOST),
      global_batch_size=BATCH, total_steps=total_steps, log_every_steps=3,
      checkpoint_steps=checkpoint_steps)


START = checkpoints.Position(0, 0, 0)


def _train(run, position=START):
  try:
    return loop.train(run, position)
  finally:
    run.summaries.close()


def _expected_rows(steps):
  flat = [row for epoch in range(steps // 5 + 1)
          for row in _rows_of_epoch(epoch)]
  return [flat[BATCH * s:BATCH * (s + 1)] for s in range(steps)]


def _checkpoint_steps(directory):
  return sorted(int(p.name[len('ckpt-'):-len('.index')])
                for p in directory.glob('ckpt-*.index'))


def test_every_batch_of_every_epoch_in_order(tmp_path):
  fake = FakeTrainer()
  outcome = _train(_run(tmp_path, fake, total_steps=12))
  assert fake.rows == _expected_rows(12)
  assert outcome.position == checkpoints.Position(12, 2, 4)
  assert _checkpoint_steps(tmp_path) == [4, 8, 12]
  found = scalars(str(tmp_path))
  assert sorted(found[summaries.EVAL_ACCURACY]) == [5, 10, 12]  # Epochs.
  assert sorted(found[summaries.TOTAL_LOSS]) == [3, 6, 9, 12]
  # The progress line's loss is the mean of its window: steps 10 to 12.
  assert outcome.progress.last_window_loss == pytest.approx(
      np.mean([1 / 10, 1 / 11, 1 / 12]))
  assert 0 <= outcome.evaluation['accuracy'] <= 1


def test_a_resumed_run_sees_the_rest_of_its_epoch(tmp_path):
  first = FakeTrainer()
  stopped = _train(_run(tmp_path / 'a', first, total_steps=7))
  assert stopped.position == checkpoints.Position(7, 1, 4)
  rest = FakeTrainer()
  _train(_run(tmp_path / 'b', rest, total_steps=12), stopped.position)
  assert first.rows + rest.rows == _expected_rows(12)


def test_a_nan_loss_stops_before_it_is_saved(tmp_path):
  fake = FakeTrainer(losses=lambda step: float('nan') if step == 6 else 1.0)
  with pytest.raises(errors.NonFiniteError,
                     match=r'the loss is nan at step 6; .*ckpt-5\) holds '
                     'the last good state'):
    _train(_run(tmp_path, fake, total_steps=12, checkpoint_steps=1))
  assert _checkpoint_steps(tmp_path) == [1, 2, 3, 4, 5]


def test_a_signal_stops_after_the_step_with_a_checkpoint(tmp_path):
  def sigterm_at_3(step):
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)
  fake = FakeTrainer(on_step=sigterm_at_3)
  with pytest.raises(loop.TrainingInterrupted) as stop:
    _train(_run(tmp_path, fake, total_steps=12, checkpoint_steps=100))
  assert (stop.value.step, stop.value.exit_code) == (3, 128 + signal.SIGTERM)
  assert _checkpoint_steps(tmp_path) == [3]
  assert len(fake.rows) == 3


@pytest.mark.slow
def test_train_and_evaluate_takes_its_data_and_trainer(tmp_path):
  """The job around the loop: resume, metrics.json; no flags, no model."""
  train_config = config.TrainConfig(model_dir=str(tmp_path), batch_size=BATCH,
                                    train_steps=7, log_every_steps=1,
                                    steps_per_loop=1)  # A Python fake.
  one_clone = deploy.DeploymentConfig(clone_on_cpu=True)
  first = FakeTrainer()
  before = metrics_lib.process_age()
  metrics = job.train_and_evaluate(
      train_config, one_clone, data_override=_tiny_data(),
      trainer_override=first)
  after = metrics_lib.process_age()
  with open(tmp_path / metrics_lib.METRICS_FILE) as f:
    assert json.load(f) == metrics_lib.strict(metrics)
  assert (metrics['steps'], metrics['resumed_from_step']) == (7, None)
  assert metrics['global_batch_size'] == BATCH
  assert metrics['train_loss'] == pytest.approx(1 / 7)
  # The process before the job (this test process's age then), read from
  # Linux's /proc: more than the seconds since the job began, and finite.
  phases = metrics['phases_seconds']
  assert phases['imports'] > phases['startup'] > 0
  # With 'other', the phases add up to the process's age when the job
  # wrote its record (/proc's clock ticks are 10 ms).
  whole = sum(phases[name] for name in metrics_lib.WHOLE_PHASES
              if name in phases) + phases['other']
  assert phases['other'] >= -0.02
  assert before - 0.02 <= whole <= after + 0.02
  rest = FakeTrainer()
  metrics = job.train_and_evaluate(
      config.TrainConfig(model_dir=str(tmp_path), batch_size=BATCH,
                         train_steps=12, log_every_steps=1,
                         steps_per_loop=1),
      one_clone, data_override=_tiny_data(), trainer_override=rest)
  assert (metrics['steps'], metrics['resumed_from_step']) == (12, 7)
  assert first.rows + rest.rows == _expected_rows(12)


def test_the_first_progress_line_says_the_speed_is_not_timed_yet(caplog):
  progress = loop.Progress(total_steps=4, global_batch_size=8,
                           log_every_steps=1)
  progress.first_step_started = 0.0
  with caplog.at_level('INFO', logger='absl'):
    progress.record(1, [0.5], epoch=0)  # The traced step: untimed.
  assert 'not timed yet (the first step traces)' in caplog.text
  assert 'nan' not in caplog.text


@pytest.mark.parametrize('accuracy, last_loss, batch_norm, hinted', [
    (0.1, 0.5, True, True),    # Chance, learning, BatchNorm: the hint.
    (0.6, 0.5, True, False),   # Evaluation learns too.
    (0.1, 0.95, True, False),  # Training does not learn either.
    (0.1, 0.5, False, False),  # No moving statistics to blame.
])
def test_evaluation_at_chance_while_training_learns_suggests_the_momentum(
    accuracy, last_loss, batch_norm, hinted):
  inputs = keras.Input((2,))
  x = keras.layers.BatchNormalization()(inputs) if batch_norm else inputs
  run = type('Run', (), {})()
  run.dataset = type('Data', (), {'num_classes': 10})()
  run.trainer = type('Trainer', (), {'model': keras.Model(
      inputs, keras.layers.Dense(10)(x))})()
  progress = loop.Progress(global_batch_size=2, total_steps=10,
                           log_every_steps=1)
  progress.first_window_loss, progress.last_window_loss = 1.0, last_loss
  assert loop._at_chance_while_learning(
      run, {'accuracy': accuracy}, progress) is hinted


@pytest.mark.parametrize('momentum, hint', [
    (0.99, '(momentum 0.99) lag the weights; a smaller --batch_norm_momentum '
           '(e.g. 0.9)'),
    (0.9, '(momentum 0.9) lag the weights; a smaller --batch_norm_momentum '
          '(e.g. 0.5)'),
    (0.5, '(momentum 0.5) follow within a few steps; look at what differs')])
def test_the_batch_norm_hint_suggests_a_momentum_smaller_than_the_models(
    momentum, hint):
  model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(
      momentum=momentum)])
  assert hint in loop.batch_norm_hint(model)
