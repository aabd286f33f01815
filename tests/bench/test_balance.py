"""The balance benchmark on a simulated unequal pair, tiny."""

import pytest

from tfmulti.bench import balance as bench_balance


def test_the_slow_clone_gets_fewer_rows_and_every_split_is_reported():
  report = bench_balance.run('lenet', batch_size=8, slowdown=4.0, rounds=1,
                             steps=1)
  solo = report['solo_rows_per_sec']
  assert solo[0] > solo[1]  # Clone 1 waits 3x clone 0's time a row.
  assert report['ideal_rows_per_sec'] == pytest.approx(sum(solo))
  shares = report['auto_shares']
  assert sum(shares) == 16 and shares[0] > shares[1]
  assert report['trace_count'] == 2  # One trace per split: even, auto.
  for name in ('even', 'auto'):
    assert report[name]['rows_per_sec_median'] > 0
  assert 'auto shares' in bench_balance.format_report(report)


def test_bad_slowdown_stops_with_one_line():
  with pytest.raises(SystemExit, match='slowdown=0.5: must be >= 1'):
    bench_balance.main(['--slowdown=0.5'])
