"""A model's own steps (`train_step`, `test_step`, `compute_loss`) through
`TowersModel` as through plain `fit`: keras.io's trainer pattern, the
TensorFlow guide's overrides and a GAN with two optimizers; each run once
a batch, its layers computed by rows on the clones (read from the traced
step)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import readings_apart
from tfmulti import deploy
from tfmulti import errors
from tfmulti import fit
from tfmulti.fit import own_steps

ROWS, BATCH = 48, 16
_CONFIG = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)


class GuideModel(keras.Model):
  """The TensorFlow guide's first override: its own train_step, with
  `compute_loss`, the optimizer and `self.metrics` Keras compiled."""

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      y_pred = self(x, training=True)
      loss = self.compute_loss(y=y, y_pred=y_pred)
    trainable_vars = self.trainable_variables
    gradients = tape.gradient(loss, trainable_vars)
    self.optimizer.apply(gradients, trainable_vars)
    for metric in self.metrics:
      if metric.name == 'loss':
        metric.update_state(loss)
      else:
        metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}


def _guide_model(seed=0):
  return _functional(GuideModel, seed)


def _data():
  rng = np.random.default_rng(3)
  return (rng.normal(size=(ROWS, 6)).astype(np.float32),
          rng.normal(size=(ROWS, 1)).astype(np.float32))


@pytest.mark.slow
def test_the_guides_own_train_step_trains_as_plain_fit():
  x, y = _data()
  histories, models = _fit_both(
      _guide_model, dict(x=x, y=y, batch_size=BATCH, epochs=2),
      dict(optimizer='adam', loss='mse', metrics=['mae']))
  _assert_same(histories, models)


def _devices(towers, data, kind):
  """{device: count} of the ops of type `kind` in the traced own step."""
  graph = towers.steps._train.get_concrete_function(data).graph
  found = {}
  for op in graph.get_operations():
    if op.type == kind:
      device = op.device.split('device:')[-1]
      found[device] = found.get(device, 0) + 1
  return found


class SampleWeightModel(keras.Model):
  """The guide's override with sample weights."""

  def train_step(self, data):
    if len(data) == 3:
      x, y, sample_weight = data
    else:
      sample_weight = None
      x, y = data
    with tf.GradientTape() as tape:
      y_pred = self(x, training=True)
      loss = self.compute_loss(y=y, y_pred=y_pred,
                               sample_weight=sample_weight)
    trainable_vars = self.trainable_variables
    gradients = tape.gradient(loss, trainable_vars)
    self.optimizer.apply(gradients, trainable_vars)
    for metric in self.metrics:
      if metric.name == 'loss':
        metric.update_state(loss)
      else:
        metric.update_state(y, y_pred, sample_weight=sample_weight)
    return {m.name: m.result() for m in self.metrics}


class EvaluatingModel(GuideModel):
  """The guide's override of evaluation: its own test_step."""

  def test_step(self, data):
    x, y = data
    y_pred = self(x, training=False)
    loss = self.compute_loss(y=y, y_pred=y_pred)
    for metric in self.metrics:
      if metric.name == 'loss':
        metric.update_state(loss)
      else:
        metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}


class LossModel(keras.Model):
  """Keras's steps around its own `compute_loss` (an L1 term added)."""

  def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                   training=True):
    loss = super().compute_loss(x, y, y_pred, sample_weight, training)
    return loss + 0.01 * keras.ops.mean(keras.ops.abs(y_pred))


def _functional(cls, seed=0):
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((6,))
  x = keras.layers.Dense(16, activation='tanh')(inputs)
  return cls(inputs, keras.layers.Dense(1)(x))


def _fit_both(model_fn, fit_args, compile_args, evaluate=False,
              num_clones=2, **options):
  """(plain fit's history, the towers', their models) on `num_clones`
  clones with `options`, each compiled with `compile_args` (or what it
  returns, a new optimizer)."""
  histories, models = [], []
  config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True)
  for towers in (False, True):
    with config.variables_scope():
      model = model_fn()
    trained = fit.TowersModel(model, config, **options) if towers else model
    trained.compile(**(compile_args() if callable(compile_args)
                       else compile_args))
    history = trained.fit(**fit_args, shuffle=False, verbose=0).history
    if evaluate:
      history['evaluate'] = trained.evaluate(
          fit_args['x'], fit_args['y'], batch_size=BATCH, verbose=0)
    histories.append(history)
    models.append(model)
  return histories, models


