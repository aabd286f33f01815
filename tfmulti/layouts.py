"""Where a step's rows go, in one place: the step's layout.

A step's global batch (the whole job's rows of one update) is cut over
workers (each its consecutive rows), accumulation steps (consecutive parts
whose gradients make one update), clones (shards, by `clone_shares` or as
evenly as the rows go), micro-batches (a clone's shard through its
stages) and, with `reproducible_rows`, atoms. `StepLayout` holds every
piece of that cut, with its row offset in the global batch and its rows,
built once a batch shape from plain integers; the code that runs a piece
reads its rows, its seed's offset and its penalty weight there. Each rule
that refuses a batch is checked here, once, with its message.

`for_step` builds it from what the job says (a `DeploymentConfig`, the
`StepOptions`, the batch's rows): every caller reads it through there.
This module is arithmetic on integers and imports no TensorFlow; the
TensorFlow helpers that apply a layout to tensors are `rows`'.

An empty piece (a short last batch, fewer rows than clones) is part of the
layout and runs nothing: it adds exactly 0 to every sum.
"""

import dataclasses
import functools
from typing import Optional, Tuple

from tfmulti import errors


def split_rows(rows, shares):
  """`rows` split in proportion to `shares`, by largest remainder.

  Each part gets the floor of its quota rows * share / sum(shares); the
  rows left over go one each to the parts with the largest remainders (the
  first part on a tie). Equal shares give parts that differ by one row at
  most, the longer ones first.
  """
  total = sum(shares)
  quotas = [rows * share / total for share in shares]
  sizes = [int(quota) for quota in quotas]
  by_remainder = sorted(range(len(shares)),
                        key=lambda i: (sizes[i] - quotas[i], i))
  for i in by_remainder[:rows - sum(sizes)]:
    sizes[i] += 1
  return sizes


@dataclasses.dataclass(frozen=True)
class Piece:
  """Rows of a step that run one forward and backward pass together.

  Attributes:
    worker: the worker whose batch holds them.
    accumulation_step: which of the worker's accumulation steps.
    clone: the clone (or tf.distribute replica) that runs them.
    microbatch: their micro-batch of the clone's shard (0 without stages).
    atom: their atom's index in the job (-1 without `reproducible_rows`).
    offset: their first row in the whole job's global batch.
    rows: how many rows (0 for an empty piece, which runs nothing).
    penalty: the piece's part of the weight penalties (they count once a
      step over the job: the parts sum to 1).
    device: the device its clone runs on, on its worker ('' when the
      layout was cut without devices).
  """
  worker: int
  accumulation_step: int
  clone: int
  microbatch: int
  atom: int
  offset: int
  rows: int
  penalty: float
  device: str = ''


@dataclasses.dataclass(frozen=True)
class StepLayout:
  """Every piece of one step of the job, in row order.

  Attributes:
    global_rows: the whole job's rows of the step (every worker, every
      accumulation step): each piece's loss is a mean over its rows
      weighted by rows / global_rows.
    num_workers, num_clones, accumulation_steps: the cut's counts.
    atom_rows: rows an atom (`reproducible_rows`); 0 without atoms.
    pieces: every piece of every worker, ordered by worker, accumulation
      step, clone, micro-batch (their offsets increase in that order).
  """
  global_rows: int
  num_workers: int
  num_clones: int
  accumulation_steps: int
  atom_rows: int
  pieces: Tuple[Piece, ...]

  def of(self, worker=None, accumulation_step=None, clone=None):
    """The pieces of that worker, accumulation step and clone (None: all)."""
    wanted = (worker, accumulation_step, clone)
    return tuple(p for p in self.pieces if all(
        w is None or w == v for w, v in
        zip(wanted, (p.worker, p.accumulation_step, p.clone))))

  def rows_of(self, **where):
    """The rows of the pieces `of(**where)` selects."""
    return sum(p.rows for p in self.of(**where))

  def worker_rows(self, worker=0):
    """Rows of `worker`'s batch (every worker's is as long, but where the
    cut gives the workers their own `worker_parts`)."""
    return self.rows_of(worker=worker)

  def step_rows(self, worker, accumulation_step):
    """Rows of one accumulation step of `worker`'s batch."""
    return self.rows_of(worker=worker, accumulation_step=accumulation_step)

  def clone_rows(self, worker, accumulation_step):
    """Each clone's rows of that accumulation step, a tuple."""
    return tuple(self.rows_of(worker=worker,
                              accumulation_step=accumulation_step, clone=c)
                 for c in range(self.num_clones))

  def microbatch_rows(self, worker, accumulation_step, clone):
    """The rows of each non-empty micro-batch (or atom) of that clone."""
    return tuple(p.rows for p in self.of(worker, accumulation_step, clone)
                 if p.rows)

  def equal_steps(self, worker=0):
    """Whether `worker`'s accumulation steps are cut alike (then one traced
    body serves them all, in a loop)."""
    first = self._shape(worker, 0)
    return all(self._shape(worker, k) == first
               for k in range(1, self.accumulation_steps))

  def _shape(self, worker, step):
    return tuple((p.clone, p.microbatch, p.rows)
                 for p in self.of(worker, step))

  def is_even(self):
    """Whether every clone of every accumulation step has as many rows."""
    return len({p for w in range(self.num_workers)
                for k in range(self.accumulation_steps)
                for p in self.clone_rows(w, k)}) == 1

  def clone_spans(self, worker=0):
    """Where each clone's shard lies in `worker`'s batch: per clone, a
    (start, stop) for each accumulation step, counted from the batch's
    first row. A clone's shard of the step is these rows, in order (what
    the input feed cuts, `deploy.feeds`)."""
    first = self.of(worker)[0].offset
    spans = []
    for clone in range(self.num_clones):
      spans.append(tuple(
          (pieces[0].offset - first,
           pieces[0].offset - first + sum(p.rows for p in pieces))
          for pieces in (self.of(worker, k, clone)
                         for k in range(self.accumulation_steps))))
    return tuple(spans)

  def clone_device(self, worker, clone):
    """The device clone `clone` of `worker` runs on ('' without devices)."""
    return self.of(worker, 0, clone)[0].device


