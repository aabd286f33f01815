"""`digits`: scikit-learn's copy of the UCI optical digits, as a TFDS dataset.

The 1,797 real 8x8 handwritten digits (values 0-16) ship inside
scikit-learn, so this dataset prepares offline. Each image is scaled to
0-255, resized bilinearly to 24x24 and padded to 28x28 (MNIST's layout: a
digit in the middle of a 28x28 frame). A fixed, stratified split keeps 360
images for test.
"""

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

IMAGE_SIZE = 28  # Pixels per side, as MNIST.
_DIGIT_SIZE = 24  # Pixels per side of the resized digit, before padding.
_MAX_VALUE = 16  # The UCI digits count pen strokes per 4x4 block: 0-16.
TEST_EXAMPLES = 360  # 20% of 1,797.
_SPLIT_SEED = 0  # Fixed: the split is part of the dataset's definition.


def _images_and_labels():
  """All 1,797 images as uint8 (N, 28, 28, 1), and their labels."""
  # Imported here: scikit-learn is needed only to prepare the dataset once.
  from sklearn import datasets
  digits = datasets.load_digits()
  images = digits.images[..., np.newaxis] * (255.0 / _MAX_VALUE)
  images = tf.image.resize(images, (_DIGIT_SIZE, _DIGIT_SIZE), 'bilinear')
  pad = (IMAGE_SIZE - _DIGIT_SIZE) // 2
  images = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
  images = np.clip(np.round(images.numpy()), 0, 255).astype(np.uint8)
  return images, digits.target.astype(np.int64)


def _split_indices(labels):
  """{'train': indices, 'test': indices}: stratified by label, fixed."""
  from sklearn import model_selection
  train, test = model_selection.train_test_split(
      np.arange(len(labels)), test_size=TEST_EXAMPLES, stratify=labels,
      random_state=_SPLIT_SEED)
  return {'train': np.sort(train), 'test': np.sort(test)}


class Digits(tfds.core.GeneratorBasedBuilder):
  """UCI optical handwritten digits (scikit-learn's copy), 28x28 grayscale."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'First release: 1,437 train, 360 test images.'}

  def _info(self):
    return self.dataset_info_from_configs(
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=(IMAGE_SIZE, IMAGE_SIZE, 1)),
            'label': tfds.features.ClassLabel(num_classes=10),
        }),
        supervised_keys=('image', 'label'),
        homepage='https://archive.ics.uci.edu/dataset/80',
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download: scikit-learn ships the data.
    images, labels = _images_and_labels()
    return {name: self._generate_examples(images, labels, indices)
            for name, indices in _split_indices(labels).items()}

  def _generate_examples(self, images, labels, indices):
    for i in indices:
      yield int(i), {'image': images[i], 'label': labels[i]}