def _assert_same(histories, models):
  want, got = histories
  assert readings_apart(got).keys() == want.keys()
  for key, values in want.items():
    np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)
  for g, w in zip(models[1].weights, models[0].weights):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=w.path)


@pytest.mark.parametrize('cls, extra', [
    pytest.param(SampleWeightModel, dict(sample_weight=np.linspace(
        0.5, 1.5, ROWS).astype(np.float32)), marks=pytest.mark.slow),
    pytest.param(EvaluatingModel, dict(validation_data=_data()),
                 marks=pytest.mark.slow),
    pytest.param(LossModel, dict(validation_data=_data()),
                 marks=pytest.mark.slow)],
                         ids=['sample_weight', 'test_step', 'compute_loss'])
def test_the_guides_overrides_train_and_evaluate_as_plain_fit(cls, extra):
  x, y = _data()
  histories, models = _fit_both(
      lambda: _functional(cls), dict(x=x, y=y, batch_size=BATCH, epochs=2,
                                     **extra),
      dict(optimizer='adam', loss='mse', metrics=['mae']), evaluate=True)
  _assert_same(histories, models)


def test_the_own_step_computes_its_layers_on_every_clone():
  """Read from the traced step: each clone's forward and backward matrix
  products on its device (two Dense layers: 2 forward, 4 backward a
  clone, the inputs' gradient among them: a split call cannot tell
  whether its caller differentiates its inputs), the clones' gradients
  summed beside the variables (CPU:0), one sum a variable."""
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                   variables_device='CPU:0')
  with config.variables_scope():
    model = _guide_model()
  towers = fit.TowersModel(model=model, config=config)
  towers.compile(optimizer='sgd', loss='mse')
  x, y = _data()
  data = (tf.constant(x[:BATCH]), tf.constant(y[:BATCH]))
  assert _devices(towers, data, 'MatMul') == {'CPU:0': 6, 'CPU:1': 6}
  assert _devices(towers, data, 'AddN') == {'CPU:0': 4}


class MyTrainer(keras.Model):
  """keras.io's trainer pattern: a model wrapped by a trainer with its own
  train_step and test_step, `compile(optimizer=...)` alone."""

  def __init__(self, model):
    super().__init__()
    self.model = model
    self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
    self.accuracy_metric = keras.metrics.SparseCategoricalAccuracy()

  @property
  def metrics(self):
    return [self.accuracy_metric]

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      y_pred = self.model(x, training=True)
      loss = self.loss_fn(y, y_pred)
    trainable_vars = self.trainable_variables
    gradients = tape.gradient(loss, trainable_vars)
    self.optimizer.apply_gradients(zip(gradients, trainable_vars))
    for metric in self.metrics:
      metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}

  def test_step(self, data):
    x, y = data
    y_pred = self.model(x, training=False)
    for metric in self.metrics:
      metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}

  def call(self, x):
    return self.model(x)


def _trainer(seed=0):
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([keras.Input((6,)),
                            keras.layers.Dense(16, activation='relu'),
                            keras.layers.Dense(3, activation='softmax')])
  return MyTrainer(model)


@pytest.mark.slow
def test_the_trainer_pattern_trains_as_plain_fit():
  x, _ = _data()
  y = np.random.default_rng(5).integers(0, 3, ROWS).astype(np.int32)
  histories, models = _fit_both(
      _trainer, dict(x=x, y=y, batch_size=BATCH, epochs=2,
                     validation_data=(x, y)),
      lambda: dict(optimizer=keras.optimizers.SGD(0.1)))
  _assert_same(histories, models)


