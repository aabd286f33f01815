"""What tfmulti reads of Keras beyond its public API, in one place.

Every private Keras name the library reads is here, and only here, with
the Keras versions it was tested on (`TESTED_KERAS`, pinned in setup.cfg):
a new Keras that moves one breaks this module's tests, not a training run.
The conventions read here:

* `stateless_call(..., return_losses=True)` returns the layers' `add_loss`
  terms (activity regularizers included) first, then one penalty a
  trainable weight that has a regularizer (`Layer.losses`' order).
* A layer's random generators are `keras.random.SeedGenerator`s in its
  `_seed_generators`; each keeps an int64 state `[seed, counter]` among the
  model's non-trainable variables, and each draw reads the state and adds
  1 to the counter.
* A mean-reduced Keras loss divides by the replica count inside a
  tf.distribute replica context (`scale_loss_for_distribution`).
* A functional model's nodes (`_nodes`, a layer's `_inbound_nodes`), its
  inputs' and outputs' structures (`_inputs_struct`, `_outputs_struct`),
  whether a layer takes `training` (`_call_has_training_arg`), the call
  context a layer's `__call__` reads `training` from when none is passed
  (`current_call_ctx`, a `CallContext`, in Keras's global state), a tensor's
  Keras mask, a compiled model's loss (`_compile_loss`), metrics
  (`_compile_metrics`, `_symbolic_build`) and loss tracker
  (`_loss_tracker`).
* A compiled loss (`CompileLoss`) of several outputs adds, on every call,
  each output's unweighted loss to that output's metric (its `_metrics`,
  `logits_loss`, ...), weighted by the output's static rows (`shape[0]`):
  None in Keras's traced step (its batches come from a dataset whose batch
  dimension is unknown), so each batch weighs one there, whatever its rows.
* An optimizer's `apply` runs its arithmetic under the caller's device
  scope: Keras applies each update through the default tf.distribute
  strategy (`extended.update`), which does not colocate it with its
  variable; only the assignments themselves land beside the variable.
  `updates_beside_variables` moves the arithmetic there.
* Whether TensorFlow's op determinism is on: TF's private
  `config.is_op_determinism_enabled`, which Keras's own
  `jit_compile='auto'` reads too.
* A `tf.experimental.Optional` made empty takes the structure of the
  value a loop gives it: TF's private `Optional._element_spec`, which
  Keras's own `steps_per_execution` loop sets (`set_element_spec`).
* A `tf.train.Checkpoint`'s saver gathers what it writes, by checkpoint
  key (the object graph's proto under `_CHECKPOINTABLE_OBJECT_GRAPH`
  among them), in `_saver._gather_serialized_tensors` (values may be
  `SaveSpec`s to call, or slices by spec). `checkpoint_io` compiles that
  gathering into a snapshot and the write (one `SaveV2` of those keys)
  apart, so a snapshot costs one call and the write runs on another
  thread (TF's own background write walks the object graph in Python on
  every save).
* An op of a graph being traced can be made to wait for another after it
  was built: TF's private `Operation._add_control_input`
  (`pipeline.backward.release` holds the ops of a split backward pass's
  weight gradients, built in B, until W's turn).
* A layer records the input shape it was built on in its
  `_build_shapes_dict` (functional or called eagerly alike).
"""

import contextlib
import functools
import threading

import keras
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

# The Keras releases this module was tested on (setup.cfg pins the range).
TESTED_KERAS = ('3.15',)


def wait_for(op, gate):
  """Makes `op`, already in the graph being traced, run after `gate`."""
  op._add_control_input(gate)  # pylint: disable=protected-access


