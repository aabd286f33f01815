"""The command line: `python train.py` and `tfmulti-train`.

  python train.py --num_clones=2 --clone_on_cpu

This module alone defines flags. It turns them into frozen configs at once,
places the clones (before TensorFlow initialises) and makes one library
call. Every problem a user can fix stops with one line naming the value and
the fix (`errors.UserError`), before any training state exists.
"""

import gc
import hashlib
import os
import re
import sys
import textwrap

from tfmulti import native_logs

# A clean first screen: TensorFlow's C++ start-up chatter (CUDA probing on a
# CPU machine, oneDNN notices) is held back unless --verbosity asks for it.
_VERBOSE = native_logs.quiet_start(sys.argv)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti import data  # noqa: E402
from tfmulti import device_kinds  # noqa: E402
from tfmulti import devices  # noqa: E402
from tfmulti import errors  # noqa: E402
from tfmulti import models  # noqa: E402
from tfmulti import step_options  # noqa: E402
from tfmulti import tf_config  # noqa: E402
from tfmulti.data import options as options_lib  # noqa: E402
from tfmulti.deploy import placement  # noqa: E402
from tfmulti.distribute import cluster  # noqa: E402
from tfmulti.distribute import resolvers  # noqa: E402
from tfmulti.engine import registry  # noqa: E402
from tfmulti.engine import step_calls  # noqa: E402
from tfmulti.mesh import mesh_layouts  # noqa: E402
from tfmulti.models import external  # noqa: E402
from tfmulti.train import build  # noqa: E402
from tfmulti.train import config  # noqa: E402
from tfmulti.train import job  # noqa: E402
from tfmulti.train import learning_rates  # noqa: E402
from tfmulti.train import loop  # noqa: E402
from tfmulti.train import planned_job  # noqa: E402

PROGRAM = 'train.py'

_NUM_CLONES = flags.DEFINE_integer(
    'num_clones', 1, 'Model copies (clones), one per device: GPU:0..N-1, or '
    'logical CPU:0..N-1 with --clone_on_cpu. One clone on a machine without '
    'a GPU runs on the CPU.')
_CLONE_ON_CPU = flags.DEFINE_bool(
    'clone_on_cpu', False, 'Run clone i on logical CPU device i (created '
    'here) instead of GPU:i; works on any machine. The clones share the '
    'cores: an op splits over num_clones\' share of them (all of them '
    'under --reproducible_rows).')
_VARIABLES_DEVICE = flags.DEFINE_string(
    'variables_device', 'cpu', "Where variables and optimizer slots live, "
    "and the update runs: 'cpu' (CPU:0, slim's default), 'gpu:N' (one "
    "chosen GPU) or 'spread' (each variable on one of the clones' devices, "
    'balanced by bytes, its update beside it; towers and multi_worker).')
_MESH_SHAPE = flags.DEFINE_list(
    'mesh_shape', None, "Keras's device mesh over the clones' devices, "
    'e.g. 2,2 (with --mesh_axes, and --layout_map or --plan_tables): each '
    'variable the layout map splits is stored as its shards over the mesh, '
    'each clone gathering them; --num_clones is the mesh\'s device count. '
    "Towers, or multi_worker: a mesh of each worker's clones.")
_MESH_AXES = flags.DEFINE_list(
    'mesh_axes', None, "The mesh's axis names, as Keras names them, e.g. "
    'batch,model.')
_LAYOUT_MAP = flags.DEFINE_string(
    'layout_map', None, "'model' (the model's own get_layout_map(mesh), or "
    "its backbone's: keras-hub's), 'auto' (derived from the model: kernels "
    'by columns and rows, attention by heads, tables by rows on the compute '
    'axis; large variables split over the batch axis) or MODULE:FUNCTION, '
    'FUNCTION(device_mesh) returning a keras.distribution.LayoutMap (e.g. '
    'keras_hub.models:LlamaBackbone.get_layout_map).')
_PLAN_TABLES = flags.DEFINE_bool(
    'plan_tables', False, 'With --mesh_shape: each plain Embedding table no '
    'rule of the layout map names is laid out whole, by rows or by columns, '
    'balancing the bytes each device holds and looks up (--layout_map '
    'optional).')
_STRICT_LAYOUT_MAP = flags.DEFINE_bool(
    'strict_layout_map', False, 'With --mesh_shape: a layout map key that '
    "matches no variable (nor names a layer's output) stops the run, naming "
    'the nearest variable paths; else a warning.')
_KEEP_JOINS = flags.DEFINE_bool(
    'keep_joins', False, 'With --mesh_shape: each variable sharded for '
    'storage alone is joined once before the pass and kept through the '
    "step (faster where memory allows, FSDP's reshard_after_forward=False); "
    "else a Dense, EinsumDense or convolution layer's are joined in its "
    'call, let go after, and joined again for its gradient.')
_GATHER_AHEAD = flags.DEFINE_integer(
    'gather_ahead', mesh_layouts.GATHER_AHEAD, 'With --mesh_shape: a layer '
    'joined in its call reads its shards while this many layers before it '
    'compute (after it, for its gradient), holding as many more layers; 0: '
    'once its own inputs exist.')
_BATCH_SIZE = flags.DEFINE_integer(
    'batch_size', 64, 'Examples per clone per step (as in slim); the global '
    'batch is batch_size * num_clones * workers.')
