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

import dataclasses

from absl import logging
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import layouts
from tfmulti import pieces
from tfmulti import plans
from tfmulti import rows
from tfmulti import step_options
from tfmulti import trainer
from tfmulti.deploy import balance
from tfmulti.deploy import batch_norm
from tfmulti.deploy import combiners
from tfmulti.deploy import feeds
from tfmulti.deploy import packs
from tfmulti.deploy import runners
from tfmulti.deploy import towers_in_strategy
from tfmulti.deploy import xla_rule
from tfmulti.deploy.clones import create_clones
from tfmulti.deploy.clones import on_clone
from tfmulti.deploy.clones import placed
from tfmulti.deploy.clones import split_batch
from tfmulti.deploy.clones import values_of
from tfmulti.mesh import shard_views
from tfmulti.mesh import sharding
from tfmulti.pipeline import schedules
from tfmulti.pipeline.stages import Stages


@dataclasses.dataclass(frozen=True)
class Parts:
  """What a `DeployedModel`'s step is composed of, chosen once by
  `deploy()` from the config and the options.

  Attributes:
    runner: how each clone runs its shard (`runners`).
    combiner: how the clones' gradients meet (`combiners`).
    shares: the shares policy: with `clone_shares='auto'`, the
      `balance.Balancer` that measures them; else `balance.Fixed`, the
      options' own (or the one given to `deploy(..., shares=)`).
    measure: `balance.Probes`: each clone timed alone, the policy's
      measure.
    update_scope: the context the optimizer's update runs in: beside each
      variable (where the variables are spread, its owner; else the
      variables device, where it would run anyway).
    storage: what the step reads and updates (`sharding`): the model's
      trainable variables, or their shards.
    summaries: `summaries(grads_and_vars, scale)` -> {path: gradient}, or
      nothing without `summarize_gradients`.
  """
  runner: object
  combiner: object
  shares: object
  measure: object
  storage: object
  update_scope: object = lambda optimizer: (
      keras_internals.updates_beside_variables(optimizer,
                                               devices.GraphPlacement()))
  summaries: object = lambda grads_and_vars, scale: {}


