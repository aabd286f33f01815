"""Variable layouts over a device mesh, as Keras's `ModelParallel` gives them.

A `VariableLayouts` is the pure part of a `keras.distribution.ModelParallel`:
the mesh's shape and axis names and the layout map's rules (a variable
path pattern and its axes: a mesh axis name, or None, a dimension). A
variable's axes come from Keras's own `LayoutMap` lookup (an exact key,
else the one key that fully matches; none: replicated), and `blocks` cuts
its shape into the shards the axes name: a dimension named by an axis
splits into as many equal parts as the axis has devices.

Each shard lives on one device of the mesh whose coordinates on the named
axes are the shard's (which one: `sharding`); the towers keep one copy of
each shard, where JAX's arrays keep one on every device of the unnamed
axes, because one update writes it.
"""

import dataclasses
import itertools
import math
import re

import keras
import numpy as np

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti.mesh import auto_layout

# `VariableLayouts.rules` that say: the model's own `get_layout_map(mesh)`
# (keras-hub's backbones have one), read when the towers are built.
MODEL_OWN = 'model'
# `VariableLayouts.rules` that say: derived from the model when the towers
# are built (`auto_layout`).
AUTO = 'auto'
# Layers gathered ahead by default: FSDP's prefetch of one.
GATHER_AHEAD = 1


