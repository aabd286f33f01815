"""Writes small TFDS datasets into a test's data_dir, offline."""

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds


def store(name, data_dir, *, features, rows, version='1.0.0', seed=0):
  """Prepares dataset `name` in `data_dir`: `rows[split]` random rows of
  `features` a split (images of the feature's shape, labels cycling over
  the classes), as a prepared copy TFDS reads by name."""
  rng = np.random.RandomState(seed)

  def split(count):
    columns = {}
    for key, feature in features.items():
      if isinstance(feature, tfds.features.Image):
        columns[key] = rng.randint(0, 256, (count, *feature.shape)).astype(
            np.uint8)
      elif isinstance(feature, tfds.features.ClassLabel):
        columns[key] = np.arange(count) % feature.num_classes
      else:  # An id or other text.
        columns[key] = [str(i) for i in range(count)]
    return tf.data.Dataset.from_tensor_slices(columns)
  tfds.dataset_builders.store_as_tfds_dataset(
      name=name, version=str(version), features=features,
      split_datasets={s: split(n) for s, n in rows.items()},
      data_dir=str(data_dir))
