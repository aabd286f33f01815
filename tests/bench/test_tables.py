"""`python -m tfmulti.bench.tables`: a table split by rows holds 1/N a
device and moves the rows its ids touch, measured on the batch."""

import argparse

import numpy as np
import pytest

from tfmulti.bench import tables as bench


@pytest.mark.slow
def test_a_row_sharded_table_moves_the_rows_its_ids_touch():
  args = argparse.Namespace(num_clones=4, vocab=4096, width=16, tokens=8,
                            rows_per_clone=32)
  report = bench.run(args)
  assert report['max_held_of_share'] <= report['target']
  assert report['max_moved_of_touched'] <= report['target']
  # Each device moves at least what its ids touch: a figure that counted
  # less (a size left unevaluated) would fail here.
  assert all(min(r['sent_of_touched'], r['received_of_touched']) >= 1.0
             for r in report['devices'].values())
  assert 'x touched' in bench.format_report(report)


def test_touched_bytes_count_each_id_of_another_device():
  # Two devices, rows 0-1 on 0 and 2-3 on 1; clone 0's ids [0, 3, 3],
  # clone 1's [2, 0, 2]: clone 0 asks device 1 for two rows, clone 1
  # asks device 0 for one.
  ids = np.array([[0, 3, 3], [2, 0, 2]])
  width = 2
  row, gradient = width * 4, width * 4 + 4
  touched = bench._touched(ids, 2, 4, width)
  assert touched[0] == (2 * (4 + gradient) + 1 * row,
                        2 * row + 1 * (4 + gradient))
  assert touched[1] == (1 * (4 + gradient) + 2 * row,
                        1 * row + 2 * (4 + gradient))


@pytest.mark.parametrize('argv, message', [
    (['--vocab=10', '--num_clones=4'],
     '--vocab=10 does not split into --num_clones=4'),
    (['--width=0'], 'width=0: must be an integer >= 1'),
    (['--num_clones=1'], '--num_clones=1: a table split over one device'),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)
