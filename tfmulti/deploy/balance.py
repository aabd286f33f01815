"""Automatic clone shares (`--clone_shares=auto`) for unequal devices.

A step waits for its slowest clone, so on unequal devices an even split
wastes the fast ones. `Balancer` measures each clone's throughput alone
(rows a second, forward and backward on its device), sets the shares in
proportion, and measures again every `every_steps` steps, so a device that
slows down later gets fewer rows at the next measurement.

`Balancer` is a policy the towers consult before cutting a step's layout:
it replaces the shares between steps. Shares are whole numbers out of
`BUCKETS` (3:1 is 12:4), and a new split is taken only when it predicts a
step at least `MIN_GAIN` faster than the current split does under the same
measurement, so noise does not move it.
The step, traced once per distinct split, thus retraces a bounded number
of times (at most the splits of BUCKETS, in practice one or two;
`Trainer.trace_count` counts them). Any split trains exactly as one device
on the whole batch (`trainer.shard_loss`).
"""

from absl import logging
import tensorflow as tf

from tfmulti import errors
from tfmulti import layouts
from tfmulti.layouts import split_rows
from tfmulti.pipeline import costs

BUCKETS = 16  # Shares are integers summing to this.
# A new split must predict a step this much faster than the current one's,
# so measurement noise on equal devices does not move (and retrace) it.
MIN_GAIN = 0.05


def shares_for(throughputs, buckets=BUCKETS):
  """Integer shares summing to `buckets`, proportional to `throughputs`
  (largest remainder), each at least 1."""
  if len(throughputs) > buckets:
    raise errors.ConfigError(
        f'{len(throughputs)} clones cannot be balanced in {buckets} buckets.')
  shares = split_rows(buckets, throughputs)
  while 0 in shares:  # Every clone keeps a row's worth; the largest pays.
    shares[shares.index(0)] = 1
    shares[shares.index(max(shares))] -= 1
  return tuple(shares)


def predicted_step_seconds(rows, throughputs):
  """The step time a split predicts: its slowest clone's rows / speed."""
  return max(r / t for r, t in zip(rows, throughputs))


def clone_throughputs(towers, images, labels):
  """Each clone's rows a second alone (forward and backward on its
  devices), on an equal share of an accumulation step of this batch."""
  rows = layouts.clone_probe_rows(
      tf.nest.flatten(images)[0].shape[0],
      layouts.cut_of(towers.config, towers.options))
  images, labels = tf.nest.map_structure(lambda t: t[:rows], (images, labels))
  speeds = []
  for i in range(towers.config.num_clones):
    probe = towers.probe(i)
    speeds.append(rows / costs.median_seconds(
        lambda probe=probe: float(probe(images, labels))))
  return speeds


class Balancer:
  """The policy behind `clone_shares='auto'`: the shares a step uses,
  measured again every `every_steps` steps.

  `DeployedModel.train_step_outputs` asks it for the shares before it cuts
  the step's layout; nothing else sees it.

  Attributes:
    every_steps: steps between measurements (the first is at step 0 of
      this process, so a resumed run measures again).
    measure: `measure(towers, images, labels)` -> each clone's throughput
      in rows a second; `clone_throughputs` unless given (tests inject it).
    history: (step, shares, throughputs) of every measurement.
  """

  def __init__(self, every_steps, measure=None):
    self.every_steps = every_steps
    self.measure = measure or clone_throughputs
    self.history = []
    self._steps = 0

  def shares(self, towers, images, labels):
    """The shares of `towers`' next step on this batch: measured again
    when due, else its current ones."""
    shares = towers.clone_shares
    if self._steps % self.every_steps == 0:
      shares = self.rebalance(towers, images, labels)
    self._steps += 1
    return shares

  def rebalance(self, towers, images, labels):
    """Measures the clones; returns the shares to use (the current ones
    unless a new split predicts a step `MIN_GAIN` faster)."""
    throughputs = self.measure(towers, images, labels)
    rows = layouts.accumulation_step_rows(
        tf.nest.flatten(images)[0].shape[0],
        layouts.cut_of(towers.config, towers.options))
    current = towers.clone_shares
    now = predicted_step_seconds(
        split_rows(rows, current or [1] * len(throughputs)), throughputs)
    shares = shares_for(throughputs)
    new = predicted_step_seconds(split_rows(rows, shares), throughputs)
    if current is None or new < now * (1 - MIN_GAIN):
      logging.info(
          'clone shares %s from %s rows/s; predicted step %.1f ms (the '
          'split before: %.1f ms)', '/'.join(map(str, shares)),
          ', '.join(f'{t:.0f}' for t in throughputs), 1e3 * new, 1e3 * now)
      current = shares
    self.history.append((self._steps, current, tuple(throughputs)))
    return current


class Fixed:
  """The shares policy that measures nothing: the shares its `value` holds
  (None for equal). `deploy()` gives it the options' own shares; whoever
  compares splits (the benchmark `bench.unequal_clones`) sets it between
  steps. The step consults it as it does the `Balancer`."""

  def __init__(self, value=None):
    self.value = value
    self.history = [(0, value, ())]  # Nothing to wait for before a cut.

  def shares(self, towers, images, labels):
    """`value`, whatever the batch."""
    del towers, images, labels  # Fixed: nothing is measured.
    return self.value