@dataclasses.dataclass(frozen=True)
class Cut:
  """How a step's rows are cut: the counts and rules of a layout, with no
  batch (`step_layout` cuts a batch by it).

  Attributes:
    num_clones: clones (or replicas) a worker.
    shares: each clone's share of an accumulation step's rows; None for
      equal shares.
    accumulation_steps: K accumulation steps a batch.
    num_microbatches: micro-batches a clone's shard is cut into.
    staged: the clones run stages (with atoms, each micro-batch must then
      be one atom).
    atom_rows: `reproducible_rows` (0: off).
    num_workers: workers in the job.
    devices: each clone's device (as `DeploymentConfig.clone_devices()`
      gives them), for the pieces; () without.
    even: every clone must take as many rows (lockstep clones, whose
      synchronized BatchNorm all-reduces between equal shards).
    worker_parts: each worker's rows of the global batch, where they
      differ (`worker_parts`); None: every worker brings as many.
  """
  num_clones: int = 1
  shares: Optional[Tuple[float, ...]] = None
  accumulation_steps: int = 1
  num_microbatches: int = 1
  staged: bool = False
  atom_rows: int = 0
  num_workers: int = 1
  devices: Tuple[str, ...] = ()
  even: bool = False
  worker_parts: Optional[Tuple[int, ...]] = None


def is_staged(config, options):
  """Whether the clones run stages: more than one stage, or micro-batches
  (one stage fed in micro-batches is a pipeline of one). The one rule
  every caller asks."""
  return config.num_stages > 1 or options.num_microbatches > 1


def cut_of(config, options, shares=None):
  """The `Cut` of a job's steps: `config` a `DeploymentConfig`, `options`
  its `StepOptions`; `shares` the clones' current shares (those measured
  for `clone_shares='auto'`), else the options' own."""
  return Cut(num_clones=config.num_clones,
             shares=shares if shares is not None else options.fixed_shares,
             accumulation_steps=options.accumulation_steps,
             num_microbatches=options.num_microbatches,
             staged=is_staged(config, options),
             atom_rows=options.reproducible_rows,
             num_workers=config.num_workers,
             devices=tuple(config.clone_devices()),
             even=options.sync_batch_norm,
             worker_parts=options.worker_parts)


def for_step(config, options, worker_rows, *, shares=None, partial=False):
  """The `StepLayout` of a step on a batch of `worker_rows` rows on each
  worker (`cut_of` says how it is cut; `step_layout` cuts it)."""
  return step_layout(worker_rows, cut_of(config, options, shares), partial)