@dataclasses.dataclass(frozen=True)
class VariableLayouts:
  """A mesh and a layout map's rules: pure, so a config holds it.

  Attributes:
    mesh_shape: devices along each mesh axis; clone i runs on the mesh's
      i-th device in row-major order.
    axis_names: the mesh axes' names, as Keras's `DeviceMesh` names them.
    rules: (key, axes) pairs of the layout map, in its order; `axes` a
      tuple of axis names or None, one a dimension; or `MODEL_OWN`, the
      model's own map, or `AUTO`, one derived from it (`resolved`).
    batch_axis: the axis Keras splits the batch over (`ModelParallel`'s
      `batch_dim_name`; None: the first, as Keras's default). A kernel
      dimension it names is storage alone; one another axis names is
      computed where its blocks live (`tensor_parallel`).
    plan_tables: each plain Embedding table no rule names is laid out by
      `table_plan` (whole, by rows or by columns), balancing the bytes
      each device holds and looks up; False: whole, spread by bytes.
    strict_layout_map: a key that matches no variable (nor names a
      layer's output) is an error naming the nearest paths; False: a
      warning (Keras's own behaviour is silence).
    keep_joins: each sharded variable joined for the pass is joined once
      before it and kept through the step (faster, where the memory
      allows: FSDP's `reshard_after_forward=False`); False: a plain
      layer's joined in its call and let go after (`releases`).
    gather_ahead: a layer joined in its call reads its shards while the
      calls this many before it compute (in the backward pass, after
      it): their copies travel beside compute, and as many more layers'
      are held; 0: once its own inputs (gradients) exist.
  """
  mesh_shape: tuple
  axis_names: tuple
  rules: tuple = ()
  batch_axis: str = None
  plan_tables: bool = False
  strict_layout_map: bool = False
  keep_joins: bool = False
  gather_ahead: int = GATHER_AHEAD

  def __post_init__(self):
    if self.batch_axis is None and self.axis_names:
      object.__setattr__(self, 'batch_axis', self.axis_names[0])
    if (not self.mesh_shape or len(self.mesh_shape) != len(self.axis_names)
        or any(not isinstance(n, int) or n < 1 for n in self.mesh_shape)):
      raise errors.ConfigError(
          f'mesh shape {self.mesh_shape} with axes {self.axis_names}: give '
          'one positive device count an axis name.')
    if (isinstance(self.gather_ahead, bool) or
        not isinstance(self.gather_ahead, int) or self.gather_ahead < 0):
      raise errors.ConfigError(
          f'gather_ahead={self.gather_ahead!r}: give a count of layers, '
          '0 or more.')
    if self.keep_joins and self.gather_ahead != GATHER_AHEAD:
      raise errors.ConfigError(
          f'gather_ahead={self.gather_ahead} with keep_joins: kept joins '
          'are gathered once, before the pass; drop one of the two.')
    if len(set(self.axis_names)) != len(self.axis_names):
      raise errors.ConfigError(
          f'mesh axes {self.axis_names}: name each axis once.')
    for key, axes in () if self.rules in (MODEL_OWN, AUTO) else self.rules:
      if not isinstance(axes, tuple):
        raise errors.ConfigError(
            f'layout_map[{key!r}] = {axes!r}: give a tuple of axis names '
            'or None, one a dimension.')
      try:
        re.compile(key)
      except re.error as e:
        raise errors.ConfigError(
            f'layout_map[{key!r}]: the key is not a regular expression '
            f'({e}); escape it (re.escape).') from None
      for axis in axes:
        if axis is not None and axis not in self.axis_names:
          raise errors.ConfigError(
              f'layout_map[{key!r}] = {axes}: {axis!r} is not an axis of '
              f'the mesh {self.axis_names}; use one of them or None.')
      named = [axis for axis in axes if axis is not None]
      if len(set(named)) != len(named):
        raise errors.ConfigError(
            f'layout_map[{key!r}] = {axes}: a mesh axis splits one '
            'dimension; name each axis once.')

  @property
  def compute_axes(self):
    """The mesh axes other than the batch axis: a kernel dimension one
    of them names is computed where its blocks live."""
    return tuple(a for a in self.axis_names if a != self.batch_axis)

  @property
  def num_devices(self):
    """The mesh's device count: one clone each."""
    return math.prod(self.mesh_shape)

  def axes_for(self, path, shape):
    """The axes of the variable at `path` of `shape` by Keras's rules, or
    None where it is whole (no key matches, or every axis is None).

    Raises:
      errors.ConfigError: several keys match, or the layout does not fit
        the shape (its rank, or a dimension of fewer entries than the
        axis has devices).
    """
    layout_map = self._layout_map()
    try:
      layout = layout_map[path]
    except ValueError as e:  # Keras: several keys match.
      raise errors.ConfigError(
          f'variable {path}: {str(e).splitlines()[0]}') from None
    if layout is None or not any(a is not None for a in layout.axes):
      return None
    axes = tuple(layout.axes)
    if len(axes) != len(shape):
      raise errors.ConfigError(
          f'variable {path} of shape {tuple(shape)}: layout {axes} names '
          f'{len(axes)} dimensions; give one axis or None a dimension.')
    for dim, axis in zip(shape, axes):
      parts = self.parts_of(axis)
      if dim < parts:
        raise errors.ConfigError(
            f'variable {path} of shape {tuple(shape)}: layout {axes} splits '
            f'a dimension of {dim} over {parts} devices of {axis!r}, more '
            'than it has; use a smaller mesh axis, or None.')
    return axes

  def even(self, shape, axes):
    """Whether each dimension of `shape` splits into equal parts under
    `axes` (a kernel computed as blocks needs them; a table or a joined
    variable takes `shards.part_sizes`)."""
    return all(dim % self.parts_of(axis) == 0
               for dim, axis in zip(shape, axes))

  def names(self, path):
    """Whether a rule of the map matches `path` (Keras's lookup), be its
    axes all None (whole) or not."""
    try:
      return self._layout_map()[path] is not None
    except ValueError:  # Several keys match: `axes_for` refuses it.
      return True

  def unmatched(self, paths):
    """The layout map's keys that match none of `paths` (Keras's rule: an
    exact key, or one that fully matches)."""
    return [key for key, _ in self.rules
            if not any(re.fullmatch(key, path) for path in paths)]

  def parts_of(self, axis):
    """How many parts a dimension named `axis` splits into (1: None)."""
    return 1 if axis is None else self.mesh_shape[self.axis_names.index(axis)]

  def candidates(self, axes, block):
    """The flat indices of the mesh devices that may hold shard `block`
    (its index along each dimension) of a variable laid out by `axes`:
    those whose coordinates on the named axes are the shard's."""
    fixed = {axis: index for axis, index in zip(axes, block) if axis}
    return [flat for flat, coordinates in enumerate(
        np.ndindex(*self.mesh_shape))
            if all(coordinates[self.axis_names.index(axis)] == index
                   for axis, index in fixed.items())]

  def mesh(self):
    """Keras's `DeviceMesh` of this shape and these names (devices
    'cpu:0'..., which a layout map's rules do not read)."""
    devices = [f'cpu:{i}' for i in range(self.num_devices)]
    return keras.distribution.DeviceMesh(self.mesh_shape,
                                         list(self.axis_names), devices)

  def _layout_map(self):
    layout_map = keras.distribution.LayoutMap(self.mesh())
    for key, axes in self.rules:
      layout_map[key] = axes
    return layout_map


