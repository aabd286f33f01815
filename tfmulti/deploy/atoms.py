"""Reproducible rows: a step whose bits do not depend on its layout.

With `StepOptions.reproducible_rows` a, a step's global batch is cut into
atoms of a rows in row order (atom i holds rows [i * a, (i + 1) * a)),
whatever the workers, clones, shares, stages, micro-batches or
accumulation steps. Each atom's forward and backward pass runs alone, with
the same shapes and kernels wherever it runs. Its gradients, loss and
BatchNorm statistics are kept apart (stacked in atom order, gathered from
every worker) and summed at the step's end, on the optimizer device, by
one left fold over the atom indices:

    g = (...((g_0 + g_1) + g_2) + ...) + g_{A-1}

The same additions in the same order, whatever the layout, so the update
is the same bit for bit. The price: each atom is a small batch of its own,
and the atoms' gradients are held until the step's end (A copies of the
gradients, instead of one running sum).

BatchNorm normalises each atom by its own statistics (ghost BatchNorm with
groups of a rows); the moving statistics become the mean of the atoms'
updates (the same fold, divided by A). The regularization losses count
once, in atom 0's pass.

What is guaranteed: the same weights after the same steps for any layout
of the same global batch and a, on devices of one type, with one
TensorFlow build (and its thread count). Not guaranteed: equality with a
step without atoms (the atoms' sum rounds differently from one batch's
sum, and ghost BatchNorm is another model), across device types, or across
TensorFlow builds.
"""

import tensorflow as tf

from tfmulti import errors


def check_devices(config):
  """Raises `UnsupportedError` if `config`'s clones and stages run on more
  than one device type (their kernels would round differently)."""
  kinds = sorted({tf.DeviceSpec.from_string(device).device_type
                  for device in config.compute_devices()})
  if len(kinds) > 1:
    raise errors.UnsupportedError(
        f'reproducible_rows: the clones and stages run on {" and ".join(kinds)}'
        ' devices, whose kernels round differently; place them all on one '
        'device type.')


def check_rows(a, step_rows, shard_sizes, microbatch_rows=None):
  """Raises `ConfigError` unless every clone's shard of an accumulation
  step of `step_rows` rows (`shard_sizes`) is whole atoms of `a` rows, and
  each micro-batch (`microbatch_rows(shard)`, with stages) is one atom."""
  if step_rows % a:
    raise errors.ConfigError(
        f'reproducible_rows={a}: a batch of {step_rows} rows (of an '
        f'accumulation step, on a worker) is not whole atoms of {a} rows; '
        f'pass a multiple of {a} rows (batch with drop_remainder=True).')
  for clone, size in enumerate(shard_sizes):
    if size % a:
      raise errors.ConfigError(
          f'reproducible_rows={a}: clone {clone} gets {size} rows, not whole '
          f'atoms of {a}; choose clone_shares (or a batch) that give each '
          f'clone a multiple of {a} rows.')
    if microbatch_rows is not None and set(microbatch_rows(size)) != {a}:
      raise errors.ConfigError(
          f'reproducible_rows={a}: each micro-batch through the stages must '
          f'be one atom, and clone {clone} cuts its {size} rows into '
          f'{microbatch_rows(size)}; use num_microbatches={size // a}.')


def per_atom(clone_fn, a):
  """`clone_fn` (as `clones.clone_step`, on one clone's shard) run on each
  atom of `a` rows alone.

  The returned function takes `clone_fn`'s arguments and returns (outputs
  in row order, the atoms' losses stacked, atom 0's regularization, each
  gradient stacked over the atoms (None where no atom reaches it), one set
  of new non-trainable values an atom). The regularization weight goes to
  the shard's first atom only.
  """
  def run(trainable, non_trainable, images, labels, regularization_weight,
          loss_scale):
    count = images.shape[0] // a
    results = []
    for k, (x, y) in enumerate(zip(tf.split(images, count),
                                   tf.split(labels, count))):
      with tf.name_scope(f'atom_{k}'):
        weight = regularization_weight if k == 0 else 0.0
        results.append(clone_fn(trainable, non_trainable, x, y, weight,
                                loss_scale))
    outputs, losses, regularizations, gradients, states = zip(*results)
    return (tf.concat(outputs, axis=0), tf.stack(losses), regularizations[0],
            stack(gradients), [state for (state,) in states])
  return run


def stack(per_atom_gradients):
  """Per variable, its gradients over the atoms stacked (atom first); None
  where every atom's gradient is None."""
  return [None if parts[0] is None else tf.stack(parts)
          for parts in zip(*per_atom_gradients)]


def gather(tensors):
  """Every worker's atoms of `tensors` (atom first), in worker order: the
  job's atoms in row order. Call it in the worker's replica context."""
  return tf.distribute.get_replica_context().all_gather(tensors, axis=0)


def fold(stacked):
  """Each tensor's sum over its first axis, by a left fold in atom order.

  The fold is a `tf.while_loop`: Grappler's arithmetic optimizer rewrites
  a chain of additions in one graph (into an `AddN`, its inputs in an order
  of its own, which depends on the graph around it), but not additions
  made in separate iterations of a loop.
  """
  return [tf.foldl(lambda total, part: total + part, tensor)
          for tensor in stacked]


def mean_state(stacked):
  """The atoms' new non-trainable values (atom first) combined: floating
  ones (BatchNorm's moving statistics) the mean by the fold, the others
  (counters, generator states) atom 0's."""
  return [fold([values])[0] / tf.cast(tf.shape(values)[0], values.dtype)
          if values.dtype.is_floating else values[0] for values in stacked]
