"""Variables stored as their layouts say: each shard on its device.

`storage_of(config, model, optimizer)` is the one place the step learns
what it reads and updates:

  Whole    the model's trainable variables themselves (every config
           without variable layouts)
  Sharded  each variable a layout splits (`mesh_layouts`) stored as its
           shards, each a Keras variable on one mesh device, and every
           other variable moved whole to the least-loaded device (a
           planned table to its planned device: `table_plan`); each
           plain Embedding's table looked up where its shards live, or
           where it lives whole (`lookups`: row-, column- or table-wise)

Under `Sharded` each shard is read once where it lives and sent to each
clone, which joins the shards (`read`: an all-gather) for its pass (a
looked-up table's join, or a split kernel's, runs only where a layer
reads the variable whole: a tied output layer, a weight penalty; a split
kernel's blocks are joined where they compute, `tensor_parallel`),
whose tape watches the joined variables; each clone cuts their gradients
into the shards' pieces after its pass (`cutting`; a split kernel's
blocks' are summed over the clones that made them first, then cut:
`met`), the
combiners sum each beside its shard (a reduce-scatter) and the optimizer
updates the shards, its slots beside them. The model's own variable keeps
its name, shape and path, and its storage becomes a `ShardedValue`:
reading it (predict, a checkpoint, `get_weights`) joins the shards where
it is read, and assigning it (`load_weights`, a restore) cuts the value
into them, so no device holds the whole variable.
"""

import collections
import contextlib
import difflib
import math
import types

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import pieces
from tfmulti.mesh import lookups
from tfmulti.mesh import mesh_layouts
from tfmulti.mesh import records
from tfmulti.mesh import releases
from tfmulti.mesh import shards as shards_lib
from tfmulti.mesh import table_plan
from tfmulti.mesh import tensor_parallel

# Optimizers whose update of an element reads only that element's gradient
# and slots, so a shard's update is the whole update's (and their
# subclasses). Adafactor factors a kernel's moments over its rows and
# columns; Lamb and Muon read a whole variable's norm or matrix.
ELEMENTWISE = tuple(getattr(keras.optimizers, name) for name in (
    'SGD', 'Adam', 'AdamW', 'Adamax', 'Nadam', 'RMSprop', 'Adagrad',
    'Adadelta', 'Ftrl', 'Lion'))


class Whole:
  """The model's trainable variables, each whole on its device."""

  def __init__(self, model):
    self.variables = model.trainable_variables

  read = staticmethod(pieces.whole)
  in_place = frozenset()  # Nothing is read where it lives.
  splits = types.MappingProxyType({})  # No kernel computes as blocks.
  why_not_compiled = None  # Its pass compiles.

  @staticmethod
  def cutting(body):
    """`body` itself: its gradients are `variables`'."""
    return body

  @staticmethod
  def met(results):
    """The clones' `results` themselves: nothing is summed before the
    combiner."""
    return results


