"""Combiners: how a step's clones' gradients meet, chosen once.

`deploy()` picks one from the step options:

  Summed    each variable's gradients summed beside its owner, over clones
            then accumulation steps (packed on the way with
            `gradient_packs`); slim's sum
  AtomFold  with `reproducible_rows`: every atom of the job kept apart,
            gathered from every worker, and folded in atom order
            (`deploy.atoms`), so the sum does not depend on the layout

A combiner is called as `combiner(clones_of, images, labels, layout,
structure)`: it runs the layout's accumulation steps (`rows.accumulate`;
`clones_of(images, labels, k, terms_shift)` gives accumulation step k's
`Clone`s), assigns the new non-trainable values (`States`), and returns
(gradients, [total loss, regularization, each clone's loss], outputs);
`for_update(grads_and_vars, total, regularization)` gives what this
worker hands the optimizer.

What differs between workers is a part too, chosen once when the combiner
is made (`across`): alone (`Alone`), the chief (`Chief`) or another worker
(`OtherWorker`), so no step method asks the worker count or role.
"""

import tensorflow as tf

from tfmulti import devices
from tfmulti import keras_internals
from tfmulti import rows
from tfmulti import slices
from tfmulti.deploy import atoms
from tfmulti.deploy import packs as packs_lib
from tfmulti.deploy.batch_norm import combine_non_trainable
from tfmulti.deploy.batch_norm import moments_of
from tfmulti.deploy.clones import optimize_clones


class States:
  """The model's non-trainable variables, assigned once a step, each on
  its owner: under the BatchNorm policy, but for the random generators'
  states, which every accumulation step reads unadvanced (its pieces'
  offsets differ) and the step assigns once at its end."""

  def __init__(self, config, model, policy):
    self.model = model
    self.policy = policy
    self.owners = [config.owner_device(devices.device_of(v))
                   for v in model.non_trainable_variables]
    self.seeds = keras_internals.seed_indices(model)
    self._moments = moments_of(model)

  def update(self, clones, advanced=None):
    """Assigns what `clones` left, but the generators' states; puts those
    in `advanced` (a list) when given."""
    with tf.name_scope('update_state'):
      values = combine_non_trainable(clones, self.policy, self._moments,
                                     self.owners)
      if advanced is not None:
        advanced[:] = [values[i] for i in self.seeds]
      self.assign({i: value for i, value in enumerate(values)
                   if i not in self.seeds})

  def assign(self, values):
    """Assigns the variables at the keys of `values` (index -> new value)
    theirs, each on its owner."""
    every = self.model.non_trainable_variables
    for i, value in values.items():
      with tf.device(self.owners[i]):
        every[i].assign(value)


def of(options):
  """The combiner these step options ask for: `AtomFold` with
  `reproducible_rows`, else `Summed`."""
  return AtomFold if options.reproducible_rows else Summed


