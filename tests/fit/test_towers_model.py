"""TowersModel: Keras's compile / fit / evaluate / predict over the towers,
equal to plain `fit` on one device."""

import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import CHATTER
from tests.helpers import L2
from tests.helpers import make_batch
from tests.helpers import mlp
from tests.helpers import readings_apart
from tests.helpers import REPO
from tests.helpers import weights
from tfmulti import deploy
from tfmulti import devices
from tfmulti import errors
from tfmulti import fit
from tfmulti.fit import readings as fit_readings

ROWS = 36  # 4 batches of 8 and a last one of 4 (Keras keeps it).
BATCH = 8
OPTIMIZERS = {
    'momentum': lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    'adam': lambda: keras.optimizers.Adam(0.01),
}


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(rows=ROWS, batch=BATCH):
  images, labels = make_batch(rows, seed=3)
  return tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch)


def _plain_fit(optimizer, batch=BATCH, model_fn=mlp, epochs=2):
  """One device, Keras's own fit: the reference."""
  model = model_fn()
  model.compile(optimizer=OPTIMIZERS[optimizer](), loss=_loss(),
                metrics=['accuracy'])
  history = model.fit(_data(batch=batch), epochs=epochs, verbose=0)
  return model, history.history


def _towers_fit(optimizer, batch=BATCH, model_fn=mlp, epochs=2, **kwargs):
  options = {k: kwargs.pop(k) for k in list(kwargs)
             if k not in ('num_clones', 'num_stages', 'variables_device')}
  config = deploy.DeploymentConfig(clone_on_cpu=True, **kwargs)
  with tf.device(config.variables_device()):
    model = model_fn()
  towers = fit.TowersModel(model, config, **options)
  towers.compile(optimizer=OPTIMIZERS[optimizer](), loss=_loss(),
                 metrics=['accuracy'])
  history = towers.fit(_data(batch=batch), epochs=epochs, verbose=0)
  return towers, history.history


@pytest.mark.parametrize('optimizer, layout', [
    pytest.param(optimizer, layout, marks=[pytest.mark.slow] if (
        len(layout) > 1 or optimizer == 'adam') else [])
    for optimizer in sorted(OPTIMIZERS) for layout in (
        dict(num_clones=2),
        dict(num_clones=2, clone_shares=(3, 1)),
        dict(num_clones=2, num_stages=2, num_microbatches=2))])
