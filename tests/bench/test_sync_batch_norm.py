"""`python -m tfmulti.bench.sync_batch_norm`: its report and refusals."""

import pytest

from tfmulti.bench import sync_batch_norm as bench


@pytest.mark.slow
def test_report_times_each_phase_of_both_variants(capsys):
  report = bench.run('resnet8_thin', rows=4, rounds=2)
  assert set(report['medians']) == set(bench.VARIANTS)
  assert all(len(runs) == 2 for runs in report['runs'].values())
  for medians in report['medians'].values():
    assert set(medians) == set(bench.PHASES)
    assert all(seconds > 0 for seconds in medians.values())
  assert report['first_step_ratio'] > 0
  assert 'synchronized / unsynchronized' in bench.format_report(report)
  capsys.readouterr()


@pytest.mark.parametrize('argv, message', [
    (['--model=applications:Nope'], 'keras.applications has no such model'),
    (['--model=nope'], "model='nope'"),
    (['--rows=0'], 'rows=0: must be an integer >= 1'),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)