_MODEL = flags.DEFINE_string(
    'model', 'lenet', f'One of the registry\'s ({", ".join(models.names())})'
    ', keras.applications.NAME (weights=None, ending in logits, its '
    "family's preprocess_input inside) or MODULE:FUNCTION: your "
    'function(input_shape, num_classes) returning a keras.Model '
    '(functional, Sequential or subclassed) that ends in logits (MODULE '
    'dotted on PYTHONPATH, or a .py path). Every model receives float32 '
    'pixels in [0, 255], as Keras\'s image loaders give them: scale inside '
    'yours (keras.layers.Rescaling(1/255)).')
_WEIGHTS = flags.DEFINE_string(
    'weights', None, 'A local weights file the model starts from: one '
    'saved from the same model (model.save_weights), or for '
    'keras.applications.NAME its backbone\'s (Keras\'s *_notop.h5), under '
    'a new layer of logits. A resume starts from its checkpoint.')
_BATCH_NORM_MOMENTUM = flags.DEFINE_float(
    'batch_norm_momentum', None, "Every BatchNormalization's momentum (its "
    "moving statistics' decay, tf_cnn_benchmarks' --batch_norm_decay); "
    "unset keeps each layer's own. keras.applications use 0.99-0.999, "
    'slow for a model trained from scratch for a few epochs: try 0.9.')
_IMAGE_SIZE = flags.DEFINE_list(
    'image_size', None, 'HEIGHT,WIDTH: resize every image to it (bilinear); '
    'unset keeps the data\'s own size.')
_DATASET = flags.DEFINE_string(
    'dataset', 'digits', f'One of {", ".join(data.DATASETS)} (\'digits\' '
    "needs no network, 'synthetic' is one random batch repeated, for "
    'throughput); tfds:NAME[/CONFIG][:VERSION], any TFDS image '
    'classification dataset (from --data_dir, else downloaded); '
    'folder:PATH, a folder of class subfolders of PNG or JPEG images '
    '(PATH/train and PATH/test if both exist); or tfrecord:GLOB, '
    'TFRecords of image/encoded and image/class/label.')
_VALIDATION_FRACTION = flags.DEFINE_float(
    'validation_fraction', 0.2, 'The share held out for evaluation (drawn '
    'with --seed) from a source without an evaluation split of its own: a '
    'folder without train and test subfolders, a TFDS dataset without '
    'test or validation, TFRecords without --validation_glob.')
_VALIDATION_GLOB = flags.DEFINE_string(
    'validation_glob', None, 'With --dataset=tfrecord:GLOB: the TFRecord '
    'files to evaluate on, e.g. /data/imagenet/validation-*.')
_LABEL_OFFSET = flags.DEFINE_integer(
    'label_offset', 0, 'With --dataset=tfrecord:GLOB: subtracted from '
    "every label (TF's ImageNet converter writes 1..1000: give 1).")
_NUM_CLASSES = flags.DEFINE_integer(
    'num_classes', None, 'With --dataset=tfrecord:GLOB: the class count; '
    'unset, the largest label plus one.')
_SHARD_FILES = flags.DEFINE_bool(
    'shard_files', False, 'With --strategy=multi_worker and folder: or '
    'tfrecord: data: each worker reads its own share of the training files '
    '(file i to worker i mod N), for I/O. It trades exactness: the run no '
    'longer equals one process. Every worker trains the steps of the one '
    'with the fewest rows.')
_AUGMENT = flags.DEFINE_list(
    'augment', [], f'Training-row augmentations, off by default: any of '
    f'{",".join(options_lib.AUGMENTATIONS)} (a left-right mirror half the '
    'time; a pad by an eighth of each side and a random crop back), each '
    'row\'s draw seeded by (--seed, epoch, row), so every layout sees the '
    'same rows.')
_DATA_DIR = flags.DEFINE_string(
    'data_dir', None, 'TFDS data directory holding prepared datasets '
    '(default: ~/tensorflow_datasets).')
_OPTIMIZER = flags.DEFINE_enum('optimizer', 'adam', build.OPTIMIZERS,
                               "Optimizer; 'momentum' is SGD with 0.9.")
_LEARNING_RATE = flags.DEFINE_float(
    'learning_rate', 1e-3, 'Base learning rate of one device (see '
    '--lr_scaling).')
_LR_SCALING = flags.DEFINE_enum(
    'lr_scaling', learning_rates.NO_SCALING, learning_rates.LR_SCALINGS,
    "'linear': the peak rate is --learning_rate times the job's clones "
    '(Goyal et al. 2017); use it with --warmup_steps.')
_LR_SCHEDULE = flags.DEFINE_enum(
    'lr_schedule', learning_rates.CONSTANT, learning_rates.LR_SCHEDULES,
    'Decay after warm-up, over the global steps of the run: cosine to 0, or '
    'x0.1 at half and three quarters of the steps.')
_WARMUP_STEPS = flags.DEFINE_integer(
    'warmup_steps', 0, 'Global steps of linear warm-up from 0 to the peak '
    'rate.')
_EPOCHS = flags.DEFINE_integer(
    'epochs', 40, 'Passes over the train split (ignored with --train_steps).')
_TRAIN_STEPS = flags.DEFINE_integer(
    'train_steps', None, 'Global steps to train; overrides --epochs.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of weights, dropout and '
                             'shuffling.')
_DETERMINISTIC = flags.DEFINE_bool(
    'deterministic', False, 'Deterministic ops too: a rerun gives '
    'bit-identical weights (slower on GPUs).')