def test_fit_equals_plain_fit_on_one_device(optimizer, layout):
  want_model, want_logs = _plain_fit(optimizer)
  towers, logs = _towers_fit(optimizer, **layout)
  for got, want in zip(weights(towers.model), weights(want_model)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # The logs callbacks see: the loss (regularization in it) and accuracy.
  # Beside them, the steps' readings (time, rows, memory: `fit.readings`).
  assert logs.keys() - want_logs.keys() <= set(fit_readings.KEYS)
  assert want_logs.keys() <= logs.keys()
  for key in want_logs:
    np.testing.assert_allclose(logs[key], want_logs[key], rtol=1e-5,
                               err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize('optimizer', sorted(OPTIMIZERS))
def test_accumulation_equals_plain_fit_on_twice_the_batch(optimizer):
  want_model, _ = _plain_fit(optimizer, batch=2 * BATCH)
  towers, _ = _towers_fit(optimizer, batch=2 * BATCH, num_clones=2,
                          accumulation_steps=2)
  for got, want in zip(weights(towers.model), weights(want_model)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_last_partial_batch_trains_exactly_with_one_more_trace():
  # 36 rows in batches of 8 over 3 clones: 3/3/2 rows, then 2/1/1.
  want_model, _ = _plain_fit('momentum', epochs=1)
  towers, _ = _towers_fit('momentum', num_clones=3, epochs=1)
  for got, want in zip(weights(towers.model), weights(want_model)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # One trace a shape (8 and 4 rows): the metrics' variables are made
  # before the first, which would otherwise be traced twice. Another epoch
  # adds none.
  def traces():  # The trainer's step and Keras's metrics of it.
    return (towers.towers.trace_count,
            towers.steps._record.function.experimental_get_tracing_count())
  assert traces() == (2, 2)
  towers.fit(_data(), epochs=1, verbose=0)
  assert traces() == (2, 2)


def _counted_fit(steps_per_execution, epochs=2):
  """2 clones, `fit` with `steps_per_execution`: (the TowersModel, its
  logs, the steps Keras's eager `train_step` ran)."""
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = mlp()
  towers = fit.TowersModel(model, config)
  towers.compile(optimizer=OPTIMIZERS['adam'](), loss=_loss(),
                 metrics=['accuracy'], steps_per_execution=steps_per_execution)
  eager, train_step = [], towers.train_step
  towers.train_step = lambda data: eager.append(1) or train_step(data)
  history = towers.fit(_data(), epochs=epochs, verbose=0)
  return towers, history.history, len(eager)


@pytest.mark.slow
def test_steps_per_execution_runs_the_full_batches_in_one_call_exactly():
  """compile(steps_per_execution=3), 5 batches an epoch (the last of 4
  rows): the fit's first call runs Keras's eager steps (they fix the full
  layout); then each call is one compiled loop over the full batches,
  and an epoch's last batch ends its call as one step of its own. The
  same bits as one step a call, and plain fit's weights."""
  want_model, want_logs = _plain_fit('adam')
  one, one_logs, one_eager = _counted_fit(1)
  towers, logs, eager = _counted_fit(3)
  assert one_eager == 10  # Every step an eager train_step.
  # Epoch 1: 3 eager, 1 in a loop, the last alone; epoch 2: 3 in a loop,
  # then 1 and the last alone.
  assert eager == 3 + 1 + 1
  assert towers.train_function.function.experimental_get_tracing_count() == 1
  assert int(towers.optimizer.iterations.numpy()) == 10
  for got, want, reference in zip(weights(towers.model), weights(one.model),
                                  weights(want_model)):
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
  assert readings_apart(logs) == readings_apart(one_logs)
  for key in want_logs:
    np.testing.assert_allclose(logs[key], want_logs[key], rtol=1e-5,
                               err_msg=key)


def test_steps_per_execution_with_measured_shares_is_refused_in_one_line():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = mlp()
  towers = fit.TowersModel(model, config, clone_shares='auto')
  with pytest.raises(errors.ConfigError, match=re.escape(
      'steps_per_execution=2 with clone_shares=auto: the balancer times the '
      'clones between steps, one step a call; set steps_per_execution=1')):
    towers.compile(optimizer='sgd', loss=_loss(), steps_per_execution=2)


@pytest.mark.slow
def test_a_last_batch_of_fewer_rows_than_clones_trains_as_plain_fit():
  """tf.data's last batch of 2 rows on 3 clones: clone 2 takes none."""
  images, labels = make_batch(34, seed=3)
  data = tf.data.Dataset.from_tensor_slices((images, labels)).batch(BATCH)
  plain = mlp()
  plain.compile(optimizer=OPTIMIZERS['momentum'](), loss=_loss())
  plain.fit(data, epochs=1, verbose=0)
  config = deploy.DeploymentConfig(num_clones=3, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = mlp()
  towers = fit.TowersModel(model, config)
  towers.compile(optimizer=OPTIMIZERS['momentum'](), loss=_loss())
  towers.fit(data, epochs=1, verbose=0)
  for got, want in zip(weights(model), weights(plain)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('options, message', [
    (dict(reproducible_rows=4),
     'reproducible_rows=4: a batch of 2 rows on a worker is not'),
    (dict(sync_batch_norm=True),
     'sync_batch_norm=True runs equal clones in lockstep, and a batch of 3 '
     'rows does not split evenly'),
])
def test_a_last_batch_the_layout_refuses_stops_fit_before_a_step(options,
                                                                 message):
  """Arrays whose last batch the layout cannot cut are refused before the
  first step, in one line, the weights as they were: not after an epoch."""
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = mlp()
  towers = fit.TowersModel(model, config, **options)
  towers.compile(optimizer=OPTIMIZERS['momentum'](), loss=_loss())
  before = weights(model)
  rows = 34 if 'reproducible_rows' in options else 35  # A last batch of 2, 3.
  images, labels = make_batch(rows, seed=3)
  with pytest.raises(errors.ConfigError, match=message) as refused:
    towers.fit(images, labels, batch_size=8, epochs=1, verbose=0)
  assert '\n' not in str(refused.value)
  for got, want in zip(weights(model), before):
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_evaluate_and_predict_equal_the_plain_model():
  towers, _ = _towers_fit('momentum', num_clones=2, epochs=1)
  images, labels = make_batch(ROWS, seed=4)
  plain = mlp()
  plain.set_weights(towers.model.get_weights())
  plain.compile(loss=_loss(), metrics=['accuracy'])
  np.testing.assert_allclose(towers.predict(images, batch_size=BATCH,
                                            verbose=0),
                             plain.predict(images, verbose=0), atol=1e-6)
  np.testing.assert_allclose(
      towers.evaluate(images, labels, batch_size=BATCH, verbose=0),
      plain.evaluate(images, labels, batch_size=BATCH, verbose=0),
      rtol=1e-6)


def test_compile_builds_the_slots_beside_the_variables_and_pins_clones():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                   variables_device='/device:CPU:2')
  with tf.device(config.variables_device()):
    model = mlp()
  towers = fit.TowersModel(model, config)
  towers.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                 loss=_loss())
  # Built in compile, before any step: Keras's fit would build them on the
  # default device otherwise.
  assert {devices.device_of(v).split('device:')[-1]
          for v in towers.optimizer.variables} == {'CPU:2'}
  images, labels = make_batch(BATCH)
  graph = towers.towers.traced_step(images, (labels,), with_outputs=True).graph
  matmuls = {op.device.split('device:')[-1] for op in graph.get_operations()
             if op.type == 'MatMul'}
  assert matmuls == {'CPU:0', 'CPU:1'}


def test_jit_compile_true_is_per_clone_xla():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  towers = fit.TowersModel(mlp(), config)
  towers.compile(optimizer='sgd', loss=_loss(), jit_compile=True)
  assert towers.options.xla and not towers.jit_compile
  towers.compile(optimizer='sgd', loss=_loss())  # 'auto': no XLA asked.
  assert towers.jit_compile is False


class TestClearErrors:

  def _towers(self, model=None, **options):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
    return fit.TowersModel(model or mlp(), config, **options)

  @pytest.mark.parametrize('reduction', ['sum', None])
  def test_a_loss_that_is_not_a_mean(self, reduction):
    towers = self._towers()
    with pytest.raises(errors.ConfigError,
                       match=f'reduction={reduction!r}: the towers compute '
                       'the mean'):
      towers.compile(optimizer='sgd',
                     loss=keras.losses.SparseCategoricalCrossentropy(
                         from_logits=True, reduction=reduction))

  def test_inside_a_strategy_scope(self):
    strategy = tf.distribute.OneDeviceStrategy('/cpu:0')
    with strategy.scope():
      with pytest.raises(errors.ConfigError, match='outside any '
                         'tf.distribute strategy scope'):
        self._towers()
    towers = self._towers()
    towers.compile(optimizer='sgd', loss=_loss())
    with strategy.scope():
      with pytest.raises(errors.ConfigError, match='outside any'):
        towers.fit(*make_batch(BATCH), verbose=0)
    assert int(towers.optimizer.iterations) == 0

  def test_a_model_built_outside_the_variables_device(self):
    config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                     variables_device='/device:CPU:2')
    towers = fit.TowersModel(mlp(), config)  # Built on CPU:0.
    with pytest.raises(errors.DeviceError, match='not on the variables '
                       "device '/device:CPU:2'"):
      towers.compile(optimizer='sgd', loss=_loss())

  def test_a_model_with_nothing_to_train(self):
    model = mlp()
    model.trainable = False
    with pytest.raises(errors.ConfigError, match='no trainable weights'):
      self._towers(model)


def test_a_function_loss_of_one_value_a_row_is_its_mean():
  """keras.losses.sparse_categorical_crossentropy returns a value a row;
  2 clones must still equal one device."""
  def loss(labels, logits):
    return keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True)
  images, labels = make_batch(BATCH)
  runs = []
  for num_clones in (1, 2):
    config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True)
    with tf.device(config.variables_device()):
      model, optimizer = mlp(), keras.optimizers.SGD(0.1)
    deployed = deploy.deploy(config, model, loss, optimizer)
    for _ in range(3):
      deployed.train_step(images, labels)
    runs.append(weights(model))
  for got, want in zip(*runs):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert L2 > 0  # The model's penalty counts too (mlp has L2).


class _StopMidEpoch(keras.callbacks.Callback):
  """Raises once, in the middle of epoch `epoch`: a crash."""

  def __init__(self, epoch, batch):
    super().__init__()
    self.at = (epoch, batch)
    self.epoch = None

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    if (self.epoch, batch) == self.at:
      self.at = None
      raise RuntimeError('interrupted')


@pytest.mark.parametrize('steps_per_execution, save_freq', [
    (1, 'epoch'),
    pytest.param(2, 'epoch', marks=pytest.mark.slow),
    # Resumed mid-epoch: the steps passed over run one a call.
    pytest.param(2, 2, marks=pytest.mark.slow)])
def test_backup_and_restore_resumes_an_interrupted_fit_exactly(
    tmp_path, steps_per_execution, save_freq):
  want, _ = _towers_fit('momentum', num_clones=2, epochs=3)
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  towers = fit.TowersModel(mlp(), config)
  towers.compile(optimizer=OPTIMIZERS['momentum'](), loss=_loss(),
                 steps_per_execution=steps_per_execution)
  backup = keras.callbacks.BackupAndRestore(str(tmp_path / 'backup'),
                                            save_freq=save_freq)
  with pytest.raises(RuntimeError, match='interrupted'):
    towers.fit(_data(), epochs=3, verbose=0,
               callbacks=[backup, _StopMidEpoch(epoch=1, batch=3)])
  towers.fit(_data(), epochs=3, verbose=0, callbacks=[backup])
  for got, expected in zip(weights(towers.model), weights(want.model)):
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_reduce_lr_on_plateau_changes_the_rate_the_towers_use():
  plateau = dict(monitor='loss', factor=0.5, patience=0, min_delta=1e9)
  model = mlp()
  model.compile(optimizer=OPTIMIZERS['momentum'](), loss=_loss())
  model.fit(_data(), epochs=3, verbose=0,
            callbacks=[keras.callbacks.ReduceLROnPlateau(**plateau)])
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  towers = fit.TowersModel(mlp(), config)
  towers.compile(optimizer=OPTIMIZERS['momentum'](), loss=_loss())
  towers.fit(_data(), epochs=3, verbose=0,
             callbacks=[keras.callbacks.ReduceLROnPlateau(**plateau)])
  assert float(towers.optimizer.learning_rate) == pytest.approx(0.1 / 4)
  for got, want in zip(weights(towers.model), weights(model)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_early_stopping_and_tensorboard_see_the_towers_logs(tmp_path):
  towers, _ = _towers_fit('momentum', num_clones=2, epochs=1)
  stop = keras.callbacks.EarlyStopping(monitor='loss', patience=0,
                                       min_delta=1e9)
  history = towers.fit(
      _data(), epochs=5, verbose=0, callbacks=[
          stop, keras.callbacks.TensorBoard(str(tmp_path / 'tb'))])
  assert len(history.history['loss']) == 2  # Stopped after no improvement.
  assert list((tmp_path / 'tb' / 'train').glob('events.out.tfevents.*'))


_LOAD_AND_PREDICT = '''
import sys
import os
import re
import subprocess
import sys

import keras
import numpy as np
model = keras.models.load_model(sys.argv[1])
np.save(sys.argv[3], model.predict(np.load(sys.argv[2]), verbose=0))
assert 'tfmulti' not in sys.modules
'''


@pytest.mark.slow
def test_model_checkpoint_writes_what_plain_keras_loads_elsewhere(tmp_path):
  path = str(tmp_path / 'best.keras')
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  towers = fit.TowersModel(mlp(), config)
  towers.compile(optimizer=OPTIMIZERS['momentum'](), loss=_loss())
  towers.fit(_data(), epochs=2, verbose=0,
             callbacks=[keras.callbacks.ModelCheckpoint(path)])
  images, _ = make_batch(ROWS, seed=5)
  np.save(tmp_path / 'images.npy', images)
  result = subprocess.run(
      [sys.executable, '-c', _LOAD_AND_PREDICT, path,
       str(tmp_path / 'images.npy'), str(tmp_path / 'out.npy')],
      cwd=tmp_path, capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-2000:]
  np.testing.assert_allclose(np.load(tmp_path / 'out.npy'),
                             towers.predict(images, verbose=0), atol=1e-6)


def _mobilenet():
  keras.utils.set_random_seed(0)
  return keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3),
                                        classes=10)


