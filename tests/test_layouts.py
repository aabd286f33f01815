"""The step's layout (`layouts.StepLayout`): integers only, no devices, as
`DeploymentConfig`'s tests are."""

import ast

import pytest

from tfmulti import errors
from tfmulti import layouts
from tfmulti import step_options


def _cut(layout):
  return [(p.worker, p.accumulation_step, p.clone, p.microbatch, p.offset,
           p.rows) for p in layout.pieces]


def test_clones_split_as_evenly_as_the_rows_go():
  layout = layouts.step_layout(10, layouts.Cut(num_clones=4))
  assert layout.clone_rows(0, 0) == (3, 3, 2, 2)
  assert [p.offset for p in layout.pieces] == [0, 3, 6, 8]
  assert layout.global_rows == 10 and not layout.is_even()


def test_each_piece_names_its_clone_device():
  layout = layouts.step_layout(4, layouts.Cut(
      num_clones=2, num_microbatches=2, staged=True,
      devices=('/device:CPU:0', '/device:CPU:1')))
  assert [(p.clone, p.device) for p in layout.pieces] == [
      (0, '/device:CPU:0'), (0, '/device:CPU:0'), (1, '/device:CPU:1'),
      (1, '/device:CPU:1')]


def test_shares_split_by_largest_remainder():
  assert layouts.step_layout(16, layouts.Cut(
      num_clones=2, shares=(3, 1))).clone_rows(0, 0) == (12, 4)
  assert layouts.split_rows(16, (2, 1)) == [11, 5]


def test_workers_accumulation_clones_and_microbatches_in_row_order():
  layout = layouts.step_layout(8, layouts.Cut(
      num_clones=2, accumulation_steps=2, num_microbatches=2, staged=True,
      num_workers=2))
  assert layout.global_rows == 16
  assert _cut(layout)[:4] == [(0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 1, 1),
                              (0, 0, 1, 0, 2, 1), (0, 0, 1, 1, 3, 1)]
  assert _cut(layout)[8] == (1, 0, 0, 0, 8, 1)  # Worker 1 starts at row 8.
  offsets = [p.offset for p in layout.pieces]
  assert offsets == sorted(offsets) and sum(p.rows for p in layout.pieces) \
      == 16
  assert layout.equal_steps() and layout.step_rows(1, 1) == 4


def test_clone_spans_hold_each_clones_rows_of_every_accumulation_step():
  """What the input feed cuts a batch by: clone 0 of a 3:1 split takes 6 of
  each accumulation step's 8 rows, in order; a worker counts from its own
  first row."""
  layout = layouts.step_layout(16, layouts.Cut(
      num_clones=2, shares=(3, 1), accumulation_steps=2))
  assert layout.clone_spans() == (((0, 6), (8, 14)), ((6, 8), (14, 16)))
  two_workers = layouts.step_layout(8, layouts.Cut(
      num_clones=2, num_workers=2,
      devices=('/device:GPU:0', '/device:GPU:1')))
  assert two_workers.clone_spans(1) == (((0, 4),), ((4, 8),))
  assert two_workers.clone_device(1, 1) == '/device:GPU:1'


def test_the_penalties_count_once_over_the_job():
  layout = layouts.step_layout(8, layouts.Cut(
      num_clones=2, accumulation_steps=2, num_workers=2))
  assert sum(p.penalty for p in layout.pieces) == 1.0
  assert [p.penalty for p in layout.pieces if p.penalty] == [0.5, 0.5]
  atoms = layouts.step_layout(8, layouts.Cut(num_clones=2, atom_rows=2,
                                             num_workers=2))
  assert [(p.worker, p.atom) for p in atoms.pieces if p.penalty] == [(0, 0)]


def test_atoms_are_whole_and_numbered_over_the_job():
  layout = layouts.step_layout(12, layouts.Cut(num_clones=2, atom_rows=4,
                                               num_workers=2))
  assert layout.clone_rows(0, 0) == (8, 4)  # 3 atoms: 2 and 1.
  assert [p.atom for p in layout.pieces] == list(range(6))
  assert {p.rows for p in layout.pieces} == {4}
  assert [p.offset for p in layout.pieces] == [0, 4, 8, 12, 16, 20]


def test_a_short_last_batch_leaves_empty_pieces():
  layout = layouts.step_layout(3, layouts.Cut(
      num_clones=4, accumulation_steps=2, num_microbatches=2, staged=True),
                               partial=True)
  assert [layout.step_rows(0, k) for k in range(2)] == [2, 1]
  assert layout.clone_rows(0, 1) == (1, 0, 0, 0)
  assert layout.microbatch_rows(0, 0, 0) == (1,)  # Not an empty one.
  assert not layout.equal_steps()
  assert sum(p.rows for p in layout.pieces) == 3


def test_one_layout_object_a_shape():
  # tf.function traces once a layout: equal arguments give the same object.
  assert layouts.step_layout(8, layouts.Cut(num_clones=2)) is (
      layouts.step_layout(8, layouts.Cut(num_clones=2)))


