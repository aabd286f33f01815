"""Seeded augmentation of training rows (`--augment=flip,crop`).

Every draw is stateless and seeded by (the epoch's seed, the row's position
in the epoch), so the augmented rows depend on neither the layout that
trains them nor the thread that makes them: every clone count, stage cut
and resumed run sees the same rows, and exactness tests hold with it on.
"""

import tensorflow as tf

from tfmulti.data import options as options_lib

_CROP_PAD_DIVISOR = 8  # Pad by an eighth of each side (4 px at 32x32).


def augmenter(names, epoch_seed):
  """A map of (position, (image, label)) to an augmented (image, label)."""
  names = tuple(names)

  def augment(position, example):
    image, label = example
    # Two independent streams a row: one a augmentation.
    seeds = [tf.stack([tf.cast(epoch_seed, tf.int64), 2 * position + k])
             for k in range(2)]
    if options_lib.CROP in names:
      image = _pad_and_crop(image, seeds[0])
    if options_lib.FLIP in names:
      image = tf.image.stateless_random_flip_left_right(image, seeds[1])
    return image, label
  return augment


def _pad_and_crop(image, seed):
  """`image` padded with zeros by an eighth of each side, cropped back to
  its own size at an offset drawn with `seed`."""
  height, width = image.shape[0], image.shape[1]
  pad_h = max(1, height // _CROP_PAD_DIVISOR)
  pad_w = max(1, width // _CROP_PAD_DIVISOR)
  padded = tf.pad(image, [[pad_h, pad_h], [pad_w, pad_w], [0, 0]])
  return tf.image.stateless_random_crop(padded, tf.shape(image), seed)
