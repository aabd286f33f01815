"""`python -m tfmulti.bench.plan_calibration`: each layout the plan
searches on logical CPUs predicted from its traced step and timed; the
scores; bad flags refused in one line."""

import argparse

import pytest

from tfmulti.bench import plan_calibration as bench
from tfmulti.plan import search


def test_spearman_is_one_for_the_same_order_and_minus_one_reversed():
  assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1
  assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1
  assert bench.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


@pytest.mark.slow
def test_every_layout_of_two_clones_is_predicted_and_timed():
  report = bench.run(argparse.Namespace(
      model='lenet', num_clones=2, rows_per_clone=2, image_size=28,
      sequence_length=8, width=4, steps=1, rounds=1))
  names = [c.name for c in search.candidates(2, on_cpus=True)]
  assert [row['name'] for row in report['rows']] == names
  for row in report['rows']:
    assert 'refused' not in row, row
    assert row['predicted_ms'] > 0 and row['measured_ms'] > 0
    assert row['kernels'] > 0  # LeNet's convolutions, timed here.
  assert report['rates']['kernels_timed'] > 0
  assert -1 <= report['spearman'] <= 1
  assert report['chosen_of_best'] >= 1
  text = bench.format_report(report)
  assert 'split over 2' in text and 'Spearman' in text


@pytest.mark.parametrize('argv, message', [
    (['--steps=0'], 'steps=0: must be an integer >= 1.'),
    (['--model=vgg'], '--model=vgg: give a registered CNN (lenet, '),
])
def test_a_bad_flag_is_refused_in_one_line(argv, message):
  with pytest.raises(SystemExit) as exit_info:
    bench.main(argv)
  assert str(exit_info.value).startswith(
      'python -m tfmulti.bench.plan_calibration: error: ' + message)
