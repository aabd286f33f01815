"""Where this worker stands, read the way the job was launched.

`--cluster` names the source, and every source gives the same
`cluster.Cluster` record:

* `tf_config`: the `TF_CONFIG` variable (`cluster.from_environment`);
* `slurm`: the tasks of the Slurm step this process is one of, read from
  Slurm's own variables: `SLURM_PROCID` (this task's rank),
  `SLURM_STEP_NUM_TASKS`, `SLURM_STEP_NODELIST` (expanded in Slurm's
  order: `n[9-10]` is n9 then n10, not sorted as strings) and
  `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`). Ranks go node by node (Slurm's
  block distribution), and a node's tasks take consecutive ports from
  `--port`, so one task a node or one a GPU both work, on nodes without
  GPUs too (TF's `SlurmClusterResolver` runs `nvidia-smi` and sorts hosts
  as strings);
* `indexed_job`: a Kubernetes Indexed Job or JobSet: this pod's index from
  `JOB_COMPLETION_INDEX`, the hosts from a pattern such as
  `train-{index}.train:2222` and `--num_workers`;
* `auto`: `tf_config` when `TF_CONFIG` is set, `slurm` inside a Slurm step
  of more than one task, else `none` (one process).

The multi-worker strategy reads `TF_CONFIG`; for the other sources
`resolve_into` writes the one `tf_config(cluster)` gives into this
process's environment before the strategy is made.
"""

import itertools
import re

from tfmulti import errors
from tfmulti import tf_config as tf_config_lib
from tfmulti.distribute import cluster as cluster_lib

AUTO = 'auto'
TF_CONFIG = 'tf_config'
SLURM = 'slurm'
INDEXED_JOB = 'indexed_job'
NONE = 'none'
SOURCES = (AUTO, TF_CONFIG, SLURM, INDEXED_JOB, NONE)
# A Slurm node's first port when none is given (`--port`, `workers.start`):
# its k tasks use it and the k - 1 after it.
DEFAULT_PORT = 12345


def source_of(kind, environ):
  """The source `kind` names; for `auto`, the one the environment shows."""
  errors.check_choice('cluster', kind, SOURCES)
  if kind != AUTO:
    return kind
  if environ.get(cluster_lib.TF_CONFIG):
    return TF_CONFIG
  if _int_or_none(environ.get('SLURM_STEP_NUM_TASKS')) not in (None, 0, 1):
    return SLURM
  return NONE


def resolve(kind, environ, *, port=None, worker_hosts=None,
            num_workers=None):
  """This task's `Cluster` from the source `kind`, or None for `none`.

  Raises:
    errors.ClusterError: a variable missing or malformed, naming it.
  """
  kind = source_of(kind, environ)
  if kind == TF_CONFIG:
    return cluster_lib.from_environment(environ)
  if kind == SLURM:
    return slurm(environ, port)
  if kind == INDEXED_JOB:
    return indexed_job(environ, worker_hosts, num_workers)
  return None


def resolve_into(kind, environ, **flags):
  """`resolve`, then the `TF_CONFIG` the strategy reads written into
  `environ` when the cluster came from another source."""
  found = resolve(kind, environ, **flags)
  if found is not None and source_of(kind, environ) != TF_CONFIG:
    environ[cluster_lib.TF_CONFIG] = tf_config(found)
  return found


def tf_config(cluster):
  """The `TF_CONFIG` value that places this task in `cluster`."""
  return tf_config_lib.for_worker(cluster.workers, cluster.index)


def slurm(environ, port):
  """The `Cluster` of this Slurm step's tasks (see the module)."""
  rank = _needed_int(environ, 'SLURM_PROCID')
  num_tasks = _needed_int(environ, 'SLURM_STEP_NUM_TASKS')
  hosts = expand_nodelist(_needed(environ, 'SLURM_STEP_NODELIST'))
  per_node = expand_tasks_per_node(
      _needed(environ, 'SLURM_STEP_TASKS_PER_NODE'))
  if len(per_node) != len(hosts) or sum(per_node) != num_tasks:
    raise errors.ClusterError(
        f'SLURM_STEP_TASKS_PER_NODE={environ["SLURM_STEP_TASKS_PER_NODE"]!r} '
        f'gives {per_node} tasks on the {len(hosts)} nodes of '
        f'SLURM_STEP_NODELIST and SLURM_STEP_NUM_TASKS={num_tasks}; run '
        'inside one srun step.')
  if not 0 <= rank < num_tasks:
    raise errors.ClusterError(
        f'SLURM_PROCID={rank} is not a task of SLURM_STEP_NUM_TASKS='
        f'{num_tasks}; run inside one srun step.')
  first = _port(port)
  addresses = tuple(f'{host}:{first + local}'
                    for host, count in zip(hosts, per_node)
                    for local in range(count))
  return cluster_lib.Cluster(addresses, rank, rank == 0)


