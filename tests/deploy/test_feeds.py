"""Tests for tfmulti.deploy.feeds: each clone's shard prefetched to its device.

A feed changes where a step's rows wait, never what the step computes:
every test trains through it and compares with the step that splits the
whole batch itself (whose equality with one device the towers' tests
prove): bit for bit on the dense model, and with `reproducible_rows`.
Logical CPUs stand in for GPUs (`prefetch_to_clones=True`; the default
turns it on for GPU clones only).
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import assert_same_checkpoints
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import mlp
from tfmulti import deploy
from tfmulti import devices
from tfmulti import rows
from tfmulti.deploy import balance
from tfmulti.deploy import feeds

ROWS = 16  # A global batch.
STEPS = 4  # Batches an epoch.


def dataset(rows_=ROWS, steps=STEPS):
  """`steps` batches of `rows_` rows, their rows known (as the job's
  pipeline makes them: `drop_remainder=True`)."""
  images, labels = make_batch(rows_ * steps, seed=3)
  return tf.data.Dataset.from_tensor_slices((images, labels)).batch(
      rows_, drop_remainder=True)


def bn_mlp():
  return mlp(batch_norm=True)


def synchronized_mlp():
  return mlp(batch_norm=True, synchronized=True)


def train(prefetch, config_fields, model_fn=bn_mlp, epochs=1, **fields):
  """(losses, the model's and optimizer's variables) after `epochs` passes
  over `dataset()`, fed as the training loop feeds a trainer."""
  config = deploy.DeploymentConfig(clone_on_cpu=True,
                                   prefetch_to_clones=prefetch,
                                   **config_fields)
  towers = make_deployed(config, model_fn, **fields)
  losses = []
  for _ in range(epochs):
    for images, labels in towers.distribute_dataset(dataset()):
      # Fed shards, or the whole batch: never a silent fallback.
      assert isinstance(images, rows.Shards) is prefetch
      losses.append(float(towers.train_step_outputs(images, labels).total))
  variables = towers.model.variables + towers.optimizer.variables
  return losses, [v.numpy() for v in variables]


def assert_same_bits(got, want):
  (got_losses, got_variables), (want_losses, want_variables) = got, want
  assert len(got_losses) == STEPS and got_losses == want_losses
  assert len(got_variables) == len(want_variables)
  for k, (mine, theirs) in enumerate(zip(got_variables, want_variables)):
    assert np.array_equal(mine, theirs), f'variable {k} differs'


# (DeploymentConfig fields, model, StepOptions fields) of each layout.
LAYOUTS = {
    '2 clones': (dict(num_clones=2), bn_mlp, {}),
    'shares 3:1 x 2 accumulation steps': (
        dict(num_clones=2), bn_mlp,
        dict(clone_shares=(3, 1), accumulation_steps=2)),
    '2 clones x 2 stages x 2 micro-batches': (
        dict(num_clones=2, num_stages=2), bn_mlp, dict(num_microbatches=2)),
    'synchronized BatchNorm': (
        dict(num_clones=2), synchronized_mlp, dict(sync_batch_norm=True)),
}


@pytest.mark.parametrize('name', [
    pytest.param(name, marks=[] if name == '2 clones' else [pytest.mark.slow])
    for name in LAYOUTS])
def test_the_feed_trains_the_bits_of_the_split_batch(name):
  config_fields, model_fn, fields = LAYOUTS[name]
  assert_same_bits(train(True, config_fields, model_fn, **fields),
                   train(False, config_fields, model_fn, **fields))


def test_each_clone_reads_its_shard_on_its_device():
  """Read from the traced step: every op that reads clone i's inputs or
  targets runs on clone i's device, and nothing splits a whole batch."""
  config = deploy.DeploymentConfig(num_clones=3, clone_on_cpu=True,
                                   prefetch_to_clones=True)
  towers = make_deployed(config, accumulation_steps=2)
  images, labels = next(iter(towers.distribute_dataset(dataset(12, 1))))
  wanted = config.clone_devices()
  for nest in (images, labels):
    assert [devices.canonical(t.device) for t in nest.parts] == wanted
  step = towers.traced_step(images, labels)
  placement = devices.GraphPlacement()
  # The step's first inputs: the images' shards, then the labels'.
  for k, shard in enumerate(step.inputs[:2 * config.num_clones]):
    readers = shard.consumers()
    assert readers and {placement.of_op(op) for op in readers} == {
        wanted[k % config.num_clones]}, shard.name
  assert not [op for op in step.graph.get_operations()
              if op.name.startswith('split_batch')]


@pytest.mark.slow
def test_a_short_batch_cut_by_clone_trains_as_the_split_batch():
  """Unequal accumulation steps (a short last batch, which the job's
  pipeline drops): each clone cuts its own shard into them."""
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  split, by_clone = (make_deployed(config, bn_mlp, accumulation_steps=2)
                     for _ in range(2))
  images, labels = make_batch(11)
  layout = split.layout_for(images, labels, partial=True)
  assert not layout.equal_steps()
  shards = [rows.Shards(feeds.clone_parts(nest, layout), layout)
            for nest in (images, labels)]
  want = split.train_step_outputs(images, labels, partial=True)
  got = by_clone.train_step_outputs(*shards)
  assert float(got.total) == float(want.total)
  for mine, theirs in zip(by_clone.model.variables, split.model.variables):
    assert np.array_equal(mine.numpy(), theirs.numpy())


@pytest.mark.slow
def test_the_cut_follows_automatic_shares():
  """The first cut waits for the first measurement (3:1); a split measured
  during an epoch (1:3, at its last step) cuts the next epoch's batches."""
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                   prefetch_to_clones=True)
  measured = iter([[300.0, 100.0]] + [[100.0, 300.0]] * 2)
  shapes = []

  def measure(images, labels):
    del labels
    shapes.append(tuple(images.shape))  # Zeros of the whole batch's shape.
    return next(measured)
  towers = make_deployed(config,
                         shares=balance.Balancer(STEPS, measure=measure))
  for wanted in ((12, 4), (4, 12)):
    for images, labels in towers.distribute_dataset(dataset()):
      assert tuple(part.shape[0] for part in images.parts) == wanted
      towers.train_step_outputs(images, labels)
  assert shapes == [(ROWS, 6)] * 3


@pytest.mark.slow
@pytest.mark.parametrize('atom_rows', [0, 2])
def test_train_py_through_the_feed_writes_the_same_checkpoint(
    run_train, monkeypatch, atom_rows):
  """The job's loop and pipeline, fed shard by shard: LeNet's checkpoint
  bit for bit with `reproducible_rows`; without it to rounding (its
  convolutions may round otherwise on a shard in a buffer of its own:
  measured, last-bit differences in a third of one weight's slot)."""
  common = dict(num_clones=2, batch_size=4, train_steps=3,
                clone_shares=['3', '1'], accumulation_steps=2,
                reproducible_rows=atom_rows)
  split = run_train(**common)
  made = []
  feed = feeds.Feeder.feed

  def counted(self, *args, **kwargs):
    made.append(feed(self, *args, **kwargs))
    return made[-1]
  monkeypatch.setattr(feeds.Feeder, 'feed', counted)
  monkeypatch.setattr(deploy.DeploymentConfig, 'prefetches_to_clones',
                      lambda self: True)
  through_the_feed = run_train(**common)  # Its steps read inside a loop.
  assert [type(f) for f in made] == [feeds.Fed]  # One chain of epochs.
  assert_same_checkpoints(through_the_feed['checkpoint'], split['checkpoint'],
                          exact=bool(atom_rows))
