"""Multi-worker training on TensorFlow's own runtime, from `TF_CONFIG`.

The cluster comes from the standard `TF_CONFIG` variable, e.g. on the
second of two machines:

  {"cluster": {"worker": ["host0:12345", "host1:12345"]},
   "task": {"type": "worker", "index": 1}}

Worker 0 is the chief (or the task of a "chief" job, if there is one): it
alone writes checkpoints, summaries and metrics.json to the model_dir; the
others write theirs to temporary directories that they remove.
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib

import tensorflow as tf

from tfmulti import errors

TF_CONFIG = 'TF_CONFIG'
# What a restart of the command line's workers does after a lost peer.
RESUME_FROM_CHECKPOINT = 'they resume from the latest checkpoint'
# A task as TensorFlow's errors name it: /job:worker/replica:0/task:1.
_TASK_NAME = re.compile(r'/job:(chief|worker)/replica:\d+/task:(\d+)')
# The port of an address as gRPC's errors write it: ipv4:10.0.0.2:2222,
# ipv6:[::1]:2222.
_GRPC_PORT = re.compile(r'ipv(?:4:[\d.]+|6:\[[^\]\s]*\]):(\d+)')
_MOST_LISTED = 4  # Peers a lost-peer line lists when TF's error names none.


@dataclasses.dataclass(frozen=True)
class Cluster:
  """This task's place in the cluster.

  Attributes:
    workers: the addresses of every training task, chief first.
    index: this task's position in `workers` (its worker index).
    is_chief: whether this task writes the outputs.
    num_chiefs: how many of `workers` come from a "chief" job (0 or 1):
      TensorFlow's task i of the "worker" job is `workers[num_chiefs + i]`.
  """
  workers: tuple
  index: int
  is_chief: bool
  num_chiefs: int = 0

  @property
  def num_workers(self):
    return len(self.workers)

  @property
  def peers(self):
    """The other tasks' addresses."""
    return tuple(a for i, a in enumerate(self.workers) if i != self.index)


def from_environment(environ=None):
  """The `Cluster` described by TF_CONFIG.

  Raises:
    errors.ClusterError: TF_CONFIG is unset or malformed, names parameter
      servers, or puts this task outside the cluster.
  """
  environ = os.environ if environ is None else environ
  raw = environ.get(TF_CONFIG)
  if not raw:
    raise errors.ClusterError(
        'strategy=multi_worker needs TF_CONFIG, e.g. {"cluster": {"worker": '
        '["host0:12345", "host1:12345"]}, "task": {"type": "worker", '
        '"index": 0}}; see the README.')
  try:
    config = json.loads(raw)
    jobs, task = config['cluster'], config['task']
    task_type, task_index = task['type'], int(task['index'])
  except (ValueError, KeyError, TypeError) as e:
    raise errors.ClusterError(f'TF_CONFIG={raw!r} is not a cluster: it needs '
                       '"cluster" and "task" with "type" and "index".') from e
  if 'ps' in jobs:
    raise errors.ClusterError(
        f'TF_CONFIG names parameter servers ({jobs["ps"]}): tfmulti does not '
        'run ParameterServerStrategy (see the README); drop the "ps" job.')
  chiefs, workers = list(jobs.get('chief', [])), list(jobs.get('worker', []))
  addresses = tuple(chiefs + workers)
  position = {'chief': 0, 'worker': len(chiefs)}.get(task_type)
  if position is None or not 0 <= task_index < len(jobs.get(task_type, [])):
    raise errors.ClusterError(
        f'TF_CONFIG task {task!r} is not in the cluster {jobs}; its type is '
        '"chief" or "worker" and its index one of that job\'s positions.')
  return Cluster(addresses, position + task_index, position + task_index == 0,
                 num_chiefs=len(chiefs))


def check_flags(cluster, num_workers, worker_index):
  """Raises `errors.ClusterError` if flags given disagree with TF_CONFIG."""
  if num_workers not in (None, cluster.num_workers):
    raise errors.ClusterError(
        f'--num_workers={num_workers}, but TF_CONFIG has '
        f'{cluster.num_workers} workers; leave it unset.')
  if worker_index not in (None, cluster.index):
    raise errors.ClusterError(
        f'--worker_index={worker_index}, but TF_CONFIG makes this task worker '
        f'{cluster.index}; leave it unset.')


class _OneReplicaPerWorker(
    tf.distribute.cluster_resolver.TFConfigClusterResolver):
  """TF_CONFIG, with no accelerators: one replica (the host) per worker.

  The towers place their clones on the worker's devices themselves; the
  strategy only all-reduces the workers' summed gradients.
  """

  def num_accelerators(self, task_type=None, task_id=None,
                       config_proto=None):
    return {}


# Run by a watchdog process (Python, no TensorFlow): probes the peers and,
# if one never answers, says so and kills the training process, which
# TensorFlow's collective runtime holds in C++ (GIL held, SIGTERM taken by
# its coordination service for preemption) while it waits without end.
# It signals no process but its own parent, and ends when the parent does
# (the parent's PID may belong to another process by then).
_WATCHDOG = """
import os, signal, socket, sys, time
parent, timeout_s, index = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + timeout_s
for address in sys.argv[4:]:
  host, port = address.rsplit(':', 1)
  while True:
    if os.getppid() != parent:
      sys.exit(0)
    try:
      socket.create_connection((host, int(port)), timeout=1.0).close()
      break
    except OSError as e:
      if time.monotonic() > deadline and os.getppid() == parent:
        print(f'error: worker {index} cannot reach its peer {address} after '
              f'{timeout_s:.0f} s ({e}); start every worker of TF_CONFIG, '
              'check the address and the firewall.', file=sys.stderr,
              flush=True)
        os.kill(parent, signal.SIGKILL)
        sys.exit(1)
      time.sleep(0.5)
"""


