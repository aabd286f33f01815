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
updates (the same fold, divided by A). The weight penalties count once, in
the job's atom 0; the model's `add_loss` terms on every atom, weighted by
its rows. Random layers fold each atom's generators with its first row in
the global batch, so its masks depend only on the step and its place.

The atoms are cut by `layouts.StepLayout`, which hands clones whole atoms (by
their shares, as the atoms go) and refuses a batch that is not whole atoms
(a short last batch included: give it a multiple of a rows).

What is guaranteed: the same weights after the same steps for any layout
of the same global batch and a, on devices of one type, with one
TensorFlow build (and its thread count). Not guaranteed: equality with a
step without atoms (the atoms' sum rounds differently from one batch's
sum, and ghost BatchNorm is another model), across device types, or across
TensorFlow builds.
"""

import tensorflow as tf

from tfmulti import errors
from tfmulti import rows
from tfmulti import slices


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


def run_whole(body, clone_pieces, variables, images, labels, terms):
  """`body` (a `pieces.Body`) on a clone's one live piece (its rows'
  `layouts.Piece`), from `variables` (trainable and non-trainable values),
  under the step's `terms`: `body`'s result with its new non-trainable
  values in a list of one."""
  (piece,) = [piece for piece in clone_pieces if piece.rows]
  *result, state = body(*variables, images, labels, piece.penalty,
                        piece.offset + terms.shift, terms)
  return (*result, [state])


def run_atoms(body, clone_pieces, variables, images, labels, terms):
  """As `run_whole`, on a clone's pieces each an atom, each alone: (outputs
  in row order, the atoms' losses stacked, the sum of their
  regularization, each gradient stacked over the atoms (None where no atom
  reaches it), one set of new non-trainable values an atom)."""
  live = [piece for piece in clone_pieces if piece.rows]
  sizes = [piece.rows for piece in live]
  results = []
  for k, (piece, x, y) in enumerate(zip(live, rows.split(images, sizes),
                                        rows.split(labels, sizes))):
    with tf.name_scope(f'atom_{k}'):
      results.append(body(*variables, x, y, piece.penalty,
                          piece.offset + terms.shift, terms))
  outputs, losses, regularizations, gradients, states = zip(*results)
  return (tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0),
                                *outputs),
          tf.stack(losses), tf.add_n(list(regularizations)),
          stack(gradients), list(states))


def stack(per_atom_gradients):
  """Per variable, its gradients over the atoms stacked (atom first); None
  where every atom's gradient is None."""
  with tf.name_scope('stack_gradients'):
    return [None if parts[0] is None else stacked(parts)
            for parts in zip(*per_atom_gradients)]


def joined(parts):
  """Several clones' stacked atoms of one tensor joined in clone order (the
  job's atoms in row order): concatenated, or, `tf.IndexedSlices`, their
  slices joined."""
  return slices.concat(parts) if slices.is_sparse(parts[0]) else tf.concat(
      parts, axis=0)


def stacked(parts):
  """The atoms' `parts` of one tensor stacked, atom first; the atoms'
  `tf.IndexedSlices` joined in atom order instead, which is already their
  exact fold (`slices`)."""
  return slices.concat(parts) if slices.is_sparse(parts[0]) else tf.stack(
      parts)


def gather(tensors):
  """Every worker's atoms of `tensors` (atom first), in worker order: the
  job's atoms in row order. Call it in the worker's replica context."""
  return slices.from_components(
      tensors, tf.distribute.get_replica_context().all_gather(
          slices.components(tensors), axis=0))


def fold(stacked):
  """Each tensor's sum over its first axis, by a left fold in atom order.

  The fold is a `tf.while_loop`: Grappler's arithmetic optimizer rewrites
  a chain of additions in one graph (into an `AddN`, its inputs in an order
  of its own, which depends on the graph around it), but not additions
  made in separate iterations of a loop.
  """
  return [tensor if slices.is_sparse(tensor) else
          tf.foldl(lambda total, part: total + part, tensor)
          for tensor in stacked]


def mean_state(stacked):
  """The atoms' new non-trainable values (atom first) combined: floating
  ones (BatchNorm's moving statistics) the mean by the fold, the others
  (counters, generator states) atom 0's."""
  return [fold([values])[0] / tf.cast(tf.shape(values)[0], values.dtype)
          if values.dtype.is_floating else values[0] for values in stacked]