class Sharded:
  """Each laid-out variable as its shards; the rest whole.

  Attributes:
    variables: what the step reads and the optimizer updates: for each of
      the model's trainable variables in order, itself or its shards in
      row-major order.
    grids: for each of the model's trainable variables, its parts along
      each dimension, or None for a whole one.
    sharded: (variable, parts, shards) of each sharded variable.
    shapes: the model's trainable variables' shapes.
    tables: {index among the model's trainable variables: its Embedding
      layer} of each table looked up (`lookups`).
    splits: {index among the model's trainable variables: (its layer,
      the kernel's dimension a compute axis splits, that axis's index in
      the mesh)} of each kernel computed where its blocks live
      (`tensor_parallel`).
    mesh: (the mesh's shape, the clones' devices in its order).
    devices: the device of each of `variables`.
    in_place: the indices into `variables` of the shards read where they
      are (the tables' and the split kernels': never packed).
    records: the storage record of each of the model's trainable
      variables (`records`: kept, joined, released, a table, blocks): its
      read, the gradients of its own sources cut into its shards', in
      turn.
    released: (layer, {id(variable): its index among the model's
      trainable variables}) of each layer that joins its sharded
      variables in its call (`releases`).
    ahead: how many released calls early their shards are gathered.
  """

  def __init__(self, variables, grids, sharded, shapes, tables=None,
               splits=None, mesh=None, released=(),
               ahead=mesh_layouts.GATHER_AHEAD):
    self.variables = variables
    self.grids = grids
    self.sharded = sharded
    self.shapes = shapes
    self.tables = tables or {}
    self.splits = splits or {}
    self.mesh = mesh
    self.released = released
    self.ahead = ahead
    self.devices = [devices.device_of(v) for v in variables]
    self.records = tuple(self._records())
    self.in_place = frozenset(
        i for record in self.records
        if isinstance(record, (records.Table, records.Blocks))
        for i in range(record.where.start, record.where.stop))

  def _spans(self):
    """(k, parts, where) of each of the model's trainable variables: its
    index, its grid and the slice of `variables` storing it."""
    at = 0
    for k, parts in enumerate(self.grids):
      count = 1 if parts is None else len(mesh_layouts.blocks(parts))
      yield k, parts, slice(at, at + count)
      at += count

  def _records(self):
    """The storage record of each of the model's trainable variables, by
    its kind: a looked-up table, a split kernel's blocks, sharded and
    joined for the pass, or whole."""
    for k, parts, where in self._spans():
      if k in self.tables:
        yield records.Table(where, parts, self.tables[k], self.devices[where])
      elif k in self.splits:
        layer, dim, axis = self.splits[k]
        yield records.Blocks(where, parts, layer, dim, axis, self._homes)
      elif parts is not None and any(k in ks.values()
                                        for _, ks in self.released):
        yield records.Released(where, parts)
      elif parts is not None:
        yield records.Joined(where, parts, self.shapes[k])
      else:
        yield records.Kept(where)

  def read(self, values, watch):
    """`pieces.Body`'s reading of `values` (reads of `variables`) under
    its tape's `watch`: each record's read of its own (`Reading`), the
    model's trainable values and the sources the tape watches, each
    record's in a row; its tables
    looked up and its split kernels computed where they live. A join no
    op reads (a looked-up table's, a split kernel's) is never run."""
    here = self._here() if self.splits else 0
    readings = [record.read(values[record.where], here, watch)
                for record in self.records]
    sources = [s for reading in readings for s in reading.sources]
    tables = [t for reading in readings for t in reading.tables]
    blocks = [b for reading in readings for b in reading.blocks]
    joined = [(layer, {v: (self.records[k].parts,
                           values[self.records[k].where])
                       for v, k in ks.items()})
              for layer, ks in self.released]
    return ([reading.value for reading in readings], sources,
            _in_place(tables, blocks, joined, self.ahead))

  @property
  def why_not_compiled(self):
    """Why XLA cannot compile a pass that reads this storage, or None."""
    if self.in_place:
      return ('they look tables up or compute layers on the devices their '
              'shards live on')
    if self.released:
      return ('their layers join their shards in their calls, and a '
              'compiled pass receives every shard as it starts (keep_joins '
              'compiles them)')
    return None

  def leaders(self):
    """Each clone's mesh row's leader (`leaders`) along the axes its split
    kernels' blocks lie along."""
    return leaders(self.mesh[0],
                   {axis for _, _, axis in self.splits.values()})

  def _homes(self, here, axis, count):
    """The devices of clone `here`'s mesh row along mesh axis `axis`."""
    return [self.mesh[1][i] for i in tensor_parallel.homes(
        self.mesh[0], here, axis, count)]

  def _here(self):
    """The mesh index of the clone on whose device ops are made now (the
    first clone's where no clone's device is current)."""
    here = devices.current()
    return next((i for i, device in enumerate(self.mesh[1])
                 if devices.same_device(device, here)), 0)

  def cutting(self, body):
    """`body` (a `pieces.Body`, compiled or not) with its gradients, of
    `read`'s sources, cut into `variables`' after it has run
    (`cut_gradients`; a split kernel's blocks are cut in `met`, after
    every clone's pass): a compiled pass keeps static shapes, and an
    Embedding's slices go to their shards in numbers that vary."""
    def run(*args):
      outputs, loss, regularization, gradients, new = body(*args)
      return (outputs, loss, regularization, self.cut_gradients(gradients),
              new)
    return run

  def cut_gradients(self, gradients):
    """The gradients of `variables` from those of `read`'s sources: each
    record cuts the gradients of its own sources (`Joined`'s split, a
    table's shards' own, a split kernel's blocks uncut until `met`)."""
    here = self._here() if self.splits else 0
    cuts, at = [], 0
    with tf.name_scope('cut_shards'):
      for record in self.records:
        mine = gradients[at:at + record.sources]
        at += record.sources
        cuts.extend(record.cut(mine, here))
    return cuts

  def met(self, results):
    """The clones' `results` (`runners`: a pass's, its gradients of
    `variables` fourth; None: a clone with no rows) with each split
    kernel's blocks' gradients summed where they were made over the
    clones that made them there (a mesh row's leader, `leaders`; any
    clone that computed rows, across workers), and cut into their
    shards' pieces there: one cut and one piece sent a block's device.
    The first such clone carries the pieces; the others none."""
    if not self.splits:
      return results
    gradients = [r and list(r[3]) for r in results]
    terms = collections.defaultdict(list)  # (slot, home) -> [(clone, g)]
    shards = {}  # A block's slot -> (its parts, its shards' slots).
    blocks = [r for r in self.records if isinstance(r, records.Blocks)]
    for i, mine in enumerate(gradients):
      for record in blocks if mine else ():
        for home, members in record.blocks(i):
          slot = record.where.start + members[0]
          shards[slot] = record.rest, [record.where.start + m
                                       for m in members]
          if mine[slot] is not None:
            terms[slot, home].append((i, mine[slot]))
          mine[slot] = None
    with tf.name_scope('cut_shards'):
      for (slot, home), made in terms.items():
        rest, slots = shards[slot]
        with tf.device(home):
          pieces = shards_lib.cut(rest, tf.add_n(
              [gradient for _, gradient in made]))
        first = gradients[made[0][0]]
        for s, piece in zip(slots, pieces):
          first[s] = piece
    return [r and (*r[:3], g, *r[4:]) for r, g in zip(results, gradients)]


