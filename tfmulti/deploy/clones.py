"""Slim's clone building blocks: one clone's step, the clones, their sum.

`create_clones` runs each clone's forward pass, loss and gradient on its
own device and shard of the batch (through its stages, with `stages`);
`optimize_clones` sums them. `deploy.DeployedModel` builds its step from
these; they are also there for writing one's own loop, as in slim.
"""

import collections
import contextlib

import tensorflow as tf

from tfmulti import devices
from tfmulti import keras_internals
from tfmulti import layouts
from tfmulti import rows
from tfmulti import step_options
from tfmulti import trainer
from tfmulti.deploy import atoms
from tfmulti.deploy import packs as packs_lib
from tfmulti.deploy import towers_in_strategy

# A clone's share of one step (slim: Clone(outputs, scope, device)).
# `loss` is the clone's part of the total loss (its mean loss weighted by
# its share of the global batch, plus its part of the regularization);
# `gradients` are d loss / d trainable variable, computed on `device`;
# `non_trainable` is a list of (rows, values): the model's non-trainable
# variables as the forward pass of the clone's shard (or of each of its
# micro-batches) left them.
Clone = collections.namedtuple(
    'Clone', ['outputs', 'loss', 'regularization_loss', 'gradients',
              'non_trainable', 'scope', 'device'])


def clone_step(model, loss_fn, global_rows, trainable, non_trainable,
               images, labels, penalty_weight, loss_scale, offset=0):
  """Forward pass, loss and gradient of one piece; changes no variable.

  `trainable` and `non_trainable` are the variables' values as tensors, so
  the computation can be compiled by XLA apart from the variables (XLA will
  not read a variable that lives on another device). `global_rows` counts
  the whole job's batch. The weight penalties count `penalty_weight` times
  (the piece's part of them, `layouts.Piece.penalty`); the model's `add_loss`
  terms count on every piece, weighted by its rows. Random layers draw
  from their generators folded with `offset`, the piece's first row in the
  global batch, so no two pieces repeat a mask; the generators come back
  advanced from their unfolded state. The gradient is of
  `loss * loss_scale` (float16 loss scaling; 1 otherwise). Traced at the
  root (lockstep replica 0, an XLA function), it opens the scope 'clone'
  (`trainer.off_the_root`).
  """
  seeds = keras_internals.seed_indices(model)
  folded = keras_internals.fold_seeds(non_trainable, seeds, offset)
  with trainer.off_the_root('clone'), tf.GradientTape() as tape:
    tape.watch(trainable)
    outputs, new_non_trainable, losses = model.stateless_call(
        trainable, folded, images, training=True, return_losses=True)
    model_losses, penalties = keras_internals.split_losses(model, losses)
    loss, regularization, scaled_loss = trainer.objective(
        loss_fn, labels, outputs, global_rows=global_rows,
        model_losses=model_losses, penalties=penalties,
        penalty_weight=penalty_weight, loss_scale=loss_scale)
  gradients = tape.gradient(scaled_loss, trainable)
  new_non_trainable = keras_internals.unfold_seeds(
      new_non_trainable, folded, non_trainable, seeds)
  return outputs, loss, regularization, gradients, [new_non_trainable]


@contextlib.contextmanager
def on_clone(config, clone_index):
  """Places ops on the clone's device, under its name scope: slim's
  (none for one clone) or 'clone', as a layer named with a leading '_'
  may not open a name scope at the root."""
  scope = config.clone_scope(clone_index) or 'clone'
  with tf.device(config.clone_device(clone_index)), tf.name_scope(scope):
    yield


def split_batch(config, tensors, sizes=None):
  """Splits the rows of `tensors` (a nest) over the clones, on the inputs
  device: evenly, or `sizes[i]` rows to clone i; a list of nests."""
  with tf.device(config.inputs_device()), tf.name_scope('split_batch'):
    if sizes is None:
      sizes = layouts.even_parts(tf.nest.flatten(tensors)[0].shape[0],
                                 config.num_clones)
    return rows.split(tensors, sizes)


def values_of(variables):
  """The variables' current values, read on the current device."""
  return [tf.convert_to_tensor(v) for v in variables]


def worker_of(config, layout):
  """This worker's index in `layout` (0 in a layout of one worker's batch
  alone)."""
  return config.worker_index if layout.num_workers > 1 else 0


