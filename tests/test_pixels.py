"""Images as Keras gives them: every model receives float32 pixels in
[0, 255]; the registry's scale inside, a keras.applications model gets its
family's preprocess_input as its first layer (`models.pixels`)."""

import importlib
import os
import sys

from absl.testing import flagsaver
import keras
import numpy as np
import pytest
from sklearn import datasets
import tensorflow as tf

from tfmulti import errors
from tfmulti import models
from tfmulti.models import external
from tfmulti.train import config as config_lib


def _pixels(shape=(2, 32, 32, 3), seed=0):
  return np.random.default_rng(seed).uniform(0, 255, shape).astype(
      np.float32)


def _first_layers_output(model, name, images):
  """What `model`'s layer `name` makes of `images`."""
  probe = keras.Model(model.input, model.get_layer(name).output)
  return probe(images).numpy()


@pytest.mark.parametrize('application', [
    'MobileNetV2',  # 'tf': x / 127.5 - 1.
    pytest.param('DenseNet121', marks=pytest.mark.slow),  # 'torch'.
])
def test_an_applications_first_layer_is_its_familys_preprocess_input(
    application):
  model = models.get_model(f'keras.applications.{application}',
                           input_shape=(32, 32, 3), num_classes=10)
  family = importlib.import_module(
      getattr(keras.applications, application).__module__)
  images = _pixels()
  np.testing.assert_allclose(
      _first_layers_output(model, 'preprocess_input', images),
      family.preprocess_input(images.copy()), rtol=1e-4, atol=1e-4)  # float32.


def test_a_family_with_its_scaling_inside_gets_none():
  preprocessing = external.Preprocessing.of(
      keras.applications.EfficientNetB0, 3)
  assert preprocessing.layer is None
  assert 'inside the model already' in preprocessing.description


@pytest.mark.slow
def test_a_caffe_family_with_weights_computes_what_keras_computes(tmp_path):
  """ResNet50's preprocess_input reverses RGB to BGR: the pixels stay RGB
  and the first kernel's input channels are reversed instead, which gives
  Keras's own features on `preprocess_input(images)`."""
  keras.utils.set_random_seed(0)
  reference = keras.applications.ResNet50(
      weights=None, include_top=False, input_shape=(32, 32, 3),
      pooling='avg')
  path = str(tmp_path / 'resnet50_notop.weights.h5')
  reference.save_weights(path)
  model = models.get_model('keras.applications.ResNet50',
                           input_shape=(32, 32, 3), num_classes=10,
                           weights=path)
  images = _pixels()
  want = reference(keras.applications.resnet50.preprocess_input(
      images.copy()))
  got = _first_layers_output(model, 'avg_pool', images)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_an_efficientnet_given_weights_divides_as_its_imagenet_weights_do(
    tmp_path):
  from keras.src.applications import efficientnet
  keras.utils.set_random_seed(0)
  backbone = keras.applications.EfficientNetB0(
      weights=None, include_top=False, input_shape=(32, 32, 3),
      pooling='avg')
  path = str(tmp_path / 'b0_notop.weights.h5')
  backbone.save_weights(path)
  model = models.get_model('keras.applications.EfficientNetB0',
                           input_shape=(32, 32, 3), num_classes=10,
                           weights=path)
  mine, = [layer for layer in model.layers
           if isinstance(layer, keras.layers.Normalization)]
  theirs, = [layer for layer in backbone.layers
             if isinstance(layer, keras.layers.Normalization)]
  np.testing.assert_allclose(
      np.ravel(mine.adapt_variance),
      np.ravel(theirs.adapt_variance) * efficientnet.IMAGENET_STDDEV_RGB,
      rtol=1e-6)


