"""The towers: TF-Slim's model_deploy on TF 2 and Keras 3.

`from tfmulti import deploy` gives slim's names where its users look for
them: `deploy.DeploymentConfig`, `deploy.deploy`, `deploy.DeployedModel`,
the clone building blocks (`Clone`, `create_clones`, `optimize_clones`),
the BatchNorm policies (`deploy.BN_*`) and the step options
(`deploy.StepOptions`).

  placement           DeploymentConfig: every device string
  clones              one clone's step, the clones, their sum (slim's blocks)
  towers              deploy() and DeployedModel: the compiled step
  towers_model        TowersModel: the towers behind Keras's compile/fit
  batch_norm          the moving statistics after a step of several clones
  balance             automatic clone shares for unequal devices
  towers_in_strategy  the towers inside a tf.distribute strategy
"""

from tfmulti.deploy.batch_norm import (  # noqa: F401
    BATCH_NORM_POLICIES, BN_CLONE_0, BN_FULL_BATCH, BN_MEAN,
    combine_non_trainable, moments_of)
from tfmulti.deploy.clones import (  # noqa: F401
    Clone, clone_step, create_clones, on_clone, optimize_clones, split_batch,
    values_of)
from tfmulti.deploy.placement import DeploymentConfig  # noqa: F401
from tfmulti.deploy.towers import (  # noqa: F401
    DeployedModel, check_model, check_options, deploy)
from tfmulti.deploy.towers_model import TowersModel  # noqa: F401
from tfmulti.step_options import StepOptions  # noqa: F401
from tfmulti.trainer import mean_loss, shard_loss  # noqa: F401
