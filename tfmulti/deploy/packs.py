"""Packs: one cross-device transfer per (clone, owner) instead of one per
variable.

With `StepOptions.gradient_packs`, each clone flattens and concatenates the
gradients bound for one owner device (`DeploymentConfig.owner_device`: the
variables device, or each variable's own when spread) into one tensor, on
the device that computed them; the owner sums the clones' packs as single
tensors and splits the sum back into gradients. The clones' reads of an
owner's variables are packed the same way: concatenated once on the owner,
split on each clone. tf_cnn_benchmarks' `--gradient_repacking` did this for
its all-reduce. Concatenating and splitting move bits without arithmetic,
and a sum is elementwise: with `reproducible_rows`, whose fold fixes the
order of every sum, the weights are the same bits as unpacked; without it
Grappler may reorder an `AddN` of several clones, packed or not, so they
are equal to rounding.

A pack holds variables of one owner and one dtype, in variable order:
'auto' makes one pack an owner and dtype; a count k cuts each of those
into k packs of near-equal bytes (whole variables), so the first pack's
sum can start while the last is still on its way.
"""

import math

import tensorflow as tf

from tfmulti import devices
from tfmulti import slices
from tfmulti import step_options


def groups(variables, owners, packs, apart=()):
  """The packs, as tuples of indices into `variables`.

  Args:
    variables: the trainable variables.
    owners: each variable's owner device.
    packs: `StepOptions.gradient_packs`: 0 (none), 'auto' or a count.
    apart: indices left out of every pack (a looked-up table's shards,
      which no clone reads whole).

  Returns:
    A tuple of index tuples; empty for `packs=0`.
  """
  if not packs:
    return ()
  by_owner = {}
  for index, (variable, owner) in enumerate(zip(variables, owners)):
    if index in apart:
      continue
    by_owner.setdefault((owner, tf.as_dtype(variable.dtype)), []).append(
        index)
  count = 1 if packs == step_options.AUTO else packs
  found = []
  for indices in by_owner.values():
    sizes = [devices.variable_bytes(variables[i]) for i in indices]
    found.extend(_cut(indices, sizes, count))
  return tuple(found)


def _cut(indices, sizes, count):
  """`indices` in at most `count` consecutive runs of near-equal bytes."""
  count = min(count, len(indices))
  total, runs, run, held = sum(sizes), [], [], 0
  for index, size in zip(indices, sizes):
    run.append(index)
    held += size
    if len(runs) < count - 1 and held >= total * (len(runs) + 1) / count:
      runs.append(tuple(run))
      run = []
  if run:
    runs.append(tuple(run))
  return runs


def pack(tensors, leading=0):
  """`tensors` flattened past their first `leading` axes and concatenated
  (along axis `leading`) into one tensor."""
  return tf.concat([tf.reshape(t, [*t.shape[:leading], -1])
                    for t in tensors], axis=leading)


def unpack(packed, shapes, leading=0):
  """The tensors `pack` joined, given their `shapes` (past the leading
  axes)."""
  parts = tf.split(packed, [math.prod(shape) for shape in shapes],
                   axis=leading)
  return [tf.reshape(part, [*packed.shape[:leading], *shape])
          for part, shape in zip(parts, shapes)]


def sum_packed(gradients_by_clone, group, owner, leading=0):
  """The clones' gradients of the variables in `group` packed where each
  clone computed them, summed (or, with `leading`, concatenated along
  axis 0: stacked atoms) on `owner` as one tensor, and split there; None
  when some clone has no gradient for one of them or computes them on
  several devices (then they go unpacked). `tf.IndexedSlices` travel
  beside the pack, joined on `owner` (`slices.add`)."""
  if any(g is None for gradients in gradients_by_clone for g in
         (gradients[k] for k in group)):
    return None
  sparse = [k for k in group if slices.is_sparse(gradients_by_clone[0][k])]
  dense = [k for k in group if k not in sparse]
  if any(len({gradients[k].device for k in dense}) > 1
         for gradients in gradients_by_clone):
    return None
  joined = {k: devices.on(owner, slices.add,
                          [gradients[k] for gradients in gradients_by_clone])
            for k in sparse}
  if dense:
    packed = []
    for gradients in gradients_by_clone:
      parts = [gradients[k] for k in dense]
      with tf.device(parts[0].device), tf.name_scope('pack_gradients'):
        packed.append(pack(parts, leading))
    shapes = [gradients_by_clone[0][k].shape[leading:] for k in dense]
    with tf.device(owner), tf.name_scope('sum_gradients'):
      total = (tf.add_n(packed) if not leading
               else tf.concat(packed, axis=0))
      joined.update(zip(dense, unpack(total, shapes, leading)))
  return [joined[k] for k in group]


def read_packed(variables, group, owner):
  """The values of the variables in `group`, packed on `owner` (call
  `unpack` on the reading device)."""
  with tf.device(owner), tf.name_scope('pack_variables'):
    return pack([tf.convert_to_tensor(variables[k]) for k in group])
