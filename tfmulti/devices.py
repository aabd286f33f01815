"""Runtime device checks, and logical CPU devices for clones on one CPU.

`DeploymentConfig` writes every device string; this module only reads them
and compares them with what the TensorFlow runtime has. `place_clones`
decides, before TensorFlow initialises, whether the clones of a command-line
run go to GPUs or to logical CPUs.
"""

import contextlib
import functools
import itertools
import math
import os

from absl import logging
import tensorflow as tf

from tfmulti import errors
from tfmulti import plans

_LOGICAL_CPU_HINT = (
    'create logical CPU devices before TensorFlow initialises, e.g. '
    'tfmulti.devices.create_logical_cpus(num_clones * num_stages) at the '
    'top of main(), or '
    'train.py --clone_on_cpu')


def create_logical_cpus(count):
  """Splits the physical CPU into `count` logical CPU devices (CPU:0..N-1).

  Clones placed on logical CPUs share the machine's cores and one thread
  pool, so they test the multi-device code paths on any machine; they add
  no compute, and `share_cores` lets them run side by side.

  Must run before TensorFlow initialises its runtime (before the first op or
  device query). Calling it again with a count no larger than what is
  already configured is a no-op.

  Args:
    count: how many logical CPU devices to create, >= 1.

  Raises:
    errors.ConfigError: `count` < 1.
    RuntimeError: the runtime is already initialised with fewer devices.
  """
  errors.check_count('count', count, 1)
  cpu = tf.config.list_physical_devices('CPU')[0]
  configured = tf.config.get_logical_device_configuration(cpu) or []
  if len(configured) >= count:  # Never shrink what an earlier call set up.
    return
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
  except RuntimeError as e:
    existing = len(tf.config.list_logical_devices('CPU'))
    if existing >= count:
      return
    raise RuntimeError(
        f'cannot create {count} logical CPU devices: TensorFlow is already '
        f'initialised with {existing}. Call create_logical_cpus({count}) '
        'before any TensorFlow op runs or any device is listed.') from e
  logging.info('Created %d logical CPU device%s.', count,
               '' if count == 1 else 's')


def cores():
  """The cores this process may run on (its CPU affinity where the system
  tells it; else every core of the machine)."""
  if hasattr(os, 'sched_getaffinity'):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def share_cores(num_clones):
  """Sizes TensorFlow's intra-op pool, the threads one op may split over,
  to `num_clones`' share of the cores, where the runtime would give every
  op all of them.

  Logical CPUs share one runtime and that one pool. With every core an
  op's, one clone's convolution spreads over the cores while the other
  clone's waits for them; with a share each, the clones' ops run side by
  side (on 2 cores and 2 clones, each op on one thread: the towers' LeNet
  step 1.17x faster, ResNet-20's 1.26x, BENCHMARKS.md; measured on 2 cores
  only). A kernel's rounding can depend on its threads, so a run whose
  bits must match another layout's (`reproducible_rows`) keeps the
  default. Only clones count: stages were not measured with shares of
  their own.

  Must run before TensorFlow initialises its runtime. A pool the process
  set already (`tf.config.threading`, or `TF_NUM_INTRAOP_THREADS`) stays.

  Args:
    num_clones: clones on logical CPUs, >= 1.

  Returns:
    The pool's threads, or None where it stays as it is: one clone, a
    single core, a pool set already, or a runtime already started.
  """
  available = cores()
  threads = max(1, available // num_clones)
  if (threads == available
      or tf.config.threading.get_intra_op_parallelism_threads()
      or int(os.environ.get('TF_NUM_INTRAOP_THREADS') or 0)):
    return None
  try:
    tf.config.threading.set_intra_op_parallelism_threads(threads)
  except RuntimeError:  # Initialised already: its pool stays.
    return None
  logging.info('%d clones on logical CPUs: an op splits over %d thread%s '
               'of the %d cores, so the clones compute side by side.',
               num_clones, threads, '' if threads == 1 else 's', available)
  return threads


def split_gpu(count, memory_mb):
  """Splits physical GPU 0 into `count` logical GPUs of `memory_mb` each.

  For measuring the multi-GPU paths on a machine with one GPU; the logical
  GPUs share the GPU's compute. Must run before TensorFlow initialises.

  Raises:
    errors.DeviceError: no GPU, or a bad count or size.
    RuntimeError: TensorFlow is already initialised.
  """
  errors.check_count('count', count, 1)
  errors.check_count('memory_mb', memory_mb, 1)
  gpus = tf.config.list_physical_devices('GPU')
  if not gpus:
    raise errors.DeviceError(f'cannot split a GPU into {count}: this machine '
                             'has no GPU.')
  try:
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)
                  for _ in range(count)])
  except RuntimeError as e:
    raise RuntimeError(
        f'cannot split GPU 0 into {count}: TensorFlow is already '
        'initialised; split it before any op runs.') from e
  logging.info('Split GPU 0 into %d logical GPUs of %d MB.', count, memory_mb)


