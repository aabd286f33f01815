"""TF-Slim's model_deploy tower design, brought to TF 2 and Keras 3.

One `DeploymentConfig` says where everything lives: the variables (CPU:0, or a
chosen device), the clones (one per GPU, or one per logical CPU with
`clone_on_cpu`), the input split and the gradient sum. `deploy()` turns a
built functional Keras model, a loss and an optimizer into a `DeployedModel`
whose `train_step` splits this worker's batch of `batch_size * num_clones`
rows evenly over the clones, runs each clone's forward pass, loss and
gradient on its own device, sums the gradients on the optimizer device and
applies them once. The result equals one device training on the whole batch.

How the step runs is one `StepOptions` record, passed whole. Three of its
options keep that equality: `clone_shares` splits the rows unevenly (for
unequal devices; `balance` measures and sets them), `num_microbatches`
feeds each clone, cut into `DeploymentConfig.num_stages` stages on their
own devices, with micro-batches (`tfmulti.pipeline`), and
`accumulation_steps` sums several accumulation steps into one update
(`rows.accumulate`).

How this differs from slim (graph-mode TF 1):
  * `create_clones` records each clone under its own `tf.GradientTape` and
    computes that clone's gradient on its device at once; slim built only
    the forward pass there and took gradients later in `optimize_clones`.
  * `optimize_clones` sums the clones' losses and gradients; it does not
    compute them, and nothing goes through graph collections.
  * Clones run `model.stateless_call`, so Keras 3 BatchNorm returns its new
    moving statistics instead of assigning them once per clone; they are
    assigned once per step by `batch_norm_policy`.
  * With `clone_on_cpu`, clone i runs on CPU:i (logical CPU devices, see
    `devices.create_logical_cpus`); slim put every clone on CPU:0.
  * With a chosen variables device, the gradient sum and the update run
    there too, next to the variables and slots they read and write.
  * With parameter servers, worker devices carry `/task:<replica_id>`; slim
    left the task out, which broke multi-node runs (tensorflow/models#3945).
  * On GPUs the input pipeline cuts each step's batch by its layout and
    prefetches each clone's shard to the clone's device
    (`distribute_dataset`, `feeds`); slim's prefetch queue handed each
    clone its own batch on the host. Unfed, the step splits the batch on
    the inputs device.

This module knows nothing of the tf.distribute paths; the one place where
the towers meet a strategy (clones in lockstep, for synchronized BatchNorm)
is `towers_in_strategy`.
"""

import contextlib
import dataclasses
import functools

from absl import logging
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import layouts
from tfmulti import rows
from tfmulti import step_options
from tfmulti import trainer
from tfmulti.deploy import atoms
from tfmulti.deploy import balance
from tfmulti.deploy import feeds
from tfmulti.deploy import packs
from tfmulti.deploy import towers_in_strategy
from tfmulti.deploy import xla_rule
from tfmulti.deploy.batch_norm import combine_non_trainable
from tfmulti.deploy.batch_norm import moments_of
from tfmulti.deploy.clones import clone_step
from tfmulti.deploy.clones import create_clones
from tfmulti.deploy.clones import on_clone
from tfmulti.deploy.clones import optimize_clones
from tfmulti.deploy.clones import split_batch
from tfmulti.deploy.clones import values_of
from tfmulti.deploy.clones import worker_of
from tfmulti.pipeline.stages import Stages


