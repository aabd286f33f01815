"""Where each embedding table lives, planned: whole, by rows or by columns.

A recommender's tables differ by orders of magnitude, in rows and in the
ids a step looks up. Under `VariableLayouts(plan_tables=True)`
(`--plan_tables`) the towers plan each plain Embedding table the layout
map does not name, as TorchRec's planner does, balancing two loads over
the mesh's devices: the bytes of the tables each holds, and the bytes it
looks up a step (each id's row, or its shard's piece of the row).

A table whole on one device (table-wise) takes each clone's ids once and
gathers them in one op; split, each clone's ids are partitioned over its
shards (by rows), or sent to every shard (by columns). So the planner
splits only where balance needs it. Largest first (by the larger of its
two loads), each table goes:

1. whole, to the device that keeps the busiest lowest, if every device
   then stays within `TARGET` times an even share of both loads;
2. else over the fewest devices that keep them within it, by rows before
   columns (a column split sends every id to each shard);
3. else the layout, whole or split, that loads the devices least past
   the target (the sum of each load's excess), then keeps the busiest
   lowest.

Each shard goes to the device, of those its layout allows
(`VariableLayouts.candidates`), that keeps the busiest lowest. A table's
lookups are estimated from its layer's input shape as built (the ids an
example gives: 20 for an input of shape (None, 20); a dimension not known
counts 1, with a warning naming the table; a layer called on several
inputs counts the one it was built on), spread evenly over its rows: ids
skewed to popular rows, as clicks are, load the shard of those rows more
than the plan counts. The optimizer's slots scale every table alike, so
they do not move the plan.
"""

import dataclasses
import itertools
import math
from typing import Optional

from absl import logging
import numpy as np
import tensorflow as tf

from tfmulti import keras_internals
from tfmulti.mesh import lookups
from tfmulti.mesh import mesh_layouts
from tfmulti.mesh import shards

TARGET = 1.1  # The busiest device's load, over an even share.


@dataclasses.dataclass(frozen=True)
class Table:
  """What the planner knows of a table: its path, its (rows, width), the
  ids an example looks up in it and the bytes of an element."""
  path: str
  shape: tuple
  ids: int
  itemsize: int = 4

  def loads(self):
    """(bytes held, bytes looked up an example), whole."""
    rows, width = self.shape
    return np.array([rows, self.ids], float) * width * self.itemsize


@dataclasses.dataclass(frozen=True)
class Choice:
  """A table's plan: its layout's `axes` (None: whole) and the flat mesh
  index of the device of each shard, in row-major order."""
  axes: Optional[tuple]
  homes: tuple

  def describe(self):
    """'whole on device 2', 'by rows over model on devices 0, 1, 2, 3'."""
    on = ', '.join(map(str, self.homes))
    if self.axes is None:
      return f'whole on device {on}'
    rows, columns = self.axes
    how = ' and '.join(f'by {what} over {axis}' for what, axis in (
        ('rows', rows), ('columns', columns)) if axis)
    return f'{how} on devices {on}'


def plan(tables, layouts, may_split=True):
  """{path: `Choice`} for `tables` (`Table`s) over `layouts`' mesh, by
  the rules of the module; whole tables alone unless `may_split`."""
  n = layouts.num_devices
  totals = np.maximum(sum(t.loads() for t in tables), 1)
  loads = np.zeros((n, 2))  # Each device's loads, x an even share.
  chosen = {}
  for table in sorted(tables, key=lambda t: -max(t.loads() / totals)):
    weight = table.loads() / totals * n
    options = [_placed(axes, table.shape, weight, loads, layouts)
               for axes in _layouts(table.shape, layouts, may_split)]
    fits = [option for option in options if option[0][0] == 0]
    _, choice, added = fits[0] if fits else min(options,
                                                key=lambda o: o[0])
    loads += added
    chosen[table.path] = choice
  return chosen


def peak(tables, choices, layouts):
  """The busiest device's (bytes held, bytes looked up) under `choices`,
  each over an even share."""
  n = layouts.num_devices
  totals = np.maximum(sum(t.loads() for t in tables), 1)
  loads = np.zeros((n, 2))
  for table in tables:
    choice = choices[table.path]
    for home, part in zip(choice.homes, _parts(table.shape, choice.axes,
                                               layouts)):
      loads[home] += table.loads() / totals * n * part
  return tuple(loads.max(axis=0))


def _parts(shape, axes, layouts):
  """The part of a table of `shape` each of its shards under `axes` (None:
  whole) holds, in the shards' order (`shards.part_sizes`: equal, or as
  even as they go)."""
  if axes is None:
    return [1.0]
  sizes = [shards.part_sizes(dim, layouts.parts_of(axis))
           for dim, axis in zip(shape, axes)]
  return [math.prod(size / dim for size, dim in zip(block, shape))
          for block in itertools.product(*sizes)]


def _layouts(shape, layouts, may_split):
  """Whole, then each layout that splits `shape` over the mesh's axes
  (unequal parts where an axis does not divide a dimension:
  `shards.part_sizes`): by the fewest parts, rows before columns."""
  options = [None]
  axes = [a for a in layouts.axis_names if layouts.parts_of(a) > 1]
  for rows in (None, *axes) if may_split else ():
    for columns in (None, *axes):
      split = (rows, columns)
      if (rows or columns) and rows != columns and all(
          dim >= layouts.parts_of(axis)
          for dim, axis in zip(shape, split)):
        options.append(split)
  return sorted(options, key=lambda split: (
      math.prod(mesh_layouts.grid(layouts, split)) if split else 1,
      split is not None and split[0] is None))


def _placed(axes, shape, weight, loads, layouts):
  """(its score: the loads' excess past the target, then the busiest
  load; the `Choice`; the loads it adds) of a table of `weight` laid out
  by `axes`, each shard where it keeps the busiest lowest."""
  parts = mesh_layouts.grid(layouts, axes) if axes else (1, 1)
  added = np.zeros_like(loads)
  homes = []
  for block, part in zip(mesh_layouts.blocks(parts),
                         _parts(shape, axes, layouts)):
    share = weight * part
    allowed = (layouts.candidates(axes, block) if axes
               else range(layouts.num_devices))
    home = min(allowed, key=lambda d: max(loads[d] + added[d] + share))
    added[home] += share
    homes.append(home)
  after = loads + added
  excess = np.maximum(after - TARGET, 0).sum()
  return (excess, after.max()), Choice(axes, tuple(homes)), added


def tables_of(model, skip):
  """{id(table variable): `Table`} of `model`'s plain Embeddings whose
  table is trainable, unconstrained (a constraint reads it whole) and
  not in `skip` (ids)."""
  ids = {id(v) for v in model.trainable_variables
         if id(v) not in skip and v.constraint is None
         and not v.overwrite_with_gradient}
  return {key: Table(
      layer.embeddings.path, tuple(layer.embeddings.shape),
      _ids_per_example(layer), tf.as_dtype(layer.embeddings.dtype).size)
          for key, layer in lookups.tables(model, ids).items()}


def _ids_per_example(layer):
  """The ids an example gives `layer` (an Embedding): its input's size
  past the batch, as built (1 where a dimension is unknown, warned)."""
  shape = keras_internals.build_input_shape(layer)
  if shape is None or None in tuple(shape)[1:]:
    logging.warning(
        'table %s: its input shape %s as built does not say the ids an '
        'example gives; the plan counts 1 for each unknown dimension.',
        layer.embeddings.path, shape)
  return math.prod(d or 1 for d in tuple(shape or (None, None))[1:])
