"""Model and pipeline parallelism: one clone cut into stages on devices.

`Stages` cuts a functional Keras model at layer boundaries into
consecutive stages (sub-models sharing the model's layers and variables),
and runs one clone's shard of a step through them, cut into micro-batches
(GPipe, Huang et al. 2019; here in the order of 1F1B, the default):

    time ->
    stage 0     F0  F1      B0  F2  B1  F3  B2      B3
    stage 1         F0  B0  F1  B1  F2  B2  F3  B3

Stage (chunk) s of clone c runs on `DeploymentConfig.chunk_devices(c,
...)[s]` (one stage a device, or the schedule's chunks placed by
`schedules.chunk_devices`). The step is one TensorFlow graph, whose
executor runs an op as soon as its inputs exist, so stage 1 works on
micro-batch 0 while stage 0 works on micro-batch 1. The order of each
device's passes is the `pipeline_schedule`'s (`schedules`), imposed with
control dependencies: a pass's inputs go through `pass_gate` identities
that wait for what its device's previous pass made. Each stage's backward
pass runs on its own device, from the gradient of its outputs (computed by
the next stage) to the gradients of its inputs and variables
(`tf.GradientTape` per stage and micro-batch, with `output_gradients`;
`backward` splits it into B and W where the schedule asks). A tensor that
several stages read (a skip connection across a boundary) is sent from its
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
from tfmulti import pieces
from tfmulti import rows
from tfmulti import slices
from tfmulti import step_options
from tfmulti import trainer
from tfmulti.pipeline import backward
from tfmulti.pipeline import costs
from tfmulti.pipeline import partition
from tfmulti.pipeline import schedules

# The suffix of a backward pass's name scope (a recomputed forward pass
# runs in it: `engine.readings` counts it as backward).
BACKWARD = '_backward'


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
    measure = costs.BY_NAME[options.stage_costs]
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
    schedule = options.pipeline_schedule
    chunks = schedules.chunks_per_device(schedule, options.virtual_stages)
    if num_stages % chunks:
      raise errors.ConfigError(
          f'{num_stages} stages: pipeline_schedule={schedule!r} runs '
          f'{chunks} chunks a device; cut a multiple of {chunks}.')
    layers = len(costs.operations(model))
    if chunks > 1 and num_stages > layers:
      interleaved = schedule == step_options.INTERLEAVED_1F1B
      raise errors.ConfigError(
          f'{"virtual_stages" if interleaved else "pipeline_schedule"}='
          f'{chunks if interleaved else repr(schedule)}: '
          f'{num_stages // chunks} stages of {chunks} chunks cut '
          f'{model.name!r} into {num_stages} chunks, and it has {layers} '
          f'layers: use fewer {"virtual_stages or " if interleaved else ""}'
          'stages.')
    # The stage device (an index) of each chunk.
    self.chunk_devices = schedules.chunk_devices(
        schedule, num_stages // chunks, options.virtual_stages)
    starts = stage_starts(model, num_stages, options)
    self.stages = split_model(model, starts)
    self.backward = backward.for_schedule(options.pipeline_schedule)
    # The trainable variables (their indices) whose gradients B takes.
    in_b = {id(v) for op, _ in costs.operations(model)
            if not self.backward.defers(op)
            for v in getattr(op, 'trainable_variables', ())}
    self.in_b = {i for i, v in enumerate(model.trainable_variables)
                 if id(v) in in_b}
    self.input_keys = tuple(id(t) for t in model.inputs)
    self.output_keys = tuple(id(t) for t in model.outputs)
    # What each stage's forward pass keeps for its backward pass; the last
    # stage's backward pass follows at once, so it always keeps its tapes.
    last = len(self.stages) - 1
    self.keepers = [_Recompute if options.recompute and s < last
                    else _KeepTapes for s in range(last + 1)]

  def _run_stage(self, s, context, values, flight, with_loss):
    """Stage s on one micro-batch (`flight`), reading its inputs from
    `values` (tensors by Keras tensor id) and adding its outputs there: its
    `_Result`; `with_loss` (the last stage's, where its tape records the
    loss) the micro-batch's part of the loss too."""
    stage = self.stages[s]
    outputs, new_non_trainable, model_losses, penalties = pieces.forward(
        stage.model, [context.trainable[i] for i in stage.trainable],
        [context.non_trainable[i] for i in stage.non_trainable],
        [values[k] for k in stage.input_keys], flight.offset)
    outputs = keras.tree.flatten(outputs)
    values.update(zip(stage.output_keys, outputs))
    # In the variables' dtype (float64 models too), not the activations'.
    weights = stage.trainable or range(len(context.trainable))
    dtype = context.trainable[weights[0]].dtype if weights else tf.float32
    penalty = (trainer.penalty(penalties, flight.weight, dtype) +
               trainer.model_loss(model_losses, flight.rows,
                                  context.global_rows, dtype))
    # The penalty is kept apart, per stage.
    loss = self.loss_of(context, flight, values) if with_loss else None
    return _Result(outputs, new_non_trainable, penalty, loss,
                   (model_losses, penalties))

  def _source_keys(self, s):
    """The tensors whose gradients stage s gives its backward pass: what
    it reads that is not a model input (stage 0 reads only those, and
    watches just its weights)."""
    return [k for k in self.stages[s].input_keys if k not in self.input_keys]

  def _forward(self, s, context, inputs, flight):
    """Stage s on one micro-batch, from its `inputs`, under a tape of its
    own (nothing else records on it, so its gradients walk that stage
    alone): a `_Kept`."""
    values = dict(zip(self.stages[s].input_keys, inputs))
    last = s == len(self.stages) - 1
    with tf.GradientTape() as tape:
      tape.watch([context.trainable[i] for i in self.stages[s].trainable])
      tape.watch([values[k] for k in self._source_keys(s)])
      result = self._run_stage(s, context, values, flight,
                               self.backward.loss_on_stage_tape(last))
    result, loss_tape = self.backward.take_loss(
        self, context, flight, values, result) if last else (result, None)
    return _Kept(inputs, tape, loss_tape, result, values)

  def loss_of(self, context, flight, values):
    """The micro-batch's part of the loss, from the model outputs among
    `values`."""
    loss, _, _ = trainer.objective(
        context.loss_fn, flight.labels, keras_internals.pack_outputs(
            self.model, [values[k] for k in self.output_keys]),
        global_rows=context.global_rows)
    return loss

  def clone_step(self, devices, loss_fn, clone_pieces, variables, batch,
                 terms, fold=slices.add):
    """One clone's forward and backward passes over its stages.

    As `pieces.Body`, on the clone's `clone_pieces` (`layouts.Piece`s:
    its micro-batches, whose rows, penalty weights and offsets it reads,
    the offsets moved by `terms.shift`), with `devices` the clone's stage
    devices, `variables` (trainable and non-trainable values) and `batch`
    its (images, labels); the new non-trainable values come as a list,
    one a micro-batch, for `batch_norm.combine_non_trainable`. The
    micro-batches' losses and gradients meet by `fold`: summed, or, each
    micro-batch an atom (`reproducible_rows`), stacked, as
    `deploy.atoms.run_atoms` gives them. Each device runs its passes in
    the order of `pipeline_schedule` (`schedules.device_orders`).
    """
    trainable, non_trainable = variables
    live = [piece for piece in clone_pieces if piece.rows]
    sizes = [piece.rows for piece in live]
    with tf.device(devices[0]):
      image_parts, label_parts = (rows.split(nest, sizes) for nest in batch)
    context = _Context(loss_fn, terms.global_rows, terms.loss_scale,
                       trainable, non_trainable,
                       tf.get_current_name_scope())
    flights = [_Flight(dict(zip(self.input_keys, keras_internals.flat_inputs(
        self.model, x))), y, piece, terms.shift, len(self.stages),
                       list(non_trainable))
               for piece, x, y in zip(live, image_parts, label_parts)]
    num_devices = max(self.chunk_devices) + 1
    ends = [[] for _ in range(num_devices)]  # What each device last made.
    per_device = schedules.device_orders(
        self.options.pipeline_schedule, num_devices, len(sizes),
        self.options.virtual_stages)
    run = {schedules.FORWARD: self._forward_pass,
           schedules.BACKWARD: self._backward_pass,
           schedules.WEIGHTS: self._weights_pass}
    for s, kind, m in schedules.build_order(per_device, len(self.stages)):
      # Its passes chained per device, not per chunk.
      d = self.chunk_devices[s]
      ends[d] = run[kind](s, m, devices, context, flights[m], ends[d])
    return _clone_results(self, devices, context, flights, len(trainable),
                          fold)

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
      kept = self.keepers[s].forward(self, s, context, inputs, flight)
      flight.values.update((k, kept.values[k]) for k in stage.output_keys)
      for i, value in zip(stage.non_trainable, kept.result.state):
        flight.new_non_trainable[i] = value
      flight.kept[s] = kept
    result = kept.result
    return list(result.outputs) + [result.penalty] + (
        [] if result.loss is None else [result.loss])

  def _backward_pass(self, s, m, devices, context, flight, after):
    """Micro-batch m's backward pass through stage s, from the gradients
    of its outputs, once the stage's previous pass (`after`) is done: the
    gradients of the tensors it read and of its variables, those a W pass
    takes held back for it (`backward.held_back`). Returns what it made."""
    stage, last = self.stages[s], len(self.stages) - 1
    with tf.device(devices[s]), tf.name_scope(
        self._scope(context, m, s, BACKWARD)):
      upstream = [flight.upstream[k] for k in stage.output_keys] if (
          s < last) else []
      kept = self.keepers[s].taped(self, s, context, flight.kept[s], flight,
                                   (after, upstream))
      # The pass's own copy of the scale: what it hands on is its own.
      scale = tf.identity(tf.cast(context.loss_scale,
                                  kept.result.penalty.dtype))
      if s == last:
        scales = _gate([scale, scale], after)
        through = self.backward.output_gradients(self, kept, scales[0])
      else:
        scales = [scale, scale]
        through = dict(zip(stage.output_keys, _gate(upstream, after)))
      targets, output_gradients = self.backward.loss_targets(kept.result,
                                                             scales[0])
      for k, output in zip(stage.output_keys, kept.result.outputs):
        if k in through:  # Else a model output: the loss's.
          targets.append(output)
          output_gradients.append(through[k])
      targets.append(kept.result.penalty)
      output_gradients.append(scales[1])
      made = self._gradients(s, context, flight, kept,
                             (targets, output_gradients))
    if s == last:
      made += self.backward.handed_on(through, self.output_keys)
    # A B with no input gradients to give (a first stage whose weights wait
    # for W) hands the next pass the gradients it was given.
    return made or list(through.values()) + list(scales)

  def _gradients(self, s, context, flight, kept, walk):
    """Stage s's gradients from its tape, walked once from `walk`'s
    (targets, output gradients): the input gradients handed upstream and
    the weights' in the flight; those W takes (not `in_b`) are kept in
    `flight.pending[s]`, their own ops held back. Returns B's gradients."""
    keys = self._source_keys(s)
    trainable = self.stages[s].trainable
    now = [i for i in trainable if i in self.in_b]
    later = [i for i in trainable if i not in self.in_b]
    start = backward.mark()
    grads = kept.tape.gradient(
        walk[0], [context.trainable[i] for i in now + later] +
        [kept.values[k] for k in keys], output_gradients=walk[1])
    deferred = grads[len(now):len(now) + len(later)]
    grads = grads[:len(now)] + grads[len(now) + len(later):]
    flight.add_grads(now, grads[:len(now)])
    flight.pending[s] = (later, deferred, backward.held_back(
        start, deferred, grads))
    for k, g in zip(keys, grads[len(now):]):
      g = tf.zeros_like(kept.values[k]) if g is None else g
      flight.upstream[k] = flight.upstream[k] + g if (
          k in flight.upstream) else g
    return [g for g in grads if g is not None]

  def _weights_pass(self, s, m, devices, context, flight, after):
    """Micro-batch m's W pass on stage s (schedules that split the
    backward pass): its deferred weight gradients, whose ops B built and
    held back (`backward.held_back`), released once the stage's previous
    pass (`after`) is done. In the traced step each half of a layer's
    gradient is built once: `Conv2DBackpropInput` runs in B,
    `Conv2DBackpropFilter` in W. Returns what it made."""
    made = []
    with tf.device(devices[s]), tf.name_scope(
        self._scope(context, m, s, '_weights')):
      indices, grads, held = flight.pending[s]
      gate = backward.release(held, after)
      flight.add_grads(indices, grads)
      # Named in this pass's scope, so the traced order can be read back;
      # after the gate, so the next pass waits for this one even where B
      # held nothing back (a stage without deferred weights).
      with tf.control_dependencies([gate]):
        made += [tf.identity(g, name='weights_done') for g in grads
                 if g is not None]
    flight.pending[s] = None
    return made + [gate]