def checkpoint_io(checkpoint, check):
  """(snapshot, write) of `checkpoint`, two compiled calls: `snapshot()`
  returns `check(tensors)` (a bool tensor), and the tensors as they
  are now (copies the steps after it cannot change); `write(prefix,
  tensors)` writes them as `checkpoint.write(prefix)` would (one `SaveV2`:
  its data file, then its index, each renamed into place whole), from any
  thread. Raises `NotImplementedError` for a checkpoint that holds objects
  with savers of their own."""
  from tensorflow.python.training.saving import saveable_object  # pylint: disable=g-import-not-at-top
  names, slices, graph = [], [], []  # Each tensor's key and slice; proto.

  def tensor(value):
    return value.tensor if isinstance(value, saveable_object.SaveSpec) else (
        value)

  def snapshot():
    serialized, _, registered, proto = (
        checkpoint._saver._gather_serialized_tensors(None))  # pylint: disable=protected-access
    if registered:
      raise NotImplementedError(f'savers of their own: {list(registered)}')
    del names[:], slices[:], graph[:]
    tensors = []
    for by_key in serialized.values():
      for key, value in by_key.items():
        for spec, part in (value.items() if isinstance(value, dict)
                           else [('', value)]):
          names.append(key)
          slices.append(spec)
          tensors.append(tf.identity(tensor(part)))
    graph.append(proto.SerializeToString())
    return check(tensors), tensors

  def write(prefix, tensors):
    with tf.device('/cpu:0'):
      saved = tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                                shape_and_slices=slices, tensors=tensors)
      with tf.control_dependencies([saved]):  # Not pruned: the result.
        return tf.identity(prefix)
  return (tf.function(snapshot, autograph=False),
          tf.function(write, autograph=False))


def set_element_spec(optional, spec):
  """Gives `optional` (a `tf.experimental.Optional`, empty when made, as a
  loop variable) the structure its loop body's value has: Keras's own
  multi-step loop (`TensorFlowTrainer._make_function`) does the same."""
  optional._element_spec = spec  # pylint: disable=protected-access


def flat_layers(model):
  """Every layer of `model`, nested ones too, in order."""
  return list(model._flatten_layers())


def batch_norms(model):
  """The model's `BatchNormalization` layers (nested ones too), in order."""
  return [layer for layer in flat_layers(model)
          if isinstance(layer, keras.layers.BatchNormalization)]


@contextlib.contextmanager
def synchronized_batch_norms(model):
  """Every BatchNormalization of `model` all-reduces its batch statistics
  over the replicas while the block traces (Keras reads `synchronized`
  when the layer is called); the layers' config is restored after, so a
  saved model is as the user built it."""
  layers = [layer for layer in batch_norms(model) if not layer.synchronized]
  for layer in layers:
    layer.synchronized = True
  try:
    yield
  finally:
    for layer in layers:
      layer.synchronized = False


@contextlib.contextmanager
def calling(layers_and_calls):
  """Inside, in this replica, each layer of `layers_and_calls` (layer,
  call) runs `call` in place of its own `call` (Keras's `__call__` calls
  the instance's). One call a replica: clones traced at once, as the
  replicas of a strategy, each run their own (outside a strategy, one
  replica: 0)."""
  replica = _replica()
  with _CALLING_LOCK:  # The replicas trace on threads of their own.
    for layer, call in layers_and_calls:
      calls = layer.__dict__.get(_CALLS)
      if calls is None:
        calls = layer.__dict__[_CALLS] = {}
        layer.__dict__['call'] = functools.partial(_dispatch, layer, calls)
      if replica in calls:
        raise RuntimeError(f'layer {layer.name!r} is replaced twice in '
                           f'replica {replica}.')
      calls[replica] = call
  try:
    yield
  finally:
    with _CALLING_LOCK:
      for layer, _ in layers_and_calls:
        calls = layer.__dict__[_CALLS]
        del calls[replica]
        if not calls:
          del layer.__dict__[_CALLS], layer.__dict__['call']


_CALLS = '_tfmulti_calls'
_CALLING_LOCK = threading.Lock()


def _replica():
  """The tf.distribute replica tracing now: its id in its group (0 in the
  default replica context, outside any strategy); None in a strategy's
  cross-replica context (its scope, a merge)."""
  context = tf.distribute.get_replica_context()
  if context is None:
    return None
  return int(tf.get_static_value(context.replica_id_in_sync_group))


def _dispatch(layer, calls, *args, **kwargs):
  """`layer`'s call in this replica: its replacement, else its own."""
  call = calls.get(_replica(), type(layer).call.__get__(layer))
  return call(*args, **kwargs)


def split_losses(model, losses):
  """`stateless_call`'s losses of `model` as (add_loss terms, weight
  penalties): the penalties are the last, one a regularized weight."""
  count = sum(getattr(v, 'regularizer', None) is not None
              for v in model.trainable_weights)
  cut = len(losses) - count
  return list(losses[:cut]), list(losses[cut:])


