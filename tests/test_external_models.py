"""Tests for the models a user names (`models.external`): keras.applications
and a function of the user's, through the registry and the command line."""

import json
import os
import re
import warnings

from absl.testing import flagsaver
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import assert_same_checkpoints
from tfmulti import errors
from tfmulti import models

# A user's module: model functions good and bad.
_USER_MODULE = '''
import keras


def small_cnn(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Rescaling(1 / 255)(inputs)  # As Keras's tutorials do.
  x = keras.layers.Conv2D(4, 3, activation='relu', name='conv')(x)
  x = keras.layers.Flatten()(x)
  x = keras.layers.Dense(16, activation='relu', name='hidden')(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes, name='logits')(x))


def with_softmax(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  return keras.Model(inputs, keras.layers.Dense(num_classes,
                                                activation='softmax')(x))


def three_outputs(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  return keras.Model(inputs, keras.layers.Dense(3)(
      keras.layers.Flatten()(inputs)))


def sequential_cnn(input_shape, num_classes):
  return keras.Sequential([
      keras.Input(input_shape), keras.layers.Rescaling(1 / 255),
      keras.layers.Conv2D(4, 3, activation='relu'),
      keras.layers.Flatten(), keras.layers.Dense(num_classes)])


class _Cnn(keras.Model):
  def __init__(self, num_classes, **kwargs):
    super().__init__(**kwargs)
    self.num_classes = num_classes
    self.conv = keras.layers.Conv2D(4, 3, activation='relu')
    self.flat = keras.layers.Flatten()
    self.logits = keras.layers.Dense(num_classes)

  def call(self, images):
    return self.logits(self.flat(self.conv(images / 255)))

  def get_config(self):
    return {**super().get_config(), 'num_classes': self.num_classes}


def subclassed_cnn(input_shape, num_classes):
  return _Cnn(num_classes)  # Unbuilt: tfmulti builds it on the images.


def nothing(input_shape, num_classes):
  return None


def broken(input_shape, num_classes):
  raise RuntimeError('a bug in my model')
'''


@pytest.fixture
def user_module(tmp_path):
  path = tmp_path / 'my_models.py'
  path.write_text(_USER_MODULE)
  return str(path)


def test_a_users_function_builds_the_model(user_module):
  model = models.get_model(f'{user_module}:small_cnn', input_shape=(8, 8, 1),
                           num_classes=10)
  assert model.count_params() == 40 + (6 * 6 * 4 * 16 + 16) + 17 * 10


@pytest.mark.slow
def test_keras_applications_end_in_logits():
  model = models.get_model('keras.applications.MobileNetV2',
                           input_shape=(32, 32, 3), num_classes=10)
  assert model.outputs[0].shape[-1] == 10
  assert model.layers[-1].activation is not keras.activations.softmax


@pytest.mark.parametrize('name, message', [
    ('keras.applications.MobileNetV2', r'--model=keras.applications.'
     r'MobileNetV2 cannot take images of shape \(8, 8, 1\)'),
    ('keras.applications.VGG99', 'keras.applications has no such model'),
    ('{module}:with_softmax', 'ends in a softmax; return logits'),
    ('{module}:three_outputs', r'outputs \[\(None, 3\)\]; the data has 10 '
     'classes'),
    ('{module}:nothing', 'returned NoneType, not a keras.Model'),
    ('{module}:missing', "has no function 'missing'"),
    ('no_such.py:f', "there is no file 'no_such.py'"),
    ('no_such_module:f', "no module 'no_such_module' on PYTHONPATH"),
    ('vgg', "model='vgg' is not one of"),
    (':f', 'is not a registered model, keras.applications.NAME or '
     'MODULE:FUNCTION'),
])
def test_a_model_that_cannot_train_is_one_line(user_module, name, message):
  with pytest.raises(errors.ConfigError, match=message) as e:
    models.get_model(name.format(module=user_module), input_shape=(8, 8, 1),
                     num_classes=10)
  assert '\n' not in str(e.value) and len(str(e.value)) < 300


def test_an_error_inside_the_users_function_keeps_its_type(user_module):
  with pytest.raises(RuntimeError, match='a bug in my model'):
    models.get_model(f'{user_module}:broken', input_shape=(8, 8, 1),
                     num_classes=10)


def test_the_default_model_dir_of_a_users_function_is_one_short_folder():
  """A .py file's function: its file's stem and the function, told apart
  from another file of that name; the same file by another spelling is
  the same run."""
  from tfmulti import cli
  names = []
  for model in ('path/to/my_models.py:small_cnn',
                os.path.abspath('path/to/my_models.py') + ':small_cnn',
                'other/my_models.py:small_cnn'):
    with flagsaver.flagsaver(model=model):
      names.append(cli.default_model_dir(cli._step_options()))
  assert re.fullmatch(r'runs/my_models\.small_cnn\.[0-9a-f]{6}-digits-'
                      r'towers-1clones', names[0]), names[0]
  assert names[1] == names[0] != names[2]


@pytest.mark.parametrize('layout', [
    pytest.param(dict(num_clones=2), marks=pytest.mark.slow),
    dict(num_clones=2, clone_shares=['3', '1']),
    pytest.param(dict(num_clones=2, num_stages=2, num_microbatches=2),
                 marks=pytest.mark.slow)])