def create_clones(config, model, loss_fn, images, labels, *,
                  layout=None, accumulation_step=0, shift=0,
                  options=step_options.DEFAULTS, loss_scale=1.0,
                  lockstep=None, stages=None, packs=(), by_clone=False):
  """Runs every clone on its device and its pieces of the batch.

  Args:
    config: a `DeploymentConfig`.
    model: a built functional `keras.Model` whose variables live on
      `config.variables_device()`.
    loss_fn: `loss_fn(labels, outputs)` -> mean loss over those examples.
    images: this worker's rows of the accumulation step (a nest); with
      `by_clone`, a tuple of each clone's rows of it, already on its
      device (a prefetched `rows.Shards`), which the clone reads there.
    labels: its targets, as many rows (a nest; a tuple with `by_clone`).
    layout: the step's `layouts.StepLayout`; None for this batch alone (one
      accumulation step, the clones' shares as even as the rows go).
    accumulation_step: whose pieces these rows are, in `layout`.
    shift: rows to add to those pieces' offsets (a tensor inside the
      accumulation loop, which runs step 1's pieces again).
    options: the `StepOptions`; here `xla` compiles each piece's forward
      and backward pass with XLA, one cluster per piece on its clone's
      device (compiling the whole step would fuse every clone into one
      cluster on one device), and `reproducible_rows` runs each atom of a
      clone alone: each `Clone` then holds its atoms' losses and
      gradients stacked, atom first, unsummed (`deploy.atoms`).
    loss_scale: multiplies each piece's loss before its gradient (the
      float16 loss scale of a `keras.optimizers.LossScaleOptimizer`).
    lockstep: None, or a `tf.distribute.MirroredStrategy` over the clone
      devices whose replicas run the clones at once, every BatchNorm
      synchronized (see `towers_in_strategy.run_clones_in_lockstep`).
    stages: None, or a `pipeline.Stages`: each clone runs its shard in
      micro-batches through its stages, on `config.stage_devices(clone)`.
    packs: groups of trainable variables (`packs.groups`) whose values
      each clone without stages reads as one tensor from their owner.
    by_clone: `images` and `labels` come cut into the clones' shards.

  Returns:
    A list of `Clone`, one per clone with rows (an empty clone of a short
    batch runs nothing and adds nothing).
  """
  if layout is None:
    layout = layouts.step_layout(rows.batch_rows(images, labels), layouts.Cut(
        num_clones=config.num_clones,
        num_microbatches=options.num_microbatches,
        staged=stages is not None, atom_rows=options.reproducible_rows),
                                 partial=True)
  worker = worker_of(config, layout)
  sizes = layout.clone_rows(worker, accumulation_step)
  pieces = [layout.of(worker, accumulation_step, c)
            for c in range(config.num_clones)]

  def clone_fn(*args):
    return clone_step(model, loss_fn, layout.global_rows, *args)
  if options.xla is True:  # 'auto' is resolved by `xla_rule` first.
    clone_fn = tf.function(clone_fn, jit_compile=True)
  if by_clone:
    image_shards, label_shards = images, labels
  else:
    image_shards = split_batch(config, images, sizes)
    label_shards = split_batch(config, labels, sizes)
  if lockstep is not None:
    with tf.device(config.optimizer_device()):
      variables = (values_of(model.trainable_variables),
                   values_of(model.non_trainable_variables))
    with keras_internals.synchronized_batch_norms(model):
      results = towers_in_strategy.run_clones_in_lockstep(
          lockstep, clone_fn, variables,
          [(x, y, p[0].penalty, p[0].offset + shift)
           for x, y, p in zip(image_shards, label_shards, pieces)],
          loss_scale)
  else:
    results = [None] * config.num_clones
    reads = _packed_reads(config, model.trainable_variables,
                          packs if stages is None else ())
    for i in range(config.num_clones):
      if not sizes[i]:
        continue
      with on_clone(config, i):
        # Each clone reads the variables from their owners.
        variables = (reads(config.clone_device(i)),
                     values_of(model.non_trainable_variables))
        if stages is not None:
          results[i] = stages.clone_step(
              config.chunk_devices(i, stages.options.virtual_stages),
              loss_fn, layout.global_rows,
              pieces[i], shift, *variables, image_shards[i],
              label_shards[i], loss_scale)
        else:
          results[i] = atoms.run_pieces(
              clone_fn, pieces[i], shift, *variables, image_shards[i],
              label_shards[i], loss_scale, stacked=bool(layout.atom_rows))
  clones = []
  for i, result in enumerate(results):
    if result is None:
      continue
    *result, states = result
    part_rows = [p.rows for p in pieces[i] if p.rows]
    clones.append(Clone(*result, list(zip(part_rows, states)),
                        scope=config.clone_scope(i),
                        device=config.clone_device(i)))
  return clones


def _packed_reads(config, variables, packs):
  """`reads(device)`: the variables' values read on `device`, those of
  each pack from another device as one tensor, packed once on its owner."""
  owners = [config.owner_device(devices.device_of(v)) for v in variables]
  packed = {group: packs_lib.read_packed(variables, group, owners[group[0]])
            for group in packs}

  def reads(device):
    values = {}
    for group, tensor in packed.items():
      if not devices.same_device(owners[group[0]], device):
        values.update(zip(group, packs_lib.unpack(
            tensor, [variables[k].shape for k in group])))
    return [values[k] if k in values else tf.convert_to_tensor(v)
            for k, v in enumerate(variables)]
  return reads


def optimize_clones(clones, variables, owners=None, packs=()):
  """Sums the clones' losses and gradients on the current device.

  Call it under `tf.device(config.optimizer_device())`.

  Args:
    clones: the list `create_clones` returned.
    variables: the trainable variables, in the order of the gradients.
    owners: where each variable's gradients are summed (one device a
      variable: `config.owner_device`); None for the current device.
    packs: groups of variable indices whose gradients travel and are
      summed as one tensor each (`packs.groups`; needs `owners`).

  Returns:
    (total_loss, grads_and_vars), skipping variables that no clone reached.
  """
  with tf.name_scope('optimize_clones'):
    total_loss = tf.add_n([clone.loss for clone in clones], name='total_loss')
    summed = {}
    for group in packs:
      sums = packs_lib.sum_packed([c.gradients for c in clones], group,
                                  owners[group[0]])
      summed.update(zip(group, sums or ()))
    grads_and_vars = []
    for k, variable in enumerate(variables):
      grads = [c.gradients[k] for c in clones if c.gradients[k] is not None]
      if k in summed:
        grads_and_vars.append((summed[k], variable))
      elif grads:
        grads_and_vars.append((devices.on(
            owners[k] if owners else None, tf.add_n, grads,
            name='sum_gradients'), variable))
  return total_loss, grads_and_vars
