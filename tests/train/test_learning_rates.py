"""Tests for tfmulti.train.learning_rates: warm-up, decay, scaling."""

import numpy as np
import pytest

from tfmulti import errors
from tfmulti.train import build
from tfmulti.train import config as config_lib
from tfmulti.train import learning_rates

DIGITS_TRAIN = 1437
EPOCHS = 8


def _rate(schedule, step):
  return float(schedule(step))


def test_warmup_rises_linearly_to_the_peak():
  schedule = learning_rates.Schedule(0.4, 100, warmup_steps=4)
  np.testing.assert_allclose([_rate(schedule, s) for s in range(6)],
                             [0.1, 0.2, 0.3, 0.4, 0.4, 0.4], rtol=1e-6)


def test_cosine_reaches_half_at_midpoint_and_zero_at_the_end():
  schedule = learning_rates.Schedule(1.0, 110, kind='cosine', warmup_steps=10)
  assert _rate(schedule, 10) == pytest.approx(1.0)
  assert _rate(schedule, 60) == pytest.approx(0.5, abs=1e-6)
  assert _rate(schedule, 110) == pytest.approx(0.0, abs=1e-6)


def test_step_drops_tenfold_at_half_and_three_quarters():
  schedule = learning_rates.Schedule(1.0, 100, kind='step')
  np.testing.assert_allclose(
      [_rate(schedule, s) for s in (0, 49, 50, 74, 75, 99)],
      [1.0, 1.0, 0.1, 0.1, 0.01, 0.01], rtol=1e-5)


def _digits_schedule(num_clones, lr_scaling, kind='cosine'):
  """The schedule train.py gives an 8-epoch digits run at 64 per clone."""
  steps = EPOCHS * (DIGITS_TRAIN // (64 * num_clones))
  config = config_lib.TrainConfig(learning_rate=0.1, lr_scaling=lr_scaling,
                                  lr_schedule=kind)
  return build.make_schedule(config, num_clones, steps), steps


@pytest.mark.parametrize('kind', ['cosine', 'step'])
def test_decay_spans_the_same_epochs_for_1_and_4_clones(kind):
  one, one_steps = _digits_schedule(1, 'none', kind)
  four, four_steps = _digits_schedule(4, 'none', kind)
  assert (one_steps, four_steps) == (8 * 22, 8 * 5)
  # The same epoch (2, 5 and 7 of 8) gets the same rate, whatever the clones.
  for epoch in (2, 5, 7):
    assert _rate(four, epoch * 5) == pytest.approx(
        _rate(one, epoch * 22), abs=1e-6)


def test_linear_scaling_multiplies_by_the_clones():
  one, _ = _digits_schedule(1, 'linear')
  four, _ = _digits_schedule(4, 'linear')
  assert one.peak == pytest.approx(0.1) and four.peak == pytest.approx(0.4)
  assert _rate(four, 4 * 5) == pytest.approx(4 * _rate(one, 4 * 22), rel=1e-5)


@pytest.mark.parametrize('kwargs, message', [
    (dict(warmup_steps=100), r'warmup_steps=100 must be in \[0, total_steps'),
    (dict(kind='linear'), "lr_schedule='linear'"),
])
def test_bad_schedules(kwargs, message):
  with pytest.raises(errors.ConfigError, match=message):
    learning_rates.Schedule(0.1, 100, **kwargs)


def test_bad_scaling():
  with pytest.raises(errors.ConfigError, match="lr_scaling='sqrt'"):
    learning_rates.peak_learning_rate(0.1, 'sqrt', 2)