@pytest.mark.parametrize('kwargs, message', [
    (dict(worker_rows=6, accumulation_steps=4),
     'a batch of 6 rows does not split into accumulation_steps=4'),
    (dict(worker_rows=3, num_clones=4),
     'a batch of 3 rows leaves clone 3 of 4 no rows'),
    (dict(worker_rows=8, num_clones=2, shares=(100, 1)),
     r'leaves clone 1 of 2 no rows \(clone_shares=100,1\)'),
    (dict(worker_rows=4, num_microbatches=5, staged=True),
     'num_microbatches=5 is more than the 4 rows of clone 0; use at most 4'),
    (dict(worker_rows=10, atom_rows=4),
     'reproducible_rows=4: a batch of 10 rows on a worker is not'),
    (dict(worker_rows=16, atom_rows=4, num_microbatches=2, staged=True),
     'each micro-batch through the stages must be one atom.*'
     'num_microbatches=4'),
    (dict(worker_rows=8, num_clones=2, shares=(1, 1, 1)),
     'give one share per clone'),
    (dict(worker_rows=0), r'rows of a batch=0: must be an integer >= 1'),
    (dict(worker_rows=7, num_clones=2, partial=True, even=True),
     'sync_batch_norm=True runs equal clones in lockstep, and a batch of 7 '
     'rows does not split evenly over num_clones=2'),
])
def test_each_rule_refuses_in_one_line(kwargs, message):
  worker_rows = kwargs.pop('worker_rows')
  partial = kwargs.pop('partial', False)
  with pytest.raises(errors.ConfigError, match=message) as refused:
    layouts.step_layout(worker_rows, layouts.Cut(**kwargs), partial)
  assert '\n' not in str(refused.value) and len(str(refused.value)) < 300


def test_for_step_cuts_as_the_config_and_options_say():
  """The one builder from (DeploymentConfig, StepOptions, rows): counts,
  shares, stages and devices read from both records (duck-typed here, as
  the layout knows no TensorFlow)."""
  class Config:
    num_clones, num_workers, num_stages = 2, 1, 1

    def clone_devices(self):
      return ['/device:CPU:0', '/device:CPU:1']
  options = step_options.StepOptions(clone_shares=(3, 1),
                                     accumulation_steps=2)
  layout = layouts.for_step(Config(), options, 16)
  assert layout.clone_rows(0, 1) == (6, 2)
  assert layout.clone_device(0, 1) == '/device:CPU:1'
  assert layouts.for_step(Config(), options, 16, shares=(1, 1)).clone_rows(
      0, 0) == (4, 4)
  assert not layouts.is_staged(Config(), options)


def test_the_layout_module_imports_no_tensorflow():
  tree = ast.parse(open(layouts.__file__).read())
  imported = {alias.name.split('.')[0] for node in ast.walk(tree)
              if isinstance(node, (ast.Import, ast.ImportFrom))
              for alias in node.names} | {
                  node.module.split('.')[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module}
  assert not imported & {'tensorflow', 'keras', 'numpy'}, imported


def test_row_arithmetic_of_evaluation_workers_and_fit():
  assert layouts.even_parts(7, 3) == [3, 2, 2]
  assert layouts.worker_span(12, 2, 3) == (8, 4)
  with pytest.raises(errors.ConfigError, match='does not split over 5'):
    layouts.worker_span(12, 0, 5)
  assert layouts.fit_batches(100, 32) == (100, 32, 4)
  assert layouts.fit_batches(100, 32, validation_split=0.2) == (80, 32, 16)


def test_the_workers_shards_tile_the_global_batch_in_worker_order():
  spans = [layouts.worker_shard(48, w, 2, 3, k)
           for w in range(2) for k in range(3)]
  assert spans == [(8 * i, 8) for i in range(6)]


def test_a_clones_probe_and_a_replicas_piece_are_layout_arithmetic():
  cut = layouts.Cut(num_clones=2, accumulation_steps=2)
  assert layouts.clone_probe_rows(16, cut) == 4
  piece = layouts.step_layout(8, layouts.Cut(accumulation_steps=2)).of(
      0, 1)[0]
  assert layouts.replica_terms(3, 4, 64, piece, first=False) == (196, 0)
  assert layouts.replica_terms(0, 4, 64, piece, first=True) == (4, 0.25)


class TestWorkerParts:
  """Workers whose parts of the global batch differ (an elastic start)."""

  def test_parts_are_whole_units_the_longer_first(self):
    assert layouts.worker_parts(48, 5, 4) == (12, 12, 8, 8, 8)
    assert layouts.worker_parts(48, 5) == (10, 10, 10, 9, 9)
    assert layouts.worker_parts(48, 3, 4) == (16, 16, 16)
    with pytest.raises(errors.ConfigError, match='48 rows is not 13 or more '
                       'whole parts of 4 rows'):
      layouts.worker_parts(48, 13, 4)

  @pytest.mark.parametrize('atom_rows', [0, 4])
  def test_the_pieces_tile_the_global_batch_in_worker_order(self, atom_rows):
    parts = layouts.worker_parts(48, 5, max(atom_rows, 1))
    cut = layouts.Cut(num_clones=2, atom_rows=atom_rows, num_workers=5,
                      worker_parts=parts)
    layout = layouts.step_layout(parts[-1], cut)
    assert layout.global_rows == 48
    assert [layout.worker_rows(w) for w in range(5)] == list(parts)
    offset = 0
    for piece in layout.pieces:  # Consecutive rows, nothing twice.
      assert piece.offset == offset
      offset += piece.rows
    assert offset == 48
    if atom_rows:
      assert [p.atom for p in layout.pieces] == list(range(12))
    assert sum(p.penalty for p in layout.pieces) == pytest.approx(1.0)
    # Every worker cuts the same layout from its own part.
    assert layouts.step_layout(parts[0], cut) == layout

  def test_a_batch_that_is_no_workers_part_is_one_line(self):
    cut = layouts.Cut(num_workers=2, worker_parts=(10, 8))
    with pytest.raises(errors.ConfigError, match='a batch of 9 rows on a '
                       'worker, whose parts of the global batch are 10/8'):
      layouts.step_layout(9, cut)