def seed_indices(model):
  """Indices, in `model.non_trainable_variables`, of its layers' random
  generator states (`[seed, counter]`)."""
  where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
  return tuple(where[id(generator.state)]
               for layer in flat_layers(model)
               for generator in getattr(layer, '_seed_generators', ())
               if id(generator.state) in where)


def seed_states(model):
  """The model's random generator states (variables), which a checkpoint
  of the model alone does not hold."""
  return [model.non_trainable_variables[i] for i in seed_indices(model)]


def fold_seeds(values, indices, offset):
  """`values` (non-trainable values) with each generator state at
  `indices` folded with `offset` (a piece's first row in the global batch):
  pieces of one step draw different numbers, and a piece draws the same
  wherever it runs."""
  values = list(values)
  for i in indices:
    values[i] = tf.random.experimental.stateless_fold_in(
        values[i], tf.cast(offset, values[i].dtype))
  return values


def unfold_seeds(new_values, folded, original, indices):
  """`new_values` with each generator state at `indices` advanced from
  its `original` (unfolded) state by as many draws as the piece made."""
  new_values = list(new_values)
  for i in indices:
    new_values[i] = original[i] + (new_values[i] - folded[i])
  return new_values


def unscale_for_replicas(loss):
  """A mean-reduced Keras loss computed in a replica context, times the
  replica count it was divided by."""
  return keras.src.losses.loss.unscale_loss_for_distribution(loss)


def operation_nodes(model, operation):
  """The nodes of `operation` that belong to functional `model`."""
  return [node for i, node in enumerate(operation._inbound_nodes)
          if f'{id(operation)}_ib-{i}' in model._nodes]


def takes_training(layer):
  """Whether `layer.call` takes a `training` argument."""
  return layer._call_has_training_arg


class Lazy:
  """A variable's value for `stateless_run` made only when a layer reads
  it (`make()`): a sharded table looked up where it lives is joined only
  if a layer reads it whole, so no join is traced where none does."""

  def __init__(self, make):
    self.make = make


def stateless_run(model, trainable, non_trainable, inputs, training):
  """`model.stateless_call(trainable, non_trainable, inputs,
  training=training, return_losses=True)` for any Keras model: a
  subclassed model's `call` may take no `training`, and `stateless_call`
  calls `call` itself, so its layers are called in a call context that
  says `training`, as Keras's `__call__` would open one. A `Lazy` value
  among `trainable` is made when a layer first reads its variable (in
  Keras's stateless scope, as `stateless_call` runs the model)."""
  from keras.src.backend.common import global_state
  from keras.src.layers.layer import CallContext
  kwargs = {'training': training} if takes_training(model) else {}
  outer = global_state.get_global_attribute('current_call_ctx')
  context = CallContext(entry_layer=model)
  context.training = training
  global_state.set_global_attribute('current_call_ctx', context)
  lazy = {id(v): value for v, value in zip(model.trainable_variables,
                                           trainable)
          if isinstance(value, Lazy)}
  try:
    if lazy and model._remat_mode is None and (
        model.dtype_policy.quantization_mode is None):
      return _lazy_call(model, trainable, non_trainable, inputs, lazy,
                        kwargs)
    trainable = [v.make() if isinstance(v, Lazy) else v for v in trainable]
    return model.stateless_call(trainable, non_trainable, inputs,
                                return_losses=True, **kwargs)
  finally:
    global_state.set_global_attribute('current_call_ctx', outer)


def _lazy_call(model, trainable, non_trainable, inputs, lazy, kwargs):
  """`stateless_call`'s run (its plain path), its `Lazy` values made when
  read."""
  from keras.src.backend.common import stateless_scope

  made = {}  # (id(variable), graph) -> its value made there.

  class LazyScope(stateless_scope.StatelessScope):

    def get_current_value(self, variable):
      value = super().get_current_value(variable)
      if value is not None or id(variable) not in lazy:
        return value
      # Made in the graph that reads it (a branch's or a loop's own): a
      # tensor of one function graph is no value in another.
      key = id(variable), tf.compat.v1.get_default_graph()
      if key not in made:
        made[key] = tf.cast(lazy[id(variable)].make(), variable.dtype)
      return made[key]

  mapping = [(v, value) for v, value in zip(model.trainable_variables,
                                            trainable)
             if not isinstance(value, Lazy)]
  mapping += list(zip(model.non_trainable_variables, non_trainable))
  with LazyScope(state_mapping=mapping, collect_losses=True) as scope:
    outputs = model.call(inputs, **kwargs)
    losses = model.losses
  return (outputs, [scope.get_current_value(v)
                    for v in model.non_trainable_variables], losses)


