"""Each clone's shard of a step, cut by its layout and prefetched to its device.

Without a feed, a step gets the global batch on the inputs device (the
host), splits it there, and each clone's rows cross to its device inside
the step, which waits for them. With one (`DeploymentConfig.
prefetches_to_clones()`: on for GPU clones), `DeployedModel.
distribute_dataset` hands the loop a `Feeder.feed` (a `Fed`): the input pipeline
cuts every global batch into the clones' shards by the step's
`layouts.StepLayout` (a clone's shard holds its rows of every accumulation
step, `StepLayout.clone_spans`) and copies each to its clone's device,
`BUFFER_STEPS` steps ahead, while the steps before it run; the step reads
each shard where it already is (`rows.Shards`, the step's cut `clones.placed`).
The rows, and every piece's offset, are the layout's, so the step computes
what it computes on the whole batch, bit for bit.

The copies are TensorFlow's multi-device iterator, reached through
`tf.distribute`'s public `distribute_datasets_from_function` on a
`MirroredStrategy` over the clone devices that serves the input alone
(its all-reduce is never called): one host pipeline, whose consecutive
elements (clone 0's shard of a step, clone 1's, ...) go round robin to
the devices' buffers, so each image is decoded once, however many clones.
tf_cnn_benchmarks staged each tower's batch on its GPU for the same reason.
"""

import functools

import tensorflow as tf

from tfmulti import devices
from tfmulti import rows

BUFFER_STEPS = 2  # Steps whose shards wait on each clone's device.


class Feeder:
  """Feeds `config`'s clones their shards, prefetched to their devices.

  Holds the input strategy (made once: its devices are the clones'), so a
  new feed each epoch costs only its pipeline.
  """

  def __init__(self, config):
    self._strategy = devices.mirrored_strategy(
        config, tf.distribute.ReductionToOneDevice(config.inputs_device()))

  def feed(self, dataset, layout, worker=0):
    """Each global batch of `dataset` cut by `layout` into the clones'
    shards, each on its clone's device.

    Args:
      dataset: a `tf.data.Dataset` of (images, labels) batches (nests) of
        this worker, each of `layout.worker_rows()` rows.
      layout: the `layouts.StepLayout` to cut them by; each step runs it.
      worker: this worker's index in `layout`.

    Returns:
      A `Fed`: its elements are (inputs, targets), each a `rows.Shards` of
      `layout`.
    """
    def cut(images, labels):
      shards = [tf.data.Dataset.from_tensors(shard) for shard in
                clone_parts((images, labels), layout, worker)]
      return functools.reduce(tf.data.Dataset.concatenate, shards)
    options = tf.distribute.InputOptions(
        experimental_fetch_to_device=True,
        experimental_per_replica_buffer_size=BUFFER_STEPS)
    return Fed(self._strategy.distribute_datasets_from_function(
        lambda _: dataset.flat_map(cut), options), layout, self._strategy)


class Fed:
  """A feed's steps: iterated in Python, each a pair of `rows.Shards`; or
  read inside a compiled loop of steps (`iterator`, then `shards` of each
  element, which works on the traced element as on the eager one).

  Attributes:
    layout: the `layouts.StepLayout` its batches were cut by.
  """

  def __init__(self, distributed, layout, strategy):
    self._distributed = distributed
    self.layout = layout
    self._strategy = strategy

  def __iter__(self):
    for element in self._distributed:
      yield self.shards(element)

  def iterator(self):
    """The multi-device iterator itself, for a compiled loop to read."""
    return iter(self._distributed)

  def shards(self, element):
    """(inputs, targets) `rows.Shards` of one element of `iterator`."""
    parts = self._strategy.experimental_local_results(element)
    return tuple(rows.Shards(tuple(part[k] for part in parts), self.layout)
                 for k in range(2))


def clone_parts(nest, layout, worker=0):
  """The clones' shards of a batch (a nest of `worker`'s rows), cut by
  `layout`: a tuple, one nest a clone (`rows.Shards.parts`)."""
  def rows_of(tensor, spans):
    pieces = [tensor[start:stop] for start, stop in spans]
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0)
  return tuple(tf.nest.map_structure(functools.partial(rows_of, spans=spans),
                                     nest)
               for spans in layout.clone_spans(worker))


def known_rows(specs):
  """Whether every tensor of these `tf.TensorSpec`s (a dataset's element)
  has a known number of rows: a batch a layout can cut before it comes."""
  return all(spec.shape.rank and spec.shape[0] is not None
             for spec in tf.nest.flatten(specs))


def stand_in(specs, rows_=None):
  """Zeros shaped as `specs` (a nest of specs or tensors; `rows_` rows
  each, if given): a batch to time the clones on where the real one is
  cut already (`clone_shares='auto'` measures speed, not values)."""
  return tf.nest.map_structure(
      lambda spec: tf.zeros([rows_ or spec.shape[0], *spec.shape[1:]],
                            spec.dtype), specs)
