"""Model and pipeline parallelism: one clone cut into stages on devices.

`Stages` cuts a functional Keras model at layer boundaries into
consecutive stages (sub-models sharing the model's layers and variables),
and runs one clone's shard of a step through them, cut into micro-batches
(GPipe, Huang et al. 2019; here in the order of 1F1B, the default):

    time ->
    stage 0     F0  F1      B0  F2  B1  F3  B2      B3
    stage 1         F0  B0  F1  B1  F2  B2  F3  B3

Stage s of clone c runs on `DeploymentConfig.stage_device(c, s)`. The step
is one TensorFlow graph, whose executor runs an op as soon as its inputs
exist, so stage 1 works on micro-batch 0 while stage 0 works on
micro-batch 1. The order of each stage's passes is the
`pipeline_schedule`'s (`schedules`: 1F1B or GPipe), imposed with control
dependencies: a pass's inputs go through `pass_gate` identities that wait
for what the stage's previous pass made. Each stage's backward pass runs
on its own device, from the gradient of its outputs (computed by the next
stage) to the gradients of its inputs and variables (`tf.GradientTape` per
stage and micro-batch, with `output_gradients`). A tensor that several
stages read (a skip connection across a boundary) is sent from its
producer to each reader, and the gradients that come back are summed on
the producer's side.

Each micro-batch's loss is `trainer.shard_loss` of its rows over the global
batch, so the sum over micro-batches, clones (and workers) is the mean over
the global batch, and the step equals one device on the whole batch.
Gradients of one stage are summed over its micro-batches on the stage's
device (one transfer a stage per step), then over clones on the optimizer
device (`clones.optimize_clones`).

With `recompute`, a stage keeps only its inputs during the forward pass and
runs its forward again, under a tape, when its output gradients arrive
(GPipe's re-materialisation: memory for one micro-batch's activations a
stage instead of all of them). The recomputed moving statistics are
dropped: BatchNorm statistics are taken from the first pass only.

Variables stay where the towers keep them, on the variables device: the
clones share one copy, and the one update runs beside it; each stage reads
its own variables once a step. (GPipe keeps a stage's variables on its
device because it has one clone; with several, one copy per stage device
would need the clones' gradients all-reduced, the mirrored design.)
"""

