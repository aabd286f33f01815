"""What the image sources share: which bytes are PNG or JPEG, and whether
they decode.

A folder (`image_folder`) and TFRecords (`tfrecords`) check every image
before training by decoding it once with the op that training decodes it
with (`tf.io.decode_image`), so an image that passes decodes in every
epoch, and a truncated or corrupt one stops the run in one line naming it.
"""

import tensorflow as tf

from tfmulti import errors

PNG = b'\x89PNG\r\n\x1a\n'
JPEG = b'\xff\xd8'


def shape(data):
  """(height, width, channels) of encoded image bytes `data` (a string
  tensor), decoded; zeros for bytes that are neither PNG nor JPEG.

  Raises:
    tf.errors.InvalidArgumentError: PNG or JPEG bytes that do not decode
      (`why_not_decoded` says why).
  """
  known = tf.logical_or(tf.strings.substr(data, 0, len(PNG)) == PNG,
                        tf.strings.substr(data, 0, len(JPEG)) == JPEG)
  return tf.cond(known, lambda: tf.shape(tf.io.decode_image(
      data, expand_animations=False)), lambda: tf.zeros([3], tf.int32))


def why_not_decoded(data):
  """Why encoded image bytes `data` do not decode, in TensorFlow's words, or
  None when they do. JPEG bytes are read by their header first: for a bad
  one `decode_image` says only "unknown format"."""
  data = bytes(data.numpy()) if tf.is_tensor(data) else data
  checks = [lambda: tf.io.decode_image(data, expand_animations=False)]
  if data.startswith(JPEG):
    checks.insert(0, lambda: tf.io.extract_jpeg_shape(data))
  for check in checks:
    try:
      check()
    except tf.errors.InvalidArgumentError as e:
      return errors.tf_reason(e)
  return None
