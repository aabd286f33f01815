"""What both doors export: the model for one device, made once, here.

The command line's export (`train.export`) and `TowersModel.export` write
the same model: a copy of the trained one with its weights, made in no
device or strategy scope (Keras's clone: a functional or Sequential
model's layers copied, a subclassed one made again from its config), so it
loads and runs on one device whatever path trained it, a sharded
variable's weights read whole, and its variables named afresh (TensorFlow
refuses a variable named '__net/bias', which a class `_Net` makes, in a
SavedModel). A model Keras cannot clone (a subclass without a config) is
exported itself, its sharded variables whole on the host while it is
written (`sharding.whole_on_host`).
"""

import contextlib

from absl import logging
import keras

from tfmulti import keras_internals
from tfmulti.mesh import sharding


@contextlib.contextmanager
def one_device_model(model, input_shape=None):
  """Inside, the model to export for `model` (see the module); a subclassed
  copy is built on the shape `model` was built on, else on `input_shape`
  (one row's)."""
  try:
    copy = keras.models.clone_model(model)
  except (NotImplementedError, TypeError) as e:
    logging.info('exporting model %r itself: Keras cannot copy it (%s)',
                 model.name, str(e).splitlines()[0] if str(e) else e)
    with sharding.whole_on_host(model):
      yield model
    return
  # A root scope name has no leading '_' (Keras names a class '_Net'
  # '__net'), and saving traces the model at the root.
  copy.name = copy.name.lstrip('_') or 'model'
  if not copy.built:
    shape = keras_internals.build_input_shape(model)
    copy(keras.KerasTensor(shape if shape is not None else
                           (None, *input_shape)))
  copy.set_weights(model.get_weights())
  yield copy