class DeployedModel(trainer.Trainer):
  """A model deployed over clones, with its compiled training step.

  Slim's DeployedModel held a train_op and summary_op; in TF 2 it holds the
  `tf.function` that runs one step, composed of the `Parts` `deploy()`
  chose. Attributes: `config`, `model`, `loss_fn`, `optimizer`, `options`
  (the `StepOptions`), `parts` and `stages` (the `pipeline.Stages`, or
  None).
  """

  def __init__(self, config, model, loss_fn, optimizer, options, parts):
    self.config = config
    self.model = model
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.options = options
    self.parts = parts
    self.stages = getattr(parts.runner, 'stages', None)
    self._shares = options.fixed_shares
    self._feeder = None  # A `feeds.Feeder`, made at the first feed.
    self._fed = None  # The `feeds.Fed` a compiled loop reads, if any.
    self.step_function = tf.function(self.step_graph, autograph=False)
    self._predict = tf.function(self._predict_graph, autograph=False)

  @property
  def clone_shares(self):
    """Each clone's share of a step's rows; None for equal. Read-only:
    the options' own, or the shares policy's latest."""
    return self._shares

  def step_graph(self, images, labels, layout, cut=split_batch,
                 with_outputs=False):
    """The step, untraced: for `tf.function`, or inside a replica context
    (each worker of a multi-worker job runs it; Keras's `apply_gradients`
    then all-reduces the workers' summed gradients before the update).

    `images` and `labels` are nests of this worker's batch, and `cut`
    `(config, nest, layout, worker)` cuts each into the clones' shards:
    `clones.split_batch` on the inputs device, or `clones.placed` for the
    shards a feed cut and placed (`rows.Shards.parts`). `layout` is the
    step's `layouts.StepLayout` (`layout_for`). `with_outputs`: also
    return the clones' outputs, in row order.
    """
    config = self.config
    with tf.device(config.optimizer_device()):
      scale = tf.identity(trainer.loss_scale_of(self.optimizer))
    worker = config.worker_index
    images, labels = (cut(config, nest, layout, worker)
                      for nest in (images, labels))

    def clones_of(images, labels, k, shift):
      return create_clones(
          config, self.parts.runner, images, labels, layout=layout,
          accumulation_step=k,
          terms=pieces.StepTerms(layout.global_rows, scale, shift))
    structure = [] if with_outputs else None  # The outputs' nest.
    gradients, (total, regularization, *clone_losses), outputs = (
        self.parts.combiner(clones_of, images, labels, layout, structure))
    with tf.device(config.optimizer_device()):
      grads_and_vars = [(g, v) for g, v in zip(
          gradients, self.parts.storage.variables) if g is not None]
      summed = self.parts.summaries(grads_and_vars, scale)
      grads_and_vars, total, regularization = (
          self.parts.combiner.for_update(grads_and_vars, total,
                                         regularization))
      # A LossScaleOptimizer divides by the scale, and skips the update
      # (halving the scale) when a gradient is not finite.
      with self.parts.update_scope(self.optimizer):
        self.optimizer.apply_gradients(grads_and_vars)
    return trainer.StepOutputs(
        total, regularization, clone_losses, summed,
        tf.nest.pack_sequence_as(structure[0], outputs) if outputs else None)

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
    if not self.parts.shares.measured():  # The first cut waits for one.
      self._measure_shares(*feeds.stand_in(specs))
    if self._feeder is None:
      self._feeder = feeds.Feeder(self.config)
    layout = self.layout_for(*specs)
    return self._feeder.feed(dataset, layout, self.config.worker_index)

  def _measure_shares(self, images, labels):
    """Asks the shares policy for the next step's shares on this batch
    (with `clone_shares='auto'`, measured again when due)."""
    rows_ = layouts.accumulation_step_rows(
        tf.nest.flatten(images)[0].shape[0],
        layouts.cut_of(self.config, self.options))
    with tf.device(self.config.inputs_device()):
      self._shares = self.parts.shares.shares(images, labels, rows=rows_,
                                              current=self._shares)

  def layout_for(self, images, labels, partial=False):
    """The `layouts.StepLayout` of a step on this worker's batch (nests),
    under the clones' current shares; raises `ConfigError` for a batch
    that cannot be cut so. `partial`: a short last batch (Keras's), which
    may leave clones or micro-batches empty, as plain `fit` trains it."""
    return layouts.for_step(self.config, self.options,
                            rows.batch_rows(images, labels),
                            shares=self._shares, partial=partial)

  def check_batch(self, global_rows, partial=False):
    """Raises `ConfigError` for a batch of `global_rows` rows (this
    process's: the towers' step runs one worker's) that the step cannot
    cut under the clones' current shares."""
    layouts.for_step(self.config, self.options, global_rows,
                     shares=self._shares, partial=partial)

  def _step_arguments(self, images, labels, partial=False, measure=False):
    """The compiled step's (images, labels, layout, cut) for this
    batch, or for a feed's `rows.Shards` (their own layout, each shard
    read on its clone). `measure`: with `clone_shares='auto'`, the shares
    are measured first, when due (for shards, on zeros shaped as a shard,
    for the feed's next cut)."""
    if isinstance(images, rows.Shards):
      if measure:
        self._measure_shares(*(
            feeds.stand_in(nest.parts[0], nest.layout.worker_rows())
            for nest in (images, labels)))
      return images.parts, labels.parts, images.layout, placed
    images, labels = [tf.nest.map_structure(tf.convert_to_tensor, nest)
                      for nest in (images, labels)]
    if measure:
      self._measure_shares(images, labels)
    return (images, labels, self.layout_for(images, labels, partial),
            split_batch)

  def train_step_outputs(self, images, labels, *, partial=False,
                         with_outputs=False, whole_batch=False):
    """One step on this worker's batch, or on a feed's `rows.Shards`
    (`distribute_dataset`); returns its `StepOutputs`.

    `partial` takes a short last batch (see `layout_for`);
    `with_outputs` returns the training outputs too (for compiled metrics);
    `whole_batch` changes nothing in one process (the batch is its own).
    One trace per distinct layout: it is a frozen record of ints.
    """
    del whole_batch  # One process: its batch is the job's.
    return self._step(
        self._step_arguments(images, labels, partial, measure=True),
        with_outputs)

  def _step(self, arguments, with_outputs):
    """The compiled step on `arguments`: its `StepOutputs`, each output
    with the logits Keras kept on it again (`step_graph`'s are a
    `keras_internals.with_logits` nest)."""
    result = self.step_function(*arguments, with_outputs)
    return result._replace(outputs=keras_internals.logits_kept(
        result.outputs))

  def loop_iterator(self, batches):
    """An iterator over `batches` for a compiled loop of steps: a feed's
    multi-device iterator (its elements cut into `rows.Shards` in the
    loop, `loop_step`), or the batches' own."""
    self._fed = batches if isinstance(batches, feeds.Fed) else None
    return self._fed.iterator() if self._fed else iter(batches)

  def loop_step(self, element, with_outputs=False, whole_batch=False):
    """One step of a compiled loop on an element of `loop_iterator`: the
    compiled step at the clones' current shares (measured between loops,
    not in them)."""
    del whole_batch  # One process: its batch is the job's.
    if self._fed is not None:
      element = self._fed.shards(element)
    return self._step(self._step_arguments(*element), with_outputs)

  def traced_step(self, images, labels, with_outputs=False):
    """The step's concrete function on this batch, or on a feed's
    `rows.Shards` (its graph shows where each op runs)."""
    return self.step_function.get_concrete_function(
        *self._step_arguments(images, labels), with_outputs)

  def throughputs(self, images, labels):
    """Each clone's rows a second alone on this batch (`balance.Probes`)."""
    return self.parts.measure(images, labels)

  def _predict_graph(self, images, with_losses=False):
    config, model = self.config, self.model
    # Inference may see a short last batch: shards differ by one row at most,
    # and a batch of fewer rows than clones leaves the last clones idle.
    total = tf.nest.flatten(images)[0].shape[0]
    sizes = layouts.even_parts(total, config.num_clones)
    with tf.device(config.inputs_device()), tf.name_scope('split_batch'):
      shards = rows.split(images, sizes)
    outputs, regularization = [], []
    for i in (i for i, size in enumerate(sizes) if size):
      with on_clone(config, i):
        output, model_losses, penalties = self.parts.runner.infer(
            i, shards[i], (values_of(self.parts.storage.variables),
                           values_of(model.non_trainable_variables)))
        outputs.append(output)
        # The weight penalties once; the add_loss terms by rows, as a step.
        regularization.append(
            trainer.penalty(penalties, float(not regularization)) +
            trainer.model_loss(model_losses, sizes[i], total))
    with tf.device(config.inputs_device()):
      outputs = keras_internals.logits_kept(tf.nest.map_structure(
          lambda *parts: tf.concat(parts, axis=0), *outputs))
      return (outputs, tf.add_n(regularization)) if with_losses else outputs

  def predict(self, images):
    """Inference outputs for `images` (a nest), computed over the clones."""
    return self._predict(tf.nest.map_structure(tf.convert_to_tensor, images))

  def evaluate_outputs(self, images):
    """(inference outputs, the model's losses on them: weight penalties and
    `add_loss` terms, as one device would count them), for evaluation."""
    return self._predict_graph(
        tf.nest.map_structure(tf.convert_to_tensor, images), with_losses=True)