def test_a_users_model_trains_from_the_command_line_as_on_one_device(
    run_train, tmp_path, user_module, layout):
  name = f'{user_module}:small_cnn'
  common = dict(model=name, train_steps=3, optimizer='momentum',
                learning_rate=0.05)
  one = run_train(model_dir=str(tmp_path / 'one'), batch_size=8, **common)
  got = run_train(model_dir=str(tmp_path / 'got'), batch_size=4, **layout,
                  **common)
  assert got['global_batch_size'] == one['global_batch_size'] == 8
  assert_same_checkpoints(got['checkpoint'], one['checkpoint'])
  with open(os.path.join(tmp_path, 'got', 'job.json')) as f:
    assert name in f.read()


@pytest.mark.slow
@pytest.mark.parametrize('function', ['sequential_cnn', 'subclassed_cnn'])
def test_a_sequential_or_subclassed_model_trains_and_exports(
    run_train, tmp_path, user_module, function):
  """On 2 clones as on one device, then exported: the SavedModel serves
  the trained weights (the two runs' logits agree)."""
  common = dict(model=f'{user_module}:{function}', train_steps=3,
                optimizer='adam', learning_rate=0.01, export=True)
  one = run_train(model_dir=str(tmp_path / 'one'), batch_size=8, **common)
  got = run_train(model_dir=str(tmp_path / 'got'), batch_size=4,
                  num_clones=2, **common)
  assert_same_checkpoints(got['checkpoint'], one['checkpoint'])
  images = tf.random.stateless_uniform((2, 28, 28, 1), (1, 2))  # Digits.
  logits = [tf.saved_model.load(run['export']).signatures['serving_default'](
      images=images)['logits'] for run in (one, got)]
  assert logits[0].shape == (2, 10)
  np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_keras_applications_train_from_the_command_line(run_train, tmp_path):
  """MobileNetV2 on the offline digits, resized to its smallest input."""
  metrics = run_train(model='keras.applications.MobileNetV2',
                      image_size=['32', '32'], num_clones=2, train_steps=2)
  assert metrics['steps'] == 2 and metrics['train_loss'] > 0
  job = json.loads(open(os.path.join(os.path.dirname(
      metrics['checkpoint']), 'job.json')).read())
  assert job['job']['input_shape'] == [32, 32, 1]
  assert job['job']['model'] == 'keras.applications.MobileNetV2'


def test_a_weights_file_of_the_same_model_is_its_start(user_module,
                                                       tmp_path):
  name = f'{user_module}:small_cnn'
  saved = models.get_model(name, input_shape=(8, 8, 1), num_classes=3)
  path = str(tmp_path / 'small.weights.h5')
  saved.save_weights(path)
  loaded = models.get_model(name, input_shape=(8, 8, 1), num_classes=3,
                            weights=path)
  fresh = models.get_model(name, input_shape=(8, 8, 1), num_classes=3)
  for mine, theirs in zip(loaded.weights, saved.weights):
    assert (mine.numpy() == theirs.numpy()).all()
  assert any((w.numpy() != v.numpy()).any()
             for w, v in zip(loaded.weights, fresh.weights))
  with warnings.catch_warnings(record=True) as warned, pytest.raises(
      errors.ConfigError, match=r'--weights=.*small.weights.h5 does not fit '
      '--model=lenet .*give a file saved from this model') as refused:
    warnings.simplefilter('always')
    models.get_model('lenet', input_shape=(28, 28, 1), num_classes=10,
                     weights=path)
  assert '\n' not in str(refused.value)
  shown = [str(w.message)[:100] for w in warned  # What a user sees.
           if not issubclass(w.category, DeprecationWarning)]
  assert not shown, shown  # The refusal is the one line.


@pytest.mark.slow
def test_an_applications_backbone_file_starts_it_under_new_logits(tmp_path):
  backbone = keras.applications.MobileNetV2(
      weights=None, include_top=False, input_shape=(32, 32, 3),
      pooling='avg')
  for variable in backbone.weights:  # Values no fresh build draws.
    variable.assign(keras.ops.full(variable.shape, 0.25))
  path = str(tmp_path / 'mobilenet_v2_notop.weights.h5')
  backbone.save_weights(path)
  model = models.get_model('keras.applications.MobileNetV2',
                           input_shape=(32, 32, 3), num_classes=5,
                           weights=path)
  assert model.output.shape == (None, 5)
  assert model.layers[-1].name == 'logits'  # Logits: no activation.
  assert model.layers[-1].activation is keras.activations.linear
  assert len(model.weights) == len(backbone.weights) + 2
  assert all((w.numpy() == 0.25).all() for w in model.weights[:-2])


def test_a_subclassed_model_under_mixed_precision_ends_in_float32(
    user_module):
  model = models.get_model(f'{user_module}:subclassed_cnn',
                           input_shape=(8, 8, 1), num_classes=10,
                           dtype_policy='mixed_bfloat16')
  logits = model(np.zeros((2, 8, 8, 1), np.float32))
  assert logits.dtype == 'float32' and logits.shape == (2, 10)
  assert model.layers[-1].name == 'logits_float32'