def _check_keys(layouts, model):
  """Says which layout map keys match no variable of `model`: a key for a
  layer's output is ignored (logged: Keras's tensor layouts say how JAX
  lays an activation out; the towers compute each layer where its rows
  are), any other is a warning, or with `strict_layout_map` an error
  naming the nearest paths (raised before anything is placed).

  Raises:
    errors.ConfigError: a key matching nothing, under strict_layout_map.
  """
  paths = [v.path for v in model.variables]
  unmatched = layouts.unmatched(paths)
  outputs = [k for k in unmatched if mesh_layouts.names_an_output(k)]
  if outputs:
    logging.info('layout map keys of layers\' outputs, ignored (the towers '
                 'compute each layer where its rows are): %s', outputs)
  typos = [k for k in unmatched if k not in outputs]
  if typos and layouts.strict_layout_map:
    near = difflib.get_close_matches(typos[0], paths, n=3, cutoff=0.2)
    raise errors.ConfigError(
        f'layout map key {typos[0]!r} matches no variable of model '
        f'{model.name!r} (strict_layout_map); the nearest paths: '
        f'{", ".join(near) or "none"}. A key matches a variable\'s whole '
        f'path (Keras 3.14+): write it whole, or as a pattern such as '
        f'".*{typos[0]}".')
  if typos:  # Keras would be silent; a typo leaves the variable whole.
    logging.warning(
        'layout map keys matching no variable of %r (its paths start as '
        '%r): %s', model.name, paths[0], typos)


def leaders(mesh_shape, axes):
  """Each device's mesh row's leader, on a mesh of `mesh_shape` whose
  split kernels' blocks lie along `axes` (indices): the device of its row
  at coordinate 0 on each of them. A mesh row is one clone spanning its
  devices (Megatron's structure): its leader takes the row's rows and
  computes each block on the block's device, once for the row; the row's
  other clones hold blocks and take no rows (the model is traced once a
  row, not once a device: docs/design.md)."""
  found = []
  for i in range(math.prod(mesh_shape)):
    coordinates = list(np.unravel_index(i, mesh_shape))
    for axis in axes:
      coordinates[axis] = 0
    found.append(int(np.ravel_multi_index(coordinates, mesh_shape)))
  return tuple(found)


@contextlib.contextmanager
def _in_place(tables, blocks, joined, ahead):
  """Inside, `tables` are looked up, the split kernels' layers computed
  as their `blocks` where they are, and the `joined` layers' variables
  joined in their calls, gathered `ahead` calls early (`releases`)."""
  with lookups.looking_up(tables), tensor_parallel.computing(blocks):
    with releases.releasing(joined, ahead):
      yield


