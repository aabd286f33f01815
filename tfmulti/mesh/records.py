"""How a stored variable is read for a pass and its gradient cut: one
record a variable kind (`sharding.Sharded` makes them, in the step's
variables' order).

  Kept      a variable kept whole: read as it is
  Joined    its shards joined for the pass, the tape watching the join
  Table     an Embedding's table looked up where its shards live
  Released  its shards joined in its layer's call alone (`releases`)
  Blocks    a split kernel computed where its blocks live
            (`tensor_parallel`)

Each record's `read(values, here, watch)` is a `Reading`: the model's
value of the variable, the tensors the tape watches (their gradients come
back to the record's `cut`, in that order), and what is looked up or
computed where it lives.
"""

import collections

import tensorflow as tf

from tfmulti import keras_internals
from tfmulti.mesh import mesh_layouts
from tfmulti.mesh import shards as shards_lib


class Reading(collections.namedtuple(
    'Reading', ['value', 'sources', 'tables', 'blocks'])):
  """A record's read of its variable for a pass: the model's value of it,
  the tensors the tape watches (their gradients come back to the record's
  `cut`, in this order), and what it looks up or computes where it lives
  (`lookups.looking_up`'s tables, `tensor_parallel.computing`'s
  blocks)."""


class Kept:
  """A variable kept whole: read as it is, its gradient its own."""

  sources = 1

  def __init__(self, where):
    self.where = where

  def read(self, values, here, watch):
    del here  # Read where it is.
    watch(values)
    return Reading(values[0], [values[0]], (), ())

  def cut(self, gradients, here):
    del here
    return list(gradients)


class Joined:
  """A variable stored as its shards (`parts` along each dimension), joined
  on the clone's device for its pass; its gradient cut into the shards'
  pieces there, by one split a dimension (differentiating the join would
  slice each shard apart, a few ops a shard), an Embedding's
  `tf.IndexedSlices` kept as slices."""

  sources = 1

  def __init__(self, where, parts, shape):
    self.where = where
    self.parts = parts
    self.shape = shape

  def read(self, values, here, watch):
    del here  # Joined on the clone's device.
    with tf.name_scope('gather_shards'):
      whole = shards_lib.join(self.parts, values)
    watch([whole])
    return Reading(whole, [whole], (), ())

  def cut(self, gradients, here):
    del here
    (gradient,) = gradients
    count = self.where.stop - self.where.start
    if gradient is None:
      return [None] * count
    if isinstance(gradient, tf.IndexedSlices):
      return shards_lib.cut_slices(self.parts, gradient, self.shape)
    return shards_lib.cut(self.parts, gradient)


class Table:
  """An Embedding's table looked up where its shards live (`lookups`; its
  shards' reads watched as they are read), joined only where a layer
  reads it whole (a tied output layer, a weight penalty): that join is
  made when such a layer reads it (`keras_internals.Lazy`), so a step
  that only looks the table up holds no op of the whole table; the
  join's gradient reaches the watched shards through it, so their
  gradients are the table's, cut."""

  def __init__(self, where, parts, layer, devices_):
    self.where = where
    self.parts = parts
    self.layer = layer
    self.devices = devices_
    self.sources = where.stop - where.start

  def read(self, values, here, watch):
    del here  # Looked up where its shards live.
    watch(values)  # Before any join: its gradient reaches them through it.
    whole = values[0] if self.parts is None else keras_internals.Lazy(
        lambda: shards_lib.joined(self.parts, values))
    return Reading(whole, list(values),
                   [(self.layer, self.parts or (1, 1), values,
                     self.devices)], ())

  def cut(self, gradients, here):
    del here
    return list(gradients)  # The shards' own: a join's reached them.


class Released:
  """A variable stored as its shards and joined in its layer's call alone,
  let go after it (`releases`); any other read of it joined when it is
  made (`keras_internals.Lazy`), its gradient reaching the watched shards
  through that join."""

  def __init__(self, where, parts):
    self.where = where
    self.parts = parts
    self.sources = where.stop - where.start

  def read(self, values, here, watch):
    del here
    watch(values)
    return Reading(keras_internals.Lazy(
        lambda: shards_lib.joined(self.parts, values)), list(values), (), ())

  def cut(self, gradients, here):
    del here
    return list(gradients)  # The shards' own.


class Blocks:
  """A kernel computed where its blocks live (`tensor_parallel`): block j
  (its shards along the split dimension's part j, joined over the batch
  axis where the layout splits it there too) joined on the device of the
  clone's mesh row with coordinate j on the compute axis; the kernel
  joined whole only where a layer reads it whole (a weight penalty), its
  gradient's blocks added to the blocks' own there. The blocks' gradients
  stay uncut in their first shard's slot until `Sharded.met` sums them
  over the clones that made them (a mesh row's leader)."""

  def __init__(self, where, parts, layer, dim, axis, homes):
    """`homes(here, axis, count)`: the devices of clone `here`'s mesh row
    along `axis`."""
    self.where = where
    self.parts = parts
    self.layer = layer
    self.dim = dim
    self.axis = axis
    self.homes = homes
    self.rest = parts[:dim] + (1,) + parts[dim + 1:]
    self.sources = 1 + parts[dim]

  def blocks(self, here):
    """[(home, members)]: each block's device in clone `here`'s mesh row
    and the positions (in the variable's shards) of the shards it
    joins."""
    positions = mesh_layouts.blocks(self.parts)
    return [(home, [i for i, block in enumerate(positions)
                    if block[self.dim] == j])
            for j, home in enumerate(self.homes(here, self.axis,
                                                self.parts[self.dim]))]

  def read(self, values, here, watch):
    with tf.name_scope('gather_shards'):
      whole = shards_lib.join(self.parts, values)
    joined, homes = [], []
    for home, members in self.blocks(here):
      with tf.device(home), tf.name_scope('gather_blocks'):
        # A block of one shard is a tensor of its own: the shard's read
        # also feeds the whole join, whose gradient (a weight penalty's)
        # the tape would otherwise add to the block's, and `cut` adds it
        # once more.
        joined.append(tf.identity(shards_lib.join(self.rest,
                                       [values[i] for i in members])))
      homes.append(home)
    watch([whole] + joined)
    return Reading(whole, [whole] + joined, (),
                   [(self.layer, self.dim, joined, homes)])

  def cut(self, gradients, here):
    whole, *blocks = gradients
    slots = [None] * (self.where.stop - self.where.start)
    read = (None if whole is None else
            tf.split(whole, len(blocks), axis=self.dim))
    for j, (home, members) in enumerate(self.blocks(here)):
      block = blocks[j]
      if read is not None:
        with tf.device(home):
          block = read[j] if block is None else block + read[j]
      slots[members[0]] = block
    return slots
