"""`TrainConfig`: what to train, on what, for how long, and where to write.

The command line turns its flags into a `TrainConfig` (holding the
`StepOptions`) and a `deploy.DeploymentConfig` at once; the library takes
only these. Every rule that needs no runtime is checked on construction,
with one line that names the value and the fix: the job's here, the step's
in `StepOptions`, a strategy's in `registry`.
"""

import dataclasses
import os
from typing import Optional, Tuple, Union

from tfmulti import data
from tfmulti import device_kinds
from tfmulti import errors
from tfmulti import models
from tfmulti import step_options as step_options_lib
from tfmulti.data import options as options_lib
from tfmulti.engine import registry
from tfmulti.engine import step_calls
from tfmulti.train import build
from tfmulti.train import learning_rates

_SEED_LIMIT = 2**32  # NumPy's seeds are unsigned 32-bit integers.


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """What to train, on what, for how long, and where to write.

  Attributes:
    model: a name in `models.names()`, `keras.applications.NAME` or
      `MODULE:FUNCTION` (`models.external`).
    batch_norm_momentum: the momentum of every BatchNormalization's moving
      statistics (tf_cnn_benchmarks' `--batch_norm_decay`); None keeps
      each layer's own.
    weights: a local weights file the model starts from (`model.save_weights`
      of the same model, or a `keras.applications` backbone's, such as
      Keras's `*_notop.h5`); None for fresh weights. A resume starts from
      its checkpoint instead.
    dataset: a name in `data.DATASETS`, or one starting with one of
      `data.PREFIXES` (`tfds:`, `folder:`, `tfrecord:`).
    input_options: how the dataset is read (`data.InputOptions`: image
      size, augmentation, held-out share, labels), passed whole to
      `data.load`; the model's input follows the images it gives.
    model_dir: output directory: checkpoints, event files, metrics.json.
      A directory holding checkpoints resumes from the latest.
    data_dir: TFDS data directory; None for TFDS's default.
    batch_size: examples per clone per step (slim's meaning); the global
      batch is batch_size * num_clones * num_workers.
    optimizer: one of `build.OPTIMIZERS`.
    learning_rate: the one-device base rate (see `lr_scaling`).
    lr_scaling: 'none', or 'linear' (times the job's clones, Goyal et al.).
    lr_schedule: one of `learning_rates.LR_SCHEDULES`, over the run's global
      steps.
    warmup_steps: global steps of linear warm-up from 0 to the peak rate.
    epochs: passes over the train split, unless `train_steps` is set.
    train_steps: global steps to train; overrides `epochs`.
    seed: seeds weights, dropout and shuffling.
    deterministic: also make every op deterministic (bit-identical reruns).
    log_every_steps: steps between progress lines and summaries.
    steps_per_loop: steps one compiled call runs (`engine.step_calls`): N,
      or 'auto': N for about 50 ms a call, timed at the start, at most
      `log_every_steps` (1 where every guarantee does not hold with more:
      `resolved_steps_per_loop`).
    checkpoint_steps: global steps between checkpoints (and one at the end).
    keep_checkpoints: how many recent checkpoints to keep.
    async_checkpoint: write checkpoints in the background while the steps
      go on (`checkpoints.Writer`).
    mixed_precision: compute in float16 on GPUs (with loss scaling) or
      bfloat16 on CPUs; variables stay float32.
    strategy: a name in `registry.NAMES`: how the step runs.
    peer_timeout_s: seconds a multi-worker task waits for its peers, and
      for each collective, before it fails.
    export: write `export/<step>/` (SavedModel and .keras) at the end.
    profile_steps: (first, last) global steps to profile into
      `<model_dir>/plugins/profile/` for TensorBoard; None for no profile.
    elastic_start: which start of an elastic job this is (0 the first, 1
      after the first lost worker, ...: `tfmulti.launch --min_workers`);
      None outside one. A start keeps the global batch job.json recorded
      (`job.keep_global_batch`).
    step_options: how each step runs (`StepOptions`: BatchNorm policy,
      XLA, micro-batches and the stages' cut, clone shares, accumulation,
      gradient summaries), passed whole to the strategy's trainer; with
      `accumulation_steps` K the global batch of an update is batch_size *
      num_clones * num_workers * K, and steps count updates.
    device_memory: the memory of each GPU (`device_kinds.memory_bytes`:
      '80GB', or a kind such as 'h100'): the dry run checks the plan
      against it, a run shows memory as a share of it; None: a GPU's own
      kind's.
    device_peak_flops: the peak FLOP/s of each compute device for the
      run's MFU (`device_kinds.peak_rate`: '312T', or a kind such as
      'a100'); None: a GPU's own kind's (no MFU on a CPU).
    command: the command line's resolved flags, one `--name=value` each,
      which the chief writes as `<model_dir>/flags.txt` when the run
      starts, for `train.py --flagfile=` to run it again; () from the
      library (nothing written).
  """
  model: str = 'lenet'
  weights: Optional[str] = None
  batch_norm_momentum: Optional[float] = None  # None keeps the model's.
  dataset: str = 'digits'
  input_options: options_lib.InputOptions = options_lib.DEFAULTS
  model_dir: str = 'runs/default'
  data_dir: Optional[str] = None
  batch_size: int = 64
  optimizer: str = 'adam'
  learning_rate: float = 1e-3
  lr_scaling: str = learning_rates.NO_SCALING
  lr_schedule: str = learning_rates.CONSTANT
  warmup_steps: int = 0
  epochs: int = 40
  train_steps: Optional[int] = None
  seed: int = 0
  deterministic: bool = False
  log_every_steps: int = 10
  steps_per_loop: Union[int, str] = step_calls.AUTO
  checkpoint_steps: int = 500
  keep_checkpoints: int = 5
  async_checkpoint: bool = True
  mixed_precision: bool = False
  strategy: str = registry.TOWERS
  peer_timeout_s: float = 120.0
  export: bool = True
  profile_steps: Optional[Tuple[int, int]] = None
  elastic_start: Optional[int] = None
  step_options: step_options_lib.StepOptions = step_options_lib.DEFAULTS
  device_memory: Optional[str] = None
  device_peak_flops: Optional[str] = None
  command: Tuple[str, ...] = ()

  def __post_init__(self):
    data.check_name(self.dataset)
    choices = [('strategy', registry.NAMES),
               ('optimizer', build.OPTIMIZERS),
               ('lr_scaling', learning_rates.LR_SCALINGS),
               ('lr_schedule', learning_rates.LR_SCHEDULES)]
    for name, allowed in choices:
      errors.check_choice(name, getattr(self, name), allowed)
    if self.batch_norm_momentum is not None and not (
        0 <= self.batch_norm_momentum < 1):
      raise errors.ConfigError(
          f'--batch_norm_momentum={self.batch_norm_momentum}: give a '
          'momentum in [0, 1), e.g. 0.9 for models trained from scratch.')
    models.check(self.model,
                 sync_batch_norm=self.step_options.sync_batch_norm,
                 batch_norm_momentum=self.batch_norm_momentum)
    if self.input_options.shard_files and self.strategy != (
        registry.MULTI_WORKER):
      raise errors.ConfigError(
          f'--shard_files shares files out over the workers of '
          f'--strategy={registry.MULTI_WORKER}; strategy={self.strategy!r} '
          'reads every row in each process: drop it.')
    if self.weights is not None and not os.path.isfile(self.weights):
      raise errors.ConfigError(
          f'--weights={self.weights}: no such file; give a local weights '
          'file (.weights.h5 or .h5).')
    for name in ('batch_size', 'epochs', 'log_every_steps',
                 'checkpoint_steps', 'keep_checkpoints'):
      errors.check_count(name, getattr(self, name), 1)
    if self.train_steps is not None:
      errors.check_count('train_steps', self.train_steps, 1)
    self._check_steps_per_loop()
    errors.check_count('warmup_steps', self.warmup_steps, 0)
    errors.check_count('seed', self.seed, 0)
    if self.seed >= _SEED_LIMIT:
      raise errors.ConfigError(f'seed={self.seed}: must be below 2**32 '
                               f'({_SEED_LIMIT}), as NumPy requires.')
    errors.check_positive('learning_rate', self.learning_rate)
    errors.check_positive('peer_timeout_s', self.peer_timeout_s)
    if self.profile_steps is not None:
      first, last = self.profile_steps
      errors.check_count('profile_steps', first, 1)
      if not isinstance(last, int) or last < first:
        raise errors.ConfigError(
            f'profile_steps={first},{last}: the last step must be >= the '
            'first, e.g. --profile_steps=5,7.')
    if self.elastic_start is not None and (
        self.lr_scaling == learning_rates.LINEAR):
      raise errors.ConfigError(
          '--lr_scaling=linear under an elastic launch (--min_workers): '
          'the rate would follow the clones, which a lost worker changes; '
          'give the scaled rate as --learning_rate with --lr_scaling=none.')
    if not self.model_dir:
      raise errors.ConfigError("model_dir='': name an output directory.")
    device_kinds.memory_bytes(self.device_memory)
    device_kinds.peak_rate(self.device_peak_flops)

  def _check_steps_per_loop(self):
    if self.steps_per_loop != step_calls.AUTO:
      errors.check_count('steps_per_loop', self.steps_per_loop, 1)
    step_calls.check_shares('steps_per_loop', self.steps_per_loop,
                            self.step_options)

  def resolved_steps_per_loop(self):
    """`steps_per_loop`, with 'auto' made 1 where a call of many steps
    would break a guarantee: measured clone shares (the balancer times
    the clones between steps) and several workers (their calls must end
    at the same steps, so that a signal stops them all at one: give them
    an N)."""
    several_workers = registry.get(self.strategy).multi_worker
    if self.steps_per_loop == step_calls.AUTO and (
        self.step_options.auto_shares or several_workers):
      return 1
    return self.steps_per_loop