import collections
import dataclasses
from typing import Tuple

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import rows
from tfmulti import step_options
from tfmulti import trainer
from tfmulti.pipeline import costs
from tfmulti.pipeline import partition
from tfmulti.pipeline import schedules


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage: a sub-model sharing the model's layers.

  Attributes:
    model: the stage's functional `keras.Model`.
    input_keys: `id()` of each Keras tensor it reads, in its input order.
    output_keys: `id()` of each tensor it produces that a later stage (or
      the model's output) reads.
    trainable: indices of its variables in `model.trainable_variables` of
      the whole model; `non_trainable` likewise.
    first_layer: the name of its first layer.
  """
  model: keras.Model
  input_keys: Tuple[int, ...]
  output_keys: Tuple[int, ...]
  trainable: Tuple[int, ...]
  non_trainable: Tuple[int, ...]
  first_layer: str


def stage_starts(model, num_stages, options):
  """Index (among `costs.operations`) of each stage's first layer, cut by
  `options` (a `StepOptions`: `stage_boundaries`, or else `stage_costs`
  and `stage_speeds`)."""
  names = [op.name for op, _ in costs.operations(model)]
  boundaries = options.stage_boundaries
  if boundaries is None:
    measure = (costs.measured_costs if options.stage_costs == costs.MEASURED
               else costs.estimated_costs)
    return partition.partition([cost for _, cost in measure(model)],
                               num_stages, options.stage_speeds)
  if len(boundaries) != num_stages - 1:
    raise errors.ConfigError(
        f'stage_boundaries={",".join(boundaries)}: name the first '
        f'layer of stages 1..{num_stages - 1} ({num_stages - 1} names) for '
        f'num_stages={num_stages}.')
  starts = [0]
  for name in boundaries:
    if name not in names:
      raise errors.ConfigError(
          f'stage_boundaries: {model.name!r} has no layer {name!r}; its '
          f'layers are {", ".join(names[:4])}, ... (see '
          'costs.estimated_costs).')
    if names.index(name) <= starts[-1]:
      raise errors.ConfigError(
          f'stage_boundaries: {name!r} must come after '
          f'{names[starts[-1]]!r}; give the layers in model order.')
    starts.append(names.index(name))
  return starts


def _indices(variables, among):
  where = {id(v): i for i, v in enumerate(among)}
  return tuple(where[id(v)] for v in variables)


def split_model(model, starts):
  """The `Stage`s of `model` that begin at the layers `starts`."""
  graph = costs.operations(model)
  ends = list(starts[1:]) + [len(graph)]
  output_keys = {id(t): t for t in model.outputs}
  stage_of_reader = {}
  for s, (a, b) in enumerate(zip(starts, ends)):
    for _, node in graph[a:b]:
      for tensor in node.input_tensors:
        stage_of_reader.setdefault(id(tensor), set()).add(s)
  stages = []
  for s, (a, b) in enumerate(zip(starts, ends)):
    produced, inputs, outputs = set(), {}, []
    for op, node in graph[a:b]:
      for tensor in node.input_tensors:
        if id(tensor) not in produced:
          inputs.setdefault(id(tensor), tensor)
      for tensor in node.output_tensors:
        produced.add(id(tensor))
        later = any(r > s for r in stage_of_reader.get(id(tensor), ()))
        if later or id(tensor) in output_keys:
          outputs.append(tensor)
        if id(tensor) in output_keys and s < len(starts) - 1:
          raise errors.ConfigError(
              f'model {model.name!r}: its output {tensor.name!r} comes from '
              f'stage {s} of {len(starts)} (layer {op.name!r}); '
              'the last stage gives every output: cut after that layer '
              '(stage_boundaries), or use fewer stages.')
    sub = keras.Model(list(inputs.values()), outputs,
                      name=f'{model.name}_stage_{s}')
    stages.append(Stage(
        sub, tuple(inputs), tuple(id(t) for t in outputs),
        _indices(sub.trainable_variables, model.trainable_variables),
        _indices(sub.non_trainable_variables, model.non_trainable_variables),
        graph[a][0].name))
  return stages


class Stages:
  """A model cut into stages, and one clone's step through them."""

  def __init__(self, model, num_stages, options=step_options.DEFAULTS):
    """Cuts `model` as the `StepOptions` say (the cut, micro-batches,
    recomputation); raises `ConfigError` for a cut that cannot be made."""
    self.options = options
    self.model = model
    self.stages = split_model(model, stage_starts(model, num_stages, options))
    self.input_keys = tuple(id(t) for t in model.inputs)
    self.output_keys = tuple(id(t) for t in model.outputs)

  def _forward(self, s, context, values, flight):
    """Stage `s` on one micro-batch (`flight`): its `_Result`."""
    stage = self.stages[s]
    non_trainable = [context.non_trainable[i] for i in stage.non_trainable]
    seeds = keras_internals.seed_indices(stage.model)
    folded = keras_internals.fold_seeds(non_trainable, seeds, flight.offset)
    outputs, new_non_trainable, losses = stage.model.stateless_call(
        [context.trainable[i] for i in stage.trainable], folded,
        [values[k] for k in stage.input_keys],
        training=True, return_losses=True)
    new_non_trainable = keras_internals.unfold_seeds(
        new_non_trainable, folded, non_trainable, seeds)
    outputs = keras.tree.flatten(outputs)
    # In the variables' dtype (float64 models too), not the activations'.
    dtype = (context.trainable[stage.trainable[0]].dtype if stage.trainable
             else tf.float32)
    model_losses, penalties = keras_internals.split_losses(stage.model,
                                                           losses)
    penalty = (trainer.penalty(penalties, flight.weight, dtype) +
               trainer.model_loss(model_losses, flight.rows,
                                  context.global_rows, dtype))
    loss = None
    if s == len(self.stages) - 1:  # The penalty is kept apart, per stage.
      loss, _, _ = trainer.objective(context.loss_fn, flight.labels,
                                     self._model_outputs(stage, outputs),
                                     global_rows=context.global_rows)
    return _Result(outputs, new_non_trainable, penalty, loss,
                   (model_losses, penalties))

  def clone_step(self, devices, loss_fn, global_rows, pieces, shift,
                 trainable, non_trainable, images, labels, loss_scale):
    """One clone's forward and backward passes over its stages.

    As `clones.clone_step`, on the clone's `pieces` (`rows.Piece`s: its
    micro-batches, whose rows, penalty weights and offsets it reads, the
    offsets moved by `shift`), with `devices` the clone's stage devices;
    the new non-trainable values come as a list, one a micro-batch, for
    `batch_norm.combine_non_trainable`. With `reproducible_rows` each
    micro-batch is an atom, and the losses and gradients come stacked over
    them, as `deploy.atoms.run_pieces` gives them. Each stage runs its
    passes in the order of `pipeline_schedule` (`schedules.passes`).
    """
    pieces = [piece for piece in pieces if piece.rows]
    sizes = [piece.rows for piece in pieces]
    with tf.device(devices[0]):
      image_parts = rows.split(images, sizes)
      label_parts = rows.split(labels, sizes)
    context = _Context(loss_fn, global_rows, loss_scale, trainable,
                       non_trainable,
                       tf.get_current_name_scope())
    flights = [_Flight(dict(zip(self.input_keys, keras_internals.flat_inputs(
        self.model, x))), y, piece, shift, len(self.stages),
                       list(non_trainable))
               for piece, x, y in zip(pieces, image_parts, label_parts)]
    ends = [[] for _ in self.stages]  # What each stage's last pass made.
    per_stage = schedules.passes(self.options.pipeline_schedule,
                                 len(self.stages), len(sizes))
    for s, kind, m in schedules.build_order(per_stage):
      run = self._forward_pass if kind == schedules.FORWARD else (
          self._backward_pass)
      ends[s] = run(s, m, devices, context, flights[m], ends[s])
    return self._clone_results(devices, context, flights, len(trainable))

  def _clone_results(self, devices, context, flights, num_trainable):
    """`clone_step`'s results from its micro-batches' flights."""
    last = len(self.stages) - 1
    losses, regularizations = [], []
    for flight in flights:
      loss = flight.kept[last][2].loss
      with tf.device(devices[last]):
        # One sum over every layer's regularization (the stages' tapes
        # take theirs apart), the same whatever the cut.
        kept = [flight.kept[s][2].losses for s in range(last + 1)]
        regularization = trainer.penalty(
            [x for _, penalties in kept for x in penalties], flight.weight,
            loss.dtype) + trainer.model_loss(
                [x for model_losses, _ in kept for x in model_losses],
                flight.rows, context.global_rows, loss.dtype)
      losses.append(loss + regularization)
      regularizations.append(regularization)
    # Summed over micro-batches on each stage's device; with atoms (each
    # micro-batch one atom), stacked there instead, for the step's fold.
    combine = tf.stack if self.options.reproducible_rows else tf.add_n
    gradients = [None] * num_trainable
    for s, stage in enumerate(self.stages):
      with tf.device(devices[s]), tf.name_scope(f'stage_{s}_sum'):
        for k, index in enumerate(stage.trainable):
          grads = [f.stage_grads[s][k] for f in flights
                   if f.stage_grads[s][k] is not None]
          if grads:
            gradients[index] = combine(grads)
    with tf.device(devices[-1]):
      loss = combine(losses)
      output = tf.nest.map_structure(
          lambda *parts: tf.concat(parts, axis=0),
          *(self._model_outputs(self.stages[last], f.kept[last][2].outputs)
            for f in flights))
    return (output, loss, tf.add_n(regularizations), gradients,
            [f.new_non_trainable for f in flights])

  def _scope(self, context, m, s, suffix=''):
    """The absolute name scope of micro-batch m's pass on stage s (passes
    of one micro-batch are built apart, in the schedule's order)."""
    name = f'microbatch_{m}/stage_{s}{suffix}/'
    return f'{context.scope}/{name}' if context.scope else name

  def _forward_pass(self, s, m, devices, context, flight, after):
    """Micro-batch m through stage s, once the stage's previous pass
    (`after`, the tensors it made) is done; returns what it made."""
    stage = self.stages[s]
    with tf.device(devices[s]), tf.name_scope(self._scope(context, m, s)):
      inputs = _gate([flight.values[k] for k in stage.input_keys], after)
      if self.options.recompute and s < len(self.stages) - 1:
        tape, result = None, self._forward(
            s, context, dict(zip(stage.input_keys, inputs)), flight)
      else:
        tape, result = self._taped(s, context, inputs, flight)
      flight.values.update(zip(stage.output_keys, result.outputs))
      for i, value in zip(stage.non_trainable, result.state):
        flight.new_non_trainable[i] = value
      flight.kept[s] = (inputs, tape, result)
    return list(result.outputs) + [result.penalty] + (
        [] if result.loss is None else [result.loss])

  def _backward_pass(self, s, m, devices, context, flight, after):
    """Micro-batch m's backward pass through stage s, from the gradients
    of its outputs, once the stage's previous pass (`after`) is done:
    the gradients of its variables and of the tensors it read; returns
    what it made."""
    stage, last = self.stages[s], len(self.stages) - 1
    inputs, tape, result = flight.kept[s]
    with tf.device(devices[s]), tf.name_scope(
        self._scope(context, m, s, '_backward')):
      upstream = [flight.upstream[k] for k in stage.output_keys] if (
          s < last) else []
      if tape is None:  # Recompute, once the output gradients exist.
        inputs = _gate(_gate(inputs, after), upstream, 'await_gradients')
        tape, result = self._taped(s, context, inputs, flight)
      outputs, penalty, loss = result.outputs, result.penalty, result.loss
      scale = tf.cast(context.loss_scale, penalty.dtype)
      if s == last:
        targets = [loss, penalty]
        output_gradients = _gate([scale, scale], after)
      else:
        targets = list(outputs) + [penalty]
        output_gradients = _gate(upstream, after) + [scale]
      input_keys = [k for k in stage.input_keys
                    if k not in self.input_keys]
      sources = [context.trainable[i] for i in stage.trainable] + [
          x for k, x in zip(stage.input_keys, inputs)
          if k not in self.input_keys]
      grads = tape.gradient(targets, sources,
                            output_gradients=output_gradients)
      n = len(stage.trainable)
      flight.stage_grads[s] = grads[:n]
      for k, x, g in zip(input_keys, sources[n:], grads[n:]):
        g = tf.zeros_like(x) if g is None else g
        flight.upstream[k] = (flight.upstream[k] + g
                              if k in flight.upstream else g)
    return [g for g in grads if g is not None]

  def _taped(self, s, context, inputs, flight):
    """`_forward` recorded on a tape: (tape, its results)."""
    stage = self.stages[s]
    values = dict(zip(stage.input_keys, inputs))
    with tf.GradientTape() as tape:
      tape.watch([context.trainable[i] for i in stage.trainable])
      tape.watch([x for k, x in values.items() if k not in self.input_keys])
      result = self._forward(s, context, values, flight)
    return tape, result

  def predict(self, devices, images, trainable, non_trainable):
    """Inference through the stages on `devices`: (outputs, the layers'
    add_loss terms, their weight penalties)."""
    values = dict(zip(self.input_keys,
                      keras_internals.flat_inputs(self.model, images)))
    model_losses, penalties = [], []
    for s, stage in enumerate(self.stages):
      with tf.device(devices[s]):
        outputs, _, losses = stage.model.stateless_call(
            [trainable[i] for i in stage.trainable],
            [non_trainable[i] for i in stage.non_trainable],
            [values[k] for k in stage.input_keys], training=False,
            return_losses=True)
        values.update(zip(stage.output_keys, keras.tree.flatten(outputs)))
        adds, weights = keras_internals.split_losses(stage.model, losses)
        model_losses += adds
        penalties += weights
    return (keras_internals.pack_outputs(
        self.model, [values[k] for k in self.output_keys]), model_losses,
            penalties)

  def _model_outputs(self, stage, outputs):
    """The model's outputs, in its structure, from the last stage's."""
    made = dict(zip(stage.output_keys, outputs))
    return keras_internals.pack_outputs(
        self.model, [made[k] for k in self.output_keys])


def _gate(tensors, after, name='pass_gate'):
  """`tensors` through identities that run after the ops making `after`:
  what holds a pass back until its stage's previous pass is done."""
  with tf.control_dependencies(after):
    return [tf.identity(t, name=name) for t in tensors]


# A stage's forward pass on one micro-batch: its outputs, the new
# non-trainable values, its part of the regularization (penalties times the
# weight, add_loss terms by rows), the micro-batch's part of the loss (the
# last stage; else None), and its layers' (add_loss terms, penalties).
_Result = collections.namedtuple(
    '_Result', ['outputs', 'state', 'penalty', 'loss', 'losses'])


@dataclasses.dataclass(frozen=True)
class _Context:
  """What every pass of a clone's step shares (see `clone_step`)."""
  loss_fn: object
  global_rows: object
  loss_scale: object
  trainable: list
  non_trainable: list
  scope: str  # The clone's name scope, where the passes' scopes go.


class _Flight:
  """One micro-batch on its way through the stages: what its passes made
  and what the later ones read."""

  def __init__(self, values, labels, piece, shift, num_stages,
               non_trainable):
    self.values = values  # Keras tensor id -> the tensor; inputs first.
    self.labels = labels
    self.rows = piece.rows
    self.weight = piece.penalty  # Its part of the weight penalties.
    self.offset = piece.offset + shift  # Its first row, for its seeds.
    self.kept = [None] * num_stages  # (inputs, tape or None, results).
    self.upstream = {}  # Gradients of the tensors the later stages read.
    self.stage_grads = [None] * num_stages
    self.new_non_trainable = non_trainable
