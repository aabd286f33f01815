"""The Keras models users bring, through `TowersModel.fit`, equal to plain
one-device `fit` on the same rows and initial weights: several inputs and
outputs (dicts and lists), several losses with `loss_weights`, sample and
class weights, `add_loss` terms (an activity regularizer and a layer's
own), numpy input whose last batch has fewer rows than clones; a layer
named with a leading '_' on every path, against one-device towers, and a
loss over a Keras mask refused on every path."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import assert_same_steps
from tests.helpers import make_deployed
from tests.helpers import make_loss
from tests.helpers import readings_apart
from tfmulti import deploy
from tfmulti import distribute
from tfmulti import errors
from tfmulti import fit

ROWS = 34  # Batches of 8 and a last one of 2: fewer rows than 4 clones.
BATCH = 8


class _Penalized(keras.layers.Layer):
  """A layer with an `add_loss` term of its own, a mean over its rows, and
  a name Keras gives with a leading '_' (from its class name)."""

  def call(self, x):
    self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
    return x


def _dict_model():
  """Two dict inputs, two dict outputs, an activity regularizer and a
  layer's own add_loss."""
  keras.utils.set_random_seed(0)
  a, b = keras.Input((4,), name='a'), keras.Input((2,), name='b')
  x = keras.layers.Concatenate()([a, b])
  x = keras.layers.Dense(8, activation='tanh',
                         activity_regularizer=keras.regularizers.L2(0.01),
                         kernel_regularizer=keras.regularizers.L2(0.01))(x)
  x = _Penalized()(x)
  return keras.Model({'a': a, 'b': b}, {
      'logits': keras.layers.Dense(3, name='logits')(x),
      'value': keras.layers.Dense(1, name='value')(x)})


def _list_model():
  """Two list inputs and two list outputs."""
  keras.utils.set_random_seed(0)
  a, b = keras.Input((4,)), keras.Input((2,))
  x = keras.layers.Dense(8, activation='tanh')(
      keras.layers.Concatenate()([a, b]))
  # Named: Keras names a list output's loss metric by its layer.
  return keras.Model([a, b], [keras.layers.Dense(3, name='logits')(x),
                              keras.layers.Dense(1, name='value')(x)])


def _one_dict_output():
  keras.utils.set_random_seed(0)
  x = keras.Input((6,))
  h = keras.layers.Dense(8, activation='tanh')(x)
  return keras.Model(x, {'logits': keras.layers.Dense(3)(h)})


def _data(kind):
  rng = np.random.default_rng(3)
  a = rng.normal(size=(ROWS, 4)).astype(np.float32)
  b = rng.normal(size=(ROWS, 2)).astype(np.float32)
  label = rng.integers(0, 3, size=ROWS).astype(np.int32)
  value = rng.normal(size=(ROWS, 1)).astype(np.float32)
  weight = rng.uniform(0.5, 2.0, size=ROWS).astype(np.float32)
  if kind == 'dict':
    return dict(x={'a': a, 'b': b}, y={'logits': label, 'value': value},
                sample_weight=weight)
  if kind == 'list':
    return dict(x=[a, b], y=[label, value])
  return dict(x=np.concatenate([a, b], axis=1), y={'logits': label},
              class_weight=None)


def _compile_args(kind):
  scce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if kind == 'dict':
    return dict(loss={'logits': scce, 'value': 'mse'},
                loss_weights={'logits': 1.0, 'value': 0.5})
  if kind == 'list':
    return dict(loss=[scce, 'mse'], loss_weights=[1.0, 0.25])
  return dict(loss={'logits': scce})


BUILD = {'dict': _dict_model, 'list': _list_model, 'one': _one_dict_output}


def _fit(model, kind, **fit_args):
  model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                **_compile_args(kind))
  history = model.fit(**_data(kind), batch_size=BATCH, epochs=1,
                      shuffle=False, verbose=0, **fit_args)
  return {key: values[-1]
          for key, values in readings_apart(history.history).items()}


def _assert_same_metrics(got, want):
  """Every metric, the per-output losses (`logits_loss`, ...) too."""
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


def _towers(kind, num_clones, variables_device=None, **options):
  config = deploy.DeploymentConfig(num_clones=num_clones, clone_on_cpu=True,
                                   variables_device=variables_device)
  with config.variables_scope():
    model = BUILD[kind]()
  return fit.TowersModel(model, config, **options)


@pytest.mark.parametrize('kind, num_clones, options', [
    pytest.param('dict', 4, {}, marks=pytest.mark.slow),
    pytest.param('dict', 4, dict(variables_device=deploy.SPREAD,
                                 gradient_packs='auto'),
                 marks=pytest.mark.slow),
    pytest.param('dict', 2, dict(clone_shares=(3, 1), accumulation_steps=2),
                 marks=pytest.mark.slow),
    pytest.param('list', 2, {}, marks=pytest.mark.slow),
    pytest.param('one', 2, dict(accumulation_steps=2),
                 marks=pytest.mark.slow),
])
def test_fit_equals_one_device(kind, num_clones, options):
  plain = BUILD[kind]()
  want_metrics = _fit(plain, kind)
  towers = _towers(kind, num_clones, **options)
  got_metrics = _fit(towers, kind)
  for got, want in zip(towers.model.get_weights(), plain.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-5)
  _assert_same_metrics(got_metrics, want_metrics)


