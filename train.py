"""Trains an image model over clones with tfmulti's model_deploy towers.

  python train.py --num_clones=2 --clone_on_cpu

This file alone defines flags: it turns them into frozen configs at once and
makes one library call. Bad flags stop with one line naming the flag and the
fix, before any training state exists.
"""

import os
import sys

# Keep TensorFlow's C++ start-up chatter (CUDA probing) out of the log.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from absl import logging
import tensorflow as tf

from tfmulti import checkpoints
from tfmulti import cluster
from tfmulti import data
from tfmulti import deploy
from tfmulti import devices
from tfmulti import distribute
from tfmulti import loop
from tfmulti import models
from tfmulti import schedules
from tfmulti import train_lib

_NUM_CLONES = flags.DEFINE_integer(
    'num_clones', 1, 'Model copies (clones), one per device: GPU:0..N-1, or '
    'logical CPU:0..N-1 with --clone_on_cpu.', lower_bound=1)
_CLONE_ON_CPU = flags.DEFINE_bool(
    'clone_on_cpu', False, 'Run clone i on logical CPU device i (created '
    'here) instead of GPU:i; works on any machine.')
_VARIABLES_DEVICE = flags.DEFINE_string(
    'variables_device', 'cpu', "Where variables and optimizer slots live: "
    "'cpu' (CPU:0, slim's default) or 'gpu:N' (one chosen GPU).")
_BATCH_SIZE = flags.DEFINE_integer(
    'batch_size', 64, 'Examples per clone per step (as in slim); the global '
    'batch is batch_size * num_clones.', lower_bound=1)
_MODEL = flags.DEFINE_enum('model', 'lenet', models.names(),
                           'Model from the registry.')
_DATASET = flags.DEFINE_enum(
    'dataset', 'digits', data.DATASETS, "Dataset; 'digits' needs no network, "
    "'synthetic' is random on-device data for throughput.")
_DATA_DIR = flags.DEFINE_string(
    'data_dir', None, 'TFDS data directory holding prepared datasets '
    '(default: ~/tensorflow_datasets).')
_OPTIMIZER = flags.DEFINE_enum('optimizer', 'adam', train_lib.OPTIMIZERS,
                               "Optimizer; 'momentum' is SGD with 0.9.")
_LEARNING_RATE = flags.DEFINE_float(
    'learning_rate', 1e-3, 'Base learning rate of one device (see '
    '--lr_scaling).')
_LR_SCALING = flags.DEFINE_enum(
    'lr_scaling', schedules.NO_SCALING, schedules.LR_SCALINGS,
    "'linear': the peak rate is --learning_rate times --num_clones (Goyal "
    'et al. 2017); use it with --warmup_steps.')
_LR_SCHEDULE = flags.DEFINE_enum(
    'lr_schedule', schedules.CONSTANT, schedules.LR_SCHEDULES,
    'Decay after warm-up, over the global steps of the run: cosine to 0, or '
    'x0.1 at 50%% and 75%% of the steps.')
_WARMUP_STEPS = flags.DEFINE_integer(
    'warmup_steps', 0, 'Global steps of linear warm-up from 0 to the peak '
    'rate.', lower_bound=0)
_EPOCHS = flags.DEFINE_integer(
    'epochs', 40, 'Passes over the train split (ignored with --train_steps).',
    lower_bound=1)
_TRAIN_STEPS = flags.DEFINE_integer(
    'train_steps', None, 'Global steps to train; overrides --epochs.',
    lower_bound=1)
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of weights, dropout and '
                             'shuffling.')
_DETERMINISTIC = flags.DEFINE_bool(
    'deterministic', False, 'Deterministic ops too: a rerun gives '
    'bit-identical weights (slower on GPUs).')
_MODEL_DIR = flags.DEFINE_string(
    'model_dir', None, 'Checkpoints, TensorBoard events and metrics.json; '
    'a directory with checkpoints resumes. Default: '
    'runs/<model>-<dataset>-<strategy>-<N>clones/, so the same command '
    'resumes.')
_LOG_EVERY_STEPS = flags.DEFINE_integer(
    'log_every_steps', 10, 'Steps between progress lines and summaries.',
    lower_bound=1)
_CHECKPOINT_STEPS = flags.DEFINE_integer(
    'checkpoint_steps', 500, 'Global steps between checkpoints; one is also '
    'written at the end and on SIGTERM or Ctrl-C.', lower_bound=1)