def predict(stages, devices, images, trainable, non_trainable):
  """Inference through `stages` (a `Stages`) on `devices`: (outputs, a
  `with_logits` nest, the layers' add_loss terms, their weight
  penalties)."""
  values = dict(zip(stages.input_keys,
                    keras_internals.flat_inputs(stages.model, images)))
  model_losses, penalties = [], []
  for s, stage in enumerate(stages.stages):
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
  return (keras_internals.with_logits(keras_internals.pack_outputs(
      stages.model, [values[k] for k in stages.output_keys])), model_losses,
          penalties)


def _clone_results(stages, devices, context, flights, num_trainable, fold):
  """`Stages.clone_step`'s results from its micro-batches' flights."""
  last = len(stages.stages) - 1
  losses, regularizations = [], []
  for flight in flights:
    loss = flight.kept[last].result.loss
    with tf.device(devices[last]):
      # One sum over every layer's regularization (the stages' tapes
      # take theirs apart), the same whatever the cut.
      kept = [flight.kept[s].result.losses for s in range(last + 1)]
      regularization = trainer.penalty(
          [x for _, penalties in kept for x in penalties], flight.weight,
          loss.dtype) + trainer.model_loss(
              [x for model_losses, _ in kept for x in model_losses],
              flight.rows, context.global_rows, loss.dtype)
    losses.append(loss + regularization)
    regularizations.append(regularization)
  # Folded over micro-batches on each stage's device: summed, or, each
  # micro-batch an atom, stacked there for the step's fold.
  combine = fold
  gradients = [None] * num_trainable
  for s, stage in enumerate(stages.stages):
    with tf.device(devices[s]), tf.name_scope(f'stage_{s}_sum'):
      for index in stage.trainable:
        grads = [f.grads[index] for f in flights
                 if f.grads.get(index) is not None]
        if grads:
          gradients[index] = combine(grads)
  with tf.device(devices[-1]):
    loss = combine(losses)
    output = tf.nest.map_structure(
        lambda *parts: tf.concat(parts, axis=0),
        *(keras_internals.with_logits(keras_internals.pack_outputs(
            stages.model, [f.kept[last].values[k] for k in stages.output_keys]))
          for f in flights))
  return (output, loss, tf.add_n(regularizations), gradients,
          [f.new_non_trainable for f in flights])


