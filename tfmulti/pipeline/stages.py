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
from tfmulti import pieces
from tfmulti import rows
from tfmulti import slices
from tfmulti import step_options
from tfmulti import trainer
from tfmulti.pipeline import backward
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


def split_model(model, starts, parts=False):
  """The `Stage`s of `model` that begin at the layers `starts`; with
  `parts`, the pieces of stages (`weight_parts`), any of which may give a
  model output."""
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
        if id(tensor) in output_keys and s < len(starts) - 1 and not parts:
          raise errors.ConfigError(
              f'model {model.name!r}: its output {tensor.name!r} comes from '
              f'stage {s} of {len(starts)} (layer {op.name!r}); '
              'the last stage gives every output: cut after that layer '
              '(stage_boundaries), or use fewer stages.')
    sub = keras.Model(list(inputs.values()), outputs,
                      name=f'{model.name}_{"part" if parts else "stage"}_{s}')
    stages.append(Stage(
        sub, tuple(inputs), tuple(id(t) for t in outputs),
        _indices(sub.trainable_variables, model.trainable_variables),
        _indices(sub.non_trainable_variables, model.non_trainable_variables),
        graph[a][0].name))
  return stages


def weight_parts(model, starts):
  """Each stage's parts when its backward pass is split into B and W: the
  stage cut after each layer whose weight gradients W takes
  (`backward.defers_weights`), so that such a layer is its part's last. A
  part's own tape then gives those gradients (W) from its outputs'
  gradients by walking that layer alone, while B walks every part's tape
  once for the input gradients. A list (one a stage) of lists of
  `Stage`s."""
  graph = costs.operations(model)
  cuts = set(starts) | {i + 1 for i, (op, _) in enumerate(graph[:-1])
                        if backward.defers_weights(op)}
  part_starts = sorted(cuts)
  parts = split_model(model, part_starts, parts=True)
  grouped = [[] for _ in starts]
  for start, part in zip(part_starts, parts):
    grouped[sum(1 for first in starts if first <= start) - 1].append(part)
  return grouped


