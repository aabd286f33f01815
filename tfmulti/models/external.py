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

import dataclasses
import importlib
import importlib.util
import os
import sys
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals

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


def receives(name, channels):
  """How `name`'s model takes the [0, 255] pixels it receives (for the
  log): a `keras.applications` family's preprocessing, or the user's."""
  if name.startswith(KERAS_APPLICATIONS):
    return Preprocessing.of(getattr(
        keras.applications, name[len(KERAS_APPLICATIONS):]),
                            channels).description
  return ('as they are: scale them inside the model, as Keras\'s tutorials '
          'do (keras.layers.Rescaling(1/255))')


def _application(name, input_shape, num_classes, weights):
  """`keras.applications.NAME` ending in `num_classes` logits, its family's
  `preprocess_input` its first layer (`Preprocessing`); with `weights`,
  its backbone holding them and a new dense layer of logits."""
  application = getattr(keras.applications, name[len(KERAS_APPLICATIONS):])
  inputs = keras.Input(input_shape, name='images')
  preprocessing = Preprocessing.of(application, input_shape[-1])
  tensor = preprocessing.layer(inputs) if preprocessing.layer else inputs
  try:
    if weights is None:
      return application(weights=None, input_tensor=tensor,
                         input_shape=input_shape, classes=num_classes,
                         classifier_activation=None)
    backbone = application(weights=None, include_top=False,
                           input_tensor=tensor, input_shape=input_shape,
                           pooling='avg')
    loaded = application(weights=None, include_top=False,
                         input_shape=input_shape, pooling='avg')
  except ValueError as e:
    raise errors.ConfigError(
        f'--model={name} cannot take images of shape {input_shape}'
        f' ({errors.first_line(e)}); train it on a data set of larger '
        'images.') from e
  # The file fits the family's own backbone, whose layers with weights come
  # in the same order in this one (the preprocessing holds none).
  load_weights(name, loaded, weights)
  for mine, theirs in zip(_weighted(backbone), _weighted(loaded)):
    mine.set_weights(theirs.get_weights())
  preprocessing.fit_first_kernel(_weighted(backbone)[0])
  _as_imagenet_weights_expect(application, backbone)
  logits = keras.layers.Dense(num_classes, name='logits')(backbone.output)
  return keras.Model(inputs, logits, name=backbone.name)


def _weighted(model):
  """The layers of `model` that hold weights, in order."""
  return [layer for layer in model.layers if layer.weights]


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """What a `keras.applications` family's `preprocess_input` does to
  [0, 255] pixels, as the model's own first layer.

  Every family's is an affine map of each pixel's channels ('tf': x / 127.5
  - 1; 'torch': x / 255, less the ImageNet mean, over its deviation;
  'caffe': RGB to BGR, less the mean; EfficientNet's and ConvNeXt's: none,
  their scaling is inside), read off the function itself (`of`). Its scale
  and offset a channel are one weightless `Rescaling`. Where the map
  reverses the channels (RGB to BGR), the pixels stay RGB and the scale
  and offset follow them; a backbone given the family's weights then has
  its first kernel's input channels reversed (`fit_first_kernel`), which
  computes the same, and from scratch the order does not matter.

  Attributes:
    layer: the `Rescaling`, or None where the map does nothing or cannot
      take these channels (its family expects RGB).
    reverses: whether the family's map reverses the channels.
    description: what the model receives, for the log.
  """
  layer: object
  reverses: bool
  description: str

  @classmethod
  def of(cls, application, channels):
    """The preprocessing of `application`'s family on `channels`."""
    module = importlib.import_module(application.__module__)
    family = module.__name__.rsplit('.', 1)[-1]
    basis = np.concatenate([np.zeros((1, channels)), np.eye(channels)])
    try:
      mapped = np.asarray(module.preprocess_input(
          basis[None].astype(np.float32)))[0].astype(np.float64)
    except Exception:  # noqa: BLE001 - whatever it raises, it cannot.
      return cls(None, False, f"{family}'s preprocess_input takes RGB: "
                 f'the {channels}-channel pixels arrive as they are')
    offset, matrix = mapped[0], mapped[1:] - mapped[0]
    reverses = not _diagonal(matrix) and _diagonal(matrix[:, ::-1])
    scale = np.diag(matrix[:, ::-1] if reverses else matrix)
    offset = offset[::-1] if reverses else offset
    if not reverses and np.allclose(scale, 1) and np.allclose(offset, 0):
      return cls(None, False, f"{family}'s preprocess_input is inside the "
                 'model already')
    return cls(keras.layers.Rescaling(scale.tolist(), offset.tolist(),
                                      name='preprocess_input'), reverses,
               f"{family}'s preprocess_input, as its first layer")

  def fit_first_kernel(self, layer):
    """Reverses the input channels of `layer`'s kernel (the backbone's
    first with weights) where the family's map reverses the pixels'."""
    if self.reverses:
      kernel, *rest = layer.get_weights()
      layer.set_weights([kernel[..., ::-1, :], *rest])


def _diagonal(matrix):
  return np.allclose(matrix, np.diag(np.diag(matrix)))


def _as_imagenet_weights_expect(application, backbone):
  """An EfficientNet made with `weights=None` lacks the scaling Keras adds
  after its `Normalization` only for `weights='imagenet'` (1 / sqrt of
  the ImageNet deviation a channel); given those weights from a file, its
  `Normalization` divides by that too (its variance times the deviation),
  which computes the same."""
  if not application.__module__.endswith('.efficientnet'):
    return
  for layer in backbone.layers:
    if isinstance(layer, keras.layers.Normalization):
      layer.adapt_variance.assign(layer.adapt_variance * np.array(
          keras_internals.efficientnet_stddev(), np.float32))
      layer.finalize_state()


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
  if ':' not in name.strip(':'):
    raise errors.ConfigError(
        f'--model={name} is not a registered model, keras.applications.NAME '
        'or MODULE:FUNCTION (e.g. my_models:make_model, or '
        'path/to/models.py:make_model).')
  return function_named('model', name, 'FUNCTION(input_shape, num_classes)')


def function_named(flag, name, define):
  """The function `--flag=MODULE:FUNCTION` names (FUNCTION may be dotted:
  `keras_hub.models:LlamaBackbone.get_layout_map`), its module imported;
  `define` says what the function is, for the one-line refusal."""
  module_name, _, function_name = name.rpartition(':')
  if not module_name or not function_name:
    raise errors.ConfigError(
        f'--{flag}={name}: give MODULE:FUNCTION, {define} (MODULE dotted on '
        'PYTHONPATH, or a .py path).')
  function = _module(flag, name, module_name)
  for attribute in function_name.split('.'):
    function = getattr(function, attribute, None)
  if not callable(function):
    raise errors.ConfigError(
        f'--{flag}={name}: {module_name} has no function {function_name!r}; '
        f'define {define} there.')
  return function


def _module(flag, name, module_name):
  """The module `module_name` (dotted, or a .py file's path)."""
  if module_name.endswith('.py'):
    if not os.path.isfile(module_name):
      raise errors.ConfigError(
          f'--{flag}={name}: there is no file {module_name!r} (from '
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
        f'--{flag}={name}: no module {module_name!r} on PYTHONPATH; add its '
        'folder to PYTHONPATH or give the .py file\'s path.')
  return importlib.import_module(module_name)
