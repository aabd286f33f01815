"""Models a user names on the command line, besides the registry's.

* `keras.applications.NAME`: built with `weights=None` (the machines may
  be offline), the data's input shape and class count, and
  `classifier_activation=None`, so it ends in logits as the registry's
  models do. Given a local weights file (`--weights`, such as Keras's own
  `*_notop.h5`), the model is its backbone (`include_top=False`,
  `pooling='avg'`) holding the file's weights and a new dense layer of
  logits. A size below the model's minimum (MobileNetV2 takes 32x32 at
  least) is refused in one line.
* `MODULE:FUNCTION`: the user's function, called as
  `FUNCTION(input_shape, num_classes)`, returning a `keras.Model` that
  ends in logits: functional, `keras.Sequential` or subclassed (built here
  on the input shape if it is not; stages need a functional one).
  `MODULE` is a dotted module on `PYTHONPATH` or a path to a `.py` file.
  An exception raised inside the user's function keeps its traceback: it
  is their code.
"""

import importlib
import importlib.util
import os
import sys
import warnings

import keras
import tensorflow as tf

from tfmulti import errors

KERAS_APPLICATIONS = 'keras.applications.'


def is_external(name):
  """Whether `name` names a model outside the registry."""
  return name.startswith(KERAS_APPLICATIONS) or ':' in name


def check(name):
  """Raises `ConfigError` unless `name` names a model that can be found."""
  if name.startswith(KERAS_APPLICATIONS):
    if not hasattr(keras.applications, name[len(KERAS_APPLICATIONS):]):
      raise errors.ConfigError(
          f'--model={name}: keras.applications has no such model; e.g. '
          'keras.applications.MobileNetV2.')
    return
  _function(name)


def build(name, input_shape, num_classes, weights=None):
  """The model `name` names (see the module), checked; `weights`, a local
  file of a `keras.applications` backbone's weights, or None.

  Raises:
    errors.ConfigError: it cannot take this input, is not a functional
      `keras.Model`, has another output size, or ends in a softmax.
  """
  if name.startswith(KERAS_APPLICATIONS):
    model = _application(name, tuple(input_shape), num_classes, weights)
  else:
    model = _function(name)(tuple(input_shape), num_classes)
  _check_model(name, model, tuple(input_shape), num_classes)
  return model


def _application(name, input_shape, num_classes, weights):
  """`keras.applications.NAME` ending in `num_classes` logits; with
  `weights`, its backbone holding them and a new dense layer of logits."""
  application = getattr(keras.applications, name[len(KERAS_APPLICATIONS):])
  try:
    if weights is None:
      return application(weights=None, input_shape=input_shape,
                         classes=num_classes, classifier_activation=None)
    backbone = application(weights=None, include_top=False,
                           input_shape=input_shape, pooling='avg')
  except ValueError as e:
    raise errors.ConfigError(
        f'--model={name} cannot take images of shape {input_shape}'
        f' ({errors.first_line(e)}); train it on a data set of larger '
        'images.') from e
  load_weights(name, backbone, weights)
  logits = keras.layers.Dense(num_classes, name='logits')(backbone.output)
  return keras.Model(backbone.input, logits, name=backbone.name)


def load_weights(name, model, path):
  """`model` (of `--model=name`) given the weights of file `path`, or one
  line saying they do not fit."""
  try:
    # A file of another model makes Keras warn once a layer before it
    # fails; the one line below says it all.
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', UserWarning)
      model.load_weights(path)
  except (ValueError, OSError, KeyError) as e:
    raise errors.ConfigError(
        f'--weights={path} does not fit --model={name} '
        f'({errors.first_line(e)[:160]}); give a file saved from this model '
        '(model.save_weights), or for keras.applications.NAME its backbone\'s '
        "(Keras's NAME ..._notop.h5).") from e


def _check_model(name, model, input_shape, num_classes):
  """Builds `model` on `input_shape` if it is not, and refuses one that
  does not end in `num_classes` logits."""
  if not isinstance(model, keras.Model):
    raise errors.ConfigError(
        f'--model={name} returned {type(model).__name__}, not a '
        'keras.Model; return keras.Model(inputs, logits), a '
        'keras.Sequential or a keras.Model subclass.')
  images = keras.KerasTensor((None, *input_shape))
  # A symbolic call builds an unbuilt subclassed model's layers (its
  # `build(shape)` would not), reading no weight.
  outputs = tf.nest.flatten(model.compute_output_spec(images) if model.built
                            else model(images))
  size = outputs[0].shape[-1] if len(outputs) == 1 else None
  if size != num_classes:
    raise errors.ConfigError(
        f'--model={name} outputs {[tuple(o.shape) for o in outputs]}; '
        f'the data has {num_classes} classes: return one output of '
        f'{num_classes} logits a row.')
  if model.layers and getattr(model.layers[-1], 'activation', None) is (
      keras.activations.softmax):
    raise errors.ConfigError(
        f'--model={name} ends in a softmax; return logits (drop the '
        'activation of its last layer): the loss takes logits.')


def _function(name):
  """The function `MODULE:FUNCTION` names, its module imported."""
  module_name, _, function_name = name.rpartition(':')
  if not module_name or not function_name:
    raise errors.ConfigError(
        f'--model={name} is not a registered model, keras.applications.NAME '
        'or MODULE:FUNCTION (e.g. my_models:make_model, or '
        'path/to/models.py:make_model).')
  module = _module(name, module_name)
  function = getattr(module, function_name, None)
  if not callable(function):
    raise errors.ConfigError(
        f'--model={name}: {module_name} has no function {function_name!r}; '
        'define FUNCTION(input_shape, num_classes) there.')
  return function


def _module(name, module_name):
  """The module `module_name` (dotted, or a .py file's path)."""
  if module_name.endswith('.py'):
    if not os.path.isfile(module_name):
      raise errors.ConfigError(
          f'--model={name}: there is no file {module_name!r} (from '
          f'{os.getcwd()}); give its path.')
    key = f'tfmulti_user_model_{abs(hash(os.path.abspath(module_name)))}'
    if key not in sys.modules:
      spec = importlib.util.spec_from_file_location(key, module_name)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)  # Its errors are the user's.
      sys.modules[key] = module
    return sys.modules[key]
  if importlib.util.find_spec(module_name.split('.')[0]) is None:
    raise errors.ConfigError(
        f'--model={name}: no module {module_name!r} on PYTHONPATH; add its '
        'folder to PYTHONPATH or give the .py file\'s path.')
  return importlib.import_module(module_name)
