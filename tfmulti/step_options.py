"""`StepOptions`: how a training step runs, in one frozen record.

Where things live is `deploy.DeploymentConfig`'s; how a step computes is
this record's: the BatchNorm policy, XLA, the stages' micro-batches, the
clones' shares, gradient accumulation. It is validated once, on
construction (each rule here, with one message), built once from the flags
(or from a library caller's keywords) and passed whole to the trainer that
runs the step. Each registered strategy declares the options it honours
(`engine.registry`), and the registry refuses any other option set away
from its default, in one line: nothing is ignored without a word.
"""

import dataclasses
from typing import Optional, Tuple, Union

from tfmulti import errors

# BatchNorm moving statistics after a step of several clones (see
# `deploy.batch_norm`): clone 0's (slim's rule, and what MirroredStrategy
# reads back), the row-weighted mean, or one update from the whole batch.
BN_CLONE_0 = 'clone_0'
BN_MEAN = 'mean'
BN_FULL_BATCH = 'full_batch'
BATCH_NORM_POLICIES = (BN_CLONE_0, BN_MEAN, BN_FULL_BATCH)
# What the automatic stage cut balances (see `pipeline.costs`).
ESTIMATED = 'estimated'
MEASURED = 'measured'
STAGE_COSTS = (ESTIMATED, MEASURED)
# The order of each stage's passes (see `pipeline.schedules`).
GPIPE = 'gpipe'
ONE_F_ONE_B = '1f1b'
ZB_H1 = 'zb_h1'
INTERLEAVED_1F1B = 'interleaved_1f1b'
ZB_V = 'zb_v'
PIPELINE_SCHEDULES = (ONE_F_ONE_B, GPIPE, ZB_H1, INTERLEAVED_1F1B, ZB_V)
# clone_shares=auto: measured and balanced (`deploy.balance`); xla=auto:
# on where `deploy.xla_rule` says.
AUTO = 'auto'
# The options that say how a clone is cut into stages (num_stages > 1).
_OF_THE_CUT = ('stage_boundaries', 'stage_costs', 'stage_speeds', 'recompute',
               'pipeline_schedule', 'virtual_stages')


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """How each training step runs; every default is the plain step.

  Attributes:
    batch_norm_policy: one of `BATCH_NORM_POLICIES`: which moving
      statistics a step of several clones (or micro-batches) keeps.
    sync_batch_norm: BatchNorm over the global batch's statistics,
      all-reduced between clones (the towers run them in lockstep) or
      replicas.
    xla: compile each clone's forward and backward pass with XLA: True,
      False, or 'auto' (the default): on where the rule of
      `deploy.xla_rule` finds it faster and keeping every guarantee.
    num_microbatches: micro-batches each clone's shard is cut into,
      flowing through its stages (`DeploymentConfig.num_stages`).
    stage_boundaries: the first layer of each stage but the first; None
      to cut where the layers' costs balance.
    stage_costs: what the automatic cut balances: 'estimated' (multiply-adds
      from the shapes) or 'measured' (each layer timed at start-up).
    stage_speeds: a speed factor per stage device for the automatic cut
      (2 for a device twice as fast); None for equal devices.
    recompute: recompute each stage's activations in its backward pass.
    pipeline_schedule: the order of each stage's forward and backward
      passes over the micro-batches: '1f1b', 'gpipe', 'zb_h1' (each
      backward pass split into input and weight gradients, the weight
      half deferred into the bubble), 'interleaved_1f1b' (each device
      runs `virtual_stages` chunks of the model) or 'zb_v' (2 chunks a
      device in a V, the backward pass split as under 'zb_h1';
      `pipeline.schedules`).
    virtual_stages: v, with 'interleaved_1f1b': the model is cut into
      num_stages x v chunks, chunk c on stage device c mod num_stages
      (`DeploymentConfig.chunk_devices`).
    clone_shares: each clone's share of a step's rows, e.g. (3, 1); 'auto'
      to measure the clones and balance them; None for equal shares.
    rebalance_every_steps: with 'auto', steps between measurements.
    accumulation_steps: K: each step's batch holds K accumulation steps
      whose summed gradients make one update.
    summarize_gradients: steps also return the summed gradients (for
      TensorBoard's histograms and norms).
    reproducible_rows: a > 0 cuts each step's rows into atoms of `a` rows,
      each run alone and summed in one fixed order, so the result does not
      depend on the layout (`deploy.atoms`); 0 is off.
    gradient_packs: 'auto' packs each clone's gradients bound for one owner
      device (and its reads of that owner's variables) into one tensor a
      transfer; a count k > 0 cuts each owner's into k packs; 0 is off
      (`deploy.packs`).
    worker_parts: each worker's rows of a global batch, where they differ
      (an elastic start on a worker count that does not divide the job's
      global batch: `layouts.worker_parts`); None: equal parts.
  """
  batch_norm_policy: str = BN_CLONE_0
  sync_batch_norm: bool = False
  xla: Union[bool, str] = AUTO
  num_microbatches: int = 1
  stage_boundaries: Optional[Tuple[str, ...]] = None
  stage_costs: str = ESTIMATED
  stage_speeds: Optional[Tuple[float, ...]] = None
  recompute: bool = False
  pipeline_schedule: str = ONE_F_ONE_B
  virtual_stages: int = 1
  clone_shares: Optional[Union[Tuple[float, ...], str]] = None
  rebalance_every_steps: int = 100
  accumulation_steps: int = 1
  summarize_gradients: bool = False
  reproducible_rows: int = 0
  gradient_packs: Union[int, str] = 0
  worker_parts: Optional[Tuple[int, ...]] = None

  def __post_init__(self):
    errors.check_choice('batch_norm_policy', self.batch_norm_policy,
                        BATCH_NORM_POLICIES)
    errors.check_choice('stage_costs', self.stage_costs, STAGE_COSTS)
    errors.check_choice('pipeline_schedule', self.pipeline_schedule,
                        PIPELINE_SCHEDULES)
    for name in ('num_microbatches', 'rebalance_every_steps',
                 'accumulation_steps', 'virtual_stages'):
      errors.check_count(name, getattr(self, name), 1)
    for speed in self.stage_speeds or ():
      errors.check_positive('stage_speeds', speed)
    errors.check_count('reproducible_rows', self.reproducible_rows, 0)
    if not (self.xla is True or self.xla is False or self.xla == AUTO):
      raise errors.ConfigError(
          f'xla={self.xla!r}: use True, False or {AUTO!r}.')
    self._check_virtual_stages()
    self._check_packs()
    self._check_shares()
    self._check_reproducible()
    if self.sync_batch_norm:
      for name in ('clone_shares', 'accumulation_steps', 'xla',
                   'gradient_packs'):
        if name in self.in_use():
          raise errors.UnsupportedError(
              f'{name}={getattr(self, name)!r} cannot be combined with '
              'sync_batch_norm=True: synchronized BatchNorm runs equal, whole '
              f'clones at once; drop one of the two.')
    self._check_whole_clones(1)  # Micro-batches alone cut clones too.

  def _check_virtual_stages(self):
    interleaved = self.pipeline_schedule == INTERLEAVED_1F1B
    if self.virtual_stages > 1 and not interleaved:
      raise errors.ConfigError(
          f'virtual_stages={self.virtual_stages} gives each device several '
          'chunks of the model, which only '
          f'pipeline_schedule={INTERLEAVED_1F1B!r} runs ({ZB_V!r} runs 2, '
          'always); set it, or drop virtual_stages.')
    if interleaved and self.virtual_stages < 2:
      raise errors.ConfigError(
          f'pipeline_schedule={INTERLEAVED_1F1B!r} runs virtual_stages '
          f'chunks on each device, and virtual_stages={self.virtual_stages}'
          f' makes one (that is {ONE_F_ONE_B!r}): set virtual_stages=2 or '
          'more.')

  def _check_packs(self):
    packs = self.gradient_packs
    if isinstance(packs, str) and packs != AUTO:  # As the flag is written.
      packs = int(packs) if packs.isdigit() else packs
      object.__setattr__(self, 'gradient_packs', packs)
    if packs != AUTO and (isinstance(packs, bool) or not isinstance(
        packs, int) or packs < 0):
      raise errors.ConfigError(
          f'gradient_packs={packs!r}: use {AUTO!r} (one pack a device), a '
          'count of packs a device (an integer > 0), or 0 for none.')

  def _check_shares(self):
    shares = self.clone_shares
    if shares is None or shares == AUTO:
      return
    if isinstance(shares, str):  # '3,1', as the flag is written.
      shares = tuple(_number(part) for part in shares.split(','))
      object.__setattr__(self, 'clone_shares', shares)
    if not all(
        isinstance(share, (int, float)) and not isinstance(share, bool)
        and 0 < share < float('inf') for share in shares):
      raise errors.ConfigError(
          f'clone_shares={",".join(map(str, shares))}: every share must be a '
          f'number > 0, e.g. (3, 1), or {AUTO!r}.')

  def _check_reproducible(self):
    """What atoms cannot make layout-independent: statistics shared across
    atoms, or shares that move by measurement."""
    if not self.reproducible_rows:
      return
    refused = {
        'sync_batch_norm': self.sync_batch_norm,
        'batch_norm_policy': self.batch_norm_policy == BN_FULL_BATCH,
        'clone_shares': self.auto_shares}
    for name, clash in refused.items():
      if clash:
        raise errors.UnsupportedError(
            f'{name}={getattr(self, name)!r} cannot be combined with '
            f'reproducible_rows={self.reproducible_rows}: atoms normalise '
            'and are placed alone, so their sum does not depend on the '
            'layout; drop one of the two.')

  def check_stages(self, num_stages):
    """Raises `UserError` for options these stages cannot run: a clone cut
    into `num_stages` stages (or micro-batches) with what runs whole clones,
    or an option of the cut with no stages to cut."""
    if num_stages == 1:
      for name in _OF_THE_CUT:
        if name in self.in_use():
          raise errors.ConfigError(
              f'{name}={getattr(self, name)!r} says how to cut a clone into '
              'stages, and num_stages=1 makes none: set num_stages=2 or '
              'more, or drop it.')
    if (self.pipeline_schedule == INTERLEAVED_1F1B and
        self.num_microbatches % num_stages):
      raise errors.ConfigError(
          f'num_microbatches={self.num_microbatches}: '
          f'{INTERLEAVED_1F1B!r} runs micro-batches in groups of one a '
          f'stage (Megatron\'s order), so it needs a multiple of '
          f'num_stages={num_stages}: use num_microbatches='
          f'{num_stages * max(1, self.num_microbatches // num_stages)}.')
    self._check_whole_clones(num_stages)

  def _check_whole_clones(self, num_stages):
    if num_stages == 1 and self.num_microbatches == 1:
      return
    for name in ('xla', 'sync_batch_norm'):
      if getattr(self, name) is True:
        raise errors.UnsupportedError(
            f'{name}=True runs whole clones; it cannot run a clone cut into '
            f'stages or micro-batches (num_stages={num_stages}, '
            f'num_microbatches={self.num_microbatches}): drop one of them.')

  @property
  def auto_shares(self):
    """Whether the clones' shares are measured and balanced."""
    return self.clone_shares == AUTO

  @property
  def fixed_shares(self):
    """The clones' shares when given as numbers; None for equal or auto."""
    return None if self.auto_shares else self.clone_shares

  def run_name_parts(self):
    """Short words for the options that change what a step computes, in a
    fixed order, for a default run directory: two runs whose steps differ
    never share one. Options that change only how it runs (XLA,
    recomputation, where stages are cut, summaries) are left out."""
    parts = []
    if self.num_microbatches > 1:
      parts.append(f'{self.num_microbatches}microbatches')
    if self.clone_shares is not None:
      shares = (self.clone_shares if self.auto_shares
                else ':'.join(f'{share:g}' for share in self.clone_shares))
      parts.append(f'shares{shares}')
    if self.accumulation_steps > 1:
      parts.append(f'{self.accumulation_steps}accumulation')
    if self.batch_norm_policy != BN_CLONE_0:
      parts.append(f'bn_{self.batch_norm_policy}')
    if self.sync_batch_norm:
      parts.append('syncbn')
    if self.reproducible_rows:
      parts.append(f'reproducible{self.reproducible_rows}')
    return parts

  def in_use(self):
    """The names of the options set away from their defaults; shares set
    to 'auto' are named 'clone_shares=auto' (a strategy may honour shares
    given as numbers and not the measured ones)."""
    names = []
    for field in dataclasses.fields(self):
      if getattr(self, field.name) != field.default:
        names.append(field.name)
    if self.xla is not True and 'xla' in names:
      names.remove('xla')  # Off asks nothing of a strategy.
    if self.auto_shares:
      names[names.index('clone_shares')] = f'clone_shares={AUTO}'
    elif 'rebalance_every_steps' in names:
      names.remove('rebalance_every_steps')  # Read with 'auto' only.
    return names


def _number(text):
  """A share written as text: an int or a float; the text itself if it is
  neither (the check then names it)."""
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


DEFAULTS = StepOptions()  # The plain step: one stage, equal shards.
