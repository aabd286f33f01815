"""Checkpoints of sharded training, the same on every layout.

Under `sharding.Sharded` the optimizer updates shards, so its slots are
shards too, one set a mesh. A checkpoint of that optimizer would restore
only on the same mesh. `view` gives the checkpoint the optimizer as one
device would hold it: its trainable variables the model's own (each saved
whole, `sharding.ShardedValue`) and each slot of a sharded variable one
whole value joined from the shards' slots, in the place the first shard's
slot takes. The checkpoint's keys and shapes are then a plain run's: it
restores on another mesh, with no layout, on one device, and back.
"""

import contextlib
import weakref

from tfmulti import keras_internals
from tfmulti.mesh import sharding

_VIEWS = weakref.WeakKeyDictionary()


def register(optimizer, storage):
  """Makes `checkpointed(optimizer)` the view of `optimizer` (built on
  `storage.variables`) for `storage`, a `sharding.Sharded`, and its
  end-of-fit finalizing (EMA's write-back) that of the shards; nothing
  for a `sharding.Whole`."""
  if isinstance(storage, sharding.Sharded):
    _VIEWS[optimizer] = _view(optimizer, storage.sharded,
                              _groups(storage, optimizer), {})
    keras_internals.finalize_on(optimizer, storage.variables)
  else:
    _VIEWS.pop(optimizer, None)


def checkpointed(optimizer):
  """What a checkpoint tracks for `optimizer`: its view, or itself."""
  return _VIEWS.get(optimizer, optimizer)


@contextlib.contextmanager
def whole_state(optimizer):
  """Inside, `optimizer.variables` (and a loss scale optimizer's inner
  one's) are one device's (the view's): Keras's `model.save` writes them
  as plain Keras loads them."""
  swapped = []
  view = _VIEWS.get(optimizer)
  for owner in (optimizer, getattr(optimizer, 'inner_optimizer', None)):
    if view is not None and owner is not None and hasattr(view, '_variables'):
      swapped.append((owner, keras_internals.variables_list(owner)))
      keras_internals.set_variables_list(
          owner, list(keras_internals.variables_list(view)))
    view = getattr(view, 'inner_optimizer', None)
  try:
    yield
  finally:
    for owner, variables in swapped:
      keras_internals.set_variables_list(owner, variables)


def _groups(storage, optimizer):
  """{id(variable): (whole index, slot kind or None, block)} of each shard
  and each shard's slot (`keras_internals.slot_lists`)."""
  groups = {}
  for k, (*_, shards) in enumerate(storage.sharded):
    for block, shard in enumerate(shards):
      groups[id(shard)] = (k, None, block)
  variables = keras_internals.trainable_variables_of(optimizer)
  for kind, slots in keras_internals.slot_lists(optimizer).items():
    for slot, variable in zip(slots, variables):
      if id(variable) in groups:
        k, _, block = groups[id(variable)]
        groups[id(slot)] = (k, kind, block)
  return groups


def _view(optimizer, sharded, groups, made):
  """A trackable with `optimizer`'s checkpoint children, its lists of
  variables (all, trainable, each slot's) as one device's (see the
  module); its other children (a loss scale optimizer's inner one, viewed
  too) as they are. Made once, after the optimizer is built: a checkpoint
  walks the same objects each time, and each list the same object a
  value (`made`: {(whole index, slot): value})."""
  view = keras_internals.new_trackable()
  for name, child in keras_internals.checkpoint_children(optimizer).items():
    if isinstance(child, (list, tuple)) and any(  # Its variables, slots.
        id(v) in groups for v in child):
      child = _whole(list(child), sharded, groups, made)
    elif name == 'inner_optimizer':
      child = _view(child, sharded, groups, made)
    setattr(view, name, child)
  return view


def _whole(variables, sharded, groups, made):
  """`variables` with each sharded variable's shards (or their slots of
  one name) as one whole value, where the first of them stood."""
  wholes, joined = {}, []
  for variable in variables:
    group = groups.get(id(variable))
    if group is None:
      joined.append(variable)
      continue
    key = group[:2]
    if key not in wholes:
      wholes[key] = []
      joined.append(key)
    wholes[key].append((group[2], variable))
  for key, shards in wholes.items():
    if key not in made:
      made[key] = _joined(sharded[key[0]], key[1],
                          [v for _, v in sorted(shards, key=_first)])
  return [made[item] if isinstance(item, tuple) else item
          for item in joined]


def _first(pair):
  return pair[0]


def _joined(sharded, slot, shards):
  """The whole variable of `sharded` (variable, parts, shards) for its
  shards, or one whole value of its shards' `slot`."""
  whole, parts, _ = sharded
  if slot is None:
    return whole
  return sharding.ShardedValue(
      parts, [keras_internals.storage(s) for s in shards], whole.shape)
