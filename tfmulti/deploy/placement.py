"""`DeploymentConfig`: where every variable, clone, input and update lives.

TF-Slim's `DeploymentConfig`, with its constructor kept so slim code ports
unchanged. It is pure (it needs no TensorFlow runtime state, so its tests are
string assertions), and every device string in tfmulti comes from here.
`tfmulti.deploy` re-exports it: users write `deploy.DeploymentConfig`.
"""

import contextlib
import dataclasses
from typing import Optional

import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti.mesh import mesh_layouts

_HOST = '/device:CPU:0'

# `variables_device=SPREAD`: each variable on one of the clones' devices.
SPREAD = 'spread'


def _normalise_device(device):
  """Returns `device` in canonical form ('/gpu:0' -> '/device:GPU:0')."""
  try:
    return tf.DeviceSpec.from_string(device).to_string()
  except (ValueError, TypeError) as e:
    raise errors.ConfigError(
        f'variables_device={device!r} is not a device string; use e.g. '
        "'/device:CPU:0' or '/device:GPU:0'.") from e


def _check_layouts(layouts, num_clones, num_stages, variables_device,
                   num_ps_tasks):
  """Raises `ConfigError` for variable layouts these clones cannot hold."""
  if layouts is None:
    return
  if not isinstance(layouts, mesh_layouts.VariableLayouts):
    raise errors.ConfigError(
        f'variable_layouts={layouts!r}: pass a mesh_layouts.VariableLayouts '
        '(mesh_layouts.from_keras reads a keras.distribution.ModelParallel).')
  if num_clones != layouts.num_devices:
    raise errors.ConfigError(
        f'num_clones={num_clones} with a mesh of {layouts.mesh_shape}: one '
        f'clone a mesh device; use num_clones={layouts.num_devices}.')
  if num_stages > 1 or num_ps_tasks:
    raise errors.UnsupportedError(
        f'variable layouts with num_stages={num_stages}, num_ps_tasks='
        f'{num_ps_tasks}: the towers shard variables over a worker\'s whole '
        'clones; use num_stages=1 and no parameter servers.')
  if variables_device not in (None, SPREAD):
    raise errors.ConfigError(
        f'variables_device={variables_device!r} with variable layouts: the '
        'layouts place the variables; leave variables_device unset.')


