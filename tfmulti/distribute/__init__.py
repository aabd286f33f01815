"""The tf.distribute paths, run alongside the towers under one contract.

  distributed_model  MirroredStrategy, CentralStorageStrategy,
                     OneDeviceStrategy and MultiWorkerMirroredStrategy
                     behind the trainer contract
  cluster            TF_CONFIG, the multi-worker strategy, lost peers
"""

from tfmulti.distribute.distributed_model import CENTRAL_STORAGE  # noqa: F401
from tfmulti.distribute.distributed_model import check_supported  # noqa: F401
from tfmulti.distribute.distributed_model import DistributedModel  # noqa: F401
from tfmulti.distribute.distributed_model import make_strategy  # noqa: F401
from tfmulti.distribute.distributed_model import MIRRORED  # noqa: F401
from tfmulti.distribute.distributed_model import SINGLE  # noqa: F401
