"""`python -m tfmulti.bench.transfers`: its table and refusals."""

import argparse

import pytest

from tfmulti.bench import transfers as bench


@pytest.mark.slow
def test_report_counts_central_spread_and_packs():
  args = argparse.Namespace(model='lenet', num_clones=2, image_size=28,
                            num_classes=10, rows_per_clone=2)
  report = bench.run(args)
  central, spread, packed = (report['variants'][v] for v in bench.VARIANTS)
  # The host (CPU:2 beside 2 clones) sends each clone every variable.
  host = central['devices']['/device:CPU:2']
  assert host['sent_of_p'] == pytest.approx(2.0)
  assert host['received_of_p'] == pytest.approx(2.0)
  assert central['max_held_of_total'] == 1.0
  assert spread['max_sent_of_p'] < central['max_sent_of_p']
  assert spread['max_gradient_transfers_per_clone'] > 1
  assert packed['max_gradient_transfers_per_clone'] == 1  # N - 1.
  assert packed['max_sent_of_p'] == pytest.approx(spread['max_sent_of_p'])
  assert report['mirrored_theory']['sent_of_p'] == 1.0  # 2 (N-1) / N.
  assert 'spread_packs' in bench.format_report(report)


@pytest.mark.parametrize('argv, message', [
    (['--model=applications:Nope'], 'keras.applications has no such model'),
    (['--model=nope'], "model='nope'"),
    (['--num_clones=0'], 'num_clones=0: must be an integer >= 1'),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)
