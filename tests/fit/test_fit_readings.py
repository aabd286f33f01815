"""A run you can read, through `fit`: its logs, progress bar, History and
Keras's TensorBoard callback carry each step's time, examples (and
tokens) a second, memory and MFU; the MFU is the layers' FLOPs (counted
apart, from the model) over the step time and the devices' peak."""

import glob
import math
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.fit import test_own_steps as own
from tests.helpers import embedding_model
from tests.helpers import make_batch
from tests.helpers import make_loss
from tests.helpers import mlp
from tests.helpers import token_batches
from tfmulti import deploy
from tfmulti import errors
from tfmulti import fit
from tfmulti.bench import flops as flops_lib
from tfmulti.fit import readings as fit_readings

PEAK = 1e9
BATCH = 16


def _fit(make, x, y, *, steps_per_execution=1, callbacks=(), verbose=0,
         **towers_args):
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = make()
  towers = fit.TowersModel(model, config, **towers_args)
  towers.compile(optimizer=keras.optimizers.SGD(0.1), loss=make_loss(),
                 steps_per_execution=steps_per_execution)
  history = towers.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                       verbose=verbose, callbacks=list(callbacks))
  return model, history.history


@pytest.mark.parametrize('steps_per_execution', [
    1, pytest.param(2, marks=pytest.mark.slow)])
def test_history_carries_each_epochs_readings(steps_per_execution):
  x, y = make_batch(8 * BATCH)
  model, history = _fit(mlp, x, y, steps_per_execution=steps_per_execution,
                        device_peak_flops='1G')
  want_flops = flops_lib.step_flops(model, BATCH)
  assert {'step_time', 'examples_per_sec', 'mfu', 'memory_gib',
          'memory_peak_gib'} <= set(history)
  assert set(history) - {'loss'} <= set(fit_readings.KEYS)
  for epoch in range(2):
    step_time = history['step_time'][epoch]
    assert history['examples_per_sec'][epoch] * step_time == (
        pytest.approx(BATCH))
    np.testing.assert_allclose(
        history['mfu'][epoch] * step_time * 2 * PEAK, want_flops, rtol=1e-5)
    assert 0 < history['memory_gib'][epoch] <= (
        history['memory_peak_gib'][epoch])


@pytest.mark.slow
def test_token_inputs_give_tokens_a_second():
  x, y = (np.concatenate(parts) for parts in zip(*token_batches(8)))
  _, history = _fit(embedding_model, x, y)
  assert 'mfu' not in history  # No peak given, a CPU has none known.
  for epoch in range(2):
    assert history['tokens_per_sec'][epoch] == pytest.approx(
        5 * history['examples_per_sec'][epoch])  # 5 token ids a row.


def test_the_progress_bar_and_tensorboard_show_them(tmp_path, capsys):
  x, y = make_batch(4 * BATCH)
  _fit(mlp, x, y, verbose=2, device_peak_flops='1G',
       callbacks=[keras.callbacks.TensorBoard(str(tmp_path))])
  shown = capsys.readouterr().out
  for key in ('loss', 'step_time', 'examples_per_sec', 'mfu',
              'memory_peak_gib'):
    assert f' - {key}: ' in shown, key
  tags = set()
  for path in glob.glob(str(tmp_path / 'train' / 'events.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(value.tag for value in event.summary.value)
  assert {'epoch_step_time', 'epoch_mfu', 'epoch_examples_per_sec'} <= tags


@pytest.mark.slow
def test_a_models_own_step_is_read_too():
  x, y = own._data()
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = own._guide_model()
  towers = fit.TowersModel(model, config, device_peak_flops='1G')
  towers.compile(optimizer='sgd', loss='mse')
  history = towers.fit(x, y, batch_size=own.BATCH, epochs=2,
                       verbose=0).history
  want_flops = flops_lib.step_flops(model, own.BATCH)
  np.testing.assert_allclose(
      history['mfu'][1] * history['step_time'][1] * 2 * PEAK, want_flops,
      rtol=1e-5)


def test_a_bad_peak_is_refused_before_fit():
  with pytest.raises(errors.ConfigError, match='device_peak_flops=quick'):
    fit.TowersModel(mlp(), deploy.DeploymentConfig(num_clones=2,
                                                   clone_on_cpu=True),
                    device_peak_flops='quick')


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


class _Meter:
  """Records what each reading was of: (seconds, steps)."""

  def __init__(self, *args, **kwargs):
    del args, kwargs
    self.read = []

  def count(self):
    pass

  def reading(self, seconds, steps):
    self.read.append((seconds, steps))
    return types.SimpleNamespace(logs=lambda: {'step_time': seconds / steps})


def test_the_callback_times_each_call_and_each_epoch(monkeypatch):
  """Driven by hand on a clock: the first step (it traces) untimed; each
  call's steps (steps_per_execution: its last step's index); each epoch
  from its start, not from the last epoch's end (validation between);
  steps a resumed run passes over untimed; an epoch whose one step traced
  logs NaN, so History keeps one entry an epoch."""
  clock = _Clock()
  monkeypatch.setattr(fit_readings.time, 'perf_counter', clock)
  monkeypatch.setattr(fit_readings.readings, 'Meter', _Meter)
  towers = types.SimpleNamespace(
      passes=types.SimpleNamespace(passed=False),
      batches=types.SimpleNamespace(rows=16, tokens_per_row=None),
      steps=types.SimpleNamespace(step_function=None),
      model=types.SimpleNamespace(
          dtype_policy=types.SimpleNamespace(compute_dtype='float32')),
      config=types.SimpleNamespace(compute_devices=lambda: ['a', 'b']))
  callback = fit_readings.Readings(towers)
  callback.on_train_begin()
  callback.on_epoch_begin(0)
  clock.now = 10.0
  callback.on_train_batch_end(0, {})  # It traced.
  epoch = {}
  callback.on_epoch_end(0, epoch)
  assert np.isnan(epoch['step_time'])
  meter = callback._meter
  clock.now = 50.0  # Validation, then the next epoch.
  callback.on_epoch_begin(1)
  clock.now = 51.0
  logs = {}
  callback.on_train_batch_end(0, logs)
  clock.now = 55.0
  callback.on_train_batch_end(2, {})  # Two steps in one call.
  towers.passes.passed = True  # (As a resumed run's step would be.)
  clock.now = 90.0
  callback.on_train_batch_end(3, {})
  towers.passes.passed = False
  callback.on_epoch_end(1, epoch)
  assert math.isnan(meter.read[0][0]) and meter.read[1:] == [
      (1.0, 1), (4.0, 2), (5.0, 3)]
  assert logs == {'step_time': 1.0} and epoch == {'step_time': 5.0 / 3}
