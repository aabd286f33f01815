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

An empty piece (a short last batch, fewer rows than clones) is part of the
layout and runs nothing: it adds exactly 0 to every sum.

A batch may come already cut into the clones' shards by its layout
(`Shards`, `StepLayout.clone_spans`: the input feed prefetches each to
its clone's device); `accumulate` then cuts each shard on its own device.
"""

import dataclasses
import functools
from typing import Tuple

import tensorflow as tf

from tfmulti import devices
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
    """Rows of `worker`'s batch (every worker's is as long)."""
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
class Shards:
  """One nest of a step's batch (its inputs, or its targets) already cut
  into the clones' shards, as the input pipeline hands them to the step
  when it prefetches each shard to its clone's device (`deploy.feeds`).

  Attributes:
    parts: one nest a clone, in clone order: the clone's rows of every
      accumulation step, in order (`StepLayout.clone_spans`).
    layout: the `StepLayout` they were cut by; the step runs it.
  """
  parts: tuple
  layout: StepLayout


@functools.lru_cache(maxsize=None)
def step_layout(worker_rows, *, num_clones=1, shares=None,
                accumulation_steps=1, num_microbatches=1, staged=False,
                atom_rows=0, num_workers=1, partial=False, devices=None,
                even=False):
  """The `StepLayout` of a step whose workers each bring `worker_rows`.

  Args:
    worker_rows: rows of each worker's batch (the global batch, on one
      worker).
    num_clones: clones (or replicas) a worker.
    shares: each clone's share of an accumulation step's rows; None for
      equal shares.
    accumulation_steps: K accumulation steps a batch.
    num_microbatches: micro-batches a clone's shard is cut into.
    staged: the clones run stages (with atoms, each micro-batch must then
      be one atom).
    atom_rows: `reproducible_rows` (0: off).
    num_workers: workers in the job.
    partial: the batch is a short last one (Keras's last partial batch):
      it may leave clones or micro-batches empty, and accumulation steps
      unequal, as plain `fit` trains it; a full batch must split fully.
    devices: each clone's device (a tuple, as
      `DeploymentConfig.clone_devices()` gives them), for the pieces.
    even: every clone must take as many rows (lockstep clones, whose
      synchronized BatchNorm all-reduces between equal shards).

  Returns:
    The `StepLayout`; the same object for the same arguments, so a
    `tf.function` that takes it traces once a layout.

  Raises:
    errors.ConfigError: a batch this cut cannot split (each rule once).
  """
  errors.check_count('rows of a batch', worker_rows, 1)
  check_share_count(shares, num_clones)
  steps = _accumulation_rows(worker_rows, accumulation_steps,
                             atom_rows, partial)
  pieces, atom = [], 0
  for worker in range(num_workers):
    offset, atom = worker * worker_rows, worker * worker_rows // max(
        atom_rows, 1)
    for k, step_rows in enumerate(steps):
      for clone, rows in enumerate(_clone_rows(step_rows, num_clones, shares,
                                               atom_rows, partial)):
        parts = _microbatch_rows(rows, num_microbatches, staged and atom_rows,
                                 atom_rows, clone, partial)
        for m, part in enumerate(parts):
          penalty = _penalty(worker, k, clone, m, num_workers, atom_rows)
          pieces.append(Piece(worker, k, clone, m,
                              atom if atom_rows else -1, offset, part,
                              penalty, devices[clone] if devices else ''))
          offset += part
          atom += 1 if atom_rows else 0
  layout = StepLayout(worker_rows * num_workers, num_workers, num_clones,
                      accumulation_steps, atom_rows, tuple(pieces))
  if even and not layout.is_even():
    raise errors.ConfigError(
        f'sync_batch_norm=True runs equal clones in lockstep, and a batch of '
        f'{worker_rows} rows does not split evenly over num_clones='
        f'{num_clones}; give every batch a multiple of {num_clones} rows.')
  return layout


def _penalty(worker, step, clone, microbatch, num_workers, atom_rows):
  """A piece's part of the weight penalties: each worker's first piece
  carries 1 / num_workers (every worker's gradients are alike in size);
  with atoms, the job's first atom all of it (worker 0's)."""
  if step or clone or microbatch:
    return 0.0
  if atom_rows:
    return float(worker == 0)
  return 1.0 / num_workers


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
        f'rows; give every batch a multiple of {steps * atom_rows} rows (for '
        f'numpy input, a multiple of {steps * atom_rows} rows in all).')
  return split_rows(rows, [1] * steps)


def _clone_rows(rows, num_clones, shares, atom_rows, partial):
  """Each clone's rows of an accumulation step of `rows`; with atoms,
  whole atoms a clone."""
  if atom_rows:
    sizes = [atom_rows * n for n in
             split_rows(rows // atom_rows, shares or [1] * num_clones)]
  else:
    sizes = split_rows(rows, shares or [1] * num_clones)
  if not partial and not all(sizes):
    raise errors.ConfigError(
        f'a batch of {rows} rows leaves clone {sizes.index(0)} of '
        f'{num_clones} no rows (clone_shares='
        f'{",".join(map(str, shares or [1] * num_clones))}); raise the '
        'batch size or that clone\'s share.')
  return sizes


def _microbatch_rows(rows, count, staged_atoms, atom_rows, clone, partial):
  """The rows of each of a clone's pieces: its micro-batches (with
  stages), else its atoms, else the whole shard."""
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


def batch_rows(images, labels):
  """Rows of a batch of (possibly nested) `images` and `labels`, known when
  the step is traced; raises `ConfigError` unless every tensor of both has
  as many."""
  counts = {tensor.shape[0] for tensor in tf.nest.flatten((images, labels))
            if tensor is not None}
  if len(counts) != 1 or None in counts:
    raise errors.ConfigError(
        f'a batch whose inputs and targets have {sorted(counts, key=str)} '
        'rows; pass inputs and targets with as many rows each, of a known '
        'batch size.')
  return counts.pop()


def check_worker_split(rows, num_workers, made_by=''):
  """Raises `ConfigError` unless a batch of `rows` splits evenly over
  `num_workers` workers; `made_by` says where the batch came from."""
  if rows % num_workers:
    raise errors.ConfigError(
        f'a batch of {rows} rows{made_by} does not split over {num_workers} '
        f'workers; give every batch (the last one too) a multiple of '
        f'{num_workers} rows.')


def worker_part(tensors, *, worker, num_workers):
  """Worker `worker`'s rows of a global batch (a nest of tensors, rows
  known): the worker-th of `num_workers` equal, consecutive parts, as
  `worker_shards` cuts a dataset's.

  Raises:
    errors.ConfigError: a batch whose rows do not split evenly.
  """
  total = batch_rows(tensors, None)
  check_worker_split(total, num_workers)
  part = total // num_workers
  return _rows_from(tensors, worker * part, part)


def evaluation_part(tensors, *, worker, num_workers):
  """Worker `worker`'s rows of an evaluation batch (a nest, rows known)
  and their share of the batch: the worker-th of `num_workers` parts that
  differ by one row at most (evaluation updates nothing, so any batch
  splits); a batch of fewer rows than workers is every worker's whole.

  Returns:
    (its rows as `tensors`' nest, its rows / the batch's rows).
  """
  total = batch_rows(tensors, None)
  sizes = split_rows(total, [1] * num_workers)
  if not min(sizes):
    return tensors, 1.0
  return (_rows_from(tensors, sum(sizes[:worker]), sizes[worker]),
          sizes[worker] / total)


def _rows_from(tensors, first, count):
  """`count` rows of the nest `tensors` from row `first` (None stays)."""
  return tf.nest.map_structure(
      lambda t: t if t is None else t[first:first + count], tensors)


def worker_shards(dataset, *, worker, num_workers, shards_per_worker):
  """Worker `worker`'s rows of each global batch, one dataset element a
  shard.

  A global batch of B rows is cut into num_workers * shards_per_worker
  equal shards; the worker gets shards [worker * shards_per_worker,
  (worker + 1) * shards_per_worker). Every worker reads the same pipeline
  (same seed), so a step of the whole job sees exactly the global batch one
  process would, split as one process's clones would split it.
  """
  def shards(images, labels):
    rows = tf.shape(labels)[0] // (num_workers * shards_per_worker)
    first = worker * shards_per_worker * rows

    def shard(k):
      start = first + tf.cast(k, tf.int32) * rows
      return images[start:start + rows], labels[start:start + rows]
    return tf.data.Dataset.range(shards_per_worker).map(shard)
  return dataset.flat_map(shards)


def split(tensors, sizes):
  """Each tensor of the nest `tensors` split by rows into `sizes` parts:
  a list of nests, one a part."""
  parts = [tf.split(t, sizes) for t in tf.nest.flatten(tensors)]
  return [tf.nest.pack_sequence_as(tensors, list(column))
          for column in zip(*parts)] if parts else [tensors] * len(sizes)


def accumulate(step, images, labels, layout, *, worker=0, device=None,
               gradient_devices=None, by_clone=False):
  """Gradient accumulation: the layout's accumulation steps, summed.

  Accumulation step k holds the consecutive rows the layout gives it.
  Equal steps run step 0 first and the others in a `tf.while_loop`, so only
  one accumulation step's activations live at a time; unequal ones (a
  short last batch) are traced one by one. Their gradients and scalars are
  summed on `device`, and their outputs (if any) concatenated in row order.

  Args:
    step: `step(images, labels, k, shift)` -> (gradients, scalars,
      outputs): a list of gradients (None where a variable is not reached),
      a list of scalar tensors and a list of row-major tensors (may be
      empty). It runs the pieces of the layout's accumulation step `k` (a
      Python int), their offsets moved by `shift` rows (0, or a tensor in
      the loop, which runs step 1's pieces again).
    images, labels: nests of the batch of all accumulation steps; with
      `by_clone`, tuples of the clones' shards (`Shards.parts`), each cut
      into its accumulation steps on its clone's device, and `step` gets
      tuples of the clones' rows of step k.
    layout: the step's `StepLayout`.
    worker: this worker's index in it.
    device: where the sums live.
    gradient_devices: where each gradient's sum lives (a list, one device
      a variable); None for `device`.
    by_clone: `images` and `labels` come as the clones' shards.

  Returns:
    (summed gradients, summed scalars, concatenated outputs).
  """
  steps = layout.accumulation_steps
  if steps == 1:
    return step(images, labels, 0, 0)
  if not layout.equal_steps(worker):
    parts = [_step_parts(nest, layout, worker, by_clone)
             for nest in (images, labels)]
    results = [step(x, y, k, 0) for k, (x, y) in enumerate(zip(*parts))]
    with tf.device(device), tf.name_scope('accumulate'):
      return _summed(results, gradient_devices)
  rows = layout.step_rows(worker, 0)
  images, labels = [_stacked_steps(nest, layout, worker, device, by_clone)
                    for nest in (images, labels)]

  def part(nest, k):
    if not by_clone:
      return tf.nest.map_structure(lambda t: t[k], nest)
    return tuple(  # Each clone's rows of step k, read on its device.
        devices.on(layout.clone_device(worker, c) or None,
                   tf.nest.map_structure, lambda t: t[k], shard)
        for c, shard in enumerate(nest))
  gradients, scalars, outputs = step(part(images, 0), part(labels, 0), 0, 0)
  reached = [g is not None for g in gradients]
  places = [d for d, r in zip(gradient_devices or [device] * len(reached),
                              reached) if r]
  arrays = [tf.TensorArray(out.dtype, size=steps, element_shape=out.shape)
            .write(0, out) for out in outputs]

  def body(k, sums, totals, arrays):
    grads, values, outs = step(part(images, k), part(labels, k), 1,
                               (k - 1) * rows)
    with tf.device(device), tf.name_scope('accumulate'):
      grads = [g for g, r in zip(grads, reached) if r]
      sums = [devices.on(place, tf.add, a, g)
              for a, g, place in zip(sums, grads, places)]
      return (k + 1, sums,
              [a + v for a, v in zip(totals, values)],
              [array.write(k, out) for array, out in zip(arrays, outs)])
  _, sums, scalars, arrays = tf.while_loop(
      lambda k, *_: k < steps, body,
      (tf.constant(1), [g for g in gradients if g is not None], scalars,
       arrays))
  sums = iter(sums)
  return ([next(sums) if r else None for r in reached], scalars,
          [array.concat() for array in arrays])


def _step_parts(nest, layout, worker, by_clone):
  """Each accumulation step's rows of `nest` (a list, one a step); with
  `by_clone`, each clone's shard cut on its own device."""
  steps = range(layout.accumulation_steps)
  if not by_clone:
    return split(nest, [layout.step_rows(worker, k) for k in steps])
  per_clone = [devices.on(
      layout.clone_device(worker, c) or None, split, shard,
      [layout.rows_of(worker=worker, accumulation_step=k, clone=c)
       for k in steps]) for c, shard in enumerate(nest)]
  return [tuple(parts[k] for parts in per_clone) for k in steps]


