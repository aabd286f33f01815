"""Tests for `--augment`: seeded per (seed, epoch, row), the same on a
resumed epoch, each row its own draw."""

import numpy as np
import pytest

from tfmulti import data
from tfmulti import errors


def _epoch(digits_dir, augment, epoch=0, skip_batches=0, seed=0):
  loaded = data.load('digits', global_batch_size=64, data_dir=digits_dir,
                     seed=seed, options=data.InputOptions(augment=augment))
  return np.concatenate([x for x, _ in loaded.train_epoch(
      epoch, skip_batches=skip_batches)])


@pytest.mark.slow
def test_flip_mirrors_about_half_the_rows_each_its_own_draw(digits_dir):
  plain = _epoch(digits_dir, ())
  flipped = _epoch(digits_dir, ('flip',))
  mirrored = np.all(flipped == plain[:, :, ::-1], axis=(1, 2, 3))
  kept = np.all(flipped == plain, axis=(1, 2, 3))
  assert np.all(mirrored | kept)  # Each row: itself or its mirror.
  assert 0.4 < np.mean(mirrored & ~kept) < 0.6


@pytest.mark.slow
def test_crop_shifts_rows_within_an_eighth_and_keeps_the_shape(digits_dir):
  plain = _epoch(digits_dir, ())
  cropped = _epoch(digits_dir, ('crop',))
  assert cropped.shape == plain.shape
  shifted = ~np.all(cropped == plain, axis=(1, 2, 3))
  assert np.mean(shifted) > 0.7  # 25 offsets of 3 px; 1 of them is (0, 0).
  # Every row is its own shifted by at most 3 px (28 // 8) each way.
  padded = np.pad(plain, [(0, 0), (3, 3), (3, 3), (0, 0)])
  for row in range(0, len(plain), 97):
    assert any(np.array_equal(cropped[row], padded[row, i:i + 28, j:j + 28])
               for i in range(7) for j in range(7))


@pytest.mark.slow
def test_the_draws_are_the_same_on_a_rerun_and_a_resumed_epoch(digits_dir):
  both = ('flip', 'crop')
  whole = _epoch(digits_dir, both, epoch=1)
  np.testing.assert_array_equal(whole, _epoch(digits_dir, both, epoch=1))
  # A resumed epoch skips batches and draws the same rows after them.
  np.testing.assert_array_equal(
      whole[3 * 64:], _epoch(digits_dir, both, epoch=1, skip_batches=3))


@pytest.mark.parametrize('augment, message', [
    (('rotate',), r"augment='rotate': choose one of \('flip', 'crop'\)"),
    (('flip', 'flip'), 'augment=flip,flip: name each augmentation once'),
])
def test_unknown_or_repeated_augmentations_are_refused(augment, message):
  with pytest.raises(errors.ConfigError, match=message):
    data.InputOptions(augment=augment)