@dataclasses.dataclass(frozen=True, init=False)
class DeploymentConfig:
  """Where variables, clones, inputs and the optimizer live.

  Pure: it needs no TensorFlow runtime state, and every device string in
  tfmulti comes from here. The constructor keeps slim's arguments, so slim
  code ports unchanged; slim's "replica" is a *worker* (a process of a
  multi-worker job), which the rest of tfmulti calls `worker_index` and
  `num_workers`. "Replica" elsewhere means only tf.distribute's own.

  Attributes:
    num_clones: model copies on this worker, one per device.
    clone_on_cpu: put clone i on CPU:i (logical CPU devices) instead of GPU:i.
    replica_id: this worker's index in a multi-worker job (slim's name).
    num_replicas: number of workers (slim's name); each runs num_clones
      clones, and the global batch is batch_size * num_clones * num_replicas.
    num_ps_tasks: parameter-server tasks; 0 keeps the variables local.
    worker_job_name: job name of the workers in the cluster spec.
    ps_job_name: job name of the parameter servers in the cluster spec.
    num_stages: consecutive parts of the model (stages) each clone is cut
      into, each on its own device (`tfmulti.pipeline`); 1 keeps each clone
      whole on one device. Clone c's stage s runs on device c * num_stages
      + s (GPU, or logical CPU with `clone_on_cpu`), so a worker uses
      num_clones * num_stages devices.
    spread_variables: `variables_device='spread'`: each variable lives on
      one of the clones' devices (`compute_devices`), the largest first to
      the least loaded by bytes (build the model in `variables_scope()`);
      its slots, gradient sum and update run beside it.
    prefetch_to_clones: whether the input pipeline copies each clone's
      shard of a step to the clone's device ahead of the step; None (the
      default) follows `prefetches_to_clones()`'s rule.
    variable_layouts: a `mesh_layouts.VariableLayouts` (Keras's
      `ModelParallel` read): clone i on the mesh's i-th device (of each
      worker), each variable its layout splits stored as its shards, each
      on a device of the mesh that layout names, the rest spread
      (`sharding`); None keeps variables whole.
  """
  num_clones: int
  clone_on_cpu: bool
  replica_id: int
  num_replicas: int
  num_ps_tasks: int
  worker_job_name: str
  ps_job_name: str
  num_stages: int
  spread_variables: bool
  prefetch_to_clones: Optional[bool]
  variable_layouts: Optional[mesh_layouts.VariableLayouts]
  _variables_device: Optional[str]

  def __init__(self, num_clones=1, clone_on_cpu=False, variables_device=None,
               replica_id=0, num_replicas=1, num_ps_tasks=0,
               worker_job_name='worker', ps_job_name='ps', *, num_stages=1,
               prefetch_to_clones=None, variable_layouts=None):
    """Validates the arguments; raises `ConfigError` naming the bad value."""
    errors.check_count('num_clones', num_clones, 1)
    errors.check_count('num_stages', num_stages, 1)
    errors.check_count('num_replicas', num_replicas, 1)
    errors.check_count('num_ps_tasks', num_ps_tasks, 0)
    errors.check_count('replica_id', replica_id, 0)
    if replica_id >= num_replicas:
      raise errors.ConfigError(f'replica_id={replica_id} must be in '
                               f'[0, num_replicas={num_replicas}).')
    if num_replicas > 1 or num_ps_tasks > 0:
      for name, job in (('worker_job_name', worker_job_name),
                        ('ps_job_name', ps_job_name)):
        if not job:
          raise errors.ConfigError(
              f'{name}={job!r}: a job name is needed with several workers '
              'or parameter servers.')
    _check_layouts(variable_layouts, num_clones, num_stages,
                   variables_device, num_ps_tasks)
    spread_variables = (variables_device == SPREAD or
                        variable_layouts is not None)
    if spread_variables:
      variables_device = None
    if (variables_device is not None or spread_variables) and num_ps_tasks:
      raise errors.ConfigError(
          f'variables_device={variables_device or SPREAD!r} cannot be '
          f'combined with num_ps_tasks={num_ps_tasks}: parameter servers '
          'hold the variables; leave variables_device unset.')
    if variables_device is not None:
      variables_device = _normalise_device(variables_device)
    if prefetch_to_clones not in (None, True, False):
      raise errors.ConfigError(
          f'prefetch_to_clones={prefetch_to_clones!r}: use True, False or '
          'None (on for GPU clones).')
    if prefetch_to_clones and num_ps_tasks:
      raise errors.ConfigError(
          f'prefetch_to_clones=True with num_ps_tasks={num_ps_tasks}: the '
          "shards are prefetched to this process's own devices; leave it "
          'unset with parameter servers.')
    values = dict(num_clones=num_clones, clone_on_cpu=bool(clone_on_cpu),
                  replica_id=replica_id, num_replicas=num_replicas,
                  num_ps_tasks=num_ps_tasks, worker_job_name=worker_job_name,
                  ps_job_name=ps_job_name, num_stages=num_stages,
                  spread_variables=spread_variables,
                  prefetch_to_clones=prefetch_to_clones,
                  variable_layouts=variable_layouts,
                  _variables_device=variables_device)
    for name, value in values.items():
      object.__setattr__(self, name, value)

  def replaced(self, **changes):
    """This config with `changes` to `__init__`'s arguments (validated
    again): the planner's candidates (`plan.search`)."""
    arguments = dict(
        num_clones=self.num_clones, clone_on_cpu=self.clone_on_cpu,
        variables_device=(SPREAD if self.spread_variables and
                          self.variable_layouts is None
                          else self._variables_device),
        replica_id=self.replica_id, num_replicas=self.num_replicas,
        num_ps_tasks=self.num_ps_tasks, worker_job_name=self.worker_job_name,
        ps_job_name=self.ps_job_name, num_stages=self.num_stages,
        prefetch_to_clones=self.prefetch_to_clones,
        variable_layouts=self.variable_layouts)
    arguments.update(changes)
    return DeploymentConfig(**arguments)

  @property
  def worker_index(self):
    """This worker's index in a multi-worker job (slim's `replica_id`)."""
    return self.replica_id

  @property
  def num_workers(self):
    """Processes in the job (slim's `num_replicas`)."""
    return self.num_replicas

  def _worker_prefix(self):
    # With parameter servers the worker's own task must be named, or every
    # worker's ops land on task 0 (slim's bug, tensorflow/models#3945, #434).
    if self.num_ps_tasks > 0:
      return f'/job:{self.worker_job_name}/task:{self.replica_id}'
    return ''

  def _check_clone_index(self, clone_index):
    if (isinstance(clone_index, bool) or not isinstance(clone_index, int)
        or not 0 <= clone_index < self.num_clones):
      raise errors.ConfigError(f'clone_index={clone_index!r} must be in '
                               f'[0, num_clones={self.num_clones}).')

  def clone_device(self, clone_index):
    """Device of clone `clone_index` (of its first stage): GPU:i, or CPU:i
    with `clone_on_cpu` (i = clone_index * num_stages)."""
    return self.stage_device(clone_index, 0)

  def stage_device(self, clone_index, stage_index):
    """Device of stage `stage_index` of clone `clone_index`."""
    self._check_clone_index(clone_index)
    if (isinstance(stage_index, bool) or not isinstance(stage_index, int)
        or not 0 <= stage_index < self.num_stages):
      raise errors.ConfigError(f'stage_index={stage_index!r} must be in '
                               f'[0, num_stages={self.num_stages}).')
    device_type = 'CPU' if self.clone_on_cpu else 'GPU'
    index = clone_index * self.num_stages + stage_index
    return f'{self._worker_prefix()}/device:{device_type}:{index}'

  def stage_devices(self, clone_index):
    """The devices of clone `clone_index`'s stages, in stage order."""
    return [self.stage_device(clone_index, s) for s in range(self.num_stages)]

  def chunk_devices(self, clone_index, stage_of_chunk):
    """The devices of clone `clone_index`'s chunks of the model (several a
    stage device: interleaved 1F1B, ZB-V), in model order: chunk c on the
    clone's stage device `stage_of_chunk[c]` (the schedule's placement,
    `pipeline.schedules.chunk_devices`)."""
    devices = self.stage_devices(clone_index)
    return [devices[s] for s in stage_of_chunk]

  def compute_devices(self):
    """Every device a clone or stage runs on: num_clones * num_stages."""
    return [device for c in range(self.num_clones)
            for device in self.stage_devices(c)]

  def clone_scope(self, clone_index):
    """Name scope of clone `clone_index`: '' for a single clone."""
    self._check_clone_index(clone_index)
    return '' if self.num_clones == 1 else f'clone_{clone_index}'

  def clone_devices(self):
    """All clone devices (their first stages'), in clone order."""
    return [self.clone_device(i) for i in range(self.num_clones)]

  def optimizer_device(self):
    """Where the clones' gradients are summed and applied.

    The variables device when one was chosen (the update reads and writes
    every variable and slot, so it runs beside them); else this worker's
    CPU:0, as in slim. With spread variables, each variable's gradient sum
    and update run on its owner (`owner_device`); the optimizer's own
    variables (iterations, learning rate, loss scale) and its scalar
    arithmetic stay here.
    """
    return self._variables_device or self._worker_prefix() + _HOST

  def owner_device(self, variable_device):
    """Where the gradient sum and update of a variable living on
    `variable_device` run: beside it when spread, else `optimizer_device`."""
    if self.spread_variables:
      return variable_device
    return self.optimizer_device()

  def inputs_device(self):
    """Where the input pipeline runs and, unless each clone's shard is
    prefetched to its device, the batch is split."""
    return self._worker_prefix() + _HOST

  def prefetches_to_clones(self):
    """Whether the input pipeline cuts each step's batch into the clones'
    shards and copies each to its clone's device ahead of the step
    (`deploy.feeds`): `prefetch_to_clones` when given, else where the
    clones run on this process's GPUs (no parameter servers).

    On a GPU the copy of the next steps' rows is then made while a step
    computes, not inside the step, which would wait for it (no GPU has
    measured it yet: BENCHMARKS.md). Logical CPUs share one memory, so
    there is no copy to hide, only a pipeline more. Either way the step
    trains the same rows (the same bits under `reproducible_rows`).
    """
    if self.prefetch_to_clones is not None:
      return self.prefetch_to_clones
    return not self.clone_on_cpu and not self.num_ps_tasks

  def summaries_device(self):
    """Where summaries and checkpoints are written from: the host CPU."""
    return self._worker_prefix() + _HOST

  def variables_device(self):
    """Where variables and optimizer slots are created; None when spread.

    CPU:0 by default, the device given to the constructor, or the parameter
    servers' CPU. Spread variables have no one device: build the model in
    `variables_scope()`, which works in both cases.
    """
    if self.spread_variables:
      return None
    if self.num_ps_tasks > 0:
      return f'/job:{self.ps_job_name}{_HOST}'
    return self._variables_device or _HOST

  def optimizer_variables_device(self):
    """Where the optimizer is built: its own variables (iterations,
    learning rate, loss scale) are made here, and Keras makes each slot
    beside its variable. The variables device, or `optimizer_device()`
    when spread."""
    return self.variables_device() or self.optimizer_device()

  def variable_devices(self):
    """The devices a variable may live on: the clones' devices when
    spread, else the one variables device."""
    if self.spread_variables:
      return self.compute_devices()
    return [self.variables_device()]

  def variables_scope(self):
    """The context to build the model in: `tf.device(variables_device())`,
    or, when spread, one that makes the model's variables when it closes,
    the largest first on the least-loaded of `compute_devices()` by bytes
    (`_spreading`): inside it, build the model only (its variables cannot
    be read or assigned until it closes: load weights after). Build the
    optimizer outside it (under `optimizer_variables_device()`): Keras puts
    each slot beside its variable."""
    if not self.spread_variables:
      return tf.device(self.variables_device())
    return _spreading(self.compute_devices())