def is_functional(model):
  """Whether `model` is a functional graph of layers (or a Sequential)."""
  return hasattr(model, '_nodes') and bool(getattr(model, 'inputs', None))


def flat_inputs(model, inputs):
  """`inputs` (a tensor, list or dict) flattened in `model.inputs`' order."""
  struct = getattr(model, '_inputs_struct', None)
  if isinstance(inputs, dict) and struct is not None:
    return [inputs[key] for key in _input_names(model)]
  return tf.nest.flatten(inputs)


def _input_names(model):
  """The names under which a dict input feeds each of `model.inputs`."""
  struct = model._inputs_struct
  if isinstance(struct, dict):
    order = {id(t): key for key, t in struct.items()}
    return [order[id(t)] for t in model.inputs]
  return [t.name for t in model.inputs]


def mask_of(tensor):
  """The Keras mask a layer attached to `tensor`, or None."""
  return keras.src.backend.get_keras_mask(tensor)


def pack_outputs(model, flat):
  """`flat` (one tensor for each of `model.outputs`, in order) in the
  structure the model returns (a tensor, a list or a dict)."""
  return keras.tree.pack_sequence_as(model._outputs_struct, flat)


def record_on_tapes(name, outputs, inputs, backward):
  """Records, on every tape recording now, an op `name` that made
  `outputs` from `inputs`, whose gradient `backward(*the outputs'
  gradients)` returns the inputs' (one an input):
  `tf.custom_gradient`'s own means, without its graph op, so no op reads
  the inputs where the outputs are made."""
  from tensorflow.python.eager import record
  record.record_operation(name, outputs, inputs, backward)


def not_recorded():
  """A context inside which no tape records."""
  from tensorflow.python.eager import record
  return record.stop_recording()


def autocast_now():
  """A context that casts variables as the layer call running now does
  (Keras's autocast scope: mixed precision's compute dtype), for a
  recomputation of that call outside it."""
  scope = keras.src.backend.get_autocast_scope()
  if scope is None:
    return contextlib.nullcontext
  return functools.partial(keras.src.backend.AutocastScope, scope.dtype)


def current_value(variable):
  """`variable`'s value in the stateless scope the model runs in."""
  from keras.src.backend.common import stateless_scope
  return stateless_scope.get_stateless_scope().get_current_value(variable)


@contextlib.contextmanager
def values_within(mapping):
  """Inside the stateless scope the model runs in, the (variable, value)
  pairs of `mapping` read as those values; every other read, update and
  loss goes to that scope, as before."""
  from keras.src.backend.common import stateless_scope
  outer = stateless_scope.get_stateless_scope()

  class Within(stateless_scope.StatelessScope):

    def get_current_value(self, variable):
      value = super().get_current_value(variable)
      return outer.get_current_value(variable) if value is None else value

    def add_loss(self, loss):
      outer.add_loss(loss)

    def add_update(self, update):
      outer.add_update(update)

  with Within(state_mapping=mapping):
    yield


def with_logits(outputs):
  """`outputs` (a nest) and the logits Keras keeps on some of them, by
  flat index: a nest of row-major tensors that crosses functions,
  strategies and joins as the outputs do, for `logits_kept`.

  Keras's sigmoid and softmax keep their input on their output
  (`_keras_logits`), and its cross-entropy losses and metrics compute
  from those logits: from probabilities alone they clip at 1e-7. An
  attribute on a tensor does not cross a `tf.function` or a concat."""
  flat = tf.nest.flatten(outputs)
  return outputs, {i: t._keras_logits for i, t in enumerate(flat)
                   if getattr(t, '_keras_logits', None) is not None}


def logits_kept(carried):
  """The outputs of a `with_logits` nest, each with its logits on it
  again, as Keras's losses and metrics read them (None stays None)."""
  if carried is None:
    return None
  outputs, logits = carried
  flat = tf.nest.flatten(outputs)
  for i, kept in logits.items():
    flat[i] = tf.identity(flat[i])  # Its own tensor, not a shared one.
    flat[i]._keras_logits = kept
  return tf.nest.pack_sequence_as(outputs, flat)