class DeployedModel(trainer.Trainer):
  """A model deployed over clones, with its compiled training step.

  Slim's DeployedModel held a train_op and summary_op; in TF 2 it holds the
  `tf.function` that runs one step. Attributes: `config`, `model`,
  `loss_fn`, `optimizer`, `options` (the `StepOptions`), `lockstep` and
  `stages` (see `create_clones`), `clone_shares`: each clone's share of
  a step's rows, None for equal, settable between steps, and `balancer`:
  with shares 'auto', the `balance.Balancer` that sets them.
  """

  def __init__(self, config, model, loss_fn, optimizer, options, *,
               lockstep=None, stages=None, balancer=None):
    self.config = config
    self.model = model
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.options = options
    self.lockstep = lockstep
    self.stages = stages
    self.clone_shares = options.fixed_shares
    self.balancer = balancer
    self._moments = moments_of(model)
    self._seeds = keras_internals.seed_indices(model)
    # Where each variable's gradient sum, update or new value is made.
    self._owners = [config.owner_device(devices.device_of(v))
                    for v in model.trainable_variables]
    self._state_owners = [config.owner_device(devices.device_of(v))
                          for v in model.non_trainable_variables]
    self._packs = packs.groups(model.trainable_variables, self._owners,
                               options.gradient_packs)
    self._probes = {}  # Clone index -> its timing function.
    self._feeder = None  # A `feeds.Feeder`, made at the first feed.
    self._step = tf.function(self.step_graph)
    self._predict = tf.function(self._predict_graph)

  def step_graph(self, images, labels, layout, with_outputs=False,
                 by_clone=False):
    """The step, untraced: for `tf.function`, or inside a replica context
    (each worker of a multi-worker job runs it; Keras's `apply_gradients`
    then all-reduces the workers' summed gradients before the update).

    `images` and `labels` are nests of this worker's batch; `layout` is
    the step's `layouts.StepLayout` (`layout_for`): which rows each clone,
    accumulation step, micro-batch and atom runs. The accumulation steps'
    gradients are summed on the optimizer device and applied once.
    `with_outputs`: also return the clones' outputs, in row order.
    `by_clone`: `images` and `labels` are tuples of the clones' shards cut
    by `layout` (`rows.Shards.parts`), each read on its clone's device.
    """
    config, variables = self.config, self.model.trainable_variables
    loss_scale = trainer.loss_scale_of(self.optimizer)
    with tf.device(config.optimizer_device()):
      scale = 1.0 if loss_scale is None else tf.identity(loss_scale)

    def clones_of(images, labels, k, shift):
      return create_clones(config, self.model, self.loss_fn, images, labels,
                           layout=layout, accumulation_step=k, shift=shift,
                           options=self.options, loss_scale=scale,
                           lockstep=self.lockstep, stages=self.stages,
                           packs=self._packs, by_clone=by_clone)

    run = self._atoms_step if self.options.reproducible_rows else (
        self._summed_step)
    structure = []  # The outputs' nest, as traced.
    gradients, (total_loss, regularization, *clone_losses), outputs = run(
        clones_of, images, labels, layout, structure if with_outputs else None,
        by_clone)
    with tf.device(config.optimizer_device()):
      grads_and_vars = [(g, v) for g, v in zip(gradients, variables)
                        if g is not None]
      summed = {}
      if self.options.summarize_gradients:
        summed = trainer.gradients_by_path(
            grads_and_vars, None if loss_scale is None else scale)
      if self.options.reproducible_rows and config.worker_index:
        # Every worker folded the job's atoms alike; Keras's all-reduce
        # then adds these zeros to worker 0's sums, which is exact. Each
        # beside its variable, as worker 0's sums are: the all-reduce packs
        # its tensors by device, alike on every worker.
        owner = {id(v): o for v, o in zip(variables, self._owners)}
        grads_and_vars = [(devices.on(owner[id(v)], tf.zeros_like, g), v)
                          for g, v in grads_and_vars]
        total_loss, regularization = tf.zeros_like(total_loss), (
            tf.zeros_like(regularization))
      # A LossScaleOptimizer divides by the scale, and skips the update
      # (halving the scale) when a gradient is not finite.
      with (keras_internals.updates_beside_variables(self.optimizer)
            if config.spread_variables else contextlib.nullcontext()):
        self.optimizer.apply_gradients(grads_and_vars)
    return trainer.StepOutputs(
        total_loss, regularization, clone_losses, summed,
        tf.nest.pack_sequence_as(structure[0], outputs) if outputs else None)

  def _outputs(self, clones, structure):
    """The clones' outputs in row order, flat (empty without a
    `structure` list, which gets their nest)."""
    if structure is None:
      return []
    structure[:] = [clones[0].outputs]
    with tf.device(self.config.inputs_device()):
      return [tf.concat(parts, axis=0) for parts in zip(
          *(tf.nest.flatten(clone.outputs) for clone in clones))]

  def _clone_losses(self, clones, layout, k, combine):
    """Each clone's loss (0 for an empty clone of a short batch)."""
    found = iter(clones)
    return [combine(next(found).loss) if rows_ else tf.zeros([])
            for rows_ in layout.clone_rows(worker_of(self.config, layout), k)]

  def _summed_step(self, clones_of, images, labels, layout, structure,
                   by_clone):
    """The clones' gradients summed on the optimizer device, over clones
    then accumulation steps: (gradients, scalars, outputs) as
    `rows.accumulate` gives them."""
    config, variables = self.config, self.model.trainable_variables
    advanced = []  # The generators' states accumulation step 0 left.

    def accumulation_step(images, labels, k, shift):
      clones = clones_of(images, labels, k, shift)
      with tf.device(config.optimizer_device()):
        total_loss, grads_and_vars = optimize_clones(
            clones, variables, self._owners, self._packs)
        regularization = tf.add_n([c.regularization_loss for c in clones])
      self._update_state(clones, advanced if k == 0 else None)
      by_variable = {id(v): g for g, v in grads_and_vars}
      return ([by_variable.get(id(v)) for v in variables],
              [total_loss, regularization] +
              self._clone_losses(clones, layout, k, tf.identity),
              self._outputs(clones, structure))
    summed = rows.accumulate(accumulation_step, images, labels, layout,
                             worker=worker_of(self.config, layout),
                             device=config.optimizer_device(),
                             gradient_devices=self._owners, by_clone=by_clone)
    self._assign_state(dict(zip(self._seeds, advanced)))
    return summed

  def _atoms_step(self, clones_of, images, labels, layout, structure,
                  by_clone):
    """`_summed_step` with `reproducible_rows`: every atom of the job kept
    apart, then folded in atom order (`deploy.atoms`); the moving
    statistics are the atoms' mean, assigned once."""
    config, device = self.config, self.config.optimizer_device()
    reached = []  # Which variables the atoms reach, as traced.

    def accumulation_step(images, labels, k, shift):
      clones = clones_of(images, labels, k, shift)
      with tf.device(device), tf.name_scope('stack_atoms'):
        gradients = self._stacked_gradients(clones)
        reached[:] = [g is not None for g in gradients]
        states = [devices.on(owner, tf.stack, values)
                  for values, owner in zip(zip(
                      *(values for c in clones for _, values in
                        c.non_trainable)), self._state_owners)]
        stacked = [tf.concat([c.loss for c in clones], axis=0)] + [
            g for g in gradients if g is not None] + states
        regularization = tf.add_n([c.regularization_loss for c in clones])
      return ([], [regularization] +
              self._clone_losses(clones, layout, k, tf.reduce_sum),
              stacked + self._outputs(clones, structure))

    _, scalars, parts = rows.accumulate(
        accumulation_step, images, labels, layout,
        worker=worker_of(self.config, layout), device=device,
        by_clone=by_clone)
    num_outputs = len(tf.nest.flatten(structure[0])) if structure else 0
    split = len(parts) - num_outputs  # The outputs, if any, last.
    stacked, outputs = parts[:split], parts[split:]
    with tf.device(device), tf.name_scope('fold_atoms'):
      if config.num_workers > 1:
        stacked = atoms.gather(stacked)
      num_states = len(self.model.non_trainable_variables)
      folded = stacked[:len(stacked) - num_states]
      places = [device] + [o for o, r in zip(self._owners, reached) if r]
      total_loss, *sums = [devices.on(place, atoms.fold, [t])[0]
                           for t, place in zip(folded, places)]
      sums = iter(sums)
      gradients = [next(sums) if r else None for r in reached]
      self._assign_state(dict(enumerate(
          devices.on(owner, atoms.mean_state, [values])[0]
          for values, owner in zip(stacked[len(folded):],
                                   self._state_owners))))
    return gradients, [total_loss] + scalars, outputs

  def _stacked_gradients(self, clones):
    """Each variable's atoms' gradients, every clone's stacked on its
    owner (atom first; packed on the way with `gradient_packs`)."""
    stacked = {}
    for group in self._packs:
      parts = packs.sum_packed([c.gradients for c in clones], group,
                               self._owners[group[0]], leading=1)
      stacked.update(zip(group, parts or ()))
    return [stacked[k] if k in stacked
            else devices.on(owner, tf.concat, parts, axis=0)
            if parts[0] is not None else None
            for k, (parts, owner) in enumerate(zip(
                zip(*(c.gradients for c in clones)), self._owners))]

  def _update_state(self, clones, advanced=None):
    """Assigns the non-trainable variables once, under the BN policy, all
    but the random generators' states: every accumulation step reads them
    unadvanced (its pieces' offsets differ) and the step assigns them once
    at its end, from `advanced` (filled here when given)."""
    with tf.name_scope('update_state'):
      values = combine_non_trainable(
          clones, self.options.batch_norm_policy, self._moments,
          self._state_owners)
      if advanced is not None:
        advanced[:] = [values[i] for i in self._seeds]
      self._assign_state({i: value for i, value in enumerate(values)
                          if i not in self._seeds})

  def _assign_state(self, values):
    """Assigns the non-trainable variables at the keys of `values` (index
    -> new value) theirs, each on its owner."""
    every = self.model.non_trainable_variables
    for i, value in values.items():
      with tf.device(self._state_owners[i]):
        every[i].assign(value)

  def distribute_dataset(self, dataset):
    """`dataset` itself: each step splits its batch over the clones; or,
    where `config.prefetches_to_clones()` and the batches' rows are known,
    a feed (`feeds`): each global batch cut by the step's layout, each
    clone's shard prefetched to its device, as `train_step_outputs` takes
    them.

    The cut follows the clones' shares as they are when it is made: with
    `clone_shares='auto'` the first cut waits for the first measurement,
    and a split measured during an epoch cuts the next epoch's batches
    (each step runs the layout its shards were cut by, which is exact).
    """
    if not self.config.prefetches_to_clones():
      return dataset
    specs = dataset.element_spec
    if not feeds.known_rows(specs):
      logging.info('Batches of unknown rows: each step splits its batch '
                   'on %s, not prefetched to the clones.',
                   self.config.inputs_device())
      return dataset
    if self.balancer is not None and not self.balancer.history:
      with tf.device(self.config.inputs_device()):
        self.clone_shares = self.balancer.shares(self,
                                                 *feeds.stand_in(specs))
    if self._feeder is None:
      self._feeder = feeds.Feeder(self.config)
    layout = self.layout_for(*specs)
    return self._feeder.feed(dataset, layout, worker_of(self.config, layout))

  def layout_for(self, images, labels, partial=False):
    """The `layouts.StepLayout` of a step on this worker's batch (nests),
    under the clones' current shares; raises `ConfigError` for a batch
    that cannot be cut so. `partial`: a short last batch (Keras's), which
    may leave clones or micro-batches empty, as plain `fit` trains it."""
    return self.layout_for_rows(rows.batch_rows(images, labels), partial)

  def layout_for_rows(self, worker_rows, partial=False):
    """`layout_for` a batch of `worker_rows` rows on this worker."""
    return layouts.for_step(self.config, self.options, worker_rows,
                            shares=self.clone_shares, partial=partial)

  def train_step_outputs(self, images, labels, *, partial=False,
                         with_outputs=False):
    """One step on this worker's batch; returns its `StepOutputs`.

    `partial` takes a short last batch (see `layout_for`);
    `with_outputs` returns the training outputs too (for compiled metrics).
    With `clone_shares='auto'` the shares are measured first, when due.
    `images` and `labels` may be `rows.Shards` from a feed
    (`distribute_dataset`): the step then runs their layout, each clone
    reading its shard on its device.
    """
    if isinstance(images, rows.Shards):
      if self.balancer is not None:  # For the next cut; timed on zeros.
        with tf.device(self.config.inputs_device()):
          self.clone_shares = self.balancer.shares(self, *(
              feeds.stand_in(nest.parts[0], nest.layout.worker_rows())
              for nest in (images, labels)))
      return self._step(images.parts, labels.parts, images.layout,
                        with_outputs, True)
    images, labels = [tf.nest.map_structure(tf.convert_to_tensor, nest)
                      for nest in (images, labels)]
    if self.balancer is not None:
      self.clone_shares = self.balancer.shares(self, images, labels)
    # One trace per distinct layout: it is a frozen record of Python ints.
    return self._step(images, labels,
                      self.layout_for(images, labels, partial), with_outputs)

  def traced_step(self, images, labels, with_outputs=False):
    """The step's concrete function on this batch, or on a feed's
    `rows.Shards` (its graph shows where each op runs)."""
    if isinstance(images, rows.Shards):
      return self._step.get_concrete_function(
          images.parts, labels.parts, images.layout, with_outputs, True)
    images, labels = [tf.nest.map_structure(tf.convert_to_tensor, nest)
                      for nest in (images, labels)]
    return self._step.get_concrete_function(
        images, labels, self.layout_for(images, labels), with_outputs)

  def _probe_graph(self, clone_index, images, labels):
    """Clone `clone_index` alone: its forward and backward pass on its
    device(s), reduced to one number so nothing is pruned."""
    config, model = self.config, self.model
    layout = layouts.step_layout(rows.batch_rows(images, labels), layouts.Cut(
        num_microbatches=self.options.num_microbatches,
        staged=self.stages is not None))
    with on_clone(config, clone_index):
      args = (values_of(model.trainable_variables),
              values_of(model.non_trainable_variables))
      if self.stages is None:
        _, loss, _, gradients, _ = clone_step(
            model, self.loss_fn, layout.global_rows, *args, images, labels,
            0.0, 1.0)
      else:
        _, loss, _, gradients, _ = self.stages.clone_step(
            config.chunk_devices(clone_index, self.options.virtual_stages),
            self.loss_fn,
            layout.global_rows, layout.pieces, 0, *args, images, labels, 1.0)
      return loss + tf.add_n([tf.reduce_sum(g) for g in gradients
                              if g is not None])

  def probe(self, clone_index):
    """A `tf.function(images, labels)` of clone `clone_index` alone, for
    timing it (`balance.clone_throughputs`)."""
    if clone_index not in self._probes:
      self._probes[clone_index] = tf.function(
          functools.partial(self._probe_graph, clone_index))
    return self._probes[clone_index]

  def _predict_graph(self, images, with_losses=False):
    n, model = self.config.num_clones, self.model
    # Inference may see a short last batch: shards differ by one row at most,
    # and a batch of fewer rows than clones leaves the last clones idle.
    total = tf.nest.flatten(images)[0].shape[0]
    sizes = layouts.even_parts(total, n)
    shards = split_batch(self.config, images, sizes)
    outputs, regularization = [], []
    for i in range(n):
      if not sizes[i]:
        continue
      with on_clone(self.config, i):
        variables = (values_of(model.trainable_variables),
                     values_of(model.non_trainable_variables))
        if self.stages is None:
          output, _, losses = model.stateless_call(
              *variables, shards[i], training=False, return_losses=True)
          model_losses, penalties = keras_internals.split_losses(model,
                                                                 losses)
        else:
          output, model_losses, penalties = self.stages.predict(
              self.config.chunk_devices(i, self.options.virtual_stages),
              shards[i], *variables)
        outputs.append(output)
        # The weight penalties once; the add_loss terms by rows, as a step.
        regularization.append(
            trainer.penalty(penalties, float(not regularization)) +
            trainer.model_loss(model_losses, sizes[i], total))
    with tf.device(self.config.inputs_device()):
      outputs = tf.nest.map_structure(
          lambda *parts: tf.concat(parts, axis=0), *outputs)
      return (outputs, tf.add_n(regularization)) if with_losses else outputs

  def predict(self, images):
    """Inference outputs for `images` (a nest), computed over the clones."""
    return self._predict(tf.nest.map_structure(tf.convert_to_tensor, images))

  def evaluate_outputs(self, images):
    """(inference outputs, the model's losses on them: weight penalties and
    `add_loss` terms, as one device would count them), for evaluation."""
    return self._predict_graph(
        tf.nest.map_structure(tf.convert_to_tensor, images), with_losses=True)