_MODEL_DIR = flags.DEFINE_string(
    'model_dir', None, 'Checkpoints, TensorBoard events and metrics.json; '
    'a directory with checkpoints resumes. Default: '
    'runs/<model>-<dataset>-<strategy>-<N>clones[-<stages, micro-batches, '
    'shares, accumulation, BatchNorm>]/: the same command resumes, another '
    'step never does.')
_LOG_EVERY_STEPS = flags.DEFINE_integer(
    'log_every_steps', 10, 'Steps between progress lines and summaries.')
_STEPS_PER_LOOP = flags.DEFINE_string(
    'steps_per_loop', step_calls.AUTO, 'Steps one compiled call runs (a '
    "tf.while_loop over the input): N, or 'auto': enough for about 50 ms a "
    'call, timed at the start, at most --log_every_steps (1 with '
    '--clone_shares=auto or several workers). Progress lines, checkpoints, '
    'signals and the non-finite stop act between calls, at the same steps; '
    'the weights are the same.')
_CHECKPOINT_STEPS = flags.DEFINE_integer(
    'checkpoint_steps', 500, 'Global steps between checkpoints; one is also '
    'written at the end and on SIGTERM or Ctrl-C.')
_KEEP_CHECKPOINTS = flags.DEFINE_integer(
    'keep_checkpoints', 5, 'Recent checkpoints to keep.')
_ASYNC_CHECKPOINT = flags.DEFINE_bool(
    'async_checkpoint', True, 'Write checkpoints on a background thread '
    'while the steps go on (the values are copied first; the index names a '
    'checkpoint once it is whole).')
_SUMMARIZE_GRADIENTS = flags.DEFINE_bool(
    'summarize_gradients', False, 'Write gradient histograms and norms per '
    'variable to TensorBoard.')
_BATCH_NORM_POLICY = flags.DEFINE_enum(
    'batch_norm_policy', step_options.BN_CLONE_0,
    step_options.BATCH_NORM_POLICIES,
    "BatchNorm moving statistics each step: clone 0's (slim), the clones' "
    "(and micro-batches') row-weighted mean, or full_batch: one update from "
    "the whole batch's mean and variance (towers).")
_SYNC_BATCH_NORM = flags.DEFINE_bool(
    'sync_batch_norm', False, "Keras's synchronized BatchNorm: statistics "
    'of the global batch, all-reduced over the clones or replicas.')
_STRATEGY = flags.DEFINE_enum(
    'strategy', registry.TOWERS, registry.NAMES,
    "How the step runs: 'towers' (tfmulti.deploy), 'mirrored' "
    "(tf.distribute.MirroredStrategy over the same devices), "
    "'central_storage' (CentralStorageStrategy), 'single' (one device, the "
    "whole global batch: the reference), 'multi_worker' (the towers on "
    "every worker of TF_CONFIG's cluster, gradients all-reduced) or "
    "'multi_worker_mirrored' (MultiWorkerMirroredStrategy).")
_NUM_WORKERS = flags.DEFINE_integer(
    'num_workers', None, 'Workers of a multi-worker job; read from '
    'TF_CONFIG when unset (given, it must agree).')
_WORKER_INDEX = flags.DEFINE_integer(
    'worker_index', None, "This worker's index in a multi-worker job; read "
    'from TF_CONFIG when unset (given, it must agree).')
_CLUSTER = flags.DEFINE_enum(
    'cluster', resolvers.AUTO, resolvers.SOURCES, 'Where a multi-worker '
    "task finds its place: 'tf_config' (TF_CONFIG), 'slurm' (the Slurm step's "
    "variables), 'indexed_job' (a Kubernetes Indexed Job: "
    "JOB_COMPLETION_INDEX, --worker_hosts, --num_workers), 'none', or "
    "'auto': TF_CONFIG if set, else a Slurm step of several tasks, else "
    'none.')
_PORT = flags.DEFINE_integer(
    'port', resolvers.DEFAULT_PORT, 'With --cluster=slurm: the first port '
    "of each node's tasks (a node of k tasks uses k ports from it).")
_WORKER_HOSTS = flags.DEFINE_string(
    'worker_hosts', None, 'With --cluster=indexed_job: every pod\'s address '
    'as a pattern, e.g. train-{index}.train:2222.')
_PEER_TIMEOUT_S = flags.DEFINE_float(
    'peer_timeout_s', 120.0, 'Seconds a multi-worker task waits for its '
    'peers, and for each collective, before it fails.')
_EXPORT = flags.DEFINE_bool(
    'export', True, 'At the end, write <model_dir>/export/<step>/: a '
    'SavedModel (serving_default: images -> logits, probabilities) and '
    'model.keras, for one device.')
_DRY_RUN = flags.DEFINE_bool(
    'dry_run', False, 'Plan the job for its GPUs on any machine, none '
    'needed: build it, trace one step on a batch of the data\'s shapes '
    '(nothing runs), log what each device holds, its tensors\' peak, what '
    'it moves and its FLOPs, and stop with one line where an op placed on a '
    'GPU has no GPU kernel for its dtypes, or a device does not fit '
    '--device_memory. With --strategy=multi_worker, one worker of '
    '--num_workers, no cluster needed.')
_DEVICE_MEMORY = flags.DEFINE_string(
    'device_memory', None, 'The memory of each GPU: a size (80GB, 16384MB) '
    'or a name (h100, a100, a100_40gb, v100, l4, t4, ...). --dry_run checks '
    'the plan against it (no check without it); a run shows memory as a '
    'share of it, by default of the GPU\'s own kind\'s.')