class ShardedValue(keras_internals.SavedWhole):
  """A Keras variable's storage as shards (`tf.Variable`s, each on its
  device): read, it joins them where it is read; assigned, it cuts the
  value and writes each shard on its device. No whole copy is kept. A
  checkpoint holds its whole value (as a variable's: one saved on any
  layout restores on any other)."""

  def __init__(self, parts, shards, shape):
    self.parts = parts
    self.shards = shards
    self.dtype = shards[0].dtype
    self.shape = tf.TensorShape(shape)
    self.trainable = shards[0].trainable
    # The name a checkpoint records (TF's `get_full_name`): the first
    # shard's.
    self._shared_name = keras_internals.checkpoint_name(shards[0])

  def read_value(self):
    """The whole value, joined on the current device."""
    with tf.name_scope('gather_shards'):
      return shards_lib.join(self.parts,
                             [s.read_value() for s in self.shards])

  def assign(self, value):
    """Writes `value`'s shards, each on its shard's device."""
    for shard, piece in zip(self.shards, shards_lib.cut(self.parts, value)):
      with tf.device(shard.device):
        shard.assign(piece)
    return self

  def numpy(self):
    return self.read_value().numpy()

  def __array__(self, dtype=None, copy=None):
    del copy  # A read is a copy.
    return self.read_value().numpy().astype(dtype or self.dtype.as_numpy_dtype)

  def __getitem__(self, index):
    return self.read_value()[index]

  def __neg__(self):
    return -self.read_value()

  def __abs__(self):
    return abs(self.read_value())

  def __invert__(self):
    return ~self.read_value()


tf.register_tensor_conversion_function(
    ShardedValue, lambda value, dtype=None, name=None, as_ref=False:
    tf.cast(value.read_value(), dtype) if dtype else value.read_value())


def storage_of(config, model, optimizer, split_compute=True):
  """The model's storage under `config`: `Whole`, or, with variable
  layouts, `Sharded`: the model's variables moved into their shards and
  devices now, with their current values (a model sharded before is
  sharded again from its shards); with `split_compute`, each kernel a
  compute axis splits computed where its blocks live
  (`tensor_parallel`).

  Raises:
    errors.UserError: a layout that cannot be honoured (see `check`).
  """
  if config.variable_layouts is None:
    _join_all(model, config.variable_devices()[0])
    return Whole(model)
  layouts = mesh_layouts.resolved(config.variable_layouts, model)
  plan = check(layouts, model, optimizer)
  _check_keys(layouts, model)
  choices = _planned(layouts, model, optimizer)
  plan.update({k: c.axes for k, c in choices.items() if c.axes})
  _join_all(model, config.compute_devices()[0], keep=plan)
  held = dict.fromkeys(config.compute_devices(), 0)
  pinned = {k: config.clone_device(c.homes[0]) for k, c in choices.items()
            if c.axes is None}  # Placed first: the rest balance around.
  _spread([v for v in model.variables if id(v) in pinned], held, pinned)
  variables, grids, sharded = _sharded(config, layouts, model, optimizer,
                                       plan, choices, held)
  _spread([v for v in model.variables
           if id(v) not in plan and id(v) not in pinned], held, {})
  logging.info('Variables sharded by their layouts: %d of %d; bytes a '
               'device: %s.', len(plan), len(model.variables),
               sorted(held.values()))
  found = lookups.tables(model, {id(v) for v in model.trainable_variables})
  split = _even_blocks(layouts, model, plan, tensor_parallel.layers(
      model, plan, layouts.compute_axes if split_compute else ()))
  if split:
    logging.info('Layers computed where their kernels\' blocks live: %s.',
                 ', '.join(layer.name for layer, _ in split.values()))
  trainable = model.trainable_variables
  return Sharded(
      variables, grids, sharded, [v.shape for v in trainable],
      {k: found[id(v)] for k, v in enumerate(trainable) if id(v) in found},
      {k: (*split[id(v)], layouts.axis_names.index(
          plan[id(v)][split[id(v)][1]]))
       for k, v in enumerate(trainable) if id(v) in split},
      (layouts.mesh_shape, [config.clone_device(i)
                            for i in range(layouts.num_devices)]),
      _released(layouts, model, plan, set(found) | set(split)),
      layouts.gather_ahead)