@contextlib.contextmanager
def _spreading(candidates):
  """Spreads the variables made inside over `candidates` by bytes.

  Keras variables are deferred (`keras_internals.deferred_variables`) and
  made on exit, when every size is known: the largest first goes to the
  device holding the fewest bytes so far (ties: the first device), each
  with the values it would have had. Any other variable (a raw
  `tf.Variable`) goes, as it is made, to the least-loaded device, by a
  `tf.variable_creator_scope` (as TF's ParameterServerStrategy places its
  round-robin variables).
  """
  held = dict.fromkeys(candidates, 0)

  def least_loaded():
    return min(candidates, key=held.__getitem__)

  def creator(next_creator, **kwargs):
    device = least_loaded()
    with tf.device(device):
      variable = next_creator(**devices.placing(kwargs, device))
    held[device] += devices.variable_bytes(variable)
    return variable
  with keras_internals.deferred_variables() as deferred:
    with tf.variable_creator_scope(creator):
      yield
  owners = {}
  for variable in sorted(deferred, key=devices.variable_bytes, reverse=True):
    owners[id(variable)] = device = least_loaded()
    held[device] += devices.variable_bytes(variable)
  for variable in deferred:  # In creation order, as Keras would.
    with devices.made_on(owners[id(variable)]):
      keras_internals.initialize(variable)
