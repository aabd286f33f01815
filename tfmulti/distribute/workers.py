"""Your own `fit` script on every worker: where it stands, and the strategy.

  from tfmulti import deploy
from tfmulti import fit
  from tfmulti.distribute import workers as workers_lib

  workers = workers_lib.start()  # First: before TensorFlow runs an op.
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                   replica_id=workers.index,
                                   num_replicas=workers.num_workers)
  with workers.scope(), config.variables_scope():
    model = make_model()
  towers = fit.TowersModel(model, config, workers=workers)
  towers.compile(...)
  towers.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, ...)

Started by `python -m tfmulti.launch`, in a Slurm step or a Kubernetes
Indexed Job, each process finds its place as the command line does
(`resolvers`); alone, it is worker 0 of 1 and `strategy` is None, so the
same script runs on one machine unchanged.
"""

import contextlib
import dataclasses
import os
from typing import Optional

import tensorflow as tf

from tfmulti.distribute import cluster as cluster_lib
from tfmulti.distribute import preemption
from tfmulti.distribute import resolvers

# What a restart of a `fit` script's workers does after a lost peer.
_RESUME = ('with a BackupAndRestore, they resume from its last save; '
           'without, they start again')


@dataclasses.dataclass(frozen=True)
class Workers:
  """This process's place in the job, and the strategy over its workers.

  Attributes:
    cluster: the `cluster.Cluster`; None in one process.
    strategy: the `MultiWorkerMirroredStrategy` (one replica a worker: the
      towers place the clones); None in one process.
    timeout_s: how long a worker waits for its peers.
  """
  cluster: Optional[cluster_lib.Cluster]
  strategy: Optional[tf.distribute.Strategy]
  timeout_s: float = 120.0

  @property
  def index(self):
    return self.cluster.index if self.cluster else 0

  @property
  def num_workers(self):
    return self.cluster.num_workers if self.cluster else 1

  @property
  def is_chief(self):
    return self.cluster is None or self.cluster.is_chief

  def scope(self):
    """Where the model is built: the strategy's scope (a no-op alone)."""
    return (self.strategy.scope() if self.strategy is not None
            else contextlib.nullcontext())

  def lost_peers_as_errors(self):
    """Around `fit`: a collective that failed for want of a peer becomes
    one `errors.ClusterError` line naming the peer (errors pass unchanged
    alone)."""
    return cluster_lib.lost_peers_as_errors(self.cluster, resume=_RESUME)

  def agreed_stop(self):
    """A fresh `preemption.AgreedStop` over the workers; None alone."""
    if self.cluster is None:
      return None
    return preemption.AgreedStop(self.cluster, timeout_s=self.timeout_s)


def start(source=resolvers.AUTO, *, port=resolvers.DEFAULT_PORT,
          worker_hosts=None, num_workers=None, timeout_s=120.0):
  """Joins the job this process was started in; call it first.

  Args:
    source: where the cluster is read (`resolvers.SOURCES`); `auto` finds
      `TF_CONFIG` or a Slurm step, else this process runs alone.
    port, worker_hosts, num_workers: as the command line's flags of those
      names (and their defaults), for the `slurm` and `indexed_job`
      sources.
    timeout_s: how long a worker waits for its peers before it stops with
      one line naming the one missing.

  Returns:
    `Workers`.

  Raises:
    errors.ClusterError: a malformed environment, naming the variable.
  """
  found = resolvers.resolve_into(source, os.environ, port=port,
                                 worker_hosts=worker_hosts,
                                 num_workers=num_workers)
  if found is None:
    return Workers(None, None, timeout_s)
  return Workers(found, cluster_lib.multi_worker_strategy(
      found, one_replica_per_worker=True, timeout_s=timeout_s), timeout_s)