def _stacked_steps(nest, layout, worker, device, by_clone):
  """`nest` with its rows as [accumulation step, row]: on `device`, or,
  `by_clone`, each clone's shard on its own device."""
  steps = layout.accumulation_steps

  def stacked(tensors, rows):
    return tf.nest.map_structure(
        lambda t: tf.reshape(t, [steps, rows, *t.shape[1:]]), tensors)
  if not by_clone:
    with tf.device(device), tf.name_scope('accumulate'):
      return stacked(nest, layout.step_rows(worker, 0))
  return tuple(devices.on(
      layout.clone_device(worker, c) or None, stacked, shard,
      layout.rows_of(worker=worker, accumulation_step=0, clone=c))
               for c, shard in enumerate(nest))


def _summed(results, gradient_devices=None):
  """(gradients, scalars, outputs) of several accumulation steps, summed
  (gradients None where no step reaches a variable; each on its device in
  `gradient_devices`) and concatenated."""
  gradients = []
  all_grads = list(zip(*(grads for grads, _, _ in results)))
  for parts, place in zip(all_grads,
                          gradient_devices or [None] * len(all_grads)):
    parts = [g for g in parts if g is not None]
    gradients.append(devices.on(place, tf.add_n, parts) if parts else None)
  scalars = [tf.add_n(list(values))
             for values in zip(*(values for _, values, _ in results))]
  outputs = [tf.concat(list(outs), axis=0)
             for outs in zip(*(outs for _, _, outs in results))]
  return gradients, scalars, outputs