def start_watchdog(cluster, timeout_s):
  """A process that kills this one if a peer has not answered in
  `timeout_s`; it ends by itself when this process does.

  Kill it once the peers have joined.
  """
  return subprocess.Popen([sys.executable, '-c', _WATCHDOG, str(os.getpid()),
                           str(timeout_s), str(cluster.index),
                           *cluster.peers])


def multi_worker_strategy(cluster, *, one_replica_per_worker, timeout_s):
  """MultiWorkerMirroredStrategy over TF_CONFIG's cluster.

  Call it before TensorFlow runs its first op. `one_replica_per_worker`:
  the towers' setting (clones are placed by tfmulti); otherwise one replica
  per local GPU, as MirroredStrategy. If a peer has not answered within
  `timeout_s`, a watchdog process names it and kills this process
  (TensorFlow would wait without end); collectives time out after
  `timeout_s` too.
  """
  watchdog = start_watchdog(cluster, timeout_s)
  try:
    resolver = (_OneReplicaPerWorker() if one_replica_per_worker else
                tf.distribute.cluster_resolver.TFConfigClusterResolver())
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout_s)
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=options)
  except (tf.errors.OpError, ValueError, RuntimeError) as e:
    raise errors.ClusterError(
        f'worker {cluster.index} cannot start the multi-worker strategy on '
        f'{cluster.workers[cluster.index]} ({errors.first_line(e)})'
        '; check that the address is this machine and the port is free.'
    ) from e
  finally:
    watchdog.kill()  # Every peer has joined, or this worker gives up.
    watchdog.wait()


def check_agreement(strategy, job):
  """Raises `ClusterError` on every worker unless all run the same job.

  Each worker all-gathers a checksum of each of `job`'s values, before the
  first step, so workers started with different flags stop with one line
  instead of training a wrong global batch or failing at a collective.

  Args:
    strategy: the job's `MultiWorkerMirroredStrategy`.
    job: {name: JSON-serialisable value}, the same names on every worker.
  """
  names = sorted(job)
  # CRC-32 values are below 2**32, exact in float64.
  codes = tf.constant([zlib.crc32(json.dumps(job[name]).encode())
                       for name in names], tf.float64)

  @tf.function
  def gather():
    return strategy.run(lambda: tf.distribute.get_replica_context()
                        .all_gather(codes, axis=0))
  table = tf.reshape(strategy.experimental_local_results(gather())[0],
                     [-1, len(names)]).numpy()
  differ = [name for k, name in enumerate(names) if len(set(table[:, k])) > 1]
  if differ:
    mine = '; '.join(f'{name}={job[name]!r}' for name in differ)
    raise errors.ClusterError(
        f'the workers of this job disagree on {", ".join(differ)} (this '
        f'worker has {mine}); start every worker with the same flags.')


@contextlib.contextmanager
def lost_peers_as_errors(cluster, resume=RESUME_FROM_CHECKPOINT):
  """Turns a collective that failed for want of a peer into one line that
  names the peer (`lost_peer_message`); `resume` says what a restart does.

  With `cluster` None (one process), errors pass unchanged.
  """
  try:
    yield
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
          tf.errors.CancelledError, tf.errors.AbortedError) as e:
    if cluster is None:
      raise
    raise errors.PeerLostError(lost_peer_message(cluster, e, resume)) from e


def lost_peer_message(cluster, error, resume=RESUME_FROM_CHECKPOINT):
  """The one line for `error`, a collective that failed for want of a
  peer: the peers TensorFlow's error names, or, if it names none, every
  peer (the first few), each as `worker i at host:port`."""
  named = lost_peers(cluster, str(error))
  if named:
    who = ', '.join(_worker(cluster, i) for i in named)
  else:
    others = [i for i in range(cluster.num_workers) if i != cluster.index]
    who = 'one of ' + ', '.join(_worker(cluster, i)
                                for i in others[:_MOST_LISTED])
    if len(others) > _MOST_LISTED:
      who += f' and {len(others) - _MOST_LISTED} more'
  return (f'worker {cluster.index} lost a peer mid-step: {who} '
          f'({type(error).__name__}); restart every worker with the same '
          f'command: {resume}.')


def lost_peers(cluster, text):
  """The indices of the peers that TensorFlow's error `text` names, sorted.

  A peer is named by its task (`/job:worker/replica:0/task:1`), by its
  address, or by gRPC's form of it (`ipv4:10.0.0.2:2222`) when its port is
  no other worker's (a host name is written as an IP there).
  """
  named = set()
  for job, task in _TASK_NAME.findall(text):
    named.add(int(task) + (cluster.num_chiefs if job == 'worker' else 0))
  for index, address in enumerate(cluster.workers):
    if re.search(rf'(?<![\w.-]){re.escape(address)}(?!\d)', text):
      named.add(index)
  ports = [address.rsplit(':', 1)[-1] for address in cluster.workers]
  for port in _GRPC_PORT.findall(text):
    if ports.count(port) == 1:
      named.add(ports.index(port))
  named.discard(cluster.index)
  return sorted(i for i in named if 0 <= i < cluster.num_workers)


def _worker(cluster, index):
  return f'worker {index} at {cluster.workers[index]}'


def output_dir(model_dir, cluster):
  """The chief's model_dir, or a fresh temporary directory for the others."""
  if cluster is None or cluster.is_chief:
    return model_dir
  return tempfile.mkdtemp(prefix=f'tfmulti-worker{cluster.index}-')


def remove_output_dir(directory, model_dir):
  """Removes a non-chief worker's temporary directory."""
  if directory != model_dir:
    shutil.rmtree(directory, ignore_errors=True)