class GAN(keras.Model):
  """keras.io's DCGAN's training, its two optimizers and its compile; the
  latent vectors come with the data (fed alike to both runs) instead of
  from its seed generator."""

  def __init__(self, discriminator, generator, latent_dim):
    super().__init__()
    self.discriminator = discriminator
    self.generator = generator
    self.latent_dim = latent_dim

  def compile(self, d_optimizer, g_optimizer, loss_fn):
    super().compile()
    self.d_optimizer = d_optimizer
    self.g_optimizer = g_optimizer
    self.loss_fn = loss_fn
    self.d_loss_metric = keras.metrics.Mean(name='d_loss')
    self.g_loss_metric = keras.metrics.Mean(name='g_loss')

  @property
  def metrics(self):
    return [self.d_loss_metric, self.g_loss_metric]

  def train_step(self, data):
    real_images, random_latent_vectors, more_latent_vectors = data
    batch_size = keras.ops.shape(real_images)[0]
    generated_images = self.generator(random_latent_vectors)
    combined_images = keras.ops.concatenate(
        [generated_images, real_images], axis=0)
    labels = keras.ops.concatenate(
        [keras.ops.ones((batch_size, 1)), keras.ops.zeros((batch_size, 1))],
        axis=0)
    with tf.GradientTape() as tape:
      predictions = self.discriminator(combined_images)
      d_loss = self.loss_fn(labels, predictions)
    grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
    self.d_optimizer.apply_gradients(
        zip(grads, self.discriminator.trainable_weights))
    misleading_labels = keras.ops.zeros((batch_size, 1))
    with tf.GradientTape() as tape:
      predictions = self.discriminator(self.generator(more_latent_vectors))
      g_loss = self.loss_fn(misleading_labels, predictions)
    grads = tape.gradient(g_loss, self.generator.trainable_weights)
    self.g_optimizer.apply_gradients(
        zip(grads, self.generator.trainable_weights))
    self.d_loss_metric.update_state(d_loss)
    self.g_loss_metric.update_state(g_loss)
    return {'d_loss': self.d_loss_metric.result(),
            'g_loss': self.g_loss_metric.result()}


def _gan(seed=0):
  keras.utils.set_random_seed(seed)
  discriminator = keras.Sequential([
      keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, strides=2),
      keras.layers.LeakyReLU(negative_slope=0.2), keras.layers.Flatten(),
      keras.layers.Dense(1, activation='sigmoid')], name='discriminator')
  generator = keras.Sequential([
      keras.Input((4,)), keras.layers.Dense(4 * 4 * 8),
      keras.layers.Reshape((4, 4, 8)),
      keras.layers.Conv2DTranspose(8, 4, strides=2, padding='same'),
      keras.layers.LeakyReLU(negative_slope=0.2),
      keras.layers.Conv2D(1, 3, padding='same', activation='sigmoid')],
                              name='generator')
  return GAN(discriminator, generator, latent_dim=4)


@pytest.mark.slow
def test_a_gan_with_two_optimizers_trains_as_plain_fit():
  """The discriminator's update, then the generator's, which reads the
  discriminator as updated: on every clone, each update once."""
  rng = np.random.default_rng(7)
  data = tf.data.Dataset.from_tensor_slices(tuple(
      rng.normal(size=(ROWS, *shape)).astype(np.float32)
      for shape in ((8, 8, 1), (4,), (4,)))).batch(BATCH)
  histories, models = _fit_both(
      _gan, dict(x=data, epochs=2),
      lambda: dict(d_optimizer=keras.optimizers.Adam(0.0003),
                   g_optimizer=keras.optimizers.Adam(0.0003),
                   loss_fn=keras.losses.BinaryCrossentropy()))
  _assert_same(histories, models)


@pytest.mark.parametrize('options, message', [
    (dict(clone_shares='auto'), r'clone_shares=auto: model .* has its '
     r'own train_step, which applies its updates itself, once a batch; '
     'drop the option'),
    (dict(accumulation_steps=2), 'accumulation_steps=2: model'),
    (dict(reproducible_rows=4), 'reproducible_rows=4: model'),
    (dict(sync_batch_norm=True), 'sync_batch_norm=True: model'),
])
def test_what_an_own_step_cannot_run_with_is_refused_in_one_line(options,
                                                                 message):
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = _guide_model()
  with pytest.raises(errors.UserError, match=message) as refused:
    fit.TowersModel(model, config, **options)
  assert '\n' not in str(refused.value)


@pytest.mark.parametrize('compile_args, fit_args, message', [
    (dict(jit_compile=True), {}, 'jit_compile=True: a model with its own'),
    ({}, dict(callbacks=[keras.callbacks.BackupAndRestore('/nonexistent')]),
     'BackupAndRestore: model .* has its own steps'),
])
def test_what_an_own_step_cannot_compile_or_fit_with_is_refused(
    compile_args, fit_args, message):
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = _guide_model()
  before = [w.numpy() for w in model.weights]
  towers = fit.TowersModel(model, config)
  with pytest.raises(errors.UserError, match=message):
    towers.compile(optimizer='sgd', loss='mse', **compile_args)
    towers.fit(*_data(), batch_size=BATCH, verbose=0, **fit_args)
  for got, want in zip(model.weights, before):
    np.testing.assert_array_equal(got, want)