def deploy(config, model, loss_fn, optimizer, options=None, *, shares=None,
           **fields):
  """Deploys `model` over `config`'s clones.

  Checks the options (`checked_options`), then builds the step (`build`):
  the optimizer's slot variables on the variables device, and, before
  anything runs, that every device exists and every variable lives on
  `config.variables_device()`.

  Args:
    config: a `DeploymentConfig`.
    model: a functional `keras.Model` built under
      `tf.device(config.variables_device())`.
    loss_fn: `loss_fn(labels, outputs)` -> mean loss (any `keras.losses`
      object with its default reduction).
    optimizer: a Keras optimizer created under the variables device.
    options: a `StepOptions` (how each step runs); None for the defaults.
    shares: the shares policy (`balance.Balancer`, `balance.Fixed`, or
      one of the same methods), for benchmarks and tests that set or
      measure the shares their own way; None: the options' (`compose`).
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
  options = checked_options(config, batch_norm.honoured(
      model, dataclasses.replace(options or step_options.StepOptions(),
                                 **fields)))
  return build(config, model, loss_fn, optimizer, options, shares=shares)


def checked_options(config, options):
  """`options` checked against `config` (`check_options`) with `xla`
  resolved (`xla_rule`): what `build` takes. The registry calls it once,
  before anything is built; `deploy` for the library's own callers."""
  check_options(config, options)
  return xla_rule.resolve(config, options)