class _Recorder:
  """Stands in for one output's loss metric: keeps what Keras would add."""

  def __init__(self):
    self.values = []

  def update_state(self, value, sample_weight=None):
    del sample_weight  # The output's static rows: what `track` replaces.
    self.values.append(value)


def compiled_loss(model, y_true, y_pred, sample_weight=None):
  """The loss `compile` built (several outputs' losses, their weights and
  sample weights), leaving its per-output metrics as they are.

  Args:
    model: a compiled model; its loss is built first (`build_compiled`),
      or this call builds it and counts in its metrics, as Keras's would.
    y_true, y_pred, sample_weight: as Keras's `compute_loss` takes them.

  Returns:
    (total, output_losses): the weighted total (None without a compiled
    loss) and each output's unweighted loss, in the order of its metrics
    (none for one output), for `track_output_losses`.
  """
  loss = model._compile_loss
  if loss is None:
    return None, []
  if not loss.built:  # Built by this call (the towers' step run alone).
    return loss(y_true, y_pred, sample_weight), []
  # A shallow copy whose metrics only record: a call on a piece of a batch
  # must not count in the metrics (Keras counts every call), and the copy
  # leaves the shared loss alone for the clones that trace at once.
  quiet = object.__new__(type(loss))
  vars(quiet).update(vars(loss))
  quiet._metrics = [_Recorder() for _ in loss.metrics]
  total = quiet(y_true, y_pred, sample_weight)
  return total, [recorder.values[-1] for recorder in quiet._metrics]


def compiled_loss_metrics(model):
  """The compiled loss's per-output metrics (`logits_loss`, ...)."""
  return list(model._compile_loss.metrics)


def track_output_losses(model, output_losses):
  """Adds one batch's output losses (from `compiled_loss` on the whole
  batch) to their metrics as Keras's traced step does: each batch once,
  whatever its rows (a dataset of a known batch dimension has batches of
  equal rows, which weigh alike too)."""
  for metric, value in zip(compiled_loss_metrics(model), output_losses):
    metric.update_state(value)


def build_compiled(model, data):
  """Builds a compiled model's loss and metrics from a batch, once."""
  unbuilt = [part for part in (model._compile_metrics, model._compile_loss)
             if part is not None and not part.built]
  if unbuilt:
    model._symbolic_build(data_batch=data)


def loss_tracker(model):
  """The metric `fit` reports as 'loss'."""
  return model._loss_tracker


@contextlib.contextmanager
def updates_beside_variables(optimizer, placement):
  """Places every op `optimizer` makes inside with its largest input (a
  variable read with its variable), so its per-variable arithmetic (the
  update step, weight decay, moving averages, clipping's products) runs on
  that variable's device and its scalar arithmetic (from `iterations`, the
  learning rate, the loss scale) beside those; ops without inputs go with
  their consumer. Outside any strategy, Keras's one-replica "all-reduce"
  of the gradients is an `IdentityN` of them all, one op on one device that
  would gather every gradient there and send it back: it is skipped (the
  sum over one replica is the gradient itself). Use it while tracing a
  `tf.function`. `placement`: a `devices.GraphPlacement`, which reads
  each op's inputs' devices.
  """
  applier = getattr(optimizer, 'inner_optimizer', optimizer)  # Loss scale.
  alone = not tf.distribute.has_strategy()
  if alone:
    applier._all_reduce_sum_gradients = lambda grads_and_vars: grads_and_vars
  _updates_after_gradients(applier)
  try:
    with tf.compat.v1.device(None), tf.compat.v1.device(placement.of_inputs):
      yield
  finally:
    if alone:
      del applier._all_reduce_sum_gradients


def _updates_after_gradients(applier):
  """`applier`'s `update_step` from now on waits for its gradient
  (`_after_gradient`): set once and kept, as a strategy's replicas trace
  their steps at once on one optimizer (a wrapper taken off as one
  finishes would be taken from another)."""
  own = vars(applier).get('update_step')
  if getattr(own, 'func', None) is not _after_gradient:
    applier.update_step = functools.partial(_after_gradient,
                                            applier.update_step)


def _after_gradient(update_step, gradient, variable, learning_rate):
  """`update_step` whose ops (its slots' reads first) wait for
  `gradient`: else the runtime reads the slots as the step starts and
  computes what it can before the gradient (momentum's decay), holding a
  slot's worth through the pass. Eagerly, ops run in order anyway."""
  if tf.executing_eagerly():
    return update_step(gradient, variable, learning_rate)
  made = [t.op for t in ((gradient.values, gradient.indices)
                         if isinstance(gradient, tf.IndexedSlices)
                         else (gradient,))]
  with tf.control_dependencies(made):
    return update_step(gradient, variable, learning_rate)