@pytest.mark.slow
def test_class_weight_equals_one_device():
  def model():
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    return keras.Model(x, keras.layers.Dense(3)(
        keras.layers.Dense(8, activation='tanh')(x)))
  data = _data('one')
  data['y'] = data['y']['logits']
  weights = {0: 1.0, 1: 3.0, 2: 0.5}
  results = []
  for net in (model(), None):
    if net is None:
      config = deploy.DeploymentConfig(num_clones=4, clone_on_cpu=True)
      with tf.device(config.variables_device()):
        net = fit.TowersModel(model(), config)
    net.compile(optimizer='sgd',
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
    history = net.fit(data['x'], data['y'], class_weight=weights,
                      batch_size=BATCH, shuffle=False, verbose=0)
    results.append((net.get_weights(), history.history['loss'][-1]))
  (want, want_loss), (got, got_loss) = results
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-5)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)


@pytest.mark.slow
def test_evaluate_counts_the_model_losses_as_one_device():
  plain = _dict_model()
  towers = _towers('dict', 4)
  for model in (plain, towers):
    model.compile(optimizer='sgd', **_compile_args('dict'))
  data = _data('dict')
  # The total loss (both outputs' weighted losses, the penalties and the
  # add_loss terms) and each output's, over a last batch of fewer rows
  # than clones.
  got, want = (model.evaluate(**data, batch_size=BATCH, verbose=0,
                              return_dict=True) for model in (towers, plain))
  assert {'logits_loss', 'value_loss'} <= set(want)
  _assert_same_metrics(got, want)


def _masked_model():
  keras.utils.set_random_seed(0)
  x = keras.Input((5,), dtype='int32')
  h = keras.layers.Embedding(10, 4, mask_zero=True)(x)
  return keras.Model(x, keras.layers.Dense(2)(h))


def _towers_model(model):
  fit.TowersModel(
      model, deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True))


def _deployed(model):
  deploy.deploy(deploy.DeploymentConfig(clone_on_cpu=True), model,
                make_loss(), keras.optimizers.SGD(0.1))


def _distributed(model):
  strategy = distribute.make_strategy(
      'single', deploy.DeploymentConfig(clone_on_cpu=True))
  distribute.DistributedModel(strategy, model, make_loss(),
                              keras.optimizers.SGD(0.1))


@pytest.mark.parametrize('build', [_towers_model, _deployed, _distributed])
def test_a_masked_output_is_refused_in_one_line_on_every_path(build):
  with pytest.raises(errors.ConfigError, match='outputs a Keras mask') as e:
    build(_masked_model())
  assert '\n' not in str(e.value) and len(str(e.value)) < 300


class Wrapping(keras.Model):
  """A subclass made around a layer it is given: Keras cannot copy it."""

  def __init__(self, inner, **kwargs):
    super().__init__(**kwargs)
    self.inner = inner

  def call(self, x):
    return self.inner(x)


class TestAsItsModel:
  """`predict` before `compile`, `export` and `save` as on the model."""

  def _towers(self):
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    model = keras.Model(x, keras.layers.Dense(3)(x))
    return fit.TowersModel(
        model, deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True))

  def test_predict_before_compile(self):
    towers = self._towers()
    images = np.ones((5, 6), np.float32)
    np.testing.assert_allclose(towers.predict(images, verbose=0),
                               towers.model.predict(images, verbose=0))

  def test_export_serves_the_model(self, tmp_path):
    towers = self._towers()
    towers.export(str(tmp_path / 'served'), verbose=False)
    served = tf.saved_model.load(str(tmp_path / 'served'))
    images = np.ones((2, 6), np.float32)
    np.testing.assert_allclose(served.serve(images),
                               towers.model(images), atol=1e-6)

  def test_a_model_keras_cannot_copy_is_exported_itself(self, tmp_path):
    """A subclass whose constructor takes a layer (no config Keras can
    make it again from) serves its own predictions."""
    keras.utils.set_random_seed(0)
    model = Wrapping(keras.layers.Dense(3))
    model(np.ones((1, 6), np.float32))
    with pytest.raises((NotImplementedError, TypeError)):
      keras.models.clone_model(model)
    towers = fit.TowersModel(
        model, deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True))
    towers.export(str(tmp_path / 'served'), verbose=False)
    served = tf.saved_model.load(str(tmp_path / 'served'))
    images = np.ones((2, 6), np.float32)
    np.testing.assert_allclose(served.serve(images), model(images),
                               atol=1e-6)

  def test_a_saved_file_holds_the_optimizer_state(self, tmp_path):
    towers = self._towers()
    towers.compile(optimizer=keras.optimizers.Adam(0.01), loss='mse')
    towers.fit(np.ones((8, 6), np.float32), np.ones((8, 3), np.float32),
               batch_size=4, verbose=0)
    path = str(tmp_path / 'model.keras')
    towers.save(path)
    loaded = keras.models.load_model(path)  # Plain Keras, no tfmulti.
    assert int(loaded.optimizer.iterations) == 2
    want = sorted(np.array(v).sum() for v in towers.optimizer.variables)
    got = sorted(np.array(v).sum() for v in loaded.optimizer.variables)
    np.testing.assert_allclose(got, want, atol=1e-6)

  def test_a_batch_too_small_for_the_clones_names_the_batch_size(self):
    towers = self._towers()
    towers.compile(optimizer='sgd', loss='mse')
    with pytest.raises(errors.ConfigError,
                       match='a batch of 1 rows leaves clone 1 of 2 no rows'
                       '.*raise the batch size'):
      towers.fit(np.ones((4, 6), np.float32), np.ones((4, 3), np.float32),
                 batch_size=1, verbose=0)
    assert int(towers.optimizer.iterations) == 0


