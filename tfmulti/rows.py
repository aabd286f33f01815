"""Batch arithmetic: how a step's rows are cut, in one place.

A global batch is cut over workers (each worker's rows), over clones or
replicas (shards, equal or by `clone_shares`), over accumulation steps
(equal consecutive parts whose gradients make one update), and, inside a
pipelined clone, into micro-batches (`pipeline.stages`). Each rule that
refuses a batch is here, once, with its message.
"""

import tensorflow as tf

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


def check_share_count(shares, num_shards, shard_word='num_clones'):
  """Raises `ConfigError` unless `shares` (numbers, if given) has one share
  per shard."""
  if shares is None or len(shares) == num_shards:
    return
  raise errors.ConfigError(
      f'clone_shares={",".join(map(str, shares))}: give one share per clone '
      f'({shard_word}={num_shards}), e.g. {",".join(["1"] * num_shards)}.')


def shard_rows(rows, shares, num_shards, shard_word='num_clones'):
  """The rows of each shard of a batch of `rows`: by `shares` (largest
  remainder), or None for equal shards (the batch must split evenly).

  Raises:
    errors.ConfigError: a shard would get no rows, or equal shards would
      differ.
  """
  if shares is None:
    if rows % num_shards:
      raise errors.ConfigError(
          f'a batch of {rows} rows does not split evenly over {shard_word}='
          f'{num_shards}; pass a multiple of {num_shards} rows (batch the '
          'dataset with drop_remainder=True).')
    return None  # tf.split's even split.
  sizes = split_rows(rows, shares)
  if not all(sizes):
    raise errors.ConfigError(
        f'clone_shares={",".join(map(str, shares))} leaves clone '
        f'{sizes.index(0)} no rows of a batch of {rows}; raise its share or '
        'the batch size.')
  return tuple(sizes)


def accumulation_rows(rows, steps):
  """The rows of each of `steps` equal accumulation steps of a batch of
  `rows`; raises `ConfigError` if they cannot be equal."""
  if rows % steps:
    raise errors.ConfigError(
        f'a batch of {rows} rows does not split into accumulation_steps='
        f'{steps} equal accumulation steps; pass a multiple of {steps} rows.')
  return rows // steps


def check_batch(images, labels):
  """Raises `ConfigError` unless `images` and `labels` have as many rows,
  known when the step is traced."""
  rows, label_rows = images.shape[0], labels.shape[0]
  if rows is None or rows != label_rows:
    raise errors.ConfigError(
        f'images have {rows} rows and labels {label_rows}; pass a batch with '
        'as many labels as images.')


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


def accumulate(step, images, labels, steps, device):
  """Gradient accumulation: `steps` accumulation steps of the batch, summed.

  The batch's rows are cut into `steps` equal consecutive parts; part k is
  accumulation step k. Step 0 runs first, and the others in a
  `tf.while_loop`, so only one accumulation step's activations live at a
  time; their gradients and scalars are summed on `device`, and their
  outputs (if any) concatenated in row order.

  Args:
    step: `step(images, labels, first)` -> (gradients, scalars, outputs): a
      list of gradients (None where a variable is not reached), a list of
      scalar tensors and a list of row-major tensors (may be empty);
      `first` (a Python bool) is True for accumulation step 0, which counts
      the regularization.
    images, labels: the batch of all accumulation steps.
    steps: how many accumulation steps.
    device: where the sums live.

  Returns:
    (summed gradients, summed scalars, concatenated outputs).
  """
  if steps == 1:
    return step(images, labels, True)
  rows = images.shape[0] // steps
  with tf.device(device), tf.name_scope('accumulate'):
    images = tf.reshape(images, [steps, rows, *images.shape[1:]])
    labels = tf.reshape(labels, [steps, rows, *labels.shape[1:]])
  gradients, scalars, outputs = step(images[0], labels[0], True)
  reached = [g is not None for g in gradients]
  arrays = [tf.TensorArray(out.dtype, size=steps, element_shape=out.shape)
            .write(0, out) for out in outputs]

  def body(k, sums, totals, arrays):
    grads, values, outs = step(images[k], labels[k], False)
    with tf.device(device), tf.name_scope('accumulate'):
      grads = [g for g, r in zip(grads, reached) if r]
      return (k + 1, [a + g for a, g in zip(sums, grads)],
              [a + v for a, v in zip(totals, values)],
              [array.write(k, out) for array, out in zip(arrays, outs)])
  _, sums, scalars, arrays = tf.while_loop(
      lambda k, *_: k < steps, body,
      (tf.constant(1), [g for g in gradients if g is not None], scalars,
       arrays))
  sums = iter(sums)
  return ([next(sums) if r else None for r in reached], scalars,
          [array.concat() for array in arrays])
