"""Sharded variables joined late and let go early (FSDP's reshard after
forward).

A sharded variable joined for the pass (`records.Joined`) is joined
once, before the pass, and the tape keeps the join until the backward
pass reads it: every clone holds the whole model through its step. Here
a plain Keras layer's own sharded variables are joined on the clone's
device inside its call, once its inputs exist, and nothing after the
call reads that join: the layer's backward pass joins them again, once
its output's gradient exists, runs the layer's forward from its kept
inputs under a tape of its own (Grappler prunes what the gradient does
not read: a linear layer's product) and cuts the whole's gradient into
its shards' there (`shards.cut`, as `Joined` cuts it). A device then
holds, besides its shards, the joins of the layers in flight, not the
model's.

Released: the layers whose call reads their own variables alone and
changes no state, Keras's own `Dense`, `EinsumDense` and convolutions
(a subclass that keeps their `call`), unquantized, without LoRA or
rematerialization, and without a non-trainable variable; called in the
pass's own graph (in a loop's body or a branch, such as an RNN's cell,
TensorFlow takes the gradient from the body's ops, which no record on a
tape reaches: there the layer reads the join made for the pass). Any
other read of the variable (a weight penalty, another layer's tied read)
joins it as `Joined` does, kept for its own gradient. The recomputed
forward is the forward's ops on the same values: the gradients are the
same bits.
"""

import collections
import functools
import math

import keras
import tensorflow as tf

from tfmulti import keras_internals
from tfmulti.mesh import shards as shards_lib
from tfmulti.pipeline import stages

# The calls that read their layer's own variables and nothing else.
_PLAIN_CALLS = frozenset(
    cls.call for cls in (keras.layers.Dense, keras.layers.EinsumDense,
                         keras.layers.Conv1D, keras.layers.Conv2D,
                         keras.layers.Conv3D, keras.layers.Conv1DTranspose,
                         keras.layers.Conv2DTranspose,
                         keras.layers.Conv3DTranspose))


def layers(model, joined):
  """[(layer, its trainable variables)] of the layers of `model` that can
  release their variables of `joined` (ids of variables joined for the
  pass): see the module's docstring."""
  found = []
  for layer in keras_internals.flat_layers(model):
    own = layer.trainable_variables
    if (type(layer).call in _PLAIN_CALLS and own
        and not layer.non_trainable_variables
        and getattr(layer, '_remat_mode', None) is None
        and not getattr(layer, 'lora_enabled', False)
        and layer.dtype_policy.quantization_mode is None
        and any(id(v) in joined for v in own)):
      found.append((layer, own))
  return found


def releasing(layers_and_parts, ahead):
  """Inside, each layer of `layers_and_parts` (layer, {id(variable):
  (its grid of parts, its shards' values)} of its joined variables)
  joins them in its call and lets them go after (`_Released`), its shards
  gathered `ahead` released calls early (`Order`)."""
  order = Order(ahead)
  return keras_internals.calling(
      [(layer, _Released(layer, joined, order))
       for layer, joined in layers_and_parts])


class Order:
  """The released calls of one pass in the order they were traced: what
  each call's gathers wait for. A call's shards are read once the inputs
  of the call `ahead` calls before it exist (its own with `ahead` 0), so
  they travel while those calls compute; its gradient's, once the
  gradients of the call `ahead` calls after it exist (the backward pass
  runs the calls in reverse). Where those are in another graph (a loop's
  body, a branch), its own."""

  def __init__(self, ahead):
    self.ahead = ahead
    self.graph = tf.compat.v1.get_default_graph()  # The pass's.
    self.inputs = []  # Each call's inputs, in order.
    self.gradients = {}  # A call's index -> its outputs' gradients.
    self.cuts = {}  # A call's index -> its gradients' pieces.

  def here(self):
    """Whether a call now is traced in the pass's own graph: not in a
    loop's body or a branch (their gradients are taken from their ops,
    which no tape's record reaches), nor eagerly."""
    return (not tf.executing_eagerly() and
            tf.compat.v1.get_default_graph() is self.graph)

  def forward(self, inputs):
    """(this call's index, what its gathers wait for)."""
    index = len(self.inputs)
    self.inputs.append(inputs)
    return index, _here(self.inputs[max(index - self.ahead, 0)], inputs)

  def backward(self, index, gradients):
    """What the gathers for call `index`'s gradient wait for, given its
    outputs' `gradients`: those of the call `ahead` after it, and the
    pieces of the one after that, so that a join arrives once the
    gradient before it is cut, not beside it."""
    self.gradients[index] = gradients
    later = self.gradients.get(min(index + self.ahead,
                                   len(self.inputs) - 1), gradients)
    cut = self.cuts.get(index + self.ahead + 1, [])
    return _here(later + cut, gradients)

  def cut(self, index, pieces):
    """Call `index`'s gradients' `pieces`, made."""
    self.cuts[index] = [p for p in pieces if isinstance(p, tf.Tensor)]


def _here(tensors, own):
  """`tensors` where all are of the graph being built, else `own`."""
  graph = tf.compat.v1.get_default_graph()
  return tensors if all(t.graph is graph for t in tensors) else own


