"""A worker's rows: one cut (`layouts.worker_span`) for tensors and
datasets alike, uneven `worker_parts` included."""

import numpy as np
import pytest
import tensorflow as tf

from tfmulti import errors
from tfmulti import rows


def _batch(count):
  images = np.arange(count * 2, dtype=np.float32).reshape(count, 2)
  return images, np.arange(count, dtype=np.int32)


@pytest.mark.parametrize('parts', [None, (12, 12, 8, 8, 8)])
def test_a_tensor_batch_and_a_dataset_give_a_worker_the_same_rows(parts):
  images, labels = _batch(48 if parts else 50)
  dataset = tf.data.Dataset.from_tensors((images, labels))
  for worker in range(5):
    from_tensors = rows.worker_part((images, labels), worker=worker,
                                    num_workers=5, parts=parts)
    (from_dataset,) = list(rows.worker_shards(
        dataset, worker=worker, num_workers=5, shards_per_worker=1,
        parts=parts))
    for got, want in zip(from_dataset, from_tensors):
      np.testing.assert_array_equal(got, want)
  mine = rows.worker_part((images, labels), worker=2, num_workers=5,
                          parts=parts)
  want = (24, 8) if parts else (20, 10)
  assert (int(mine[1][0]), len(mine[1])) == want


def test_a_batch_that_is_not_the_parts_rows_is_refused():
  with pytest.raises(errors.ConfigError, match=r'worker parts \(12, 12, 8'):
    rows.worker_part(_batch(40), worker=0, num_workers=5,
                     parts=(12, 12, 8, 8, 8))
