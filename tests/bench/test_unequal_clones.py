"""The balance benchmark on a simulated unequal pair, tiny."""

import pytest

from tfmulti.bench import unequal_clones as bench_balance


@pytest.mark.slow
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


@pytest.mark.slow
def test_emulated_pair_balanced_then_slowed_down():
  """Shares follow the emulated speeds, before and after clone 1 slows
  down 2x; one trace per distinct split (even, 3:1, then 6:1, with at
  most one split between them on a loaded machine)."""
  report = bench_balance.run_emulated((3, 1), batch_size=16, ms_per_row=2.0,
                                      steps=2, every_steps=2)
  assert report['emulated'] is True
  # The speeds' own split (3:1 of 16 buckets, then 6:1), to a bucket: the
  # waits are timed on a shared machine, which a busy neighbour stretches.
  assert abs(report['auto_shares'][0] - 12) <= 1
  assert abs(report['slowed_shares'][0] - 14) <= 1
  assert report['slowed_shares'][0] > report['auto_shares'][0]
  assert report['trace_count'] == report['distinct_splits']
  assert 3 <= report['distinct_splits'] <= 4
  assert len(report['slowed_of_ideal_by_step']) == 4
  assert 'EMULATED' in bench_balance.format_emulated([report])


@pytest.mark.parametrize('value', ['3', '3:0', 'a:b', '3:1:2'])
def test_bad_emulated_pairs_stop_with_one_line(value):
  with pytest.raises(SystemExit, match=f'--emulated={value}: give pairs'):
    bench_balance.main([f'--emulated={value}'])