def grid(layouts, axes):
  """Parts along each dimension of a variable laid out by `axes`."""
  return tuple(layouts.parts_of(axis) for axis in axes)


def blocks(parts):
  """Each shard's index along each dimension, in row-major order (the
  order `sharding` keeps shards in)."""
  return list(itertools.product(*(range(n) for n in parts)))


def from_keras(distribution, **fields):
  """The `VariableLayouts` of a `keras.distribution.ModelParallel`: its
  mesh, its layout map's rules and its batch axis (and `fields`, the
  others of `VariableLayouts`)."""
  return from_layout_map(keras_internals.layout_map_of(distribution),
                         batch_axis=distribution.batch_dim_name, **fields)


def from_layout_map(layout_map, **fields):
  """The `VariableLayouts` of a `keras.distribution.LayoutMap`: its mesh
  and its rules, each key with the axes Keras stored (and `fields`, the
  others of `VariableLayouts`)."""
  mesh = layout_map.device_mesh
  return VariableLayouts(
      tuple(mesh.shape), tuple(mesh.axis_names),
      tuple((key, tuple(layout_map[key].axes)) for key in layout_map),
      **fields)


def auto_layout_map(model, device_mesh, batch_dim_name=None):
  """A `keras.distribution.LayoutMap` for `model` on `device_mesh`, derived
  from its variables and how its layers use them (`auto_layout`): pass it
  to Keras's `ModelParallel`, as a keras-hub backbone's `get_layout_map`.
  `batch_dim_name`: the axis the batch splits over (None: the first)."""
  layouts = resolved(VariableLayouts(
      tuple(device_mesh.shape), tuple(device_mesh.axis_names), AUTO,
      batch_axis=batch_dim_name), model)
  layout_map = keras.distribution.LayoutMap(device_mesh)
  for key, axes in layouts.rules:
    layout_map[key] = axes
  return layout_map


def names_an_output(key):
  """Whether layout map `key` names a layer's output (Keras looks a
  layer's output up at its path and '/output': a tensor layout, which
  says how JAX lays an activation out), not a variable."""
  return bool(re.search(r'(^|/)output\$?$', key))


def resolved(layouts, model):
  """`layouts` with `MODEL_OWN` read (the rules of `model`'s own
  `get_layout_map(mesh)`, or its backbone's: keras-hub's task models) or
  `AUTO` derived (`auto_layout`).

  Raises:
    errors.ConfigError: the model has no map of its own, or it does not
      fit the mesh.
  """
  if layouts.rules == AUTO:
    return dataclasses.replace(layouts,
                               rules=auto_layout.rules_for(layouts, model))
  if layouts.rules != MODEL_OWN:
    return layouts
  owner = next((o for o in (model, getattr(model, 'backbone', None))
                if callable(getattr(o, 'get_layout_map', None))), None)
  if owner is None:
    raise errors.ConfigError(
        f"layout_map='model': model {model.name!r} (nor a backbone of it) "
        'has no get_layout_map(device_mesh); name a function: '
        'MODULE:FUNCTION returning a keras.distribution.LayoutMap.')
  try:
    layout_map = owner.get_layout_map(layouts.mesh())
  except (ValueError, AttributeError) as e:  # keras-hub: an axis it lacks.
    raise errors.ConfigError(
        f"layout_map='model': {type(owner).__name__}.get_layout_map on mesh "
        f'axes {layouts.axis_names} failed ({str(e).splitlines()[0]}); '
        "name the mesh's axes as it names them (keras-hub: batch, "
        'model).') from None
  return same_mesh(layouts, from_layout_map(
      layout_map, batch_axis=layouts.batch_axis,
      plan_tables=layouts.plan_tables,
      strict_layout_map=layouts.strict_layout_map,
      keep_joins=layouts.keep_joins,
      gather_ahead=layouts.gather_ahead), 'model')


def same_mesh(layouts, made, source):
  """`made` (the `VariableLayouts` of a layout map from `source`), checked
  to be on the mesh `layouts` describes.

  Raises:
    errors.ConfigError: it is on another mesh.
  """
  if (made.mesh_shape, made.axis_names) != (layouts.mesh_shape,
                                            layouts.axis_names):
    raise errors.ConfigError(
        f'layout_map={source}: its mesh {made.mesh_shape} of axes '
        f'{made.axis_names} is not the mesh {layouts.mesh_shape} of axes '
        f'{layouts.axis_names} given; build the map on the mesh passed in.')
  return made
