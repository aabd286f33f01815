"""Tests for the agreed stop of a multi-worker job (`preemption`).

Here the workers are `AgreedStop`s over one in-memory store, stepped in
turn; the store's contract is the coordination service's (a key is set
once; a read waits up to its timeout). Real workers, signalled and
resumed, are in test_cluster.py (slow).
"""

import contextlib
import threading

import pytest

from tfmulti import errors
from tfmulti import stops
from tfmulti.distribute import cluster
from tfmulti.distribute import preemption


class _Store:
  """The coordination service's key-value store, in memory."""

  def __init__(self):
    self._values = {}
    self._changed = threading.Condition()

  def set_new(self, key, value):
    with self._changed:
      if key in self._values:
        return False
      self._values[key] = value
      self._changed.notify_all()
      return True

  def get(self, key, timeout_ms):
    with self._changed:
      self._changed.wait_for(lambda: key in self._values, timeout_ms / 1000)
      return self._values.get(key)


@contextlib.contextmanager
def _workers(count, present=None):
  """`present` (default: all) of `count` workers over one store, entered."""
  store = _Store()
  addresses = tuple(f'localhost:{1000 + i}' for i in range(count))
  with contextlib.ExitStack() as stack:
    yield [stack.enter_context(preemption.AgreedStop(
        cluster.Cluster(addresses, i, i == 0), timeout_s=2, store=store))
           for i in range(present or count)]


def _run(workers, signals, last_step=10):
  """Steps the workers in turn; `signals`: {(worker, step): name}, the
  signal a worker holds from that step on. Returns {worker: (step, Stop)}."""
  ended, held = {}, {}
  for step in range(1, last_step + 1):
    for index, worker in enumerate(workers):
      if index in ended:
        continue
      held[index] = signals.get((index, step), held.get(index))
      stop = worker.stop_after(step, held[index], last_step)
      if stop:
        ended[index] = (step, stop)
  return ended


@pytest.mark.parametrize('signalled', [0, 1])
def test_one_signalled_worker_stops_every_worker_one_step_later(signalled):
  with _workers(2) as workers:
    ended = _run(workers, {(signalled, 3): 'SIGTERM'})
  expected = (4, stops.Stop(f'SIGTERM to worker {signalled}', 143))
  assert ended == {0: expected, 1: expected}


def test_workers_signalled_at_once_keep_the_first_step_published():
  with _workers(3) as workers:
    ended = _run(workers, {(1, 5): 'SIGINT', (2, 5): 'SIGTERM',
                           (0, 6): 'SIGTERM'})
  assert {s for s in ended.values()} == {
      (6, stops.Stop('SIGINT to worker 1', 130))}
  assert len(ended) == 3


def test_a_signal_one_step_before_the_end_lets_the_run_end():
  with _workers(2) as workers:
    assert _run(workers, {(0, 9): 'SIGTERM'}, last_step=10) == {}


@pytest.mark.slow
def test_a_worker_that_never_reads_the_step_is_named():
  with _workers(3, present=2) as workers:  # Worker 2 is gone.
    with pytest.raises(errors.ClusterError,
                       match=r'worker 2 \(localhost:1002\) did not read the '
                       r'step to stop at \(4\) within 2 s'):
      workers[0].stop_after(3, 'SIGTERM', 10)
