"""What tfmulti reads of a user's Keras model, in one place."""

import keras


def batch_norms(model):
  """The model's `BatchNormalization` layers (nested ones too), in order."""
  return [layer for layer in model._flatten_layers()
          if isinstance(layer, keras.layers.BatchNormalization)]