_KEEP_CHECKPOINTS = flags.DEFINE_integer(
    'keep_checkpoints', 5, 'Recent checkpoints to keep.', lower_bound=1)
_SUMMARIZE_GRADIENTS = flags.DEFINE_bool(
    'summarize_gradients', False, 'Write gradient histograms and norms per '
    'variable to TensorBoard.')
_BATCH_NORM_POLICY = flags.DEFINE_enum(
    'batch_norm_policy', deploy.BN_CLONE_0, deploy.BATCH_NORM_POLICIES,
    "BatchNorm moving statistics each step: clone 0's (slim) or the clones' "
    'mean.')
_SYNC_BATCH_NORM = flags.DEFINE_bool(
    'sync_batch_norm', False, "Keras's synchronized BatchNorm: statistics "
    'of the global batch, all-reduced over the clones or replicas.')
_STRATEGY = flags.DEFINE_enum(
    'strategy', train_lib.TOWERS, train_lib.STRATEGIES,
    "How the step runs: 'towers' (tfmulti.deploy), 'mirrored' "
    "(tf.distribute.MirroredStrategy over the same devices), "
    "'central_storage' (CentralStorageStrategy), 'single' (one device, the "
    "whole global batch: the reference), 'multi_worker' (the towers on "
    "every worker of TF_CONFIG's cluster, gradients all-reduced) or "
    "'multi_worker_mirrored' (MultiWorkerMirroredStrategy).")
_NUM_REPLICAS = flags.DEFINE_integer(
    'num_replicas', None, 'Workers in a --strategy=multi_worker job; read '
    'from TF_CONFIG when unset (given, it must agree).', lower_bound=1)
_REPLICA_ID = flags.DEFINE_integer(
    'replica_id', None, "This worker's index in a multi_worker job; read "
    'from TF_CONFIG when unset (given, it must agree).', lower_bound=0)
_NUM_PS_TASKS = flags.DEFINE_integer(
    'num_ps_tasks', 0, 'Parameter servers: not supported (Keras 3 does not '
    'train under ParameterServerStrategy); see the README.', lower_bound=0)
_PEER_TIMEOUT_S = flags.DEFINE_float(
    'peer_timeout_s', 120.0, 'Seconds a multi_worker task waits for its '
    'peers, and for each collective, before it fails.')
_XLA = flags.DEFINE_bool('xla', False,
                         "Compile each clone's step with XLA (jit_compile).")
_MIXED_PRECISION = flags.DEFINE_bool(
    'mixed_precision', False, 'Compute in float16 on GPUs (with dynamic loss '
    'scaling) or bfloat16 on CPUs; variables stay float32.')

flags.register_validator(
    'learning_rate', lambda value: value > 0,
    message='--learning_rate must be > 0, e.g. --learning_rate=0.001.')
flags.register_validator(
    'variables_device',
    lambda value: value == 'cpu' or (value.startswith('gpu:')
                                     and value[4:].isdigit()),
    message="--variables_device must be 'cpu' or 'gpu:N', e.g. gpu:0.")


def _default_model_dir():
  # No time stamp: running the same command again resumes the same run.
  return os.path.join('runs', f'{_MODEL.value}-{_DATASET.value}-'
                      f'{_STRATEGY.value}-{_NUM_CLONES.value}clones')


def _cluster_from_flags():
  """The multi-worker `cluster.Cluster`, or None; checks the flags.

  Raises:
    ValueError: flags that need a cluster, or disagree with TF_CONFIG.
  """
  if _NUM_PS_TASKS.value:
    raise ValueError(
        f'--num_ps_tasks={_NUM_PS_TASKS.value}: parameter servers are not '
        'supported: Keras 3 does not train under ParameterServerStrategy '
        '(keras-team/keras#18624). Use --strategy=multi_worker (all-reduce).')
  if _STRATEGY.value not in distribute.MULTI_WORKER_STRATEGIES:
    if _NUM_REPLICAS.value not in (None, 1) or _REPLICA_ID.value:
      raise ValueError('--num_replicas and --replica_id describe a multi-'
                       'worker job: add --strategy=multi_worker and TF_CONFIG.')
    return None
  if _VARIABLES_DEVICE.value != 'cpu':
    raise ValueError(f'--variables_device={_VARIABLES_DEVICE.value}: a '
                     'multi_worker job keeps the variables on each worker\'s '
                     'CPU; drop the flag.')
  if (_STRATEGY.value == distribute.MULTI_WORKER_MIRRORED and
      _CLONE_ON_CPU.value and _NUM_CLONES.value != 1):
    raise ValueError(
        f'--num_clones={_NUM_CLONES.value}: multi_worker_mirrored on CPUs '
        'runs one replica per worker (MultiWorkerMirroredStrategy does not '
        'use logical CPUs); use --num_clones=1, or --strategy=multi_worker.')
  info = cluster.from_environment()
  cluster.check_flags(info, _NUM_REPLICAS.value, _REPLICA_ID.value)
  return info


