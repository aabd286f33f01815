"""Tests for tfmulti.bench.flops: the FLOPs counted (no timing asserted)."""

import pytest

from tfmulti import errors
from tfmulti import models
from tfmulti.bench import flops as bench_flops


def test_a_step_counts_three_passes_of_the_kernels_multiply_adds():
  model = models.get_model('lenet', input_shape=(28, 28, 1), num_classes=10)
  # conv 5x5x1x6 'same' at 28x28, conv 5x5x6x16 'valid' at 10x10, dense
  # 400-120, 120-84, 84-10: multiply-adds per row.
  forward = (28 * 28 * 6 * 25 + 10 * 10 * 16 * 150 + 400 * 120 + 120 * 84
             + 84 * 10)
  assert forward == 416_520
  assert bench_flops.step_flops(model, rows=4) == 3 * 2 * forward * 4


def test_the_rate_is_the_steps_flops_over_its_median_time():
  rounds = {'matmul': [100.0, 200.0, 300.0], 'step': [2.0, 1.0, 4.0],
            'step_xla': [1.0, 1.0, 1.0]}
  report = bench_flops.summarize(rounds, flops=40.0)
  assert report['matmul_flops_per_sec'] == 200.0
  assert report['step']['flops_per_sec'] == 20.0
  assert report['step']['of_matmul_rate'] == pytest.approx(0.1)
  assert report['step_xla']['of_matmul_rate'] == pytest.approx(0.2)


def test_an_unknown_model_is_refused():
  with pytest.raises(errors.ConfigError, match="model='vgg'"):
    bench_flops.FlopsConfig(model='vgg')
