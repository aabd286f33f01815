"""The TensorFlow helpers that apply a step's layout to tensors.

`layouts.StepLayout` says where a step's rows go, in integers; these cut
real batches by it: a batch's rows (`batch_rows`), a worker's part
(`worker_part`, `evaluation_part`, `worker_shards`), the split over
clones (`split`) and the accumulation steps summed (`accumulate`).

A batch may come already cut into the clones' shards by its layout
(`Shards`, `StepLayout.clone_spans`: the input feed prefetches each to
its clone's device); `accumulate` then cuts each shard on its own device.
"""

import dataclasses

import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import layouts
from tfmulti import slices


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
  layout: layouts.StepLayout


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


def worker_part(tensors, *, worker, num_workers, parts=None):
  """Worker `worker`'s rows of a global batch (a nest of tensors, rows
  known), cut as `layouts.worker_span` cuts every worker's rows: its
  part of `parts` where the parts differ, else the worker-th of
  `num_workers` equal, consecutive parts.

  Raises:
    errors.ConfigError: a batch whose rows do not split so.
  """
  first, count = layouts.worker_span(batch_rows(tensors, None), worker,
                                     num_workers, parts)
  return _rows_from(tensors, first, count)


def evaluation_part(tensors, *, worker, num_workers):
  """Worker `worker`'s rows of an evaluation batch (a nest, rows known)
  and their share of the batch: the worker-th of `num_workers` parts that
  differ by one row at most (evaluation updates nothing, so any batch
  splits); a batch of fewer rows than workers is every worker's whole.

  Returns:
    (its rows as `tensors`' nest, its rows / the batch's rows).
  """
  total = batch_rows(tensors, None)
  sizes = layouts.even_parts(total, num_workers)
  if not min(sizes):
    return tensors, 1.0
  return (_rows_from(tensors, sum(sizes[:worker]), sizes[worker]),
          sizes[worker] / total)


def _rows_from(tensors, first, count):
  """`count` rows of the nest `tensors` from row `first` (None stays)."""
  return tf.nest.map_structure(
      lambda t: t if t is None else t[first:first + count], tensors)


def worker_shards(dataset, *, worker, num_workers, shards_per_worker,
                  parts=None):
  """Worker `worker`'s rows of each global batch, one dataset element a
  shard.

  The worker's rows are its part of the global batch as
  `layouts.worker_span` cuts it (its part of `parts`, where the workers'
  parts differ; else an equal one), cut into `shards_per_worker` equal
  shards (`layouts.worker_shard`). Every worker reads the same pipeline
  (same seed), so a step of the whole job sees exactly the global batch
  one process would, split as one process's clones would split it.
  """
  def shards(images, labels):
    def shard(k):
      start, size = layouts.worker_shard(
          tf.shape(labels)[0], worker, num_workers, shards_per_worker,
          tf.cast(k, tf.int32), parts)
      return images[start:start + size], labels[start:start + size]
    return tf.data.Dataset.range(shards_per_worker).map(shard)
  return dataset.flat_map(shards)


def split(tensors, sizes):
  """Each tensor of the nest `tensors` split by rows into `sizes` parts:
  a list of nests, one a part (a None leaf, Keras's missing part, None in
  each)."""
  parts = [[None] * len(sizes) if t is None else tf.split(t, sizes)
           for t in tf.nest.flatten(tensors)]
  return [tf.nest.pack_sequence_as(tensors, list(column))
          for column in zip(*parts)] if parts else [tensors] * len(sizes)


