"""The tf.distribute paths, run alongside the towers under one contract.

  distributed_model  MirroredStrategy, CentralStorageStrategy,
                     OneDeviceStrategy and MultiWorkerMirroredStrategy
                     behind the trainer contract
  cluster            TF_CONFIG, the multi-worker strategy, lost peers
  resolvers          the cluster from TF_CONFIG, Slurm or an Indexed Job
  preemption         every worker stops after the same step
  workers            a user's own `fit` script on every worker (`start`)
"""

from tfmulti.distribute.distributed_model import check_supported  # noqa: F401
from tfmulti.distribute.distributed_model import DistributedModel  # noqa: F401
from tfmulti.distribute.distributed_model import make_strategy  # noqa: F401
from tfmulti.distribute.distributed_model import MIRRORED  # noqa: F401