@contextlib.contextmanager
def deferred_variables():
  """Keras variables made inside are deferred: the list this yields holds
  them, in creation order, on exit; `initialize` makes each one (on the
  current device). Nothing inside may read or assign a variable."""
  from keras.src.backend.common import global_state
  from keras.src.backend.common import stateless_scope
  key = 'uninitialized_variables'
  before = list(global_state.get_global_attribute(key) or [])
  made = []
  try:
    with stateless_scope.StatelessScope(initialize_variables=False):
      yield made
  finally:
    known = {id(v) for v in before}
    made.extend(v for v in global_state.get_global_attribute(key) or []
                if id(v) not in known)
    global_state.set_global_attribute(key, before)


def initialize(variable):
  """Makes a deferred Keras variable (see `deferred_variables`) here."""
  variable._deferred_initialize()


def op_determinism_enabled():
  """Whether `tf.config.experimental.enable_op_determinism()` is in force
  (TF has no public reader; Keras reads the same private one)."""
  return tf_config.is_op_determinism_enabled()


def storage(variable):
  """The `tf.Variable` (or `sharding.ShardedValue`) a Keras variable
  stores its value in."""
  return variable._value


def store_in(variable, value):
  """Makes a Keras variable store its value in `value` (a `tf.Variable`,
  or a `sharding.ShardedValue`) from now on; its name, shape and path
  stay."""
  variable._value = value


def adopting(variable, value, path):
  """A Keras variable like `variable` (name, dtype, autocast) at `path`
  that stores its value in `value`, a `tf.Variable` (Keras adopts one
  given as its initializer)."""
  adopted = keras.Variable(value, dtype=variable.dtype, trainable=True,
                           autocast=variable._autocast, name=variable.name)
  adopted._path = path
  return adopted


def decay_excluded(optimizer, variable):
  """Whether `exclude_from_weight_decay(var_list=...)` named `variable`
  (Keras keeps the variables' keys: read it before the variable's storage
  changes)."""
  optimizer = getattr(optimizer, 'inner_optimizer', optimizer)
  excluded = getattr(optimizer, '_exclude_from_weight_decay', None)
  return bool(excluded) and optimizer._var_key(variable) in excluded


def exclude_from_decay(optimizer, shards):
  """Excludes `shards` from `optimizer`'s weight decay by their keys, as
  their whole variable was (names are matched on each variable's own
  name, which a shard keeps)."""
  optimizer = getattr(optimizer, 'inner_optimizer', optimizer)
  optimizer._exclude_from_weight_decay.update(
      optimizer._var_key(s) for s in shards)


def finalize_on(optimizer, variables):
  """Makes Keras's end of `fit` (`optimizer.finalize_variable_values(
  model.trainable_weights)`: EMA's write-back) finalize `variables`, the
  ones `optimizer` was built on (a sharded model's shards), whatever list
  it is given."""
  def finalize(var_list):
    del var_list  # The model's whole variables: not what it updates.
    return type(optimizer).finalize_variable_values(optimizer, variables)
  optimizer.finalize_variable_values = finalize


def remake_optimizer_state(optimizer):
  """`optimizer`'s own variables made in its constructor (its iteration
  count, its learning rate where it is a variable, a loss scale
  optimizer's scale and step counter; its inner optimizer's too) made
  again in the current device and strategy scope, their values kept, and
  that strategy its own: Keras makes them, and reads the strategy
  (`_distribution_strategy`, through which it builds its slots and
  applies), in the constructor, wherever the user made it. Everything
  else the user gave it stays: a schedule, weight decay exclusions, a
  subclass's own state."""
  for owner in (optimizer, getattr(optimizer, 'inner_optimizer', None)):
    if owner is None:
      continue
    owner._distribution_strategy = tf.distribute.get_strategy()
    for name in _MADE_IN_CONSTRUCTORS:
      old = getattr(owner, name, None)
      if isinstance(old, keras.Variable):  # Not a schedule or callable.
        with keras.name_scope(owner.name, caller=owner):
          new = keras.Variable(old.numpy(), name=old.name, dtype=old.dtype,
                               trainable=False,
                               aggregation='only_first_replica')
        _replace_tracked(owner, name, old, new)


