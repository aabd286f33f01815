"""`python -m tfmulti.bench.sharded`: its figures and refusals."""

import argparse

import pytest

from tfmulti.bench import sharded as bench


def _report(joined, keep_joins=False, layout_map=None):
  return bench.run(argparse.Namespace(
      model='lenet', num_clones=2, image_size=28, num_classes=10,
      rows_per_clone=2, sequence_length=16, steps=1, rounds=1,
      gradient_packs=0, joined=joined, keep_joins=keep_joins,
      layout_map=layout_map))


@pytest.mark.slow
@pytest.mark.parametrize('keep_joins, moved', [(True, 1), (False, 1.45)])
def test_a_joined_lenet_holds_and_moves_a_ring_s_bytes(keep_joins, moved):
  report = _report(joined=True, keep_joins=keep_joins)
  sharded, spread = (report['variants'][v] for v in ('sharded', 'spread'))
  # Every kernel split in two: each device holds about half, and moves
  # about 2 (N-1)/N = 1 P each way (the biases, whole, a little more),
  # or 3 (N-1)/N = 1.5 P of the kernels where each layer gathers its
  # kernel again for its gradient (the biases, whole, are not gathered).
  assert sharded['max_held_of_total'] <= report['targets']['held_of_total']
  assert moved <= sharded['max_moved_of_p'] <= report['targets'][
      'moved_of_p']
  assert sharded['max_held_of_total'] < spread['max_held_of_total']
  assert sharded['max_activations_of_p'] == 0
  assert report['step_vs_spread'] > 0
  assert 'sharded / spread step' in bench.format_report(report)
  first = report['first_step_s']
  assert set(first) == {'sharded', 'spread', 'plain'}
  assert all(seconds > 0 for seconds in first.values())
  assert 'first step (trace and run) s: sharded' in bench.format_report(
      report)


@pytest.mark.slow
def test_a_lenet_computed_as_blocks_moves_activations_not_kernels():
  """On a mesh (1, 2) each split kernel computes where its blocks
  live: only the whole biases' bytes move, and the rows cross instead."""
  report = _report(joined=False)
  sharded = report['variants']['sharded']
  assert sharded['max_held_of_total'] <= report['targets']['held_of_total']
  assert sharded['max_moved_of_p'] < 0.05
  assert sharded['max_activations_of_p'] > 0


@pytest.mark.slow
def test_a_derived_map_computes_lenets_large_kernel_as_blocks():
  """`--layout_map=auto` on (1, 2): LeNet's one kernel of 64 KiB or
  more (400 x 120) computed where its blocks live, the rest whole."""
  report = _report(joined=False, layout_map='auto')
  sharded, spread = (report['variants'][v] for v in ('sharded', 'spread'))
  assert sharded['max_activations_of_p'] > 0
  assert sharded['max_moved_of_p'] < spread['max_moved_of_p']


@pytest.mark.parametrize('argv, message', [
    (['--model=llama', '--num_clones=3'],
     r'--num_clones=3 with --model=llama: its mesh is \(2, N/2\)'),
    (['--steps=0'], 'steps=0: must be an integer >= 1'),
    (['--model=llama', '--joined'], '--joined with --model=llama'),
    (['--keep_joins'], '--keep_joins without --joined'),
    (['--model=nope'], "model='nope'"),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)