_PLAN = flags.DEFINE_enum(
    'plan', None, ['auto'], 'Plan every layout tfmulti can run on '
    '--num_clones GPUs of --device_memory=KIND (or KIND,KIND,...: a plan '
    'each), or with --clone_on_cpu on '
    'logical CPUs here (variables on the host, on GPU:0, spread, packed; '
    'sharded; split over a compute axis; maps derived from the model), drop '
    'those that do not fit, rank the rest by a predicted step (the kind\'s '
    'datasheet rates and links, or rates and kernels timed here), log the '
    'table and the winning command, and train it unless --dry_run.')
_DEVICE_PEAK_FLOPS = flags.DEFINE_string(
    'device_peak_flops', None, 'The peak rate of each compute device, for '
    'the MFU on every progress line: FLOP/s (312T, 1.5e14) or a name (h100, '
    'a100, l4, ...: its rate for the step\'s dtype). Default: the GPU\'s '
    'own kind; a CPU has none.')
_PROFILE_STEPS = flags.DEFINE_list(
    'profile_steps', None, 'FIRST,LAST: write a TensorBoard profile of '
    'these global steps (e.g. 5,7) to <model_dir>/plugins/profile; view it '
    "with pip install -e '.[profile]' and tensorboard --logdir.")
_NUM_STAGES = flags.DEFINE_integer(
    'num_stages', 1, 'Cut each clone into this many consecutive stages, '
    'each on its own device (clone c, stage s on device c * num_stages + '
    's): model parallelism. Towers only.')
_NUM_MICROBATCHES = flags.DEFINE_integer(
    'num_microbatches', 1, "Cut each clone's rows into this many "
    'micro-batches flowing through its stages (GPipe pipelining).')
_STAGE_BOUNDARIES = flags.DEFINE_list(
    'stage_boundaries', None, 'The first layer of stages 1..N-1, e.g. '
    'layer3_block0_conv1 (resnet50); default: cut where the layer costs '
    'balance.')
_STAGE_COSTS = flags.DEFINE_enum(
    'stage_costs', step_options.ESTIMATED, step_options.STAGE_COSTS,
    "What the automatic cut balances: layers' multiply-adds estimated from "
    "their shapes, or each layer's forward and backward pass measured at "
    'start-up.')
_RECOMPUTE = flags.DEFINE_bool(
    'recompute', False, "Recompute each stage's activations in the backward "
    'pass (less memory, one more forward pass).')
_PIPELINE_SCHEDULE = flags.DEFINE_enum(
    'pipeline_schedule', step_options.ONE_F_ONE_B,
    step_options.PIPELINE_SCHEDULES, "The order of each stage's forward and "
    'backward passes over the micro-batches: 1f1b (one forward, one '
    'backward in turn: less activation memory), gpipe (all forwards, then '
    'all backwards), zb_h1 (1f1b with each backward pass split into input '
    'and weight gradients, the weight half filling the bubble: a third of '
    "1f1b's idle time when the three passes take equal time), "
    'interleaved_1f1b (each stage device runs --virtual_stages chunks of '
    'the model: (K - 1) / (v M) of the ideal step idle) or zb_v (2 chunks '
    'a stage device in a V, split as zb_h1: idle only while the first '
    "forward passes fill the pipeline, at 1f1b's activation memory where "
    'W reads less than the forward pass keeps).')
_VIRTUAL_STAGES = flags.DEFINE_integer(
    'virtual_stages', 1, 'With --pipeline_schedule=interleaved_1f1b: v, '
    'the chunks of the model on each stage device (num_stages x v chunks, '
    'chunk c on device c mod num_stages).')
_CLONE_SHARES = flags.DEFINE_list(
    'clone_shares', None, "Each clone's share of a step's rows, e.g. 3,1 "
    "for a device 3x as fast (towers, mirrored), or 'auto': measure the "
    'clones and balance them (towers). Default: equal.')
_REBALANCE_EVERY_STEPS = flags.DEFINE_integer(
    'rebalance_every_steps', 100, 'With --clone_shares=auto: steps between '
    "measurements of the clones' speeds.")
_ACCUMULATION_STEPS = flags.DEFINE_integer(
    'accumulation_steps', 1, 'Sum the gradients of this many accumulation '
    'steps (each batch_size * num_clones rows) into one update; steps count '
    'updates.')
_REPRODUCIBLE_ROWS = flags.DEFINE_integer(
    'reproducible_rows', 0, 'Cut each step into atoms of this many rows, '
    'each run alone and summed in one fixed order: the same weights, bit for '
    'bit, whatever the clones, shares, stages, micro-batches, accumulation '
    'steps or workers (towers, multi_worker). 0: off.')
_GRADIENT_PACKS = flags.DEFINE_string(
    'gradient_packs', '0', "'auto': each clone sends its gradients for one "
    "owner device (and reads that device's variables) as one tensor; N: in N "
    'packs a device; 0: one transfer a variable. The same weights (bit for '
    'bit with --reproducible_rows; towers).')
_XLA = flags.DEFINE_string(
    'xla', step_options.AUTO, "Compile each clone's forward and backward "
    "pass with XLA (towers only): 'true', 'false', or 'auto': on for whole "
    'clones on GPUs; off on CPUs (as Keras), and with stages or '
    'micro-batches, --reproducible_rows, --sync_batch_norm or '
    '--deterministic (logged).')
