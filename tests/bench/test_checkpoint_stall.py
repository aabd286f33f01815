"""`python -m tfmulti.bench.checkpoint_stall`: its report and refusals."""

import numpy as np
import pytest

from tfmulti import models
from tfmulti.bench import checkpoint_stall as bench


@pytest.mark.slow
def test_report_times_every_variant_each_round():
  report = bench.run('lenet', rows=8, steps=4, every=2, rounds=2)
  assert set(report['seconds']) == set(bench.VARIANTS)
  assert all(len(times) == 2 and min(times) > 0
             for times in report['seconds'].values())
  assert set(report['stall_of_a_step']) == {'foreground', 'background'}
  # The weights and a momentum slot each, in float32, and little else.
  weights = models.get_model('lenet', input_shape=bench.IMAGE_SHAPE,
                             num_classes=bench.NUM_CLASSES).count_params()
  assert 8 * weights <= report['checkpoint_bytes'] < 8 * weights + 64
  text = bench.format_report(report)
  assert 'background  a checkpoint adds' in text
  assert np.isfinite(report['step_seconds'])


@pytest.mark.parametrize('argv, message', [
    (['--model=nope'], "model='nope'"),
    (['--rounds=0'], 'rounds=0: must be an integer >= 1'),
    (['--steps=5', '--checkpoint_steps=10'],
     '--checkpoint_steps=10 leaves no checkpoint in --steps=5'),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)
