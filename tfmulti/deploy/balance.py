"""Automatic clone shares (`--clone_shares=auto`) for unequal devices.

A step waits for its slowest clone, so on unequal devices an even split
wastes the fast ones. `Balancer` measures each clone's throughput alone
(rows a second, forward and backward on its device), sets the shares in
proportion, and measures again every `every_steps` steps, so a device that
slows down later gets fewer rows at the next measurement.

`Balancer` is a policy the towers consult before cutting a step's layout:
it is handed its measure (`Probes`, the clones timed alone), the rows to
split and the current shares, returns the next shares, and never sees the
towers. Shares are whole numbers out of
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
from tfmulti import rows as rows_lib
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


class Probes:
  """Each clone's rows a second alone (forward and backward on its
  devices), timed on an equal share of an accumulation step of a batch:
  the measure behind `clone_shares='auto'`. `deploy()` makes it from the
  step's runner; the shares policy calls it and sees nothing else of the
  towers.

  Attributes:
    config: the `DeploymentConfig`.
    options: the `StepOptions`.
    runner: the step's runner (`runners`), whose `probe` runs one clone.
  """

  def __init__(self, config, options, runner):
    self.config = config
    self.options = options
    self.runner = runner
    self._probes = {}  # Clone index -> its timing function.

  def __call__(self, images, labels):
    """Each clone's throughput in rows a second on this batch."""
    rows = layouts.clone_probe_rows(
        tf.nest.flatten(images)[0].shape[0],
        layouts.cut_of(self.config, self.options))
    images, labels = tf.nest.map_structure(lambda t: t[:rows],
                                           (images, labels))
    speeds = []
    for i in range(self.config.num_clones):
      probe = self.probe(i)
      speeds.append(rows / costs.median_seconds(
          lambda probe=probe: float(probe(images, labels))))
    return speeds

  def probe(self, clone_index):
    """A `tf.function(images, labels)` of clone `clone_index` alone (its
    forward and backward pass on its device(s), reduced to one number so
    nothing is pruned)."""
    if clone_index not in self._probes:
      self._probes[clone_index] = tf.function(
          lambda images, labels: self._probe_graph(clone_index, images,
                                                   labels), autograph=False)
    return self._probes[clone_index]

  def _probe_graph(self, clone_index, images, labels):
    layout = layouts.step_layout(
        rows_lib.batch_rows(images, labels), layouts.Cut(
            num_microbatches=self.options.num_microbatches,
            staged=layouts.is_staged(self.config, self.options)))
    loss, gradients = self.runner.probe(clone_index, images, labels, layout)
    return loss + tf.add_n([tf.reduce_sum(g) for g in gradients
                            if g is not None])


class Balancer:
  """The policy behind `clone_shares='auto'`: the shares a step uses,
  measured again every `every_steps` steps. Read-only towards the towers:
  it is handed what it needs (`shares`) and returns shares.

  Attributes:
    every_steps: steps between measurements (the first is at step 0 of
      this process, so a resumed run measures again).
    measure: `measure(images, labels)` -> each clone's throughput in rows
      a second; the towers' `Probes` unless given (tests inject it).
    history: (step, shares, throughputs) of every measurement.
  """

  def __init__(self, every_steps, measure=None):
    self.every_steps = every_steps
    self.measure = measure
    self.history = []
    self._steps = 0

  def with_measure(self, measure):
    """Itself, measuring with `measure` where none was given."""
    self.measure = self.measure or measure
    return self

  def measured(self):
    """Whether a measurement was taken: a feed's first cut waits for it."""
    return bool(self.history)

  def shares(self, images, labels, *, rows, current):
    """The shares of the next step on this batch, whose accumulation
    steps have `rows` rows and whose shares are `current` (None: equal):
    measured again when due, else `current`."""
    if self._steps % self.every_steps == 0:
      current = self.rebalance(images, labels, rows=rows, current=current)
    self._steps += 1
    return current

  def rebalance(self, images, labels, *, rows, current):
    """Measures the clones on this batch; returns the shares to use
    (`current` unless a new split predicts a step `MIN_GAIN` faster)."""
    throughputs = self.measure(images, labels)
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
  compares splits (the benchmark `bench.unequal_clones`) passes one to
  `deploy(..., shares=)` and sets its `value` between steps."""

  def __init__(self, value=None):
    self.value = value

  def with_measure(self, measure):
    """Itself: it measures nothing."""
    del measure
    return self

  def measured(self):
    """Nothing to wait for before a cut."""
    return True

  def shares(self, images, labels, *, rows, current):
    """`value`, whatever the batch."""
    del images, labels, rows, current  # Fixed: nothing is measured.
    return self.value


class OnLeaders:
  """A shares policy whose shares are gathered onto the clones that take
  rows: clone i's share goes to `leaders[i]` (where a layout computes
  split kernels as blocks, a mesh row is one clone spanning its devices:
  `sharding.Sharded.leaders`), the others get none. The policy sees its
  own shares, never the gathered ones."""

  def __init__(self, policy, leaders):
    self.policy = policy
    self.leaders = leaders
    self._own = None  # The policy's last shares (None: equal).

  def with_measure(self, measure):
    """Itself, its policy measuring with `measure`."""
    self.policy = self.policy.with_measure(measure)
    return self

  def measured(self):
    """Whether the policy has what it waits for before a cut."""
    return self.policy.measured()

  def shares(self, images, labels, *, rows, current):
    """The policy's shares of the next step, each given to its clone's
    leader."""
    del current  # The gathered shares: the policy keeps its own.
    self._own = self.policy.shares(images, labels, rows=rows,
                                   current=self._own)
    gathered = [0] * len(self.leaders)
    for clone, share in enumerate(self._own or [1] * len(self.leaders)):
      gathered[self.leaders[clone]] += share
    return tuple(gathered)
