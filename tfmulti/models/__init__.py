"""Model registry: functional Keras model factories by name.

Every factory takes `(input_shape, num_classes)` (and, with BatchNorm,
`sync_batch_norm`) and returns a built functional `keras.Model`;
call it under `tf.device(variables_device)` so its variables are created
there. Besides the registry's names, `get_model` builds
`keras.applications.NAME` and a user's `MODULE:FUNCTION` (`external`).
"""

from absl import logging
import keras

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti.models import external
from tfmulti.models import pixels
from tfmulti.models.lenet import lenet
from tfmulti.models.resnet import resnet8_thin
from tfmulti.models.resnet import resnet18
from tfmulti.models.resnet import resnet20
from tfmulti.models.resnet import resnet50

_FACTORIES = {
    'lenet': lenet,
    'resnet18': resnet18,
    'resnet20': resnet20,
    'resnet50': resnet50,
    'resnet8_thin': resnet8_thin,
}
_WITH_BATCH_NORM = ('resnet18', 'resnet20', 'resnet50', 'resnet8_thin')
# A benchmark's `--model=applications:NAME`: keras.applications.NAME, as a
# user brings it (weights=None; it ends in a softmax, not logits).
APPLICATIONS = 'applications:'


def names():
  """The registered model names, sorted."""
  return sorted(_FACTORIES)


def has_batch_norm(name):
  """Whether the registered model `name` has BatchNorm layers."""
  return name in _WITH_BATCH_NORM


def check(name, *, sync_batch_norm=False, batch_norm_momentum=None):
  """Raises `ConfigError` for an unknown name, or synchronized BatchNorm
  or a BatchNorm momentum asked of a registered model without BatchNorm
  (an external model's BatchNorm is counted when it is built)."""
  if external.is_external(name):
    external.check(name)
    return
  if name not in _FACTORIES:
    raise errors.ConfigError(
        f'model={name!r} is not one of {names()}, keras.applications.NAME '
        'or MODULE:FUNCTION (a function of yours returning a keras.Model).')
  if sync_batch_norm and not has_batch_norm(name):
    raise errors.ConfigError(
        f'model={name!r} has no BatchNorm to synchronize; drop '
        f'--sync_batch_norm or pick one of '
        f'{_WITH_BATCH_NORM}.')
  if batch_norm_momentum is not None and not has_batch_norm(name):
    raise _no_batch_norm_for(name, batch_norm_momentum)


def get_model(name, *, input_shape, num_classes, dtype_policy=None,
              sync_batch_norm=False, weights=None, batch_norm_momentum=None):
  """Builds the registered model `name`.

  Args:
    name: a registered name (see `names()`), `keras.applications.NAME` or
      `MODULE:FUNCTION` (`external`).
    input_shape: (height, width, channels) of one image.
    num_classes: number of output logits.
    dtype_policy: a Keras dtype policy name for every layer, e.g.
      'mixed_bfloat16'; None keeps the global policy. Mixed models get a
      float32 output layer, so the softmax and loss run in float32.
    sync_batch_norm: BatchNorm all-reduces its batch statistics over
      the tf.distribute replicas (Keras's `synchronized=True`).
    weights: a local weights file the model starts from: the whole model's
      (`model.save_weights`), or a `keras.applications` backbone's
      (`external`); None for fresh weights.
    batch_norm_momentum: every BatchNormalization's momentum; None keeps
      each layer's own.

  Returns:
    A functional `keras.Model`.

  Raises:
    errors.ConfigError: `name` is not found, synchronized BatchNorm is
      asked of a model without BatchNorm, or an external model does not fit
      the data (`external.build`).
  """
  check(name, sync_batch_norm=sync_batch_norm)
  previous = keras.config.dtype_policy()
  try:
    if dtype_policy:
      keras.config.set_dtype_policy(dtype_policy)
    model = _build(name, tuple(input_shape), num_classes, sync_batch_norm,
                   weights)
  finally:
    keras.config.set_dtype_policy(previous)
  if weights is not None and not name.startswith(external.KERAS_APPLICATIONS):
    external.load_weights(name, model, weights)
  if sync_batch_norm and not keras_internals.batch_norms(model):
    raise errors.ConfigError(
        f'model={name!r} has no BatchNorm to synchronize; drop '
        '--sync_batch_norm.')
  if sync_batch_norm:  # An external model's, as the registry builds its own.
    for layer in keras_internals.batch_norms(model):
      layer.synchronized = True
  _set_momentum(name, model, batch_norm_momentum)
  logging.info('model %s receives float32 pixels in %s: %s', name,
               pixels.RANGE, 'it scales them inside (Rescaling(1/255))'
               if name in _FACTORIES else external.receives(
                   name, input_shape[-1]))
  if model.compute_dtype != 'float32':
    model = _float32_logits(model, input_shape)
  return model


def _float32_logits(model, input_shape):
  """`model` ending in a float32 layer, so the softmax and the loss run in
  float32: a graph of layers extended in place (its stages cut as
  before), any other model called inside a functional one."""
  inputs = (model.input if keras_internals.is_functional(model) else
            keras.Input(tuple(input_shape), name='images'))
  outputs = model.output if inputs is model.input else model(inputs)
  outputs = keras.layers.Activation('linear', dtype='float32',
                                    name='logits_float32')(outputs)
  return keras.Model(inputs, outputs, name=model.name)


def _build(name, input_shape, num_classes, sync_batch_norm, weights):
  """The model `name` names, under the current dtype policy."""
  if external.is_external(name):
    return external.build(name, input_shape, num_classes, weights)
  options = {'sync_batch_norm': True} if sync_batch_norm else {}
  try:
    return _FACTORIES[name](input_shape, num_classes, **options)
  except ValueError as e:  # A layer's output of size zero, say.
    raise errors.ConfigError(
        f'model={name!r} cannot take images of shape {input_shape} '
        f'({errors.first_line(e)}); pass --image_size=HEIGHT,WIDTH, e.g. '
        '28,28 for lenet.') from e


def _set_momentum(name, model, momentum):
  """Every BatchNormalization of `model` given `momentum` (None: kept);
  Keras reads it when the layer is called, and its config keeps it."""
  if momentum is None:
    return
  layers = keras_internals.batch_norms(model)
  if not layers:
    raise _no_batch_norm_for(name, momentum)
  for layer in layers:
    layer.momentum = momentum


def _no_batch_norm_for(name, momentum):
  return errors.ConfigError(
      f'--batch_norm_momentum={momentum}: model {name!r} has no '
      'BatchNormalization; drop it.')


def check_any(name):
  """Raises `ConfigError` unless `name` is registered or
  `applications:NAME` names a `keras.applications` model."""
  if not name.startswith(APPLICATIONS):
    check(name)
  elif not hasattr(keras.applications, name[len(APPLICATIONS):]):
    raise errors.ConfigError(
        f'--model={name}: keras.applications has no such model; e.g. '
        'applications:ResNet50.')


def get_any_model(name, *, input_shape, num_classes):
  """A fresh registered model, or `keras.applications.NAME(weights=None)`
  for `applications:NAME`."""
  if name.startswith(APPLICATIONS):
    return getattr(keras.applications, name[len(APPLICATIONS):])(
        weights=None, input_shape=input_shape, classes=num_classes)
  return get_model(name, input_shape=input_shape, num_classes=num_classes)


def ends_in_logits(name):
  """Whether model `name` (see `get_any_model`) ends in logits."""
  return not name.startswith(APPLICATIONS)
