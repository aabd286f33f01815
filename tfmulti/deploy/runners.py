"""Piece runners: how a step's clones run their shards, chosen once.

`deploy()` picks one runner from the config and the step options, and the
step never asks again:

  WholeClones     each clone whole on its device (slim's towers), its
                  pieces (one, or its atoms) through `pieces.Body`; with
                  split kernels, a mesh row's leader takes its rows and
                  computes each block on its device (`tensor_parallel`)
  LockstepClones  the clones as the replicas of a MirroredStrategy over
                  the clone devices, all at once, every BatchNorm
                  synchronized (`sync_batch_norm`)
  StagedClones    each clone cut into stages on their devices, fed with
                  micro-batches in its schedule's order (`pipeline.Stages`)

Every runner answers the same three calls: `run` (a step's clones on
their shards, one result a clone, None for an empty one), `infer` (one
clone's inference) and `probe` (one clone's forward and backward pass
alone, for timing it).
"""

from absl import logging
import tensorflow as tf

from tfmulti import devices
from tfmulti import keras_internals
from tfmulti import pieces
from tfmulti import slices
from tfmulti.deploy import atoms
from tfmulti.deploy import packs as packs_lib
from tfmulti.deploy import towers_in_strategy
from tfmulti.deploy.clones import on_clone
from tfmulti.deploy.clones import values_of
from tfmulti.mesh import sharding
from tfmulti.pipeline import stages as stages_lib


class WholeClones:
  """Each clone runs whole on its device; its gradients come back there.

  With `reproducible_rows` each atom of a clone runs alone and the
  results come stacked, atom first (`atoms.run_atoms`); with XLA, each
  piece's pass is one compiled cluster on its clone's device (compiling
  the whole step would fuse every clone into one cluster on one device),
  unless it looks tables up or computes layers on other devices
  (`lookups`, `tensor_parallel`).
  """

  def __init__(self, config, model, loss_fn, options, packs=(),
               run_pieces=atoms.run_whole, storage=None):
    """`run_pieces`: how a clone runs its pieces, the combiner's choice
    (`atoms.run_whole`, or `atoms.run_atoms`, each atom alone); `storage`:
    what it reads (`sharding`), None for the model's variables whole."""
    self.config = config
    self.model = model
    self.storage = storage or sharding.Whole(model)
    self.body = pieces.Body(model, loss_fn, read=self.storage.read)
    if options.xla is True:  # 'auto' is resolved by `xla_rule` first.
      if self.storage.why_not_compiled:
        logging.info('xla: the passes are not compiled: %s.',
                     self.storage.why_not_compiled)
      else:
        self.body = compiled(self.body)
    self.body = self.storage.cutting(self.body)
    self.run_pieces = run_pieces
    self.packs = packs

  def run(self, clone_pieces, images, labels, terms):
    """Clone i's `pieces` on its shard `images[i]`, `labels[i]`.

    Args:
      clone_pieces: per clone, its `layouts.Piece`s of the accumulation
        step.
      images, labels: per clone, its rows of the step (nests).
      terms: the step's `pieces.StepTerms`.

    Returns:
      Per clone, (outputs, loss, regularization, gradients, [new
      non-trainable values, one set a piece]); None for a clone with no
      rows. A split kernel's shard pieces come on the first clone that
      computed its block (a mesh row's leader), None on the others
      (`storage.met`).
    """
    reads = _packed_reads(self.config, self.storage.variables, self.packs)

    def run_clone(i, mine, x, y):
      variables = (reads(self.config.clone_device(i)),
                   values_of(self.model.non_trainable_variables))
      return self.run_pieces(self.body, mine, variables, x, y, terms)
    return self.storage.met(
        _each_clone(self.config, clone_pieces, images, labels, run_clone))

  def infer(self, clone_index, images, variables):
    """Clone `clone_index`'s inference on `images`, from `variables`
    (the values of `storage.variables` and of the non-trainable ones):
    (outputs, a `with_logits` nest, its `add_loss` terms, its weight
    penalties), its tables looked up where they live. Call it on the
    clone's device."""
    del clone_index  # The whole model, on the device it is called on.
    trainable, _, context = self.storage.read(variables[0],
                                              lambda sources: None)
    with context:
      output, _, losses = keras_internals.stateless_run(
          self.model, trainable, variables[1], images, training=False)
    return (keras_internals.with_logits(output),
            *keras_internals.split_losses(self.model, losses))

  def probe(self, clone_index, images, labels, layout):
    """Clone `clone_index` alone on a batch cut by `layout` (one clone):
    (loss, gradients), on its device; a split kernel's gradients are its
    blocks' uncut (not met: a probe times a pass)."""
    with on_clone(self.config, clone_index):
      variables = (values_of(self.storage.variables),
                   values_of(self.model.non_trainable_variables))
      result = atoms.run_whole(self.body, layout.of(0, 0, 0), variables,
                               images, labels,
                               pieces.StepTerms(layout.global_rows))
    return result[1], result[3]


