"""`python -m tfmulti.bench.tensor_parallel`: a split feed-forward block
holds 1/M of a clone's hidden activations a device (M: the devices it
spans), and moves one all-reduce's bytes forward and one backward."""

import argparse

import pytest

from tfmulti.bench import tensor_parallel as bench


@pytest.mark.slow
def test_a_split_block_holds_its_part_and_moves_an_all_reduce_each_way():
  args = argparse.Namespace(num_clones=4, blocks=2, width=32, hidden=96,
                            rows_per_clone=8)
  report = bench.run(args)
  assert set(report['devices']) == {f'/device:CPU:{i}' for i in range(4)}
  # Computed whole, a clone's device would hold all its rows': M = 2x.
  assert report['max_clone_part'] <= report['target']
  # Each device holds at least its part: a count that missed a part
  # (a tensor left unread) would fail here.
  assert report['max_clone_part'] >= 1.0
  assert min(report['devices'].values()) >= 1.0
  assert report['forward_all_reduces_a_block'] == pytest.approx(1.0)
  assert report['backward_all_reduces_a_block'] == pytest.approx(1.0)
  assert 'all-reduce forward' in bench.format_report(report)


@pytest.mark.parametrize('argv, message', [
    (['--num_clones=3'], '--num_clones=3: the mesh is'),
    (['--hidden=30', '--num_clones=8'], '--hidden=30 --width=48'),
    (['--rows_per_clone=48'], '--rows_per_clone=48 --width=48'),
    (['--hidden=96'], '--hidden=96: the report tells tensors'),
    (['--blocks=0'], 'blocks=0: must be an integer >= 1'),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)
