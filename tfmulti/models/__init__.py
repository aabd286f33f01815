"""Model registry: functional Keras model factories by name.

Every factory takes `(input_shape, num_classes)` and returns a built
functional `keras.Model`; call it under `tf.device(variables_device)` so its
variables are created there.
"""

from tfmulti.models.lenet import lenet
from tfmulti.models.resnet import resnet18, resnet20, resnet8_thin

_FACTORIES = {
    'lenet': lenet,
    'resnet18': resnet18,
    'resnet20': resnet20,
    'resnet8_thin': resnet8_thin,
}


def names():
  """The registered model names, sorted."""
  return sorted(_FACTORIES)


def get_model(name, *, input_shape, num_classes):
  """Builds the registered model `name`.

  Args:
    name: a registered name (see `names()`).
    input_shape: (height, width, channels) of one image.
    num_classes: number of output logits.

  Returns:
    A functional `keras.Model`.

  Raises:
    ValueError: `name` is not registered.
  """
  if name not in _FACTORIES:
    raise ValueError(f'model={name!r} is not registered; choose one of '
                     f'{names()}.')
  return _FACTORIES[name](tuple(input_shape), num_classes)