_MIXED_PRECISION = flags.DEFINE_bool(
    'mixed_precision', False, 'Compute in float16 on GPUs (with dynamic loss '
    'scaling) or bfloat16 on CPUs; variables stay float32.')


def _variables_gpu(value):
  """N of --variables_device=gpu:N, or None for 'cpu' and 'spread'."""
  if value in ('cpu', placement.SPREAD):
    return None
  if value.startswith('gpu:') and value[4:].isdigit():
    return int(value[4:])
  raise errors.ConfigError(f"--variables_device={value}: use 'cpu', "
                           f"'gpu:N' or '{placement.SPREAD}', e.g. "
                           '--variables_device=gpu:0.')


def _variables_device(value, variables_gpu):
  """The `DeploymentConfig` value of --variables_device."""
  if value == placement.SPREAD:
    return placement.SPREAD
  return None if variables_gpu is None else f'/device:GPU:{variables_gpu}'


def _variable_layouts(shape, axes, layout_map, plan_tables, strategy,
                      strict_layout_map=False, keep_joins=False,
                      gather_ahead=mesh_layouts.GATHER_AHEAD):
  """The `DeploymentConfig` value of --mesh_shape, --mesh_axes,
  --layout_map, --plan_tables, --strict_layout_map, --keep_joins and
  --gather_ahead: a `mesh_layouts.VariableLayouts`, or None without
  them."""
  given = {'mesh_shape': shape, 'mesh_axes': axes,
           'layout_map or --plan_tables': layout_map or plan_tables}
  if not any(given.values()):
    for flag, value in (('strict_layout_map', strict_layout_map),
                        ('keep_joins', keep_joins),
                        ('gather_ahead',
                         gather_ahead != mesh_layouts.GATHER_AHEAD)):
      if value:
        raise errors.ConfigError(
            f'--{flag} without --mesh_shape: there is no layout map to '
            'apply it to; give the mesh and its map, or drop the flag.')
    return None
  if not all(given.values()):
    missing = ', '.join(f'--{k}' for k, v in given.items() if not v)
    raise errors.ConfigError(
        f'{missing} missing: a mesh needs its shape, its axis names and a '
        'layout map or --plan_tables, e.g. --mesh_shape=2,2 '
        '--mesh_axes=batch,model --layout_map=model.')
  if strategy not in (registry.TOWERS, registry.MULTI_WORKER):
    raise errors.ConfigError(
        f'--mesh_shape with --strategy={strategy}: the towers shard '
        f'variables by a layout map; use --strategy={registry.TOWERS} (or '
        f'{registry.MULTI_WORKER}, a mesh a worker).')
  if not all(n.isdigit() for n in shape):
    raise errors.ConfigError(
        f'--mesh_shape={",".join(shape)}: give a device count an axis, '
        'e.g. 2,2.')
  options = dict(plan_tables=plan_tables, strict_layout_map=strict_layout_map,
                 keep_joins=keep_joins, gather_ahead=gather_ahead)
  derived = (mesh_layouts.MODEL_OWN, mesh_layouts.AUTO)
  layouts = mesh_layouts.VariableLayouts(
      tuple(int(n) for n in shape), tuple(axes),
      layout_map if layout_map in derived else (), **options)
  if layout_map is None or layout_map in derived:
    return layouts
  made = external.function_named(
      'layout_map', layout_map,
      'FUNCTION(device_mesh) returning a keras.distribution.LayoutMap')(
          layouts.mesh())
  if not isinstance(made, keras.distribution.LayoutMap):
    raise errors.ConfigError(
        f'--layout_map={layout_map} returned {type(made).__name__}, not a '
        'keras.distribution.LayoutMap; return LayoutMap(device_mesh) with '
        'its keys set.')
  return mesh_layouts.same_mesh(
      layouts, mesh_layouts.from_layout_map(made, **options), layout_map)


def _image_size(values):
  """(height, width) of --image_size, or None."""
  if values is None:
    return None
  try:
    height, width = (int(v) for v in values)
  except ValueError:
    raise errors.ConfigError(
        f'--image_size={",".join(values)}: give HEIGHT,WIDTH in pixels, '
        'e.g. --image_size=32,32.') from None
  return height, width


def _xla(value):
  """--xla as the step option: True, False or 'auto'."""
  if isinstance(value, bool) or value == step_options.AUTO:
    return value
  words = {'true': True, '1': True, 'false': False, '0': False}
  if str(value).lower() not in words:
    raise errors.ConfigError(
        f"--xla={value}: use 'true', 'false' or 'auto'.")
  return words[str(value).lower()]


def _profile_steps(values):
  """(first, last) of --profile_steps, or None."""
  if values is None:
    return None
  try:
    first, last = (int(v) for v in values)
  except ValueError:
    raise errors.ConfigError(
        f'--profile_steps={",".join(values)}: give two global steps, '
        'FIRST,LAST, e.g. --profile_steps=5,7.') from None
  return first, last


def _clone_shares(values):
  """--clone_shares as numbers, 'auto', or None."""
  if values is None or values == [step_options.AUTO]:
    return values and step_options.AUTO
  try:
    return tuple(int(v) if v.strip().isdigit() else float(v) for v in values)
  except ValueError:
    raise errors.ConfigError(
        f'--clone_shares={",".join(values)}: give numbers, e.g. 3,1, or '
        'auto.') from None


