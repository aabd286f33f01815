"""`python -m tfmulti.bench.table_plan`: planned tables keep each device
within 1.1x an even share of the bytes held and looked up, with fewer
gathers than splitting every table; each table whole does not."""

import argparse

import pytest

from tfmulti.bench import table_plan as bench


@pytest.mark.slow
def test_planned_tables_balance_what_whole_ones_do_not():
  args = argparse.Namespace(num_clones=4, width=8, rows_per_clone=32,
                            vocab_sizes=(40_000, 400, 40, 40, 40, 40, 8))
  report = bench.run(args)
  planned, whole, rows = (report['designs'][d] for d in bench.DESIGNS)
  for key in ('held', 'looked'):
    assert planned[f'max_{key}_of_share'] <= report['target']
    # Every device counted: the shares sum to N even shares.
    for design in (planned, whole, rows):
      assert len(design[f'{key}_of_share']) == 4
      assert sum(design[f'{key}_of_share']) == pytest.approx(4)
  assert whole['max_held_of_share'] > 2 * report['target']
  assert whole['gathers'] < planned['gathers'] < rows['gathers']
  assert 'planned  holds' in bench.format_report(report)


@pytest.mark.parametrize('argv, message', [
    (['--num_clones=1'], '--num_clones=1: tables over one device'),
    (['--vocab_sizes=8,6'], r'--vocab_sizes: \[6\] do not split'),
    (['--vocab_sizes=8,0'], '--vocab_sizes=8,0: give each table'),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)