def accumulate(step, images, labels, layout, *, worker=0, device=None,
               gradient_devices=None):
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
      the loop, which runs step 1's pieces again); `images` and `labels`
      are tuples of the clones' rows of step k.
    images, labels: tuples of the clones' shards (`Shards.parts`), each
      cut into its accumulation steps on its clone's device.
    layout: the step's `layouts.StepLayout`.
    worker: this worker's index in it.
    device: where the sums live.
    gradient_devices: where each gradient's sum lives (a list, one device
      a variable); None for `device`.

  Returns:
    (summed gradients, summed scalars, concatenated outputs).
  """
  if layout.accumulation_steps == 1:
    return step(images, labels, 0, 0)
  if not layout.equal_steps(worker):
    parts = [_step_parts(nest, layout, worker) for nest in (images, labels)]
    results = [step(x, y, k, 0) for k, (x, y) in enumerate(zip(*parts))]
    with tf.device(device), tf.name_scope('accumulate'):
      return _summed(results, gradient_devices)
  images, labels = [_stacked_steps(nest, layout, worker)
                    for nest in (images, labels)]

  def run(k, cut_as, shift):
    """Step `cut_as`'s pieces on each clone's rows of step k (a tensor
    in the loop), read on its device."""
    return step(*(tuple(
        devices.on(layout.clone_device(worker, c) or None,
                   tf.nest.map_structure, lambda t: t[k], shard)
        for c, shard in enumerate(nest)) for nest in (images, labels)),
                cut_as, shift)
  return _loop(run, layout.accumulation_steps,
               layout.step_rows(worker, 0), device, gradient_devices)


def _loop(run, steps, rows, device, gradient_devices):
  """Accumulation step 0 by `run(0, 0, 0)`, then steps 1.. in a
  `tf.while_loop`, each cut as step 1 with its offsets moved by
  (k - 1) * rows, summed on `device` (each gradient on its place in
  `gradient_devices`); `tf.IndexedSlices` gradients joined in step order
  (`slices`), as the outputs are."""
  gradients, scalars, outputs = run(0, 0, 0)
  reached = [g is not None for g in gradients]
  places = [d for d, r in zip(gradient_devices or [device] * len(reached),
                              reached) if r]
  sums = [g for g in gradients if g is not None]
  sparse = [slices.is_sparse(g) for g in sums]
  joined = _Joined(steps, outputs + [g for g in sums if slices.is_sparse(g)])

  def body(k, sums, totals, arrays):
    grads, values, outs = run(k, 1, (k - 1) * rows)
    with tf.device(device), tf.name_scope('accumulate'):
      grads = [g for g, r in zip(grads, reached) if r]
      sums = [a if s else devices.on(place, tf.add, a, g)
              for a, g, s, place in zip(sums, grads, sparse, places)]
      return (k + 1, sums,
              [a + v for a, v in zip(totals, values)],
              joined.write(arrays, k, outs + [g for g, s in zip(grads, sparse)
                                              if s]))
  _, sums, scalars, arrays = tf.while_loop(
      lambda k, *_: k < steps, body,
      (tf.constant(1), [tf.zeros([]) if s else g
                        for g, s in zip(sums, sparse)], scalars,
       joined.arrays),
      maximum_iterations=steps - 1)  # Its count, for a reader of the graph.
  outputs = joined.read(arrays)
  found = iter(outputs[len(outputs) - sum(sparse):])
  outputs = outputs[:len(outputs) - sum(sparse)]
  sums = iter([next(found) if s else g for g, s in zip(sums, sparse)])
  return ([next(sums) if r else None for r in reached], scalars, outputs)


class _Joined:
  """Row-major tensors (or `tf.IndexedSlices`) of each accumulation step,
  kept in `tf.TensorArray`s through the loop and joined in step order."""

  def __init__(self, steps, firsts):
    self.firsts = firsts
    self.arrays = [tf.TensorArray(t.dtype, size=steps, element_shape=t.shape)
                   .write(0, t) for t in slices.components(firsts)]

  def write(self, arrays, k, tensors):
    return [array.write(k, part)
            for array, part in zip(arrays, slices.components(tensors))]

  def read(self, arrays):
    """The tensors of every step joined, in row order."""
    return slices.from_components(self.firsts,
                                  [array.concat() for array in arrays])


def _step_parts(nest, layout, worker):
  """Each accumulation step's rows of `nest` (a list, one a step), each
  clone's shard cut on its own device."""
  steps = range(layout.accumulation_steps)
  per_clone = [devices.on(
      layout.clone_device(worker, c) or None, split, shard,
      [layout.rows_of(worker=worker, accumulation_step=k, clone=c)
       for k in steps]) for c, shard in enumerate(nest)]
  return [tuple(parts[k] for parts in per_clone) for k in steps]


def _stacked_steps(nest, layout, worker):
  """`nest`, the clones' shards, with each one's rows as [accumulation
  step, row], on its clone's device."""
  steps = layout.accumulation_steps

  def stacked(tensors, rows):
    return tf.nest.map_structure(
        lambda t: tf.reshape(t, [steps, rows, *t.shape[1:]]), tensors)
  return tuple(devices.on(
      layout.clone_device(worker, c) or None, stacked, shard,
      layout.rows_of(worker=worker, accumulation_step=0, clone=c))
               for c, shard in enumerate(nest))


def _summed(results, gradient_devices=None):
  """(gradients, scalars, outputs) of several accumulation steps, summed
  (gradients None where no step reaches a variable; each on its device in
  `gradient_devices`; slices joined, `slices.add`) and concatenated."""
  gradients = []
  all_grads = list(zip(*(grads for grads, _, _ in results)))
  for parts, place in zip(all_grads,
                          gradient_devices or [None] * len(all_grads)):
    parts = [g for g in parts if g is not None]
    gradients.append(devices.on(place, slices.add, parts) if parts else None)
  scalars = [tf.add_n(list(values))
             for values in zip(*(values for _, values, _ in results))]
  outputs = [slices.concat(list(outs)) if slices.is_sparse(outs[0])
             else tf.concat(list(outs), axis=0)
             for outs in zip(*(outs for _, _, outs in results))]
  return gradients, scalars, outputs