@functools.lru_cache(maxsize=None)
def step_layout(worker_rows, cut=Cut(), partial=False):
  """The `StepLayout` of a step whose workers each bring `worker_rows`.

  Args:
    worker_rows: rows of each worker's batch (the global batch, on one
      worker); with the cut's `worker_parts`, this worker's part.
    cut: the `Cut`: how the rows are cut.
    partial: the batch is a short last one (Keras's last partial batch):
      it may leave clones or micro-batches empty, and accumulation steps
      unequal, as plain `fit` trains it; a full batch must split fully.

  Returns:
    The `StepLayout`; the same object for the same arguments, so a
    `tf.function` that takes it traces once a layout.

  Raises:
    errors.ConfigError: a batch this cut cannot split (each rule once).
  """
  errors.check_count('rows of a batch', worker_rows, 1)
  check_share_count(cut.shares, cut.num_clones)
  atom_rows = cut.atom_rows
  per_worker = cut.worker_parts or (worker_rows,) * cut.num_workers
  if worker_rows not in per_worker:
    raise errors.ConfigError(
        f'a batch of {worker_rows} rows on a worker, whose parts of the '
        f'global batch are {"/".join(map(str, per_worker))} rows: read the '
        'rows '
        'of this worker\'s part.')
  pieces, offset = [], 0
  for worker, rows_of_worker in enumerate(per_worker):
    steps = _accumulation_rows(rows_of_worker, cut.accumulation_steps,
                               atom_rows, partial)
    atom = offset // max(atom_rows, 1)
    for k, step_rows in enumerate(steps):
      for clone, rows in enumerate(_clone_rows(step_rows, cut, partial)):
        parts = _microbatch_rows(rows, cut, clone, partial)
        for m, part in enumerate(parts):
          penalty = _penalty(worker, k, clone, m, cut)
          pieces.append(Piece(worker, k, clone, m,
                              atom if atom_rows else -1, offset, part,
                              penalty, cut.devices[clone] if cut.devices
                              else ''))
          offset += part
          atom += 1 if atom_rows else 0
  layout = StepLayout(sum(per_worker), cut.num_workers,
                      cut.num_clones, cut.accumulation_steps, atom_rows,
                      tuple(pieces))
  if cut.even and not layout.is_even():
    raise errors.ConfigError(
        f'sync_batch_norm=True runs equal clones in lockstep, and a batch of '
        f'{worker_rows} rows does not split evenly over num_clones='
        f'{cut.num_clones}; give every batch a multiple of {cut.num_clones} '
        'rows.')
  return layout


def _penalty(worker, step, clone, microbatch, cut):
  """A piece's part of the weight penalties: each worker's first piece
  carries 1 / num_workers (every worker's gradients are alike in size);
  with atoms, the job's first atom all of it (worker 0's)."""
  if step or clone or microbatch:
    return 0.0
  if cut.atom_rows:
    return float(worker == 0)
  return 1.0 / cut.num_workers


def _accumulation_rows(rows, steps, atom_rows, partial):
  """The rows of each accumulation step of a worker's batch."""
  if rows % steps and not partial:
    raise errors.ConfigError(
        f'a batch of {rows} rows does not split into accumulation_steps='
        f'{steps} equal accumulation steps; pass a multiple of {steps} rows.')
  if atom_rows and rows % (steps * atom_rows):
    raise errors.ConfigError(
        f'reproducible_rows={atom_rows}: a batch of {rows} rows on a worker '
        f'is not {steps} accumulation step(s) of whole atoms of {atom_rows} '
        f'rows; give every batch a multiple of {steps * atom_rows} rows (a '
        'last, partial batch too).')
  return split_rows(rows, [1] * steps)