def place_clones(num_clones, *, clone_on_cpu, variables_gpu=None,
                 num_stages=1):
  """Where a command-line run's clones go; call it before TensorFlow starts.

  It counts physical GPUs only (that does not initialise the runtime), then
  creates logical CPUs if the clones go there, so a multi-worker strategy
  can still be created afterwards.

  Args:
    num_clones: clones asked for.
    clone_on_cpu: clones on logical CPUs, asked for explicitly.
    variables_gpu: the index N of `--variables_device=gpu:N`, or None.
    num_stages: devices each clone is cut over (`--num_stages`).

  Returns:
    Whether the clones run on (logical) CPUs: asked for, or the one clone of
    a machine without a GPU (logged).

  Raises:
    errors.DeviceError: more clones than GPUs, or a variables GPU that this
      machine lacks; the message names the flag and the fix.
  """
  errors.check_count('num_clones', num_clones, 1)
  errors.check_count('num_stages', num_stages, 1)
  needed = num_clones * num_stages
  gpus = len(tf.config.list_physical_devices('GPU'))
  if variables_gpu is not None and variables_gpu >= gpus:
    raise errors.DeviceError(
        f'--variables_device=gpu:{variables_gpu}: this machine has {gpus} '
        'GPU(s); use --variables_device=cpu' +
        (f' or gpu:N with N < {gpus}.' if gpus else '.'))
  if not clone_on_cpu and gpus == 0 and needed == 1:
    logging.info('no GPU found: the clone runs on the CPU (CPU:0)')
    clone_on_cpu = True
  if clone_on_cpu:
    create_logical_cpus(needed)
    return True
  if needed > gpus:
    stages = f' --num_stages={num_stages}' if num_stages > 1 else ''
    raise errors.DeviceError(
        f'--num_clones={num_clones}{stages} needs {needed} GPUs, and this '
        f'machine has {gpus}; add --clone_on_cpu to run on logical CPU '
        'devices, or lower --num_clones.')
  return False


def _matches(wanted, available):
  """Whether DeviceSpec `available` satisfies every field `wanted` sets."""
  available_job = available.job or 'localhost'
  return ((wanted.job is None or wanted.job == available_job)
          and (wanted.task is None or wanted.task == (available.task or 0))
          and wanted.device_type == available.device_type
          and (wanted.device_index is None
               or wanted.device_index == available.device_index))


def missing_devices(device_names):
  """The device strings in `device_names` that the runtime does not have."""
  available = [tf.DeviceSpec.from_string(d.name)
               for d in tf.config.list_logical_devices()]
  missing = []
  for name in dict.fromkeys(device_names):  # Unique, in order.
    wanted = tf.DeviceSpec.from_string(name)
    if not any(_matches(wanted, have) for have in available):
      missing.append(name)
  return missing


def check_devices_exist(device_names):
  """Raises `DeviceError` naming every device that does not exist.

  TensorFlow would otherwise fail at the first step (with soft placement
  off) or quietly run on another device (with it on).
  """
  missing = missing_devices(device_names)
  if missing and not plans.active():  # A dry run plans absent devices.
    have = [d.name for d in tf.config.list_logical_devices()]
    raise errors.DeviceError(
        f'devices {missing} do not exist (this runtime has {have}). For '
        f'clones on one CPU, {_LOGICAL_CPU_HINT}; for GPUs, lower num_clones '
        '* num_stages to the number of GPUs.')


