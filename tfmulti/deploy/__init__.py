"""The towers: TF-Slim's model_deploy on TF 2 and Keras 3.

`from tfmulti import deploy` gives slim's names where its users look for
them: `deploy.DeploymentConfig`, `deploy.deploy`, `deploy.DeployedModel`,
the clone building blocks (`Clone`, `split_batch`, `create_clones`,
`optimize_clones`), the BatchNorm policies (`deploy.BN_*`) and the step
options (`deploy.StepOptions`). Keras's door is `tfmulti.fit`
(`deploy.TowersModel`, its old place, warns). The
library's own modules import the module that defines a name.

  placement           DeploymentConfig: every device string
  keras_distribution  Keras's DataParallel and ModelParallel read as a config
  clones              the shards, the clones, their sum (slim's blocks)
  towers              deploy(): the step composed once; DeployedModel
  runners             how each clone runs: whole, in lockstep, in stages
  combiners           how the gradients meet: summed, or atoms folded
  atoms               reproducible rows: atoms run alone, folded in order
  packs               gradients and reads packed a transfer
  batch_norm          the moving statistics after a step of several clones
  balance             clone shares for unequal devices (measured, pinned)
  feeds               each clone's shard prefetched to its device
  xla_rule            where XLA goes on (xla='auto')
  towers_in_strategy  the towers inside a tf.distribute strategy

Moved, their old names warning: a mesh's storage and compute (sharding,
shard_views, tensor_parallel, mesh_layouts, lookups, table_plan) to
`tfmulti.mesh`; the plan of a traced step (dry_run, peaks, traffic) to
`tfmulti.plan`.
"""

from tfmulti import moved
from tfmulti.deploy.clones import Clone  # noqa: F401
from tfmulti.deploy.clones import create_clones  # noqa: F401
from tfmulti.deploy.clones import optimize_clones  # noqa: F401
from tfmulti.deploy.clones import split_batch  # noqa: F401
from tfmulti.deploy.placement import DeploymentConfig  # noqa: F401
from tfmulti.deploy.placement import SPREAD  # noqa: F401
from tfmulti.deploy.towers import deploy  # noqa: F401
from tfmulti.deploy.towers import DeployedModel  # noqa: F401
from tfmulti.step_options import BN_CLONE_0  # noqa: F401
from tfmulti.step_options import BN_FULL_BATCH  # noqa: F401
from tfmulti.step_options import BN_MEAN  # noqa: F401
from tfmulti.step_options import StepOptions  # noqa: F401


def __getattr__(name):
  return moved.attribute(__name__, name)