def _cluster(path):
  """This task's `cluster.Cluster` for a multi-worker path, else None (a
  dry run plans a worker of `--num_workers` without one).

  A TF_CONFIG is checked under every strategy; a one-process strategy
  says once that it runs alone.
  """
  if not path.multi_worker:
    if _NUM_WORKERS.value not in (None, 1) or _WORKER_INDEX.value:
      raise errors.ConfigError(
          '--num_workers and --worker_index describe a multi-worker job: add '
          '--strategy=multi_worker and TF_CONFIG.')
    if os.environ.get(cluster.TF_CONFIG):
      info = cluster.from_environment()  # Raises for a malformed one.
      logging.warning(
          'TF_CONFIG describes a cluster of %d workers; strategy=%s runs in '
          'this process alone and does not use it.', info.num_workers,
          _STRATEGY.value)
    return None
  if _DRY_RUN.value:  # A worker of --num_workers, planned: no cluster.
    return None
  source = resolvers.source_of(_CLUSTER.value, os.environ)
  if source == resolvers.NONE:
    raise errors.ClusterError(
        f'strategy={_STRATEGY.value} needs a cluster, and --cluster='
        f'{_CLUSTER.value} found none: set TF_CONFIG, run inside a Slurm '
        'step, or use --cluster=indexed_job.')
  info = resolvers.resolve_into(source, os.environ, port=_PORT.value,
                                worker_hosts=_WORKER_HOSTS.value,
                                num_workers=_NUM_WORKERS.value)
  cluster.check_flags(info, _NUM_WORKERS.value, _WORKER_INDEX.value)
  return info


def _folder_name(value):
  """`value` (a --model or --dataset) as one folder's name: a .py file's
  function as <file stem>.<function>.<6 hex digits of the file's absolute
  path> (short, and two files of one name apart); else its characters
  outside [A-Za-z0-9_.] as '_'."""
  path, _, function = value.rpartition(':')
  if path.endswith('.py'):
    where = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:6]
    stem = os.path.splitext(os.path.basename(path))[0]
    value = f'{stem}.{function}.{where}'
  return re.sub(r'[^A-Za-z0-9_.]+', '_', value)


def default_model_dir(options):
  """runs/<model>-<dataset>-<strategy>-<N>clones[-<stages>...]: no time
  stamp, so the same command resumes; every setting that changes what a
  step computes is in the name, so another command never resumes it."""
  model, dataset = (_folder_name(value)
                    for value in (_MODEL.value, _DATASET.value))
  parts = [model, dataset, _STRATEGY.value,
           f'{_NUM_CLONES.value}clones']
  if _NUM_STAGES.value != 1:
    parts.append(f'{_NUM_STAGES.value}stages')
  if _IMAGE_SIZE.value:
    parts.append('x'.join(_IMAGE_SIZE.value))
  if _AUGMENT.value:
    parts.append('+'.join(_AUGMENT.value))
  if _SHARD_FILES.value:
    parts.append('sharded')
  return os.path.join('runs', '-'.join(parts + options.run_name_parts()))


def _train_config():
  options = _step_options()
  return config.TrainConfig(
      model=_MODEL.value, dataset=_DATASET.value,
      weights=_WEIGHTS.value and os.path.expanduser(_WEIGHTS.value),
      batch_norm_momentum=_BATCH_NORM_MOMENTUM.value,
      input_options=_input_options(),
      model_dir=(os.path.expanduser(_MODEL_DIR.value) if _MODEL_DIR.value
                 is not None else default_model_dir(options)),
      data_dir=_DATA_DIR.value and os.path.expanduser(_DATA_DIR.value),
      batch_size=_BATCH_SIZE.value,
      optimizer=_OPTIMIZER.value, learning_rate=_LEARNING_RATE.value,
      lr_scaling=_LR_SCALING.value, lr_schedule=_LR_SCHEDULE.value,
      warmup_steps=_WARMUP_STEPS.value, epochs=_EPOCHS.value,
      train_steps=_TRAIN_STEPS.value, seed=_SEED.value,
      deterministic=_DETERMINISTIC.value,
      log_every_steps=_LOG_EVERY_STEPS.value,
      steps_per_loop=_steps_per_loop(_STEPS_PER_LOOP.value),
      checkpoint_steps=_CHECKPOINT_STEPS.value,
      keep_checkpoints=_KEEP_CHECKPOINTS.value,
      async_checkpoint=_ASYNC_CHECKPOINT.value,
      mixed_precision=_MIXED_PRECISION.value,
      strategy=_STRATEGY.value, peer_timeout_s=_PEER_TIMEOUT_S.value,
      export=_EXPORT.value,
      profile_steps=_profile_steps(_PROFILE_STEPS.value),
      elastic_start=_elastic_start(),
      step_options=options,
      # A plan's kinds are its own (`planned_job.plan_kinds`).
      device_memory=None if _PLAN.value else _DEVICE_MEMORY.value,
      device_peak_flops=_DEVICE_PEAK_FLOPS.value, command=resolved_flags())


def resolved_flags():
  """This command line's flags as `train.py --flagfile=` reads them back,
  one `--name=value` each: every flag of this module that has a value,
  its defaults too (a later version's defaults change no rerun)."""
  found = sorted(flags.FLAGS.get_flags_for_module(sys.modules[__name__]),
                 key=lambda flag: flag.name)
  return tuple(line for line in (flag.serialize() for flag in found)
               if line)


def _elastic_start():
  """This start's number in an elastic launch (its environment), or None."""
  value = os.environ.get(tf_config.ELASTIC_START)
  return None if value is None else int(value)