def _released(layouts, model, plan, in_place):
  """[(layer, {id(variable): its index among the model's trainable
  variables})] of each layer that joins its sharded variables (ids in
  `plan`) in its call and lets them go after (`releases`): none of its
  variables looked up or computed where it lives (ids in `in_place`);
  none where `layouts.keep_joins`."""
  if layouts.keep_joins:
    return []
  index = {id(v): k for k, v in enumerate(model.trainable_variables)}
  return [(layer, {id(v): index[id(v)] for v in own if id(v) in plan})
          for layer, own in releases.layers(model, set(plan))
          if not any(id(v) in in_place for v in own)]


def _even_blocks(layouts, model, plan, split):
  """`split` (`tensor_parallel.layers`') without the kernels whose shards
  are unequal (computing as blocks needs equal ones): those are joined
  for the pass, as a variable no compute axis splits; logged."""
  uneven = [v for v in model.trainable_variables
            if id(v) in split and not layouts.even(v.shape, plan[id(v)])]
  for variable in uneven:
    logging.info('kernel %s of shape %s: its shards are unequal (layout '
                 '%s), so it is joined for the pass, not computed as '
                 'blocks', variable.path, tuple(variable.shape),
                 plan[id(variable)])
    del split[id(variable)]
  return split


def _sharded(config, layouts, model, optimizer, plan, choices, held):
  """(the step's variables: each trainable one, or its shards in its
  place; each one's grid of parts, None whole; (variable, parts, shards)
  of each sharded) with each variable of `plan` ({id: axes}) stored in
  its shards, on the devices `choices` give or the least `held`."""
  variables, grids, sharded = [], [], []
  for variable in model.trainable_variables:
    axes = plan.get(id(variable))
    if axes is None:
      variables.append(variable)
      grids.append(None)
      continue
    parts = mesh_layouts.grid(layouts, axes)
    excluded = keras_internals.decay_excluded(optimizer, variable)
    shards = _shard(config, layouts, variable, axes, parts, held,
                    choices.get(id(variable)))
    if excluded:  # By the whole's key, read before its storage moved.
      keras_internals.exclude_from_decay(optimizer, shards)
    variables.extend(shards)
    grids.append(parts)
    sharded.append((variable, parts, shards))
  return variables, grids, sharded


def _planned(layouts, model, optimizer):
  """{id(table): `table_plan.Choice`} of each plain Embedding table that
  no rule of the map names (one that keeps it whole names it), planned where
  `layouts.plan_tables`; logged. Whole alone where the optimizer cannot
  update shards (`_refusal`, logged)."""
  if not layouts.plan_tables:
    return {}
  named = {id(v) for v in model.variables if layouts.names(v.path)}
  tables = table_plan.tables_of(model, named)
  if not tables:
    logging.warning('plan_tables: model %r has no plain Embedding table '
                    'that no rule names; nothing to plan.', model.name)
    return {}
  refusal = _refusal(optimizer)
  if refusal:
    logging.warning('plan_tables: every table whole: %s', refusal)
  choices = table_plan.plan(list(tables.values()), layouts,
                            may_split=refusal is None)
  for table in tables.values():
    logging.info('table %s: %s', table.path,
                 choices[table.path].describe())
  return {key: choices[table.path] for key, table in tables.items()}


def _spread(whole, held, homes):
  """Each of the variables `whole` moved to its device in `homes` (by id)
  or, largest first, to the device of `held` (bytes, counted in) holding
  the least."""
  for variable in sorted(whole, key=devices.variable_bytes, reverse=True):
    device = (homes[id(variable)] if id(variable) in homes
              else min(held, key=held.__getitem__))
    _move(variable, device)
    held[device] += devices.variable_bytes(variable)


def stored_variables(deployed):
  """What a `DeployedModel` keeps in its devices: the variables its step
  updates (shards, or whole variables), the non-trainable ones and the
  optimizer's."""
  return (deployed.parts.storage.variables +
          deployed.model.non_trainable_variables +
          deployed.optimizer.variables)


@contextlib.contextmanager
def whole_on_host(model):
  """Inside, each sharded variable of `model` is stored whole on the host
  (for an export, which traces the model's variables as they are), and
  its shards again on exit, with the value it had on entry."""
  sharded = [(v, keras_internals.storage(v)) for v in model.variables
             if isinstance(keras_internals.storage(v), ShardedValue)]
  try:
    for variable, value in sharded:
      with tf.init_scope(), tf.device('/device:CPU:0'):
        keras_internals.store_in(variable, tf.Variable(
            value.read_value(), trainable=value.trainable,
            name=variable.name))
    yield
  finally:
    for variable, value in sharded:
      keras_internals.store_in(variable, value)