def build(config, model, loss_fn, optimizer, options, *, shares=None):
  """The `DeployedModel` of `model` on `config`'s clones, for options
  already checked (`checked_options`); see `deploy`."""
  check_model(model)
  batch_norm.check_honoured(model, options)
  trainer.check_loss(loss_fn)
  devices.check_devices_exist(
      config.variable_devices() + [config.optimizer_device(),
                                   config.inputs_device()] +
      config.compute_devices())
  storage = sharding.storage_of(
      config, model, optimizer,
      split_compute=not options.reproducible_rows)
  parts = compose(config, model, loss_fn, options, shares, storage)
  if not optimizer.built:  # Keras puts each slot beside its variable.
    with tf.device(config.optimizer_variables_device()):
      optimizer.build(storage.variables)
  plans.plan_slots(optimizer)  # Planned beside their variables, if planned.
  shard_views.register(optimizer, storage)
  devices.check_placement(
      storage.variables + model.non_trainable_variables,
      config.variable_devices())
  devices.check_placement(optimizer.variables, config.variable_devices() +
                          [config.optimizer_variables_device()])
  parts.combiner.prepare()
  return DeployedModel(config, model, loss_fn, optimizer, options, parts)


def compose(config, model, loss_fn, options, shares=None, storage=None):
  """The `Parts` of the step these options ask for on `config`'s clones:
  each choice made here, once (raises `ConfigError` for a stage cut that
  cannot be made). `shares`: a shares policy to use instead of the
  options'; `storage`: the model's (`sharding.storage_of`), None for its
  variables whole."""
  storage = storage or sharding.Whole(model)
  owners = [config.owner_device(devices.device_of(v))
            for v in storage.variables]
  gradient_packs = packs.groups(storage.variables, owners,
                                options.gradient_packs, storage.in_place)
  combine = combiners.of(options)
  if layouts.is_staged(config, options):
    # Interleaved 1F1B and ZB-V cut several chunks a stage device.
    chunks = config.num_stages * schedules.chunks_per_device(
        options.pipeline_schedule, options.virtual_stages)
    runner = runners.StagedClones(config, Stages(model, chunks, options),
                                  loss_fn, combine.fold)
  elif options.sync_batch_norm:
    runner = runners.LockstepClones(
        config, model, loss_fn, options,
        towers_in_strategy.lockstep_strategy(config))
  else:
    runner = runners.WholeClones(config, model, loss_fn, options,
                                 gradient_packs, combine.run_pieces,
                                 storage)
  measure = balance.Probes(config, options, runner)
  shares = shares or (balance.Balancer(options.rebalance_every_steps)
                      if options.auto_shares else balance.Fixed(
                          options.fixed_shares))
  if storage.splits and not layouts.is_staged(config, options):
    shares = balance.OnLeaders(shares, storage.leaders())
  return Parts(
      runner,
      combine(config, storage.variables, combiners.States(
          config, model, options.batch_norm_policy), gradient_packs),
      shares=shares.with_measure(measure), measure=measure, storage=storage,
      summaries=(trainer.gradients_by_path if options.summarize_gradients
                 else Parts.summaries))


def check_model(model):
  """Raises `ConfigError` for a model the towers cannot clone: not built,
  nothing to train, or a loss over a Keras mask (`trainer.check_no_mask`).
  Any Keras model class is cloned (functional, `keras.Sequential`,
  subclassed: each clone runs `stateless_call`); only stages need the
  layer graph (`pipeline.costs.operations`). Several inputs and outputs
  (lists or dicts) are split by rows as one input is."""
  if not model.built and not model.variables:  # A GAN's: its parts built.
    raise errors.ConfigError(
        f'model {model.name!r} is not built; build it under the variables '
        'device: keras.Input for a functional or Sequential model, a first '
        'call on a batch (model(x)) for a subclassed one.')
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
  if config.variable_layouts is not None and options.sync_batch_norm:
    raise errors.UnsupportedError(
        'sync_batch_norm with variable layouts: the clones in lockstep read '
        'whole variables; leave sync_batch_norm off, or the layouts unset.')
  combiners.of(options).check(config)
