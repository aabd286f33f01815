"""tfmulti.engine.step_calls: many steps in one compiled call train the
bits of one step a call, trace once, end at the loop's host events, stop
on a signal at a call's end and resume exactly; 'auto' and the refusals."""

import os
import signal
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.fit.test_keras_models import _subclassed
from tests.helpers import embedding_model
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import make_loss
from tests.helpers import mlp
from tests.helpers import token_batches
from tests.helpers import weights
from tfmulti import data
from tfmulti import deploy
from tfmulti import errors
from tfmulti import step_options
from tfmulti.distribute import distributed_model
from tfmulti.engine import checkpoints
from tfmulti.engine import step_calls
from tfmulti.train import config
from tfmulti.train import loop
from tfmulti.train import summaries

ROWS = 16  # Rows of a global batch.


def _batches(steps, seed=0, tokens=False):
  """`steps` global batches for `mlp` (or, `tokens`, for
  `embedding_model`), as a `tf.data.Dataset`."""
  images, labels = zip(*(
      token_batches(1, ROWS, seed=seed + s)[0] if tokens
      else make_batch(ROWS, seed=seed + s) for s in range(steps)))
  return tf.data.Dataset.from_tensor_slices(
      (np.concatenate(images), np.concatenate(labels))).batch(
          ROWS, drop_remainder=True)


def _train(trainer, calls, epochs, tokens=False):
  """Runs each epoch's counts of steps a call on a fresh iterator (as the
  loop does an epoch); returns every step's total loss."""
  totals = []
  for epoch, counts in enumerate(epochs):
    iterator = calls.iterator(trainer.distribute_dataset(
        _batches(sum(counts), seed=10 * epoch, tokens=tokens)))
    for count in counts:
      got, _ = calls.run(iterator, count)
      totals += [float(t) for t in tf.concat(
          [tf.reshape(t, [-1]) for t in got], 0)]
  return totals


def _towers(**fields):
  config_fields = {k: fields.pop(k) for k in ('num_stages',) if k in fields}
  return lambda: make_deployed(deploy.DeploymentConfig(
      num_clones=2, clone_on_cpu=True, **config_fields), **fields)


def _mirrored():
  config_ = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  strategy = distributed_model.make_strategy('mirrored', config_)
  with strategy.scope():
    model = mlp()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  return distributed_model.DistributedModel(strategy, model, make_loss(),
                                            optimizer)


def _sequential_with_dropout():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((6,)),
                           keras.layers.Dense(16, activation='tanh'),
                           keras.layers.Dropout(0.5), keras.layers.Dense(3)])


EPOCHS = ([1, 3, 2], [4, 1])  # Steps a call, in two epochs.

_LAYOUTS = {
    'towers': _towers(),
    'feed': _towers(),  # With prefetch_to_clones (below).
    'stages-reproducible': _towers(num_stages=2, num_microbatches=2,
                                   reproducible_rows=4),
    'mirrored': _mirrored,
    # Models as users bring them: the same bits in a loop, and so what one
    # step a call trains (plain one-device fit's, tests/fit).
    'subclassed': _towers(model_fn=_subclassed),
    'sequential-dropout': _towers(model_fn=_sequential_with_dropout),
    'embedding-adam': _towers(model_fn=embedding_model,
                              optimizer_fn=lambda: keras.optimizers.Adam(
                                  0.01)),
}


@pytest.mark.parametrize('name', [
    pytest.param(name, marks=[] if name == 'towers' else [pytest.mark.slow])
    for name in _LAYOUTS])
def test_many_steps_a_call_train_the_bits_of_one_a_call(name, monkeypatch):
  """Both epochs through `InALoop` (calls of 1, 3, 2, then 4, 1 steps)
  against `OneACall`: every step's loss and the weights, bit for bit; the
  step traced once, and the loop once, for every count and epoch."""
  if name == 'feed':
    monkeypatch.setattr(deploy.DeploymentConfig, 'prefetches_to_clones',
                        lambda self: True)
  make, tokens = _LAYOUTS[name], name.startswith('embedding')
  reference = make()
  want = _train(reference, step_calls.OneACall(reference),
                [[1] * sum(c) for c in EPOCHS], tokens)
  looped = make()
  in_a_loop = step_calls.InALoop(looped)
  got = _train(looped, in_a_loop, EPOCHS, tokens)
  assert got == want
  for a, b in zip(weights(looped.model), weights(reference.model)):
    np.testing.assert_array_equal(a, b)
  assert looped.trace_count == 1
  assert in_a_loop.function.experimental_get_tracing_count() == 1


def test_a_one_step_call_runs_the_loop_so_nothing_is_built_later():
  trainer = _LAYOUTS['towers']()
  in_a_loop = step_calls.InALoop(trainer)
  _train(trainer, in_a_loop, [[1]])
  assert in_a_loop.function.experimental_get_tracing_count() == 1


def test_auto_times_steps_then_fills_about_50_ms_a_call():
  plan = step_calls.Plan(step_calls.AUTO, log_every_steps=100)
  assert not plan.timing(0)  # The first step traces: not timed.
  assert plan.timing(1) and plan.count(bound=10) == 1
  for seconds in (0.009, 0.004, 0.005):  # The least disturbed: 4 ms.
    plan.record(seconds)
  assert plan.steps_per_loop == 13  # ceil(50 / 4).
  assert not plan.timing(4)
  assert plan.count(bound=20) == 13 and plan.count(bound=5) == 5
  slow = step_calls.Plan(step_calls.AUTO, log_every_steps=10)
  for _ in range(step_calls.TIMED_STEPS):
    slow.record(0.0001)  # 500 would fit in 50 ms: a progress line's 10.
  assert slow.steps_per_loop == 10
  slower = step_calls.Plan(step_calls.AUTO, log_every_steps=10)
  for _ in range(step_calls.TIMED_STEPS):
    slower.record(0.2)  # Longer than 50 ms already: one a call.
  assert slower.steps_per_loop == 1
  assert step_calls.Plan(7, 10).count(bound=0) == 1