def _gate(tensors, after, name='pass_gate'):
  """`tensors` through identities that run after the ops making `after`:
  what holds a pass back until its stage's previous pass is done."""
  with tf.control_dependencies(after):
    return [tf.identity(t, name=name) for t in tensors]


# A stage's forward pass on one micro-batch: its outputs, the new
# non-trainable values, its part of the regularization (penalties times the
# weight, add_loss terms by rows), the micro-batch's part of the loss (the
# last stage's; else None), and its layers' (add_loss terms,
# penalties).
_Result = collections.namedtuple(
    '_Result', ['outputs', 'state', 'penalty', 'loss', 'losses'])

# A stage's forward pass on one micro-batch: its inputs, its tape (None
# when the backward pass recomputes it), the loss's own tape (the last
# stage's, where the backward pass is split; else None), its `_Result`, and
# every tensor it read or made, by Keras tensor id.
_Kept = collections.namedtuple(
    '_Kept', ['inputs', 'tape', 'loss_tape', 'result', 'values'])


class _KeepTapes:
  """A stage's forward pass keeps its tape for its backward pass."""

  @staticmethod
  def forward(stages, s, context, inputs, flight):
    """Stage s's forward pass on a micro-batch, taped: a `_Kept`."""
    return stages._forward(s, context, inputs, flight)

  @staticmethod
  def taped(stages, s, context, kept, flight, gates):
    """What the backward pass walks: the tape kept."""
    del stages, s, context, flight, gates
    return kept


