"""Tests for tfmulti.models: registry, pinned parameter counts, placement."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti import deploy
from tfmulti import devices
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import models
from tfmulti.models import resnet
from tfmulti.train import build

MNIST = (28, 28, 1)
CIFAR = (32, 32, 3)


def _trainable_params(model):
  return sum(int(np.prod(v.shape)) for v in model.trainable_variables)


@pytest.mark.slow
@pytest.mark.parametrize('name, shape, trainable, total', [
    # LeNet: 156 + 2,416 + 48,120 + 10,164 + 850 (D2L 7.6, no BatchNorm).
    ('lenet', MNIST, 61_706, 61_706),
    ('lenet', CIFAR, 83_126, 83_126),
    # The total adds BatchNorm's moving mean and variance.
    ('resnet18', MNIST, 11_175_818, 11_183_626),
    # He et al.'s ResNet-20 with option-A shortcuts: 0.27M parameters.
    ('resnet20', CIFAR, 269_722, 271_098),
    ('resnet8_thin', CIFAR, 5_006, 5_126),
    # torchvision's resnet50: 25,557,032 trainable; BatchNorm's moving
    # statistics add 53,120.
    ('resnet50', (224, 224, 3), 25_557_032, 25_610_152),
])
def test_parameter_counts(name, shape, trainable, total):
  num_classes = 1000 if name == 'resnet50' else 10
  model = models.get_model(name, input_shape=shape, num_classes=num_classes)
  assert _trainable_params(model) == trainable
  assert model.count_params() == total


@pytest.mark.parametrize('name', [
    pytest.param(name, marks=[pytest.mark.slow] if name == 'resnet50' else [])
    for name in models.names()])
def test_input_shape_and_classes_come_from_the_caller(name):
  model = models.get_model(name, input_shape=(28, 28, 1), num_classes=7)
  assert model.output_shape == (None, 7)
  # The registry's declaration (read before any model is built, to refuse
  # --sync_batch_norm early) is what the built model has.
  assert models.has_batch_norm(name) == bool(keras_internals.batch_norms(model))
  outputs = model(np.zeros((2, 28, 28, 1), np.float32), training=False)
  assert outputs.shape == (2, 7)


def test_variables_are_created_under_the_device_scope():
  with tf.device('/device:CPU:2'):
    model = models.get_model('resnet8_thin', input_shape=CIFAR,
                             num_classes=10)
  assert {devices.device_of(v).split('/')[-1] for v in model.variables} == {
      'device:CPU:2'}


def test_resnet20_regularizes_its_kernels():
  model = models.get_model('resnet20', input_shape=CIFAR, num_classes=10)
  assert len(model.losses) == 20  # 19 convolutions and the dense layer.


def test_unknown_model_names_the_choices():
  with pytest.raises(errors.ConfigError, match="model='vgg'.*lenet"):
    models.get_model('vgg', input_shape=MNIST, num_classes=10)


def test_cifar_resnet_depth_must_be_6n_plus_2():
  with pytest.raises(errors.ConfigError, match='depth=21'):
    resnet.cifar_resnet(CIFAR, 10, depth=21)


@pytest.mark.slow
def test_resnet18_trains_a_step():
  """The big model through the towers (the command line's plumbing is the
  same for every model and is tested on the small ones)."""
  config = deploy.DeploymentConfig(num_clones=1, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = models.get_model('resnet18', input_shape=MNIST, num_classes=10)
    optimizer = build.make_optimizer('sgd', 1e-3)
  deployed = deploy.deploy(config, model, build.make_loss(), optimizer)
  before = [w.numpy() for w in model.trainable_weights[:1]]
  rng = np.random.default_rng(0)
  loss = deployed.train_step(rng.random((4, *MNIST), np.float32),
                             rng.integers(0, 10, 4).astype(np.int32))
  assert np.isfinite(float(loss)) and float(loss) > 0
  assert not np.array_equal(before[0], model.trainable_weights[0].numpy())


def test_option_a_shortcut_subsamples_and_zero_pads_with_keras_layers():
  images = np.random.default_rng(0).random((2, 8, 8, 4)).astype(np.float32)
  inputs = keras.Input((8, 8, 4))
  shortcut = keras.Model(inputs, resnet._option_a_shortcut(inputs, 8, 2))
  np.testing.assert_array_equal(
      shortcut(images), np.pad(images[:, ::2, ::2, :],
                               ((0, 0), (0, 0), (0, 0), (2, 2))))
  # Keras's own layers only: a saved model loads without tfmulti's code.
  assert not any(isinstance(layer, keras.layers.Lambda)
                 for layer in models.get_model(
                     'resnet20', input_shape=CIFAR, num_classes=10).layers)