def device_of(variable):
  """The device string of a `tf.Variable` or Keras variable.

  For a tf.distribute variable, the device of its primary (this worker's
  first replica's) copy.
  """
  variable = getattr(variable, 'value', variable)  # Keras -> tf.Variable.
  variable = getattr(variable, '_primary', variable)  # Distributed -> copy.
  return plans.planned_device(variable.handle) or variable.handle.device


def on_device(variable, device):
  """Whether `variable` lives on `device` (a device string)."""
  return _matches(tf.DeviceSpec.from_string(device),
                  tf.DeviceSpec.from_string(device_of(variable)))


@contextlib.contextmanager
def made_on(device):
  """Variables made inside live on `device`, inside the scope of a
  tf.distribute strategy of one local replica (a multi-worker job's) too.

  Outside a strategy `tf.device` places a variable. A strategy's variable
  creator ignores it and makes the copies on its own devices, unless it is
  given `colocate_with`, whose `_devices` it copies (TF's path for the
  optimizer's slots, `colocate_vars_with`). The creator here passes one
  naming `device`: the variable stays the strategy's (mirrored across the
  workers, all-reduced, checkpointed as any), with its local copy on
  `device`, and Keras's slots follow it there.
  """
  def creator(next_creator, **kwargs):
    return next_creator(**placing(kwargs, device))
  with tf.device(device), tf.variable_creator_scope(creator):
    yield


def placing(kwargs, device):
  """A variable creator's `kwargs` that make the variable on `device`
  under a strategy too (`made_on`), for a creator already in the chain."""
  if tf.distribute.has_strategy() and kwargs.get('colocate_with') is None:
    kwargs = dict(kwargs, colocate_with=_Devices(device))
  return kwargs


class _Devices:
  """What a strategy's creator reads of its `colocate_with`: the devices
  of the copies to make (one here)."""

  def __init__(self, device):
    self._devices = (device,)


def variable_bytes(variable):
  """Bytes of a variable's value (a `tf.Variable` or Keras variable)."""
  return math.prod(variable.shape) * tf.as_dtype(variable.dtype).size


def check_placement(variables, allowed):
  """Raises `DeviceError` if any of `variables` is on none of the devices
  in `allowed` (a list of device strings)."""
  misplaced = [(getattr(v, 'path', v.name), device_of(v)) for v in variables
               if not any(on_device(v, device) for device in allowed)]
  if misplaced:
    (path, where), more = misplaced[0], len(misplaced) - 1
    others = f' and {more} more' if more else ''
    where_wanted = (f'the variables device {allowed[0]!r}' if len(allowed) == 1
                    else f'the devices {allowed}')
    raise errors.DeviceError(
        f'variable {path!r} (on {where}){others} not on {where_wanted}; '
        'create the model in config.variables_scope() and the optimizer '
        'under tf.device(config.optimizer_variables_device()).')


def same_kernels_everywhere():
  """What `reproducible_rows` needs of the runtime beside its atoms, for
  the whole process: op determinism (a kernel gives the same bits on every
  run), and Grappler's remapper off. The remapper fuses ops where the
  graph lets it (oneDNN's fused matmul and its gradient, among others);
  a layout that cuts the graph elsewhere (stages' gates, cross-device
  copies) fuses otherwise, and a fused kernel rounds otherwise: with it on,
  4 clones x 2 stages x 2 micro-batches differed from one clone by 1 ulp
  in the first kernel on an AMD EPYC with oneDNN (BENCHMARKS.md's
  machine)."""
  tf.config.experimental.enable_op_determinism()
  tf.config.optimizer.set_experimental_options({'remapping': False})


@functools.lru_cache(maxsize=None)  # A graph names a few devices often.
def canonical(device):
  """`device` without a local job's '/job:localhost/replica:0/task:0'."""
  if not device:
    return ''
  spec = tf.DeviceSpec.from_string(device)
  if spec.job in (None, 'localhost'):
    spec = spec.replace(job=None, replica=None, task=None)
  return spec.to_string()


def on(device, fn, *args, **kwargs):
  """`fn(*args, **kwargs)` with its ops on `device`; None leaves the
  current device."""
  if device is None:
    return fn(*args, **kwargs)
  with tf.device(device):
    return fn(*args, **kwargs)


def current():
  """The device ops made here are placed on (canonical; '' for none): the
  innermost `tf.device`, or in eager mode where an op runs."""
  return canonical(tf.zeros([]).device)