class _Released:
  """`layer`'s call in place of its own: its variables of `joined`
  ({id(variable): (its grid of parts, its shards' values)}) joined in it
  and let go after, its other variables read as the pass reads them;
  Keras's own call where the inputs are sparse or ragged, or where the
  call is traced outside the pass's graph (`Order.here`)."""

  def __init__(self, layer, joined, order):
    self.keras_call = type(layer).call.__get__(layer)
    self.variables = layer.trainable_variables
    self.joined = joined
    self.grids = [joined[id(v)][0] for v in self.variables if id(v) in joined]
    self.parts = [joined[id(v)][1] for v in self.variables if id(v) in joined]
    self.scope = layer.name + stages.BACKWARD
    self.order = order

  def __call__(self, *args, **kwargs):
    flat = tf.nest.flatten((args, kwargs))
    if not self.order.here() or any(tf.is_tensor(x) and not isinstance(
        x, tf.Tensor) for x in flat):  # Sparse, ragged: Keras's own.
      return self.keras_call(*args, **kwargs)  # Joined for the pass, kept.
    at = [i for i, x in enumerate(flat) if isinstance(x, tf.Tensor)]
    call = _Call((args, kwargs), flat, at, keras_internals.autocast_now(),
                 [flat[i] for i in at],
                 [keras_internals.current_value(v) for v in self.variables
                  if id(v) not in self.joined])
    return self._recorded(call)

  def _forward(self, call, wholes):
    """The layer's call on `call`'s inputs with its variables' values
    (`wholes` for the joined ones; cast as its call casts them)."""
    kept, wholes = iter(call.kept), iter(wholes)
    values = [next(wholes) if id(v) in self.joined else next(kept)
              for v in self.variables]
    with keras_internals.values_within(list(zip(self.variables, values))):
      with call.autocast():
        args, kwargs = call.nest()
        return self.keras_call(*args, **kwargs)

  def _joins(self, after):
    """The variables joined from reads made after `after`."""
    return [shards_lib.joined(grid, [_read_after(p, after) for p in ps])
            for grid, ps in zip(self.grids, self.parts)]

  def _recorded(self, call):
    """The call's outputs, recorded on the tape as one op of its inputs,
    kept variables and shards whose gradient is `_gradient`. The
    forward's own ops are not recorded: nothing of the backward pass
    reads them."""
    index, after = self.order.forward(call.inputs)
    with keras_internals.not_recorded():
      outputs = self._forward(call, self._joins(after))
    keras_internals.record_on_tapes(
        'ReleasedCall', _with_logits(tf.nest.flatten(outputs)),
        call.inputs + call.kept + [p for ps in self.parts for p in ps],
        functools.partial(self._gradient, call, index))
    return outputs

  def _gradient(self, call, index, *dys):
    """The forward's gradient again (in name scope `scope`, from joins
    made as `order` says), each whole's gradient cut into its shards'
    once the inputs' gradients are made (its joins let go first)."""
    after = self.order.backward(index, [d for d in dys if d is not None])
    n = len(call.inputs) + len(call.kept)
    with tf.name_scope(self.scope), tf.GradientTape() as tape:
      wholes = self._joins(after)
      sources = call.inputs + call.kept + wholes
      tape.watch([s for s in sources if s.dtype.is_floating])
      again = _with_logits(tf.nest.flatten(self._forward(call, wholes)))
      pairs = [(y, d) for y, d in zip(again, dys) if d is not None]
      found = tape.gradient([y for y, _ in pairs], sources,
                            output_gradients=[d for _, d in pairs])
      with tf.name_scope('cut_shards'), tf.control_dependencies(
          [g for g in found[:n] if isinstance(g, tf.Tensor)]):
        pieces = [piece for g, grid in zip(found[n:], self.grids)
                  for piece in (shards_lib.cut(grid, g) if g is not None
                                else [None] * math.prod(grid))]
    self.order.cut(index, pieces)
    return found[:n] + pieces


class _Call(collections.namedtuple(
    '_Call', ['structure', 'flat', 'at', 'autocast', 'inputs', 'kept'])):
  """One traced call of a released layer: its arguments' `structure`
  flattened (`flat`), the positions of its tensors (`at`), the autocast
  scope it runs under, its tensor `inputs` and its kept variables'
  values."""

  def nest(self):
    """The arguments, the call's inputs in their tensors' places."""
    filled = list(self.flat)
    for i, x in zip(self.at, self.inputs):
      filled[i] = x
    return tf.nest.pack_sequence_as(self.structure, filled)


def _with_logits(flat):
  """`flat` (a layer's outputs) and the logits Keras keeps on those of
  them a softmax or sigmoid made (its cross-entropy computes from them):
  the loss's gradient may reach the layer through either."""
  return flat + list(keras_internals.with_logits(flat)[1].values())


def _read_after(value, after):
  """A new read of the variable whose read `value` is, made after `after`
  on the variable's device, so that a clone on another device receives
  its copy then, not at the step's start; `value` itself where it is no
  read (a compiled pass's argument, a packed read)."""
  if value.op.type != 'ReadVariableOp':
    return value
  graph = tf.compat.v1.get_default_graph()
  with tf.control_dependencies(after), graph.device(None):  # Its resource's.
    return tf.raw_ops.ReadVariableOp(resource=value.op.inputs[0],
                                     dtype=value.dtype)