def _steps_per_loop(value):
  """N or 'auto' of --steps_per_loop (`TrainConfig` checks N's range)."""
  if value == step_calls.AUTO:
    return value
  try:
    return int(value)
  except ValueError:
    raise errors.ConfigError(
        f"--steps_per_loop={value}: give a number of steps, e.g. 20, or "
        f"'{step_calls.AUTO}'.") from None


def _input_options():
  """The one `data.InputOptions` record of this run, from its flags."""
  return options_lib.InputOptions(
      image_size=_image_size(_IMAGE_SIZE.value),
      validation_fraction=_VALIDATION_FRACTION.value,
      validation_glob=_VALIDATION_GLOB.value,
      label_offset=_LABEL_OFFSET.value, num_classes=_NUM_CLASSES.value,
      augment=tuple(_AUGMENT.value), shard_files=_SHARD_FILES.value)


def _step_options():
  """The one `StepOptions` record of this run, from its flags."""
  return step_options.StepOptions(
      batch_norm_policy=_BATCH_NORM_POLICY.value,
      sync_batch_norm=_SYNC_BATCH_NORM.value, xla=_xla(_XLA.value),
      num_microbatches=_NUM_MICROBATCHES.value,
      stage_boundaries=(tuple(_STAGE_BOUNDARIES.value)
                        if _STAGE_BOUNDARIES.value else None),
      stage_costs=_STAGE_COSTS.value, recompute=_RECOMPUTE.value,
      pipeline_schedule=_PIPELINE_SCHEDULE.value,
      virtual_stages=_VIRTUAL_STAGES.value,
      clone_shares=_clone_shares(_CLONE_SHARES.value),
      rebalance_every_steps=_REBALANCE_EVERY_STEPS.value,
      accumulation_steps=_ACCUMULATION_STEPS.value,
      summarize_gradients=_SUMMARIZE_GRADIENTS.value,
      reproducible_rows=_REPRODUCIBLE_ROWS.value,
      gradient_packs=_GRADIENT_PACKS.value)


def configs_from_flags():
  """(TrainConfig, DeploymentConfig, cluster or None) from the flags.

  Places the clones too: logical CPUs are created here, and the clones
  given their shares of the cores, before anything initialises TensorFlow.

  Raises:
    errors.UserError: naming the flag and the fix.
  """
  variables_gpu = _variables_gpu(_VARIABLES_DEVICE.value)
  train_config = _train_config()
  path = registry.get(train_config.strategy)
  cluster_info = _cluster(path)
  clone_on_cpu = _CLONE_ON_CPU.value
  if clone_on_cpu or not _DRY_RUN.value:  # A dry run plans absent GPUs.
    clone_on_cpu = devices.place_clones(
        _NUM_CLONES.value, clone_on_cpu=clone_on_cpu,
        variables_gpu=variables_gpu, num_stages=_NUM_STAGES.value)
  if clone_on_cpu and not train_config.step_options.reproducible_rows:
    devices.share_cores(_NUM_CLONES.value)  # Atoms' bits: one pool.
  deploy_config = placement.DeploymentConfig(
      num_clones=_NUM_CLONES.value, clone_on_cpu=clone_on_cpu,
      variables_device=_variables_device(_VARIABLES_DEVICE.value,
                                         variables_gpu),
      replica_id=cluster_info.index if cluster_info else 0,
      num_replicas=(cluster_info.num_workers if cluster_info else
                    _NUM_WORKERS.value or 1),
      num_stages=_NUM_STAGES.value,
      variable_layouts=_variable_layouts(
          _MESH_SHAPE.value, _MESH_AXES.value, _LAYOUT_MAP.value,
          _PLAN_TABLES.value, train_config.strategy,
          _STRICT_LAYOUT_MAP.value, _KEEP_JOINS.value, _GATHER_AHEAD.value))
  train_config = job.keep_global_batch(train_config, deploy_config)
  return train_config, deploy_config, cluster_info


# The flags a plan chooses (`plan.search`): a --plan=auto command gives none.
_LAYOUT_FLAGS = ('variables_device', 'mesh_shape', 'mesh_axes', 'layout_map',
                 'plan_tables', 'keep_joins', 'gather_ahead', 'gradient_packs')


def _check_plan():
  """`planned_job.check_plan` of this command's flags."""
  planned_job.check_plan(
      [name for name in _LAYOUT_FLAGS
       if flags.FLAGS[name].value != flags.FLAGS[name].default],
      _CLONE_ON_CPU.value, _DEVICE_MEMORY.value, _DRY_RUN.value)


def _plan(train_config, deploy_config, cluster_info):
  """--plan=auto: the candidates planned and ranked, on each kind of
  --device_memory or on logical CPUs; logs each winner's command (this
  command's flags, the kind's and the layout's in place of --plan) and,
  unless --dry_run, trains the one winner."""
  if deploy_config.clone_on_cpu:
    found = {None: planned_job.search(train_config, deploy_config)}
  else:
    found = planned_job.search_kinds(train_config, deploy_config,
                                     planned_job.plan_kinds(
                                         _DEVICE_MEMORY.value))
  kept = [flag.serialize() for flag in sorted(
      flags.FLAGS.get_flags_for_module(sys.modules[__name__]),
      key=lambda flag: flag.name)
          if flag.value != flag.default and flag.name not in (
              'plan', 'dry_run', 'device_memory') + _LAYOUT_FLAGS]
  for kind, rows in found.items():
    logging.info('plan: %s', ' '.join(
        ['python train.py', *kept] +
        ([f'--device_memory={kind}'] if kind else []) +
        [f'--{name}={value}' for name, value in rows[0].candidate.flags]))
  if not _DRY_RUN.value:
    (rows,) = found.values()
    logging.info('plan: training %s', rows[0].candidate.name)
    job.train_and_evaluate(*rows[0].candidate.applied(
        train_config, deploy_config), cluster_info=cluster_info)