class Stages:
  """A model cut into stages, and one clone's step through them."""

  def __init__(self, model, num_stages, options=step_options.DEFAULTS):
    """Cuts `model` as the `StepOptions` say (the cut, micro-batches,
    recomputation); raises `ConfigError` for a cut that cannot be made."""
    self.options = options
    self.model = model
    schedule = options.pipeline_schedule
    chunks = schedules.chunks_per_device(schedule, options.virtual_stages)
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
    # What a pass runs, under a tape each: the stage whole, or, where the
    # schedule splits the backward pass, the stage's `weight_parts`.
    self.backward = backward.for_schedule(options.pipeline_schedule)
    self.parts = self.backward.parts(self.stages,
                                     lambda: weight_parts(model, starts))
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

  def _run_part(self, part, context, values, flight, loss_part):
    """One part of a stage on one micro-batch (`flight`), reading its
    inputs from `values` (tensors by Keras tensor id) and adding its
    outputs there: its `_Result`; with `loss_part` (the last stage's last
    part), the micro-batch's part of the loss too."""
    outputs, new_non_trainable, model_losses, penalties = pieces.forward(
        part.model, [context.trainable[i] for i in part.trainable],
        [context.non_trainable[i] for i in part.non_trainable],
        [values[k] for k in part.input_keys], flight.offset)
    outputs = keras.tree.flatten(outputs)
    values.update(zip(part.output_keys, outputs))
    # In the variables' dtype (float64 models too), not the activations'.
    weights = part.trainable or range(len(context.trainable))
    dtype = context.trainable[weights[0]].dtype if weights else tf.float32
    penalty = (trainer.penalty(penalties, flight.weight, dtype) +
               trainer.model_loss(model_losses, flight.rows,
                                  context.global_rows, dtype))
    # The penalty is kept apart, per part.
    loss = self.loss_of(context, flight, values) if loss_part else None
    return _Result(outputs, new_non_trainable, penalty, loss,
                   (model_losses, penalties))

  def _source_keys(self, s, j):
    """The tensors whose gradients part j of stage s gives its backward
    pass: what it reads that is not a model input (stage 0 reads only
    those, and watches just its weights)."""
    return [k for k in self.parts[s][j].input_keys
            if k not in self.input_keys]

  def _forward(self, s, context, inputs, flight):
    """Stage s on one micro-batch, from its `inputs`, part by part, each
    under a tape of its own (nothing else records on it, so its gradients
    walk that part alone): a `_Kept`."""
    values = dict(zip(self.stages[s].input_keys, inputs))
    tapes, results = [], []
    parts = self.parts[s]
    for j, part in enumerate(parts):
      loss_part = s == len(self.stages) - 1 and j == len(parts) - 1
      with tf.GradientTape(persistent=self.backward.persistent) as tape:
        tape.watch([context.trainable[i] for i in part.trainable])
        tape.watch([values[k] for k in self._source_keys(s, j)])
        results.append(self._run_part(
            part, context, values, flight,
            self.backward.loss_on_part_tape(loss_part)))
      tapes.append(tape)
      if loss_part:
        self.backward.take_loss(self, context, flight, values, results,
                                tapes)
    return _Kept(inputs, tapes, results, values)

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
    `deploy.atoms.run_atoms` gives them. Each stage runs its passes in
    the order of `pipeline_schedule` (`schedules.passes`).
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
      for part, result in zip(self.parts[s], kept.results):
        for i, value in zip(part.non_trainable, result.state):
          flight.new_non_trainable[i] = value
      flight.kept[s] = kept
    return [t for r in kept.results for t in list(r.outputs) + [r.penalty] + (
        [] if r.loss is None else [r.loss])]

  def _backward_pass(self, s, m, devices, context, flight, after):
    """Micro-batch m's backward pass through stage s, from the gradients
    of its outputs, once the stage's previous pass (`after`) is done: the
    gradients of the tensors it read and, unless the schedule defers them
    to a W pass, of its variables. Part by part, last first, each from its
    own tape; returns what it made."""
    stage, last = self.stages[s], len(self.stages) - 1
    kept = flight.kept[s]
    with tf.device(devices[s]), tf.name_scope(
        self._scope(context, m, s, '_backward')):
      upstream = [flight.upstream[k] for k in stage.output_keys] if (
          s < last) else []
      kept = self.keepers[s].taped(self, s, context, kept, flight,
                                   (after, upstream))
      # The pass's own copy of the scale: what it hands on is its own.
      scale = tf.identity(tf.cast(context.loss_scale,
                                  kept.results[0].penalty.dtype))
      if s == last:
        scales = _gate([scale, scale], after)
        through = self.backward.output_gradients(self, kept, scales[0])
      else:
        scales = [scale, scale]
        through = dict(zip(stage.output_keys, _gate(upstream, after)))
      made, flight.pending[s] = [], []
      for j in reversed(range(len(self.parts[s]))):
        part, result = self.parts[s][j], kept.results[j]
        targets, output_gradients = self.backward.loss_targets(result,
                                                               scales[0])
        for k, output in zip(part.output_keys, result.outputs):
          if k in through:  # Else a model output: the loss's.
            targets.append(output)
            output_gradients.append(through[k])
        targets.append(result.penalty)
        output_gradients.append(scales[1])
        keys = self._source_keys(s, j)
        indices = [i for i in part.trainable if i in self.in_b]
        weights = [context.trainable[i] for i in indices]
        grads = kept.tapes[j].gradient(
            targets, weights + [kept.values[k] for k in keys],
            output_gradients=output_gradients)
        flight.add_grads(indices, grads[:len(weights)])
        flight.pending[s].insert(0, (kept.tapes[j], targets,
                                     output_gradients))
        for k, g in zip(keys, grads[len(weights):]):
          g = tf.zeros_like(kept.values[k]) if g is None else g
          into = flight.upstream if k in stage.input_keys else through
          into[k] = into[k] + g if k in into else g
        made += [g for g in grads if g is not None]
    if s == last:
      made += self.backward.handed_on(through, self.output_keys)
    # A B with no input gradients to give (a first stage whose weights wait
    # for W) hands the next pass the gradients it was given.
    return made or list(through.values()) + list(scales)

  def _weights_pass(self, s, m, devices, context, flight, after):
    """Micro-batch m's W pass on stage s (schedules that split the
    backward pass): each part's weight gradients from its own tape and the
    output gradients its B pass used, once the stage's previous pass
    (`after`) is done. B asked those tapes for input gradients only, and W
    for weight gradients only: in the traced step each half of a layer's
    gradient is reachable from one of them (`Conv2DBackpropInput` from B,
    `Conv2DBackpropFilter` from W), so each runs once. Returns what it
    made."""
    made = []
    with tf.device(devices[s]), tf.name_scope(
        self._scope(context, m, s, '_weights')):
      for part, (tape, targets, output_gradients) in zip(
          self.parts[s], flight.pending[s]):
        indices = [i for i in part.trainable if i not in self.in_b]
        if not indices:
          continue
        grads = tape.gradient(
            targets, [context.trainable[i] for i in indices],
            output_gradients=_gate(output_gradients, after))
        flight.add_grads(indices, grads)
        # Named in this pass's scope (the tape names its ops after the
        # forward pass's), so the traced order can be read back.
        made += [tf.identity(g, name='weights_done') for g in grads
                 if g is not None]
    flight.pending[s] = None
    return made