def test_the_registrys_models_scale_inside_and_every_model_says_so(caplog):
  caplog.set_level('INFO', logger='absl')
  model = models.get_model('lenet', input_shape=(28, 28, 1), num_classes=10)
  assert isinstance(model.layers[1], keras.layers.Rescaling)
  assert model.layers[1].scale == pytest.approx(1 / 255)
  models.get_model('keras.applications.MobileNetV2',
                   input_shape=(32, 32, 3), num_classes=10)
  assert ('model lenet receives float32 pixels in [0, 255]: it scales them '
          'inside') in caplog.text
  assert ('model keras.applications.MobileNetV2 receives float32 pixels in '
          "[0, 255]: mobilenet_v2's preprocess_input, as its first layer"
          ) in caplog.text


def test_batch_norm_momentum_sets_every_layers_and_is_refused_without():
  model = models.get_model('resnet8_thin', input_shape=(8, 8, 1),
                           num_classes=10, batch_norm_momentum=0.9)
  momenta = {layer.momentum for layer in model.layers
             if isinstance(layer, keras.layers.BatchNormalization)}
  assert momenta == {0.9}
  with pytest.raises(errors.ConfigError, match=r"--batch_norm_momentum=0.9: "
                     r"model 'lenet' has no BatchNormalization; drop it"):
    models.get_model('lenet', input_shape=(28, 28, 1), num_classes=10,
                     batch_norm_momentum=0.9)
  with pytest.raises(errors.ConfigError, match=r'momentum in \[0, 1\)'):
    config_lib.TrainConfig(batch_norm_momentum=1.5)


_TUTORIAL = '''
import keras


def tutorial(input_shape, num_classes):
  """As Keras's image classification tutorial writes one."""
  return keras.Sequential([
      keras.Input(input_shape), keras.layers.Rescaling(1. / 255),
      keras.layers.Conv2D(16, 3, padding='same', activation='relu'),
      keras.layers.Flatten(), keras.layers.Dense(64, activation='relu'),
      keras.layers.Dense(num_classes)])
'''


def _write_digits(folder):
  """Every digit as a PNG in `folder`/train or /test (a fifth), one
  subfolder a class."""
  loaded = datasets.load_digits()
  for index, (image, label) in enumerate(zip(loaded.images, loaded.target)):
    split = 'test' if index % 5 == 0 else 'train'
    directory = folder / split / f'digit{label}'
    os.makedirs(directory, exist_ok=True)
    pixels = np.round(image * 255 / 16).astype(np.uint8)[..., None]
    (directory / f'{index:04d}.png').write_bytes(
        tf.io.encode_png(pixels).numpy())


@pytest.mark.slow
def test_a_tutorial_model_on_a_folder_reaches_plain_kerass_accuracy(
    run_train, tmp_path):
  """The command line gives a Rescaling-inside model [0, 255] pixels, as
  `image_dataset_from_directory` gives plain Keras."""
  _write_digits(tmp_path / 'digits')
  (tmp_path / 'user_tutorial.py').write_text(_TUTORIAL)
  sys.path.insert(0, str(tmp_path))
  try:
    tutorial = importlib.import_module('user_tutorial').tutorial
  finally:
    sys.path.remove(str(tmp_path))
  loader = dict(image_size=(8, 8), color_mode='grayscale', batch_size=32)
  train = keras.utils.image_dataset_from_directory(
      tmp_path / 'digits' / 'train', seed=0, **loader)
  test = keras.utils.image_dataset_from_directory(
      tmp_path / 'digits' / 'test', shuffle=False, **loader)
  keras.utils.set_random_seed(0)
  plain = tutorial((8, 8, 1), 10)
  plain.compile(optimizer=keras.optimizers.Adam(0.001), metrics=['accuracy'],
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  plain.fit(train, epochs=8, verbose=0)
  want = plain.evaluate(test, verbose=0)[1]
  with flagsaver.flagsaver(clone_on_cpu=True):
    got = run_train(dataset=f'folder:{tmp_path / "digits"}',
                    model=f'{tmp_path / "user_tutorial.py"}:tutorial',
                    batch_size=32, train_steps=None, epochs=8,
                    optimizer='adam', learning_rate=0.001,
                    lr_schedule='constant', warmup_steps=0)
  assert want > 0.9
  assert abs(got['eval_accuracy'] - want) <= 0.02, (got['eval_accuracy'],
                                                    want)