def test_a_call_ends_at_every_host_event():
  run = types.SimpleNamespace(log_every_steps=10, checkpoint_steps=25,
                              profile_steps=(31, 33))
  assert loop._to_next_event(run, 0, last=100) == 10
  assert loop._to_next_event(run, 20, last=100) == 5  # Checkpoint 25.
  assert loop._to_next_event(run, 27, last=100) == 3  # Before 31's profile.
  assert loop._to_next_event(run, 30, last=100) == 3  # Its end, 33.
  assert loop._to_next_event(run, 36, last=38) == 2  # The epoch's end.


def _loop_run(tmp_path, trainer, total_steps, steps_per_loop, data):
  return loop.Run(
      trainer=trainer, dataset=data, loss_fn=make_loss(),
      schedule=lambda step: 0.1,
      checkpointer=checkpoints.Checkpointer(
          str(tmp_path), model=trainer.model, optimizer=trainer.optimizer,
          max_to_keep=10, device='/device:CPU:0'),
      summaries=summaries.Summaries(str(tmp_path), device='/device:CPU:0'),
      global_batch_size=ROWS, total_steps=total_steps, log_every_steps=100,
      checkpoint_steps=100, steps_per_loop=steps_per_loop)


def _data():
  """12 steps of `_batches` an epoch, each epoch its own seed."""
  def train_epoch(epoch, skip_batches=0):
    return _batches(12, seed=epoch).skip(skip_batches)
  return data.Data(train_epoch=train_epoch, test=_batches(1),
                   input_shape=(6,), num_classes=3,
                   train_examples=12 * ROWS, test_examples=ROWS)


def _signalling(signal_at_step=None):
  """Towers on 2 clones whose loss sends this process one SIGTERM in step
  `signal_at_step` (inside the compiled call running it), and adds
  nothing to the loss (0 times what it returns)."""
  config_ = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  sent = []
  with tf.device(config_.optimizer_variables_device()):
    with config_.variables_scope():
      model = mlp()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  base = make_loss()

  def send(iterations):
    if int(iterations) + 1 == signal_at_step and not sent:
      sent.append(True)
      os.kill(os.getpid(), signal.SIGTERM)
    return 0.0

  def loss(labels, logits):
    sent_ = tf.py_function(send, [optimizer.iterations], tf.float32)
    sent_.set_shape([])
    return base(labels, logits) + 0.0 * sent_
  return deploy.deploy(config_, model, loss, optimizer)


def _interrupted_then_resumed(tmp_path):
  run = _loop_run(tmp_path, _signalling(6), 12, 4, _data())
  with pytest.raises(loop.TrainingInterrupted) as raised:
    loop.train(run, checkpoints.Position(0, 0, 0))
  run.summaries.close()
  resumed = _signalling()
  run = _loop_run(tmp_path, resumed, 12, 4, _data())
  restored = run.checkpointer.restore_latest()
  outcome = loop.train(run, restored)
  run.summaries.close()
  return raised.value, restored, outcome, resumed


@pytest.mark.slow
def test_a_signal_in_a_call_stops_after_it_and_resumes_exactly(tmp_path):
  """SIGTERM in step 6, inside the call of steps 6-9 (the calls: 1, 2-5,
  6-9, 10-12): the call finishes, step 9 is saved, and the resumed run
  ends with the weights of a run never stopped."""
  stopped, restored, outcome, resumed = _interrupted_then_resumed(
      tmp_path / 'stopped')
  assert (stopped.signal_name, stopped.step) == ('SIGTERM', 9)
  assert restored.step == 9 and outcome.position.step == 12
  whole = _signalling()
  run = _loop_run(tmp_path / 'whole', whole, 12, 4, _data())
  loop.train(run, checkpoints.Position(0, 0, 0))
  run.summaries.close()
  for a, b in zip(weights(resumed.model), weights(whole.model)):
    np.testing.assert_array_equal(a, b)


def test_refusals_and_where_auto_is_one():
  with pytest.raises(errors.ConfigError,
                     match=r"^steps_per_loop=0: must be an integer >= 1\.$"):
    config.TrainConfig(steps_per_loop=0)
  with pytest.raises(errors.ConfigError) as raised:
    config.TrainConfig(steps_per_loop=4, step_options=step_options.StepOptions(
        clone_shares='auto'))
  assert str(raised.value).startswith(
      'steps_per_loop=4 with clone_shares=auto: the balancer times')
  auto_shares = config.TrainConfig(step_options=step_options.StepOptions(
      clone_shares='auto'))
  assert auto_shares.resolved_steps_per_loop() == 1
  assert config.TrainConfig(
      strategy='multi_worker').resolved_steps_per_loop() == 1
  assert config.TrainConfig(
      strategy='multi_worker', steps_per_loop=8).resolved_steps_per_loop() == 8
  assert config.TrainConfig().resolved_steps_per_loop() == step_calls.AUTO


def test_a_call_whose_input_runs_short_says_so():
  """The loop reads as many batches as the job counted; an input that
  holds fewer fails the call naming it, not at a later position."""
  trainer = _towers()()
  calls = step_calls.calls(trainer, 4, log_every_steps=10)
  iterator = calls.runner.iterator(trainer.distribute_dataset(_batches(3)))
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='the input ran out before the steps'):
    calls.runner.run(iterator, 4)