def same_device(first, second):
  """Whether two device strings name one device."""
  return canonical(first) == canonical(second)


class GraphPlacement:
  """Where the ops of a traced graph run, as TensorFlow's placer puts them.

  An op runs on its requested device; an op reading a resource (a
  variable) on the resource's; a captured tensor comes from its source's;
  any other op runs with its largest input (the placer's rule is to
  colocate with inputs where nothing else decides). An op without inputs
  or a device ('' here) the placer puts beside its consumer.
  """

  def __init__(self):
    self._known = {}  # id(tensor) -> its device, or ''.
    self._captured = {}  # id(graph) -> {id(inner tensor): its source}.

  def of_tensor(self, tensor):
    """The device `tensor` is made on (canonical), or ''."""
    if tensor.op.device:
      return canonical(tensor.op.device)
    key = id(tensor)
    if key not in self._known:
      self._known[key] = ''  # Guards a cycle while it is worked out.
      source = self._source(tensor)
      if source is None:
        self._known[key] = self.of_inputs(tensor.op)
      elif hasattr(source, 'numpy'):  # An eager tensor: a variable's handle.
        self._known[key] = canonical(plans.planned_device(source) or
                                     source.device)
      else:
        self._known[key] = self.of_tensor(source)
    return self._known[key]

  def of_op(self, op):
    """The device `op` runs on (canonical), or ''."""
    return canonical(op.device) or self.of_inputs(op)

  def of_inputs(self, op):
    """The device of `op`'s resource input, else of its largest input with
    a device; '' if none has one."""
    resources = [t for t in op.inputs if t.dtype == tf.resource]
    for tensor in resources or sorted(op.inputs, key=_size, reverse=True):
      device = self.of_tensor(tensor)
      if device:
        return device
    return ''

  def _source(self, tensor):
    """The outer tensor `tensor` captures, or None."""
    captures = getattr(tensor.graph, 'captures', ())
    outer = self._captured.get(id(tensor.graph), {})
    if len(outer) != len(captures):  # Captures grow while tracing.
      outer = {id(inner): source for source, inner in captures}
      self._captured[id(tensor.graph)] = outer
    return outer.get(id(tensor))


def _size(tensor):
  """Elements in `tensor`: infinite when not known."""
  count = tensor.shape.num_elements() if tensor.shape.rank is not None else (
      None)
  return float('inf') if count is None else count


def mirrored_strategy(config, cross_device_ops=None):
  """A `tf.distribute.MirroredStrategy`, one replica on each of `config`'s
  clone devices; `cross_device_ops` overrides its choice of all-reduce."""
  if cross_device_ops is None and config.clone_on_cpu:
    # On CPUs TF picks collective ops, whose instance keys clash between two
    # MirroredStrategy objects in one process; a reduction onto the
    # optimizer device is what the towers do anyway.
    cross_device_ops = tf.distribute.ReductionToOneDevice(
        reduce_to_device=config.optimizer_device())
  # None: TF's choice (NCCL all-reduce on GPUs).
  return tf.distribute.MirroredStrategy(devices=config.clone_devices(),
                                        cross_device_ops=cross_device_ops)


def collective_strategy(config):
  """A `MirroredStrategy` over `config`'s clone devices whose all-reduces
  are collective ops (TF's own choice: NCCL on GPUs, a ring on CPUs), with
  collective keys no other strategy of this process uses.

  A collective op reads only its own replica's input, so tracing through it
  stays local: `ReplicaContext.all_reduce` wraps each all-reduce in a custom
  gradient that walks every op upstream of its outputs, and a reduction
  onto one device makes those outputs depend on every replica's whole graph
  so far (a walk per all-reduce: tracing quadratic in depth). Each
  strategy's keys start from their own base (TF's `_collective_key_base`,
  read when the strategy is made), as two strategies with the same keys
  clash.
  """
  keyed = type('MirroredStrategy', (tf.distribute.MirroredStrategy,),
               {'_collective_key_base': _KEYS_A_STRATEGY * next(_STRATEGIES)})
  return keyed(devices=config.clone_devices())


_STRATEGIES = itertools.count(1)
_KEYS_A_STRATEGY = 100_000  # Group keys a strategy may use (a few a run).