def predict(stages, devices, images, trainable, non_trainable):
  """Inference through `stages` (a `Stages`) on `devices`: (outputs, the
  layers' add_loss terms, their weight penalties)."""
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
  return (keras_internals.pack_outputs(
      stages.model, [values[k] for k in stages.output_keys]), model_losses,
          penalties)


def _clone_results(stages, devices, context, flights, num_trainable, fold):
  """`Stages.clone_step`'s results from its micro-batches' flights."""
  last = len(stages.stages) - 1
  losses, regularizations = [], []
  for flight in flights:
    loss = flight.kept[last].results[-1].loss
    with tf.device(devices[last]):
      # One sum over every layer's regularization (the stages' tapes
      # take theirs apart), the same whatever the cut.
      kept = [result.losses for s in range(last + 1)
              for result in flight.kept[s].results]
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
        *(keras_internals.pack_outputs(
            stages.model, [f.kept[last].values[k] for k in stages.output_keys])
          for f in flights))
  return (output, loss, tf.add_n(regularizations), gradients,
          [f.new_non_trainable for f in flights])


def _gate(tensors, after, name='pass_gate'):
  """`tensors` through identities that run after the ops making `after`:
  what holds a pass back until its stage's previous pass is done."""
  with tf.control_dependencies(after):
    return [tf.identity(t, name=name) for t in tensors]


# A part's forward pass on one micro-batch: its outputs, the new
# non-trainable values, its part of the regularization (penalties times the
# weight, add_loss terms by rows), the micro-batch's part of the loss (the
# last stage's last part; else None), and its layers' (add_loss terms,
# penalties).
_Result = collections.namedtuple(
    '_Result', ['outputs', 'state', 'penalty', 'loss', 'losses'])

# A stage's forward pass on one micro-batch: its inputs, its parts' tapes
# (None when the backward pass recomputes them) and `_Result`s, and every
# tensor it read or made, by Keras tensor id.
_Kept = collections.namedtuple('_Kept',
                               ['inputs', 'tapes', 'results', 'values'])


class _KeepTapes:
  """A stage's forward pass keeps its parts' tapes for its backward pass."""

  @staticmethod
  def forward(stages, s, context, inputs, flight):
    """Stage s's forward pass on a micro-batch, taped: a `_Kept`."""
    return stages._forward(s, context, inputs, flight)

  @staticmethod
  def taped(stages, s, context, kept, flight, gates):
    """What the backward pass walks: the tapes kept."""
    del stages, s, context, flight, gates
    return kept


class _Recompute:
  """With `recompute`, a stage's forward pass keeps only its inputs; its
  backward pass runs it again, taped, once its output gradients exist."""

  @staticmethod
  def forward(stages, s, context, inputs, flight):
    """Stage s's forward pass on a micro-batch, with no tape: a `_Kept`
    whose tapes are None."""
    values = dict(zip(stages.stages[s].input_keys, inputs))
    results = [stages._run_part(part, context, values, flight, False)
               for part in stages.parts[s]]
    return _Kept(inputs, None, results, values)

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
    # Each stage's parts' (tape, targets, output gradients) between its B
    # and W passes.
    self.pending = [None] * num_stages
    self.grads = {}  # Index among the trainable variables -> gradient.
    self.new_non_trainable = non_trainable

  def add_grads(self, indices, grads):
    """Adds the gradients of the trainable variables at `indices`."""
    for i, g in zip(indices, grads):
      if g is not None:
        self.grads[i] = slices.add([self.grads[i], g]) if (
            i in self.grads) else g
