"""The pixel range every model receives: float32 in [0, 255].

The data pipelines give each model its images as Keras's own loaders do
(`image_dataset_from_directory`, TFDS images): float32 pixels in [0, 255],
unscaled. The registry's models scale inside themselves (`scaled`, as
Keras's tutorials put `Rescaling(1./255)` in the model), a user's
`MODULE:FUNCTION` model receives the pixels as they are, and a
`keras.applications` model gets its family's `preprocess_input`
(`external`). The exported model holds that first layer too, so it serves
[0, 255] images.
"""

import keras

PIXEL_MAX = 255.0
RANGE = '[0, 255]'


def scaled(images):
  """`images` (a Keras tensor of [0, 255] pixels) scaled to [0, 1]: a
  registry model's first layer."""
  return keras.layers.Rescaling(1 / PIXEL_MAX, name='rescaling')(images)
