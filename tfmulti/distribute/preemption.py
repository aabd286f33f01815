"""Preemption: when any worker is told to stop, every worker saves one step.

A multi-worker job cannot stop where each worker's signal lands: a worker
that stops alone leaves its peers waiting in a collective, and checkpoints
of different steps cannot resume one job. So the workers agree on the step,
as TensorFlow's `PreemptionCheckpointHandler` does, through the cluster's
coordination service (its key-value store, which MultiWorkerMirroredStrategy
starts): the worker that got SIGTERM or SIGINT, at its next step boundary
(after step n), publishes "stop after step n + 1" and waits until every
worker has read it; then all run step n + 1, save it and stop. n + 1,
because a worker never runs more than one step ahead of another (each
step's all-reduce needs them all), and none can finish step n + 1 before
the publisher, who waits for every worker's acknowledgement before it runs
that step. If several workers are signalled, the first to publish wins.

The job's own path, not `PreemptionCheckpointHandler` itself: the handler
saves with its own checkpoint manager and counter, and exits the process
from inside `run`; the job's checkpoints carry its epoch and row position,
the model_dir's record and metrics, which an exact resume needs. The
agreement is the same. Nothing is read per step: a thread polls the store.

The key-value store is TensorFlow's (`tensorflow.python.eager.context`),
read here alone (`_CoordinationStore`).
"""

import threading

from absl import logging

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import stops

_KEY = 'tfmulti/stop_after_step'
_POLL_MS = 500


class _CoordinationStore:
  """The coordination service's key-value store: set once, get or wait."""

  def set_new(self, key, value):
    """Sets `key`; False if another task set it first."""
    return keras_internals.set_new_key(key, value)

  def get(self, key, timeout_ms):
    """`key`'s value, or None if it is not set within `timeout_ms`."""
    return keras_internals.key_value(key, timeout_ms)


class AgreedStop:
  """Stops every worker of `cluster` after the same step (see the module).

  Enter it around the training loop; at each step boundary call
  `stop_after(step, received, last_step)`.
  """

  def __init__(self, cluster, timeout_s, store=None):
    """`timeout_s`: how long the signalled worker waits for the others to
    read the step (the peers' timeout). `store`: the key-value store (the
    coordination service's; tests give their own)."""
    self._cluster = cluster
    self._timeout_ms = int(timeout_s * 1000)
    self._store = store or _CoordinationStore()
    self._agreed = None  # A `Stop` and its step, once read from the store.
    self._proposed = False
    self._closed = threading.Event()
    self._watcher = threading.Thread(target=self._watch, daemon=True,
                                     name='tfmulti-agreed-stop')

  def __enter__(self):
    self._watcher.start()
    return self

  def __exit__(self, *exc_info):
    self._closed.set()
    self._watcher.join()

  def _watch(self):
    """Reads the agreed step once it is published, and acknowledges it."""
    while not self._closed.is_set():
      value = self._store.get(_KEY, _POLL_MS)
      if value is None:
        continue
      step, name, index = value.split()
      self._agreed = (int(step), stops.Stop(f'{name} to worker {index}',
                                            stops.exit_code(name)))
      self._store.set_new(f'{_KEY}/ack/{self._cluster.index}', '1')
      return

  def stop_after(self, step, received, last_step):
    """The `stops.Stop` to save and stop with after global step `step`, or
    None.

    Args:
      step: the step this worker has just finished.
      received: the signal this worker received (a name), or None.
      last_step: the run's last step; a run one step from it just ends.

    Raises:
      errors.ClusterError: a worker did not read the agreed step in time.
    """
    if (received and not self._proposed and self._agreed is None
        and step + 1 < last_step):
      self._proposed = True
      self._propose(step + 1, received)
    if self._agreed is not None and step >= self._agreed[0]:
      return self._agreed[1]
    return None

  def _propose(self, stop_step, received):
    value = f'{stop_step} {received} {self._cluster.index}'
    if not self._store.set_new(_KEY, value):
      return  # Another worker published first; the watcher reads it.
    logging.warning('%s: every worker saves step %d and stops', received,
                    stop_step)
    for index in range(self._cluster.num_workers):
      if self._store.get(f'{_KEY}/ack/{index}', self._timeout_ms) is None:
        raise errors.ClusterError(
            f'worker {index} ({self._cluster.workers[index]}) did not read '
            f'the step to stop at ({stop_step}) within '
            f'{self._timeout_ms / 1000:.0f} s; restart every worker with '
            'the same command: they resume from the latest checkpoint.')
