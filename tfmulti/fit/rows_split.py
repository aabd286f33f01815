"""The layers a model's own step calls, computed by rows on the clones.

A model's own `train_step` runs once, on the whole batch, as on one
device: its Python sees the batch's rows, its losses and metrics are the
whole batch's, and each update it makes (through any optimizer, held
anywhere, inside any `tf.function` helper) is made once. Only the layers
it calls are split: while `RowsSplit.splitting()` is open, a layer called
from outside every other layer's call (the model itself, a GAN's
generator and discriminator, a trainer's wrapped model) takes its rows
apart by the clones' shares, computes each clone's rows on the clone's
device under its name scope, and joins the outputs. Its backward pass
runs each clone's part on the clone's device too (a custom gradient over
each clone's tape), and each variable's gradient is the clones' summed
beside the variable, as slim's towers sum theirs: the same numbers as
one device, to round-off.

Refused in one line: an output whose rows are not its inputs' (rows that
interact), a loss added in the call (`add_loss`, an activity
regularizer: each clone's would be its rows' alone). A call whose
tensors do not share one static row count runs whole, as on one device.
"""

import contextlib

import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import layouts


class RowsSplit:
  """`model`'s layers computed by rows on `config`'s clones (see the
  module); `shares`: each clone's share of a call's rows, None even."""

  def __init__(self, model, config, shares=None):
    self.model = model
    self.config = config
    self.shares = shares
    self._open = 0  # Layer calls open inside a split: they run whole.

  @contextlib.contextmanager
  def splitting(self):
    """Inside, each of the model's layers called from outside every
    other layer's call computes by rows on the clones."""
    with keras_internals.calling(
        [(layer, self._call(layer))
         for layer in keras_internals.flat_layers(self.model)]):
      yield

  def _call(self, layer):
    own = type(layer).call.__get__(layer)

    def call(*args, **kwargs):
      if self._open or self.config.num_clones == 1:
        return own(*args, **kwargs)
      return self._split(layer, own, args, kwargs)
    return call

  def _sizes(self, rows):
    """(the clones with rows, their rows) of a call's `rows`."""
    parts = layouts.split_rows(rows, self.shares or
                               [1] * self.config.num_clones)
    clones = [c for c, size in enumerate(parts) if size]
    return clones, [parts[c] for c in clones]

  def _split(self, layer, own, args, kwargs):
    """`own(*args, **kwargs)`, its row tensors cut by the clones' shares,
    each clone's on its device; whole where they share no row count."""
    flat = tf.nest.flatten((args, kwargs))
    at = [i for i, value in enumerate(flat) if _rows(value) is not None]
    counts = {_rows(flat[i]) for i in at}
    if len(counts) != 1:
      return self._inside(own, args, kwargs)
    clones, sizes = self._sizes(counts.pop())
    losses = len(layer.losses)
    structure = []

    @tf.custom_gradient
    def split(*inputs):
      pieces = [tf.split(x, sizes) for x in inputs]
      tapes, outputs = [], []
      for k, clone in enumerate(clones):
        mine = [piece[k] for piece in pieces]
        values = list(flat)
        for i, piece in zip(at, mine):
          values[i] = piece
        a, kw = tf.nest.pack_sequence_as((args, kwargs), values)
        with self._on(clone), tf.GradientTape() as tape:
          tape.watch(mine)
          out = self._inside(own, a, kw)
        structure[:] = [out]
        outputs.append(tf.nest.flatten(out))
        tapes.append((tape, mine, outputs[-1]))
      _check_rows(layer, outputs, sizes)

      def backward(*dys, variables=None):
        return self._backward(clones, tapes, sizes, dys, variables or [])
      return [tf.concat(parts, 0) for parts in zip(*outputs)], backward
    joined = split(*[flat[i] for i in at])
    if len(layer.losses) != losses:
      raise keras_internals.as_raised(errors.UnsupportedError(
          f'a layer of {layer.name!r} adds a loss in its call (add_loss, an '
          'activity regularizer), which each clone would compute on its '
          'rows alone; add it in the step, or train on one clone.'))
    return tf.nest.pack_sequence_as(structure[0], joined)

  def _inside(self, own, args, kwargs):
    """`own(*args, **kwargs)` with the layers it calls running whole."""
    self._open += 1
    try:
      return own(*args, **kwargs)
    finally:
      self._open -= 1

  @contextlib.contextmanager
  def _on(self, clone):
    with tf.device(self.config.clone_device(clone)), tf.name_scope(
        self.config.clone_scope(clone) or 'clone'):
      yield

  def _backward(self, clones, tapes, sizes, dys, variables):
    """Each clone's gradients of its rows on its device: its inputs'
    joined, each variable's summed beside it."""
    dys = [tf.split(dy, sizes) for dy in dys]
    inputs, weights = [], []
    for k, (clone, (tape, mine, outputs)) in enumerate(zip(clones, tapes)):
      with self._on(clone):
        grads = tape.gradient(outputs, mine + list(variables),
                              output_gradients=[
                                  dy[k] if dy is not None else tf.zeros_like(
                                      out) for dy, out in zip(dys, outputs)])
      inputs.append([tf.zeros_like(x) if g is None else g
                     for g, x in zip(grads, mine)])
      weights.append(grads[len(mine):])
    return ([tf.concat(parts, 0) for parts in zip(*inputs)],
            [_summed(v, parts) for v, parts in zip(variables, zip(*weights))])


def _rows(value):
  """The static rows of a tensor of rank 1 or more, else None."""
  if not isinstance(value, tf.Tensor) or value.shape.rank in (None, 0):
    return None
  return value.shape[0]


def _check_rows(layer, outputs, sizes):
  """Raises `UnsupportedError` where a clone's output's rows are not its
  input's: rows that interact cannot be computed apart."""
  for flat, size in zip(outputs, sizes):
    for t in flat:
      if _rows(t) != size:
        raise keras_internals.as_raised(errors.UnsupportedError(
            f'layer {layer.name!r} gives an output of shape {t.shape} for '
            f'{size} rows: its rows interact, so the clones cannot compute '
            'it by rows; train it on one clone.'))


def _summed(variable, parts):
  """A variable's gradient, its clones' summed on its device."""
  parts = [tf.convert_to_tensor(p) for p in parts if p is not None]
  if not parts:
    return None
  with tf.device(variable.device):
    return tf.add_n(parts)