def _clone_rows(rows, cut, partial):
  """Each clone's rows of an accumulation step of `rows`; with atoms,
  whole atoms a clone."""
  num_clones, atom_rows = cut.num_clones, cut.atom_rows
  shares = cut.shares or [1] * num_clones
  if atom_rows:
    sizes = [atom_rows * n for n in split_rows(rows // atom_rows, shares)]
  else:
    sizes = split_rows(rows, shares)
  empty = [i for i, (n, share) in enumerate(zip(sizes, shares))
           if share and not n]  # A share of 0: a clone that takes no rows.
  if not partial and empty:
    raise errors.ConfigError(
        f'a batch of {rows} rows leaves clone {empty[0]} of {num_clones} '
        f'no rows (clone_shares={",".join(map(str, shares))}); raise the '
        'batch size or that clone\'s share.')
  return sizes


def _microbatch_rows(rows, cut, clone, partial):
  """The rows of each of a clone's pieces: its micro-batches (with
  stages), else its atoms, else the whole shard."""
  count, atom_rows = cut.num_microbatches, cut.atom_rows
  staged_atoms = cut.staged and atom_rows
  if atom_rows and not staged_atoms:
    return [atom_rows] * (rows // atom_rows) or [0]
  sizes = split_rows(rows, [1] * count)
  if staged_atoms and rows and set(sizes) != {atom_rows}:
    raise errors.ConfigError(
        f'reproducible_rows={atom_rows}: each micro-batch through the stages '
        f'must be one atom, and clone {clone} cuts its {rows} rows into '
        f'{count} micro-batches; use num_microbatches={rows // atom_rows}.')
  if rows and not all(sizes):
    if not partial:
      raise errors.ConfigError(
          f'num_microbatches={count} is more than the {rows} rows of clone '
          f'{clone}; use at most {rows} (or a larger batch).')
    sizes = [size for size in sizes if size]  # A short last batch.
  return sizes or [0]


def check_share_count(shares, num_shards, shard_word='num_clones'):
  """Raises `ConfigError` unless `shares` (numbers, if given) has one share
  per shard."""
  if shares is None or len(shares) == num_shards:
    return
  raise errors.ConfigError(
      f'clone_shares={",".join(map(str, shares))}: give one share per clone '
      f'({shard_word}={num_shards}), e.g. {",".join(["1"] * num_shards)}.')


def check_worker_split(rows, num_workers, made_by=''):
  """Raises `ConfigError` unless a batch of `rows` splits evenly over
  `num_workers` workers; `made_by` says where the batch came from."""
  if rows % num_workers:
    raise errors.ConfigError(
        f'a batch of {rows} rows{made_by} does not split over {num_workers} '
        f'workers; give every batch (the last one too) a multiple of '
        f'{num_workers} rows.')


def even_parts(rows, parts):
  """`rows` cut into `parts` parts that differ by a row at most (the longer
  first): how inference and evaluation split a batch, which any batch
  may be, over clones or workers."""
  return split_rows(rows, [1] * parts)


def worker_parts(global_rows, num_workers, unit=1):
  """Each worker's rows of a global batch of `global_rows` rows that does
  not split evenly: whole units of `unit` rows (a worker's accumulation
  steps of whole atoms: K x `reproducible_rows`), as evenly as they go,
  the longer parts first (48 rows in units of 4 on 5 workers: 12, 12, 8,
  8, 8). Raises `ConfigError` for a batch that is not whole units, or
  that leaves a worker none.
  """
  if global_rows % unit or global_rows < unit * num_workers:
    raise errors.ConfigError(
        f'a global batch of {global_rows} rows is not {num_workers} or more '
        f'whole parts of {unit} rows (accumulation steps x '
        'reproducible_rows), one a worker at least; use fewer workers.')
  return tuple(unit * n for n in even_parts(global_rows // unit,
                                            num_workers))


def worker_span(rows, worker, num_workers, parts=None):
  """(first row, rows) of worker `worker`'s part of a global batch of
  `rows`: the one cut of a worker's rows, for tensors (`rows.worker_part`)
  and datasets (`rows.worker_shards`) alike. `parts`: every worker's rows,
  where they differ (`worker_parts`), in worker order; else the worker-th
  of `num_workers` equal, consecutive parts. `rows` may be a tensor (a
  dataset's batch, read as it comes); a Python int is checked: raises
  `ConfigError` for rows that do not split so."""
  if parts:
    if isinstance(rows, int) and rows != sum(parts):
      raise errors.ConfigError(
          f'a batch of {rows} rows cut into worker parts {tuple(parts)} of '
          f'{sum(parts)} rows; give every global batch {sum(parts)} rows.')
    return sum(parts[:worker]), parts[worker]
  if isinstance(rows, int):
    check_worker_split(rows, num_workers)
  part = rows // num_workers
  return worker * part, part


def worker_shard(rows, worker, num_workers, shards_per_worker, k,
                 parts=None):
  """(first row, rows) of shard k of worker `worker`'s part of a global
  batch of `rows` (`worker_span`'s, with `parts`), cut into
  `shards_per_worker` equal shards. Plain arithmetic: `rows` and `k` may
  be tensors (a dataset's batch, read as it comes)."""
  first, count = worker_span(rows, worker, num_workers, parts)
  size = count // shards_per_worker
  return first + k * size, size


def accumulation_step_rows(worker_rows, cut):
  """Rows of one accumulation step of a worker's batch of `worker_rows`
  (what the balancer splits by shares)."""
  return worker_rows // cut.accumulation_steps


def clone_probe_rows(worker_rows, cut):
  """Rows a clone is timed on alone (`deploy.balance`): an equal share of
  one accumulation step of a worker's batch of `worker_rows`."""
  return accumulation_step_rows(worker_rows, cut) // cut.num_clones


def replica_terms(replica, num_replicas, global_rows, piece, first):
  """(first row, penalty weight) of a tf.distribute replica's piece: its
  rows come after every row the replicas before it could hold (at most
  `global_rows` each; `replica` may be a tensor, and so may the offset),
  so no two replicas fold their random layers alike; each replica's
  `first` accumulation step carries 1 / replicas of the weight penalties
  (they count once over the job)."""
  return (replica * global_rows + piece.offset,
          1.0 / num_replicas if first else 0)


def fit_batches(rows, batch_size, validation_split=0.0):
  """(rows trained, the full batch's rows, the last batch's rows) of `fit`
  on `rows` rows of arrays, as Keras cuts them (`validation_split` set
  aside first); the last is 0 where the batches come out even."""
  rows = int(rows * (1.0 - validation_split))
  return rows, min(batch_size, rows), rows % batch_size