class Summed:
  """The clones' gradients summed beside each variable's owner, over
  clones then accumulation steps.

  Its class attributes are what the runners ask of it: `run_pieces` (how a
  clone runs its pieces) and `fold` (how a clone's micro-batches meet).
  """
  run_pieces = staticmethod(atoms.run_whole)
  fold = staticmethod(slices.add)

  @staticmethod
  def check(config):
    """Raises `UserError` for clones this combiner cannot combine."""
    del config  # Sums combine any clones.

  @staticmethod
  def prepare():
    """What the process needs before the first step: nothing."""

  def __init__(self, config, variables, states, packs=()):
    """`variables`: what the step updates (`sharding`'s storage)."""
    self.config = config
    self.variables = variables
    self.owners = [config.owner_device(devices.device_of(v))
                   for v in self.variables]
    self.states = states
    self.packs = packs
    self.workers = across(config)
    self.fixed = []  # Which gradients are a fixed lookup's, as traced.

  def __call__(self, clones_of, images, labels, layout, structure):
    device = self.config.optimizer_device()
    advanced = []  # The generators' states accumulation step 0 left.
    fixed = self.fixed

    def accumulation_step(images, labels, k, shift):
      clones = clones_of(images, labels, k, shift)
      if k == 0:
        fixed[:] = slices.fixed_lookups(c.gradients for c in clones)
      with tf.device(device):
        total_loss, grads_and_vars = optimize_clones(
            clones, self.variables, self.owners, self.packs)
        regularization = tf.add_n([c.regularization_loss for c in clones])
      self.states.update(clones, advanced if k == 0 else None)
      by_variable = {id(v): g for g, v in grads_and_vars}
      return ([by_variable.get(id(v)) for v in self.variables],
              [total_loss, regularization] +
              clone_losses(self.config, clones, layout, k, tf.identity),
              outputs_of(self.config, clones, structure))
    summed = rows.accumulate(
        accumulation_step, images, labels, layout,
        worker=self.config.worker_index, device=device,
        gradient_devices=self.owners)
    self.states.assign(dict(zip(self.states.seeds, advanced)))
    gradients, *rest = summed
    return (self.collapsed(gradients, fixed), *rest)

  def collapsed(self, gradients, fixed):
    """`gradients` with each fixed lookup's slices collapsed on its owner
    (`slices.collapsed`): one device's slices of those rows."""
    with tf.name_scope('collapse_fixed_lookups'):
      return [devices.on(owner, slices.collapsed, g) if is_fixed else g
              for g, is_fixed, owner in zip(gradients, fixed, self.owners)]

  def for_update(self, grads_and_vars, total_loss, regularization):
    """What this worker hands the optimizer: its sums, but a fixed
    lookup's slices, which the workers sum here (Keras's all-reduce would
    join them: one slice of a row a worker) and the chief alone hands."""
    fixed = {id(v) for v, f in zip(self.variables, self.fixed) if f}
    return ([(self.workers.fixed_sum(g) if id(v) in fixed else g, v)
             for g, v in grads_and_vars], total_loss, regularization)


class Alone:
  """One worker: the atoms are all here, and its sums are the job's."""

  def gather(self, stacked):
    """Every worker's atoms, in atom order: here, this worker's."""
    return stacked

  def for_update(self, grads_and_vars, total_loss, regularization, owners):
    """What this worker hands the optimizer: its folded sums."""
    del owners  # Nothing moves.
    return grads_and_vars, total_loss, regularization

  def fixed_sum(self, gradient):
    """A fixed lookup's collapsed slices summed over the workers: here,
    this worker's."""
    return gradient


class Chief(Alone):
  """Worker 0 of several: it gathers every worker's atoms and hands the
  optimizer the job's sums, as one process would."""

  def gather(self, stacked):
    return atoms.gather(stacked)

  def fixed_sum(self, gradient):
    """Every worker's values of the same rows, summed."""
    values = tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, gradient.values)
    return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)


class OtherWorker(Chief):
  """A worker but the chief: it folds the job's atoms as the chief does
  (so every worker's loss is the job's), and hands the optimizer zeros;
  Keras's all-reduce then adds them to the chief's sums, which is exact.
  Each zero beside its variable, as the chief's sums are: the all-reduce
  packs its tensors by device, alike on every worker."""

  def for_update(self, grads_and_vars, total_loss, regularization, owners):
    return ([(devices.on(owners[id(v)], slices.none_like, g), v)
             for g, v in grads_and_vars], tf.zeros_like(total_loss),
            tf.zeros_like(regularization))

  def fixed_sum(self, gradient):
    """The chief hands the sum: nothing here, once summed."""
    return slices.none_like(super().fixed_sum(gradient))


def across(config):
  """This worker's part of the atoms' fold, chosen once: `Alone`, `Chief`
  or `OtherWorker`."""
  if config.num_workers == 1:
    return Alone()
  return OtherWorker() if config.worker_index else Chief()