# The variables Keras's optimizers (a loss scale optimizer's too) make in
# their constructors.
_MADE_IN_CONSTRUCTORS = ('_iterations', '_learning_rate', 'step_counter',
                         'dynamic_scale')


def _replace_tracked(optimizer, name, old, new):
  """`optimizer.<name>` and its place in `_variables` (a list TensorFlow
  saves only as made, never changed in place: made anew) `new`; Keras's
  tracker (`_tracker`, which appends to that list) told of both."""
  from keras.src.utils import tracking
  tracker = optimizer._tracker
  kind, _ = tracker.config['variables']
  with tracking.DotNotTrackScope():
    optimizer._variables = [new if v is old else v
                            for v in optimizer._variables]
    setattr(optimizer, name, new)
  tracker.config['variables'] = (kind, optimizer._variables)
  tracker.stored_ids['variables'].discard(id(old))
  tracker.stored_ids['variables'].add(id(new))


def keras_state():
  """A copy of Keras's global state on this thread (its dtype policy,
  distribution, seed generator, remat scope: `GLOBAL_STATE_TRACKER` and
  `GLOBAL_SETTINGS_TRACKER`, thread-local), for `keras_state_of`."""
  from keras.src.backend.common import global_state
  return tuple(dict(vars(tracker)) for tracker in (
      global_state.GLOBAL_STATE_TRACKER,
      global_state.GLOBAL_SETTINGS_TRACKER))


@contextlib.contextmanager
def keras_state_of(state):
  """Inside, this thread's Keras global state is `state` (`keras_state`'s,
  taken on the caller's thread: a strategy's replica threads see none of
  it); this thread's own after."""
  from keras.src.backend.common import global_state
  trackers = (global_state.GLOBAL_STATE_TRACKER,
              global_state.GLOBAL_SETTINGS_TRACKER)
  saved = [dict(vars(tracker)) for tracker in trackers]
  for tracker, values in zip(trackers, state):
    vars(tracker).update({  # Each thread its own stacks (name scopes).
        key: list(value) if isinstance(value, list) else value
        for key, value in values.items()})
  try:
    yield
  finally:
    for tracker, values in zip(trackers, saved):
      vars(tracker).clear()
      vars(tracker).update(values)


def as_raised(error):
  """`error`, marked so that a layer's `__call__` passes it on as it is
  (Keras otherwise raises a copy with the call's arguments appended, no
  longer one line: `_keras_call_info_injected`)."""
  error._keras_call_info_injected = True
  return error


def layout_map_of(distribution):
  """A `keras.distribution.ModelParallel`'s `LayoutMap` (Keras keeps it
  private)."""
  return distribution._layout_map


def lend_distribute_tensor():
  """Gives Keras's TensorFlow backend the `distribute_tensor` it lacks,
  returning the tensor as it is. A layer's call reaches it when the
  distribution set has a layout for the layer's output (a tensor layout:
  JAX's relayout of an activation), and crashed there; the towers place
  each clone's rows themselves, so the layout is ignored (logged once a
  key by the storage)."""
  from keras.src import backend  # pylint: disable=import-outside-toplevel
  if not hasattr(backend.distribution_lib, 'distribute_tensor'):
    backend.distribution_lib.distribute_tensor = _as_it_is


def _as_it_is(tensor, layout):
  del layout  # Each clone's rows are placed by the towers.
  return tensor


def build_input_shape(layer):
  """The input shape `layer` was built on (None: not known)."""
  shapes = getattr(layer, '_build_shapes_dict', None) or {}
  return shapes.get('input_shape')


def slot_lists(optimizer):
  """{kind: slots}: each of `optimizer`'s lists of slot variables, one slot
  a trainable variable in their order (Keras keeps one list a kind:
  Adam's '_momentums' and '_velocities'); a loss scale optimizer's inner
  one's."""
  optimizer = getattr(optimizer, 'inner_optimizer', optimizer)
  variables = optimizer._trainable_variables
  return {name: list(child) for name, child in
          optimizer._trackable_children('checkpoint').items()
          if isinstance(child, (list, tuple)) and len(child) == len(variables)
          and child is not variables and child is not optimizer._variables
          and all(hasattr(slot, 'value') for slot in child)}