class RowsInPython(GuideModel):
  """Python that reads the batch's rows: updates only on more than 8."""

  def train_step(self, data):
    if data[0].shape[0] > 8:
      return super().train_step(data)
    return {}


def test_python_that_reads_the_rows_sees_the_whole_batch_as_plain_fit():
  """17 rows: one device's step updates, and so does the towers' (each
  clone would have seen 9 and 8)."""
  x, y = _data()
  histories, models = _fit_both(
      lambda: _functional(RowsInPython),
      dict(x=x[:17], y=y[:17], batch_size=17, epochs=1),
      dict(optimizer='sgd', loss='mse'))
  _assert_same(histories, models)
  assert not np.allclose(models[1].weights[0], _functional(
      RowsInPython).weights[0])


def test_an_own_step_across_workers_is_refused_in_one_line():
  class Workers:  # What workers.start() gives in a job of several.
    strategy = object()
  with pytest.raises(errors.UnsupportedError, match=(
      r"model 'guide_model\w*' has its own train_step: across workers it is "
      r'not run yet; fit it in one process \(workers=None\)\.$')):
    own_steps.check(_guide_model(), _CONFIG, deploy.StepOptions(),
                    Workers())
  own_steps.check(_guide_model(), _CONFIG, deploy.StepOptions(), None)


def test_an_own_step_in_stages_is_refused_in_one_line():
  config = deploy.DeploymentConfig(num_clones=1, num_stages=2,
                                   clone_on_cpu=True)
  with config.variables_scope():
    model = _guide_model()
  with pytest.raises(errors.UnsupportedError, match=(
      r"num_stages=2: model 'guide_model\w*' has its own train_step, which "
      r'runs whole on each clone; use num_stages=1\.$')):
    fit.TowersModel(model, config, num_microbatches=2)


class AppliesToItsOwn(GuideModel):
  """`optimizer.apply(gradients)`: the variables it was built for."""

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      loss = self.compute_loss(y=y, y_pred=self(x, training=True))
    self.optimizer.apply(tape.gradient(loss, self.trainable_variables))
    return {'loss': loss}


def test_an_update_of_no_variables_by_an_unbuilt_optimizer_fails_as_keras():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = _functional(AppliesToItsOwn)
  towers = fit.TowersModel(model, config)
  towers.compile(optimizer='sgd', loss='mse')
  with pytest.raises(ValueError, match=(
      'When passing `grads` without `variables`, the optimizer must already '
      'be built')):
    towers.fit(*_data(), batch_size=BATCH, verbose=0)


class CompiledStep(GuideModel):
  """Its train_step a tf.function of its own."""
  train_step = tf.function(GuideModel.train_step)


@pytest.mark.slow
def test_a_compiled_own_step_runs_as_its_python_on_every_clone():
  x, y = _data()
  histories, models = _fit_both(
      lambda: _functional(CompiledStep),
      dict(x=x, y=y, batch_size=BATCH, epochs=1),
      lambda: dict(optimizer='adam', loss='mse', metrics=['mae']))
  _assert_same(histories, models)


def test_an_own_step_with_steps_per_execution_trains_as_plain_fit():
  """Keras's loop of N steps a call, each the model's own step: 48 rows
  in batches of 16, 2 steps a call (the last call one step)."""
  x, y = _data()
  _assert_same(*_fit_both(
      _guide_model, dict(x=x, y=y, batch_size=BATCH, epochs=2),
      dict(optimizer='adam', loss='mse', metrics=['mae'],
           steps_per_execution=2)))


@pytest.mark.slow
def test_an_own_step_accumulates_with_the_optimizers_own_option():
  """`accumulation_steps` is refused for an own step (each run of the step
  applies an update); Keras's `gradient_accumulation_steps=` on its
  optimizer accumulates inside `apply`: 3 steps an update, as plain
  `fit`."""
  x, y = _data()
  _assert_same(*_fit_both(
      _guide_model, dict(x=x, y=y, batch_size=BATCH, epochs=2),
      lambda: dict(optimizer=keras.optimizers.Adam(
          0.01, gradient_accumulation_steps=3), loss='mse',
          metrics=['mae'])))