def check(layouts, model, optimizer):
  """{id(variable): axes} for each variable the layouts split, checked.

  Raises:
    errors.UserError: a layout on a non-trainable variable, a layout that
      does not fit its variable, or an optimizer that cannot update shards
      as one device updates the whole (an update that reads a whole
      variable, per-variable `clipnorm`, or one built already).
  """
  plan = {}
  for variable in model.variables:
    axes = layouts.axes_for(variable.path, variable.shape)
    if axes is None:
      continue
    if not variable.trainable:
      raise errors.UnsupportedError(
          f'variable {variable.path}: layout {axes} on a non-trainable '
          'variable: the towers shard trainable variables; leave it '
          'replicated (no key matching it).')
    if variable.constraint is not None or variable.overwrite_with_gradient:
      raise errors.UnsupportedError(
          f'variable {variable.path}: layout {axes} on a variable with a '
          'constraint (or overwritten by its gradient), which Keras applies '
          'to the whole; leave it replicated, or drop the constraint.')
    plan[id(variable)] = axes
  refusal = _refusal(optimizer)
  if plan and refusal:
    raise refusal
  return plan


def _refusal(optimizer):
  """The error that says why `optimizer` cannot update shards as one
  device updates the whole (an update that reads a whole variable,
  per-variable `clipnorm`, or one built already), or None."""
  inner = getattr(optimizer, 'inner_optimizer', optimizer)
  if not isinstance(inner, ELEMENTWISE):
    return errors.UnsupportedError(
        f'optimizer {type(inner).__name__}: its update reads whole '
        'variables, so sharded variables would train otherwise; use an '
        'elementwise one (' +
        ', '.join(o.__name__ for o in ELEMENTWISE) + ').')
  if getattr(inner, 'clipnorm', None):
    return errors.UnsupportedError(
        f'clipnorm={inner.clipnorm}: it clips each variable by its own norm, '
        'which a shard does not know; use global_clipnorm.')
  if optimizer.built:
    return errors.ConfigError(
        'the optimizer is built already (its slots hold whole variables): '
        'pass an optimizer not yet used; the towers build it on the shards.')
  return None


def _shard(config, layouts, variable, axes, parts, held, choice=None):
  """`variable`'s shards as Keras variables, each on the device `choice`
  (a `table_plan.Choice`) gives it, else on the least-loaded device of
  those its layout allows; the variable stored in them."""
  shards = []
  values = shards_lib.cut(parts, tf.convert_to_tensor(variable))
  for k, (block, value) in enumerate(zip(mesh_layouts.blocks(parts),
                                         values)):
    candidates = [config.clone_device(i) for i in (
        [choice.homes[k]] if choice else layouts.candidates(axes, block))]
    device = min(candidates, key=held.__getitem__)
    with tf.init_scope(), devices.made_on(device):  # A worker's too.
      storage = tf.Variable(value, trainable=True, name=variable.name)
      shards.append(keras_internals.adopting(
          variable, storage, shard_path(variable.path, block)))
    held[device] += devices.variable_bytes(storage)
  keras_internals.store_in(variable, ShardedValue(
      parts, [keras_internals.storage(s) for s in shards], variable.shape))
  return shards


def shard_path(path, block):
  """The path of a variable's shard `block`: 'd1/kernel/shard_0_1'."""
  return f'{path}/shard_' + '_'.join(str(i) for i in block)


def _join_all(model, device, keep=()):
  """Each variable of `model` sharded before (and not in `keep`, ids of
  those sharded again) stored whole on `device` again, with its value."""
  for variable in model.variables:
    if (isinstance(keras_internals.storage(variable), ShardedValue)
        and id(variable) not in keep):
      _store_whole(variable, device)


def _move(variable, device):
  """`variable` (a Keras variable) stored on `device` from now on."""
  if not devices.on_device(variable, device):
    _store_whole(variable, device)


def _store_whole(variable, device):
  """`variable` stored whole in a new `tf.Variable` on `device`, with the
  value its storage (whole or shards) holds."""
  old = keras_internals.storage(variable)
  with tf.init_scope():
    value = old.read_value()  # Read where it is (a dry run plans GPUs).
    with devices.made_on(device):
      keras_internals.store_in(variable, tf.Variable(
          value, trainable=old.trainable, name=variable.name))