# TensorFlow's private names, read here alone as Keras's are.


def current_device():
  """The device the eager context places ops on now (`tf.device`'s; ''
  where none is given): TF's private eager `context`."""
  from tensorflow.python.eager import context
  return context.context().device_name


def global_seed_set():
  """Whether TensorFlow's global seed is set (`tf.random.set_seed`,
  which Keras's `set_random_seed` calls)."""
  from tensorflow.python.eager import context
  return context.global_seed() is not None


def set_new_key(key, value):
  """Sets `key` in the coordination service's key-value store; False if
  another task set it first."""
  from tensorflow.python.eager import context
  try:
    context.context().set_config_key_value(key, value)
    return True
  except tf.errors.AlreadyExistsError:
    return False


def key_value(key, timeout_ms):
  """`key`'s value in the coordination service's store, or None if it is
  not set within `timeout_ms`."""
  from tensorflow.python.eager import context
  try:
    return context.context().get_config_key_value(key,
                                                  timeout_in_ms=timeout_ms)
  except tf.errors.DeadlineExceededError:
    return None


def function_of(graph, name):
  """The function `graph` holds under `name` (a call's, a loop's body, a
  branch's), or None."""
  return graph._get_function(name)


def is_stateful(op):
  """Whether TensorFlow counts `op` as stateful (it runs for its effect)."""
  return op._is_stateful


def node_flops(op):
  """TensorFlow's count of `op`'s floating-point operations from its
  shapes (its registered statistics), 0 where it has none or the shapes
  are unknown."""
  from tensorflow.python.framework import ops as ops_lib
  from tensorflow.python.util import deprecation
  try:
    with deprecation.silence():  # Convolutions read shapes a TF 1 way.
      value = ops_lib.get_stats_for_node_def(op.graph, op.node_def,
                                             'flops').value
  except (ValueError, TypeError):  # No statistics, or unknown shapes.
    return 0
  return value or 0


def first_trace(function):
  """The graph of `function`'s (a `tf.function`'s) first trace, or None
  before it has run: what its calls run (a later trace is another
  batch's shape, an epoch's last)."""
  traces = function._list_all_concrete_functions()
  return traces[0].graph if traces else None


def registered_kernels(op_type):
  """The kernels TensorFlow registered for `op_type` (each with its
  device type and constraints), CUDA or not."""
  from tensorflow.python.framework import kernels
  return kernels.get_registered_kernels_for_op(op_type).kernel


def xplane_proto():
  """TensorFlow's profiler XPlane protocol buffer module (a trace's
  `.xplane.pb`)."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2
  return xplane_pb2


def efficientnet_stddev():
  """keras.applications' EfficientNet's ImageNet deviation a channel
  (Keras keeps it private: `IMAGENET_STDDEV_RGB`)."""
  from keras.src.applications import efficientnet
  return efficientnet.IMAGENET_STDDEV_RGB


def trainable_variables_of(optimizer):
  """The variables `optimizer` (a loss scale optimizer's inner one) was
  built on, in order."""
  return getattr(optimizer, 'inner_optimizer', optimizer)._trainable_variables


def variables_list(optimizer):
  """`optimizer`'s list of all its variables (Keras's `_variables`)."""
  return optimizer._variables


def set_variables_list(optimizer, variables):
  """Makes `variables` `optimizer`'s list of all its variables."""
  optimizer._variables = variables


def checkpoint_children(trackable):
  """{name: child} a checkpoint of `trackable` writes."""
  return trackable._trackable_children('checkpoint')


def new_trackable():
  """An empty object a checkpoint tracks by its attributes."""
  return tf.__internal__.tracking.AutoTrackable()


def checkpoint_name(variable):
  """The name a checkpoint records for `variable` (TF's
  `get_full_name`)."""
  return variable._shared_name


class SavedWhole(tf.__internal__.tracking.Trackable):
  """A trackable a checkpoint saves as one tensor, its `read_value()`
  (read on the host), and restores through its `assign`: TF's saveable
  protocol (`_serialize_to_tensors`, `_restore_from_tensors`)."""

  def _serialize_to_tensors(self):
    with tf.device('/device:CPU:0'):
      return {'VARIABLE_VALUE': self.read_value()}

  def _restore_from_tensors(self, restored_tensors):
    return self.assign(restored_tensors['VARIABLE_VALUE'])