class AtomFold(Summed):
  """With `reproducible_rows`: every atom's gradients, loss and new
  statistics kept apart (stacked in atom order, gathered from every
  worker by the `across` part), folded in atom order on the optimizer
  device; the moving statistics are the atoms' mean, assigned once."""
  run_pieces = staticmethod(atoms.run_atoms)
  fold = staticmethod(atoms.stacked)
  check = staticmethod(atoms.check_devices)
  prepare = staticmethod(devices.same_kernels_everywhere)  # Kernels too.

  def __call__(self, clones_of, images, labels, layout, structure):
    device = self.config.optimizer_device()
    reached = []  # Which variables the atoms reach, as traced.
    fixed = self.fixed

    def accumulation_step(images, labels, k, shift):
      clones = clones_of(images, labels, k, shift)
      with tf.device(device), tf.name_scope('stack_atoms'):
        gradients = self._stacked_gradients(clones)
        reached[:] = [g is not None for g in gradients]
        if k == 0:
          fixed[:] = slices.fixed_lookups([gradients])
        states = [devices.on(owner, tf.stack, values)
                  for values, owner in zip(zip(
                      *(values for c in clones for _, values in
                        c.non_trainable)), self.states.owners)]
        stacked = [tf.concat([c.loss for c in clones], axis=0)] + [
            g for g in gradients if g is not None] + states
        regularization = tf.add_n([c.regularization_loss for c in clones])
      return ([], [regularization] +
              clone_losses(self.config, clones, layout, k, tf.reduce_sum),
              stacked + outputs_of(self.config, clones, structure))

    _, scalars, parts = rows.accumulate(
        accumulation_step, images, labels, layout,
        worker=self.config.worker_index, device=device)
    num_outputs = len(tf.nest.flatten(structure[0])) if structure else 0
    split = len(parts) - num_outputs  # The outputs, if any, last.
    total_loss, gradients = self._fold(parts[:split], reached)
    return (self.collapsed(gradients, fixed), [total_loss] + scalars,
            parts[split:])

  def _fold(self, stacked, reached):
    """(total loss, gradients) folded from the stacked atoms; assigns the
    new statistics, the atoms' mean."""
    device = self.config.optimizer_device()
    with tf.device(device), tf.name_scope('fold_atoms'):
      stacked = self.workers.gather(stacked)
      num_states = len(self.states.owners)
      folded = stacked[:len(stacked) - num_states]
      places = [device] + [o for o, r in zip(self.owners, reached) if r]
      total_loss, *sums = [devices.on(place, atoms.fold, [t])[0]
                           for t, place in zip(folded, places)]
      sums = iter(sums)
      self.states.assign(dict(enumerate(
          devices.on(owner, atoms.mean_state, [values])[0]
          for values, owner in zip(stacked[len(folded):],
                                   self.states.owners))))
      return total_loss, [next(sums) if r else None for r in reached]

  def _stacked_gradients(self, clones):
    """Each variable's atoms' gradients, every clone's stacked on its
    owner (atom first; packed on the way with `gradient_packs`)."""
    stacked = {}
    for group in self.packs:
      parts = packs_lib.sum_packed([c.gradients for c in clones], group,
                                   self.owners[group[0]], leading=1)
      stacked.update(zip(group, parts or ()))
    return [stacked[k] if k in stacked
            else devices.on(owner, atoms.joined, parts)
            if parts[0] is not None else None
            for k, (parts, owner) in enumerate(zip(
                zip(*(c.gradients for c in clones)), self.owners))]

  def for_update(self, grads_and_vars, total_loss, regularization):
    """What this worker hands the optimizer (`across`)."""
    owners = {id(v): o for v, o in zip(self.variables, self.owners)}
    return self.workers.for_update(grads_and_vars, total_loss,
                                   regularization, owners)


def outputs_of(config, clones, structure):
  """The clones' outputs in row order, flat (empty without a `structure`
  list, which gets their nest)."""
  if structure is None:
    return []
  structure[:] = [clones[0].outputs]
  with tf.device(config.inputs_device()):
    return [tf.concat(parts, axis=0) for parts in zip(
        *(tf.nest.flatten(clone.outputs) for clone in clones))]


def clone_losses(config, clones, layout, k, combine):
  """Each clone's loss of accumulation step k, through `combine` (0 for
  an empty clone of a short batch)."""
  found = iter(clones)
  return [combine(next(found).loss) if rows_ else tf.zeros([])
          for rows_ in layout.clone_rows(config.worker_index, k)]