def indexed_job(environ, worker_hosts, num_workers):
  """The `Cluster` of a Kubernetes Indexed Job's pods (see the module)."""
  index = _needed_int(environ, 'JOB_COMPLETION_INDEX')
  if not worker_hosts or '{index}' not in worker_hosts or not re.search(
      r':\d+$', worker_hosts.replace('{index}', '0')):
    raise errors.ClusterError(
        f'--worker_hosts={worker_hosts!r}: --cluster=indexed_job needs each '
        "pod's address as a pattern with {index} and a port, e.g. "
        '--worker_hosts=train-{index}.train:2222.')
  if not num_workers:
    raise errors.ClusterError(
        f'--num_workers={num_workers}: --cluster=indexed_job needs the '
        "job's completions, e.g. --num_workers=2.")
  if not 0 <= index < num_workers:
    raise errors.ClusterError(
        f'JOB_COMPLETION_INDEX={index} is not a pod of --num_workers='
        f'{num_workers}; give the Job as many completions as workers.')
  addresses = tuple(worker_hosts.replace('{index}', str(i))
                    for i in range(num_workers))
  return cluster_lib.Cluster(addresses, index, index == 0)


def expand_nodelist(text):
  """Slurm's compressed host list, expanded in order:
  'n[9-10],gpu[01,03]' -> ['n9', 'n10', 'gpu01', 'gpu03']."""
  hosts = []
  for item in _top_level_items(text, 'SLURM_STEP_NODELIST'):
    parts = re.split(r'(\[[^\]]*\])', item)
    choices = [_expand_ranges(part[1:-1], text) if part.startswith('[')
               else [part] for part in parts]
    hosts.extend(''.join(chosen) for chosen in itertools.product(*choices))
  return hosts


def expand_tasks_per_node(text):
  """Slurm's tasks per node, expanded: '2(x3),1' -> [2, 2, 2, 1]."""
  counts = []
  for item in text.split(','):
    found = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', item.strip())
    if not found:
      raise errors.ClusterError(
          f'SLURM_STEP_TASKS_PER_NODE={text!r} does not expand (e.g. '
          "'2(x3),1'); run inside an srun step.")
    counts += [int(found[1])] * int(found[2] or 1)
  return counts


def _top_level_items(text, name):
  """`text` split at the commas outside brackets."""
  items, depth, current = [], 0, ''
  for char in text:
    depth += {'[': 1, ']': -1}.get(char, 0)
    if depth not in (0, 1):
      break
    if char == ',' and depth == 0:
      items.append(current)
      current = ''
    else:
      current += char
  items.append(current)
  if depth != 0 or not all(items):
    raise errors.ClusterError(
        f'{name}={text!r} does not expand (e.g. n[1-3],gpu7); run inside '
        'an srun step.')
  return items


def _expand_ranges(ranges, text):
  """'01-03,7' -> ['01', '02', '03', '7'], zero padding kept."""
  names = []
  for part in ranges.split(','):
    found = re.fullmatch(r'(\d+)(?:-(\d+))?', part)
    if not found or (found[2] and int(found[2]) < int(found[1])):
      raise errors.ClusterError(
          f'SLURM_STEP_NODELIST={text!r} does not expand: {part!r} is not a '
          'number or a rising range; run inside an srun step.')
    width = len(found[1])
    last = int(found[2]) if found[2] else int(found[1])
    names += [f'{i:0{width}d}' for i in range(int(found[1]), last + 1)]
  return names


def _needed(environ, name):
  value = environ.get(name)
  if not value:
    source = SLURM if name.startswith('SLURM') else INDEXED_JOB
    raise errors.ClusterError(
        f'{name} is not set: --cluster={source} reads it from its launcher; '
        'run the command inside it, or choose another --cluster.')
  return value


def _needed_int(environ, name):
  value = _int_or_none(_needed(environ, name))
  if value is None:
    raise errors.ClusterError(
        f'{name}={environ[name]!r} is not an integer; run the command inside '
        'its launcher.')
  return value


def _int_or_none(text):
  try:
    return int(text)
  except (TypeError, ValueError):
    return None


def _port(port):
  if port is None or not 1 <= port <= 65535:
    raise errors.ClusterError(
        f"--port={port}: give the first port of each host's tasks, e.g. "
        f'--port={DEFAULT_PORT}.')
  return port