def configs_from_flags():
  """(TrainConfig, DeploymentConfig, cluster or None) from the flags."""
  cluster_info = _cluster_from_flags()
  train_config = train_lib.TrainConfig(
      model=_MODEL.value, dataset=_DATASET.value,
      model_dir=_MODEL_DIR.value or _default_model_dir(),
      data_dir=_DATA_DIR.value, batch_size=_BATCH_SIZE.value,
      optimizer=_OPTIMIZER.value, learning_rate=_LEARNING_RATE.value,
      lr_scaling=_LR_SCALING.value, lr_schedule=_LR_SCHEDULE.value,
      warmup_steps=_WARMUP_STEPS.value, epochs=_EPOCHS.value,
      train_steps=_TRAIN_STEPS.value, seed=_SEED.value,
      deterministic=_DETERMINISTIC.value,
      log_every_steps=_LOG_EVERY_STEPS.value,
      checkpoint_steps=_CHECKPOINT_STEPS.value,
      keep_checkpoints=_KEEP_CHECKPOINTS.value,
      summarize_gradients=_SUMMARIZE_GRADIENTS.value,
      batch_norm_policy=_BATCH_NORM_POLICY.value,
      synchronized_batch_norm=_SYNC_BATCH_NORM.value,
      mixed_precision=_MIXED_PRECISION.value, xla=_XLA.value,
      strategy=_STRATEGY.value, peer_timeout_s=_PEER_TIMEOUT_S.value)
  deploy_config = deploy.DeploymentConfig(
      num_clones=_NUM_CLONES.value, clone_on_cpu=_CLONE_ON_CPU.value,
      # None keeps CPU:0; DeploymentConfig turns 'gpu:N' into its device.
      variables_device=None if _VARIABLES_DEVICE.value == 'cpu'
      else _VARIABLES_DEVICE.value,
      replica_id=cluster_info.index if cluster_info else 0,
      num_replicas=cluster_info.num_workers if cluster_info else 1)
  return train_config, deploy_config, cluster_info


def check_devices(deploy_config):
  """Creates logical CPUs for --clone_on_cpu; checks GPUs against the flags.

  Raises:
    ValueError: naming the flag and the fix.
  """
  gpus = len(tf.config.list_physical_devices('GPU'))
  if _VARIABLES_DEVICE.value != 'cpu':
    if devices.missing_devices([deploy_config.variables_device()]):
      raise ValueError(
          f'--variables_device={_VARIABLES_DEVICE.value}: this machine has '
          f'{gpus} GPU(s); use --variables_device=cpu' +
          (f' or gpu:N with N < {gpus}.' if gpus else '.'))
  if deploy_config.clone_on_cpu:
    devices.create_logical_cpus(deploy_config.num_clones)
  elif deploy_config.num_clones > gpus:
    raise ValueError(
        f'--num_clones={deploy_config.num_clones} needs as many GPUs, and '
        f'this machine has {gpus}; add --clone_on_cpu to run the clones on '
        'logical CPU devices, or lower --num_clones.')


def main(argv):
  if len(argv) > 1:
    sys.exit(f'train.py: error: unexpected arguments {argv[1:]}; flags are '
             'written --name=value.')
  try:
    train_config, deploy_config, cluster_info = configs_from_flags()
    check_devices(deploy_config)
  except ValueError as e:
    sys.exit(f'train.py: error: {e}')
  logging.info('writing to %s', train_config.model_dir)
  try:
    train_lib.train_and_evaluate(train_config, deploy_config,
                                 cluster_info=cluster_info)
  except loop.TrainingInterrupted as e:
    logging.warning('%s', e)
    sys.exit(e.exit_code)
  except (data.DatasetUnavailableError, checkpoints.CheckpointMismatchError,
          distribute.UnsupportedError, train_lib.ConfigError,
          loop.NonFiniteLossError) as e:
    sys.exit(f'train.py: error: {e}')


def run():
  """Console-script entry point (`tfmulti-train`)."""
  app.run(main)


if __name__ == '__main__':
  run()
