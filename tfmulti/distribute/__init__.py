"""The tf.distribute paths, run alongside the towers under one contract.

  distributed_model  MirroredStrategy, CentralStorageStrategy,
                     OneDeviceStrategy and MultiWorkerMirroredStrategy
                     behind the trainer contract
  cluster            TF_CONFIG, the multi-worker strategy, lost peers
"""

from tfmulti.distribute.distributed_model import (  # noqa: F401
    CENTRAL_STORAGE, MIRRORED, SINGLE, DistributedModel, check_supported,
    make_strategy)