def test_shares_written_as_the_flag_is():
  assert deploy.StepOptions(clone_shares='3,1').clone_shares == (3, 1)
  with pytest.raises(errors.ConfigError, match='clone_shares=3,x: every'):
    deploy.StepOptions(clone_shares='3,x')


class _Scale(keras.layers.Layer):  # Keras names it '__scale'.

  def build(self, shape):
    self.w = self.add_weight(shape=(shape[-1],), initializer='ones')

  def call(self, x):
    return x * self.w


def _underscored(seed=0):
  """6 -> 3 through a layer whose name starts with '_'."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((6,))
  model = keras.Model(x, keras.layers.Dense(3)(_Scale()(x)))
  assert any(layer.name.startswith('_') for layer in model.layers)
  return model


def test_a_layer_named_with_a_leading_underscore_trains_on_one_clone():
  towers = fit.TowersModel(_underscored(), deploy.DeploymentConfig(
      clone_on_cpu=True))
  towers.compile(optimizer='sgd', loss='mse')
  towers.fit(np.ones((4, 6), np.float32), np.ones((4, 3), np.float32),
             verbose=0)
  assert int(towers.optimizer.iterations) == 1


def _underscored_towers(**options):
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  return make_deployed(config, model_fn=_underscored, **options)


def _underscored_distributed(name):
  strategy = distribute.make_strategy(
      name, deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True))
  with strategy.scope():
    model = _underscored()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  return distribute.DistributedModel(strategy, model, make_loss(), optimizer)


@pytest.mark.parametrize('make', [
    # Replica 0 of the lockstep and of a strategy, and an XLA clone's own
    # function, trace at the root name scope.
    lambda: _underscored_towers(sync_batch_norm=True),
    lambda: _underscored_towers(xla=True),
    lambda: _underscored_distributed('mirrored'),
    lambda: _underscored_distributed('single'),
    lambda: _underscored_distributed('central_storage'),
], ids=['lockstep', 'xla', 'mirrored', 'single', 'central_storage'])
def test_a_layer_named_with_a_leading_underscore_trains_on_every_path(make):
  reference = make_deployed(deploy.DeploymentConfig(clone_on_cpu=True),
                            model_fn=_underscored)
  assert_same_steps(make(), reference, rows=8)


def _two_headed(seed=0):
  """Two dict inputs, read by stage 0 and stage 1, and two dict outputs."""
  keras.utils.set_random_seed(seed)
  a, b = keras.Input((4,), name='a'), keras.Input((2,), name='b')
  x = keras.layers.Dense(8, activation='tanh', name='body')(a)
  x = keras.layers.Concatenate(name='join')([x, b])  # b read by stage 1.
  x = keras.layers.Dense(8, activation='tanh', name='neck')(x)
  return keras.Model({'a': a, 'b': b}, {
      'logits': keras.layers.Dense(3, name='logits')(x),
      'value': keras.layers.Dense(1, name='value')(x)})


@pytest.mark.slow
def test_stages_take_several_inputs_and_give_several_outputs():
  BUILD['two_headed'] = _two_headed
  try:
    plain = _two_headed()
    want_metrics = _fit(plain, 'dict')
    config = deploy.DeploymentConfig(num_clones=2, num_stages=2,
                                     clone_on_cpu=True)
    with tf.device(config.variables_device()):
      model = _two_headed()
    towers = fit.TowersModel(model, config, num_microbatches=2,
                                stage_boundaries=('join',))
    got_metrics = _fit(towers, 'dict')
  finally:
    del BUILD['two_headed']
  for got, want in zip(towers.model.get_weights(), plain.get_weights()):
    np.testing.assert_allclose(got, want, atol=1e-5)
  _assert_same_metrics(got_metrics, want_metrics)


def test_an_output_before_the_last_stage_is_refused_in_one_line():
  config = deploy.DeploymentConfig(num_clones=1, num_stages=2,
                                   clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = _two_headed()
  with pytest.raises(errors.ConfigError, match="output .* comes from stage 0 "
                     "of 2 .layer 'logits'.; the last stage gives every"):
    fit.TowersModel(model, config, stage_boundaries=('value',)).compile(
        optimizer='sgd', **_compile_args('dict'))