class _Recompute:
  """With `recompute`, a stage's forward pass keeps only its inputs; its
  backward pass runs it again, taped, once its output gradients exist."""

  @staticmethod
  def forward(stages, s, context, inputs, flight):
    """Stage s's forward pass on a micro-batch, with no tape: a `_Kept`
    whose tape is None."""
    values = dict(zip(stages.stages[s].input_keys, inputs))
    result = stages._run_stage(s, context, values, flight, False)
    return _Kept(inputs, None, None, result, values)

  @staticmethod
  def taped(stages, s, context, kept, flight, gates):
    """The forward pass again, taped, after the stage's previous pass and
    the output gradients (`gates`)."""
    after, upstream = gates
    inputs = _gate(_gate(kept.inputs, after), upstream, 'await_gradients')
    return stages._forward(s, context, inputs, flight)


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
    self.kept = [None] * num_stages  # Each stage's `_Kept`.
    self.upstream = {}  # Gradients of the tensors the later stages read.
    # Each stage's deferred weight gradients between its B and W passes:
    # (their indices, the gradients, the ops held back until W).
    self.pending = [None] * num_stages
    self.grads = {}  # Index among the trainable variables -> gradient.
    self.new_non_trainable = non_trainable

  def add_grads(self, indices, grads):
    """Adds the gradients of the trainable variables at `indices`."""
    for i, g in zip(indices, grads):
      if g is not None:
        self.grads[i] = slices.add([self.grads[i], g]) if (
            i in self.grads) else g