class LockstepClones(WholeClones):
  """The clones as the replicas of `strategy` (a `MirroredStrategy` over
  the clone devices), all at once, so Keras's synchronized BatchNorm
  all-reduces its batch statistics between them
  (`towers_in_strategy.run_clones_in_lockstep`); the variables, the sum
  and the update stay the towers'. Each clone is one piece (equal shards,
  checked by the layout)."""

  def __init__(self, config, model, loss_fn, options, strategy):
    super().__init__(config, model, loss_fn, options)
    self.strategy = strategy

  def run(self, clone_pieces, images, labels, terms):
    with tf.device(self.config.optimizer_device()):
      variables = (values_of(self.model.trainable_variables),
                   values_of(self.model.non_trainable_variables))
    with keras_internals.synchronized_batch_norms(self.model):
      results = towers_in_strategy.run_clones_in_lockstep(
          self.strategy, self.body, lambda i: variables,
          [(x, y, mine[0].penalty, mine[0].offset + terms.shift)
           for x, y, mine in zip(images, labels, clone_pieces)], terms,
          _scopes(self.config))
    return [(*result[:-1], [result[-1]]) for result in results]


class StagedClones:
  """Each clone cut into stages (`pipeline.Stages`) on
  `config.chunk_devices`, its shard fed through them in micro-batches in
  the order of the schedule; the stages read the variables from their
  owners whole (no packs)."""

  def __init__(self, config, stages, loss_fn, fold=slices.add):
    """`fold`: how a clone's micro-batches' gradients and losses meet on
    each stage's device, the combiner's choice (`slices.add`, or `atoms.stacked`
    for its fold of the atoms)."""
    self.config = config
    self.stages = stages
    self.fold = fold
    self.model = stages.model
    self.loss_fn = loss_fn

  def _devices(self, clone_index):
    return self.config.chunk_devices(clone_index, self.stages.chunk_devices)

  def _variables(self):
    return (values_of(self.model.trainable_variables),
            values_of(self.model.non_trainable_variables))

  def run(self, clone_pieces, images, labels, terms):
    """As `WholeClones.run`, through each clone's stages."""
    return _each_clone(
        self.config, clone_pieces, images, labels,
        lambda i, mine, x, y: self.stages.clone_step(
            self._devices(i), self.loss_fn, mine, self._variables(), (x, y),
            terms, self.fold))

  def infer(self, clone_index, images, variables):
    """As `WholeClones.infer`, through the clone's stages."""
    return stages_lib.predict(self.stages, self._devices(clone_index),
                              images, *variables)

  def probe(self, clone_index, images, labels, layout):
    """As `WholeClones.probe`, through the clone's stages."""
    with on_clone(self.config, clone_index):
      result = self.stages.clone_step(
          self._devices(clone_index), self.loss_fn, layout.of(0, 0, 0),
          self._variables(), (images, labels),
          pieces.StepTerms(layout.global_rows), self.fold)
    return result[1], result[3]


def compiled(body):
  """`body` (a `pieces.Body`) as one XLA-compiled function, traced once
  for every piece of the same shapes and penalty weight: the piece's
  offset goes in as a tensor (a Python int differs from clone to clone,
  and each value would be traced and compiled again). Its ops carry no
  device: each call runs it on the device it is called on."""
  function = tf.function(body, jit_compile=True)

  def call(trainable, non_trainable, images, labels, penalty_weight,
           offset, terms):
    return function(trainable, non_trainable, images, labels,
                    penalty_weight, tf.convert_to_tensor(offset), terms)
  return call


def _each_clone(config, clone_pieces, images, labels, run_clone):
  """`run_clone(i, pieces, images, labels)` for each clone with rows, on
  its device under its scope; None for a clone with none."""
  results = []
  for i, (mine, x, y) in enumerate(zip(clone_pieces, images, labels)):
    if not any(p.rows for p in mine):
      results.append(None)
      continue
    with on_clone(config, i):
      results.append(run_clone(i, mine, x, y))
  return results


def _scopes(config):
  """Each clone's name scope (`on_clone`'s)."""
  return [config.clone_scope(i) or 'clone' for i in range(config.num_clones)]


def _packed_reads(config, variables, packs):
  """`reads(device)`: the variables' values for a clone on `device`, each
  read once where it lives (TensorFlow sends a tensor once to each device
  that reads it: one read a variable, not one a clone) when a clone first
  needs it, those of each pack from another device as one tensor, packed
  once on its owner."""
  owners = [config.owner_device(devices.device_of(v)) for v in variables]
  packed = {group: packs_lib.read_packed(variables, group, owners[group[0]])
            for group in packs}
  values = {}

  def value(k):
    if k not in values:
      values[k] = tf.convert_to_tensor(variables[k])
    return values[k]

  def reads(device):
    unpacked = {}
    for group, tensor in packed.items():
      if not devices.same_device(owners[group[0]], device):
        unpacked.update(zip(group, packs_lib.unpack(
            tensor, [variables[k].shape for k in group])))
    return [unpacked[k] if k in unpacked else value(k)
            for k in range(len(variables))]
  return reads