def deploy(config, model, loss_fn, optimizer, options=None, **fields):
  """Deploys `model` over `config`'s clones.

  Builds the optimizer's slot variables on the variables device, and checks,
  before anything runs, that every device exists and every variable lives on
  `config.variables_device()`.

  Args:
    config: a `DeploymentConfig`.
    model: a functional `keras.Model` built under
      `tf.device(config.variables_device())`.
    loss_fn: `loss_fn(labels, outputs)` -> mean loss (any `keras.losses`
      object with its default reduction).
    optimizer: a Keras optimizer created under the variables device.
    options: a `StepOptions` (how each step runs); None for the defaults.
    **fields: `StepOptions` fields that replace those of `options`, e.g.
      `clone_shares=(3, 1)` for a device three times as fast, or
      `accumulation_steps=2`. `sync_batch_norm=True` runs the clones in
      lockstep (the replicas of a `MirroredStrategy` over the clone
      devices) with every BatchNormalization synchronized; `clone_shares`
      'auto' measures the clones and sets their shares (`balance`).

  Returns:
    A `DeployedModel`.

  Raises:
    errors.UserError: a missing device, a misplaced variable, a bad option,
      a model that is not built, or a cut that cannot be made.
  """
  options = dataclasses.replace(options or step_options.StepOptions(),
                                **fields)
  check_options(config, options)
  options = xla_rule.resolve(config, options)
  check_model(model)
  trainer.check_loss(loss_fn)
  stages = None
  if config.num_stages > 1 or options.num_microbatches > 1:
    # Interleaved 1F1B cuts num_stages x virtual_stages chunks.
    stages = Stages(model, config.num_stages * options.virtual_stages,
                    options)
  devices.check_devices_exist(
      config.variable_devices() + [config.optimizer_device(),
                                   config.inputs_device()] +
      config.compute_devices())
  if not optimizer.built:  # Keras puts each slot beside its variable.
    with tf.device(config.optimizer_variables_device()):
      optimizer.build(model.trainable_variables)
  devices.check_placement(model.variables, config.variable_devices())
  devices.check_placement(optimizer.variables, config.variable_devices() +
                          [config.optimizer_variables_device()])
  if options.reproducible_rows:  # Atoms alone are not enough: kernels too.
    devices.same_kernels_everywhere()
  lockstep = None
  if options.sync_batch_norm:
    lockstep = towers_in_strategy.lockstep_strategy(config)
  balancer = None
  if options.auto_shares:
    balancer = balance.Balancer(options.rebalance_every_steps)
  return DeployedModel(config, model, loss_fn, optimizer, options,
                       lockstep=lockstep, stages=stages, balancer=balancer)


def check_model(model):
  """Raises `ConfigError` for a model the towers cannot clone: not built,
  not functional, nothing to train, or a loss over a Keras mask
  (`trainer.check_no_mask`). Several inputs and outputs (lists or dicts)
  are split by rows as one input is."""
  if not model.built:
    raise errors.ConfigError(
        f'model {model.name!r} is not built; build a functional model '
        '(keras.Input) under the variables device.')
  if not getattr(model, 'inputs', None):
    raise errors.ConfigError(
        f'model {model.name!r} is a subclassed keras.Model: the towers need '
        'a functional one (keras.Model(inputs, outputs), or a built '
        'keras.Sequential), whose layers they can call and cut; build it so.')
  if not model.trainable_variables:
    raise errors.ConfigError(
        f'model {model.name!r} has no trainable weights: there is nothing to '
        'train; unfreeze some layers.')
  trainer.check_no_mask(model)


def check_options(config, options):
  """Raises `UserError` for step options these clones cannot run: the
  rules that need both records (the one-record rules are `StepOptions`')."""
  options.check_stages(config.num_stages)
  layouts.check_share_count(options.fixed_shares, config.num_clones)
  if options.reproducible_rows:
    atoms.check_devices(config)