def own_lines_only(record):
  """An absl log filter: tfmulti's lines, and every warning and error.

  Libraries' INFO lines (TFDS reading its files, the checkpoint saver) stay
  off the screen unless --verbosity asks for them.
  """
  return (record.levelno >= logging.converter.STANDARD_WARNING
          or record.pathname.startswith(_PACKAGE_DIR))


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def main(argv):
  handler = logging.get_absl_handler()
  if (not _VERBOSE and logging.get_verbosity() < logging.DEBUG
      and own_lines_only not in handler.filters):
    handler.addFilter(own_lines_only)
    tf.get_logger().setLevel('WARNING')  # "Assets written to ..." and such.
  if len(argv) > 1:
    sys.exit(f'{PROGRAM}: error: unexpected arguments {argv[1:]}; flags are '
             'written --name=value.')
  try:
    if _PLAN.value:
      _check_plan()
    train_config, deploy_config, cluster_info = configs_from_flags()
    if _PLAN.value:
      _plan(train_config, deploy_config, cluster_info)
      return
    if _DRY_RUN.value:
      planned_job.run(train_config, deploy_config, device_kinds.memory_bytes(
          train_config.device_memory))
      return
    job.train_and_evaluate(train_config, deploy_config,
                                 cluster_info=cluster_info)
  except loop.TrainingInterrupted as e:
    logging.warning('%s', e)
    sys.exit(e.exit_code)
  except errors.UserError as e:
    raise errors.exit_for(e, PROGRAM) from None


# --help's groups: every flag of this module, once (a test checks it).
HELP_GROUPS = (
    ('Where the clones run', (
        'num_clones', 'clone_on_cpu', 'variables_device', 'mesh_shape',
        'mesh_axes', 'layout_map', 'plan_tables', 'strict_layout_map',
        'keep_joins', 'gather_ahead', 'num_stages',
        'strategy')),
    ('What trains, on what', (
        'model', 'weights', 'batch_norm_momentum', 'dataset', 'data_dir',
        'image_size', 'augment',
        'validation_fraction', 'validation_glob', 'label_offset',
        'num_classes', 'shard_files', 'batch_size', 'mixed_precision')),
    ('Optimisation', (
        'optimizer', 'learning_rate', 'lr_scaling', 'lr_schedule',
        'warmup_steps', 'epochs', 'train_steps', 'seed', 'deterministic')),
    ('How each step runs (the step options)', (
        'batch_norm_policy', 'sync_batch_norm', 'xla', 'num_microbatches',
        'stage_boundaries', 'stage_costs', 'recompute', 'pipeline_schedule',
        'virtual_stages', 'clone_shares',
        'rebalance_every_steps', 'accumulation_steps', 'summarize_gradients',
        'reproducible_rows', 'gradient_packs')),
    ('Output', (
        'model_dir', 'log_every_steps', 'steps_per_loop', 'checkpoint_steps',
        'keep_checkpoints', 'async_checkpoint', 'export', 'profile_steps',
        'dry_run', 'plan', 'device_memory', 'device_peak_flops')),
    ('Several workers (TF_CONFIG, Slurm, Kubernetes)', (
        'num_workers', 'worker_index', 'cluster', 'port', 'worker_hosts',
        'peer_timeout_s')),
)
_HELP_FLAGS = ('--help', '-h', '-?', '--helpshort')
_HELP_WIDTH = 78


def help_text():
  """What --help prints: the program, then its flags by group with their
  defaults; --helpfull lists absl's and TensorFlow's flags too."""
  lines = ['Trains an image model over clones, stages and workers (tfmulti).',
           '', '  python train.py --num_clones=2 --clone_on_cpu', '']
  for title, names in HELP_GROUPS:
    lines.append(f'{title}:')
    for name in names:
      flag = flags.FLAGS[name]
      lines.append(f'  --{name} (default: {_shown(flag.default)})')
      lines.extend(textwrap.wrap(
          flag.help, _HELP_WIDTH, initial_indent='      ',
          subsequent_indent='      ', break_long_words=False,
          break_on_hyphens=False))
    lines.append('')
  lines.append('--helpfull lists every flag, absl\'s and TensorFlow\'s too.')
  return '\n'.join(lines)


def _shown(default):
  if default is None:
    return 'unset'
  if isinstance(default, list):
    return ','.join(default)
  return str(default)


def run(argv=None):
  """Console-script entry point (`tfmulti-train`).

  --help (-h, --helpshort) prints `help_text()` and exits 0; absl's own
  help would show only the flags of the script that called this.
  """
  argv = sys.argv if argv is None else argv
  if any(arg in _HELP_FLAGS for arg in argv[1:]):
    print(help_text())
    sys.exit(0)
  try:
    app.run(main, argv=argv)
  finally:
    # Every file is written and closed by now. The interpreter's last
    # collection would walk the millions of objects TensorFlow and Keras
    # made (0.7 s of a LeNet job's exit): frozen, they are left to the
    # operating system; the exit still runs atexit and flushes.
    gc.freeze()