@pytest.mark.slow
def test_bring_your_own_model_mobilenet_v2():
  """keras.applications' MobileNetV2 (BatchNorm, depthwise convolutions):
  one clone cut in 2 stages equals one device; 2 clones x 2 stages run on
  their 4 devices. (2 clones normalise each clone's rows, so they equal one
  device only with synchronized BatchNorm, which runs whole clones.) In
  float64: at 32x32 its last BatchNorm layers normalise 8 values a channel,
  and in float32 the rounding of gradients summed in another order across
  the cut grows to 1e-3 in two steps (to 2e-16 in float64)."""
  rng = np.random.default_rng(0)
  images = rng.random((16, 32, 32, 3))
  labels = np.arange(16) % 10
  policy, floatx = keras.config.dtype_policy(), keras.config.floatx()
  keras.config.set_floatx('float64')  # The losses' dtype.
  keras.config.set_dtype_policy('float64')  # The layers'.
  try:
    _train_mobilenet_in_stages(images, labels)
  finally:
    keras.config.set_dtype_policy(policy)
    keras.config.set_floatx(floatx)


def _train_mobilenet_in_stages(images, labels):
  plain = _mobilenet()
  plain.compile(optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy())
  plain.fit(images, labels, batch_size=8, epochs=1, verbose=0, shuffle=False)
  for layout in (dict(num_clones=1, num_stages=2),
                 dict(num_clones=2, num_stages=2)):
    config = deploy.DeploymentConfig(clone_on_cpu=True, **layout)
    with tf.device(config.variables_device()):
      model = _mobilenet()
    towers = fit.TowersModel(model, config)
    towers.compile(optimizer=keras.optimizers.SGD(0.01),
                   loss=keras.losses.SparseCategoricalCrossentropy())
    graph = towers.towers.traced_step(images[:8], (labels[:8],)).graph
    convs = {op.device.split('device:')[-1] for op in graph.get_operations()
             if op.type in ('Conv2D', 'DepthwiseConv2dNative')}
    assert convs == {f'CPU:{d}' for d in range(config.num_clones * 2)}
    history = towers.fit(images, labels, batch_size=8, epochs=1, verbose=0,
                         shuffle=False)
    assert np.isfinite(history.history['loss'][0])
    if config.num_clones == 1:
      for got, want in zip(weights(model), weights(plain)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


_CROSSENTROPY = keras.losses.SparseCategoricalCrossentropy()


@pytest.mark.slow
def test_the_fit_example_learns_and_writes_a_model_keras_loads(tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join('examples', 'fit_your_model.py'),
       f'--model_dir={tmp_path}'], cwd=REPO, capture_output=True, text=True,
      timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert not [part for part in CHATTER if part in result.stderr]
  accuracies = re.search(r'validation accuracy by epoch: \[(.*)\]',
                         result.stderr).group(1)
  best = max(float(a) for a in accuracies.split(','))
  assert best > 0.5  # Chance is 0.1; it reached 0.82 here.
  model = keras.models.load_model(tmp_path / 'best.keras')
  assert model.name.startswith('mobilenetv2')
