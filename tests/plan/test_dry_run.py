"""A dry run: the towers traced for 8 GPUs on a machine without one; every
op placed on a GPU has a GPU kernel for its dtypes, and each device's
bytes follow the plan."""

import re

from absl.testing import flagsaver
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti import cli
from tfmulti import errors
from tfmulti import fit
from tfmulti import plans
from tfmulti.deploy import placement
from tfmulti.deploy import towers
from tfmulti.fit import planned
from tfmulti.mesh import mesh_layouts
from tfmulti.plan import dry_run
from tfmulti.plan import peaks as peaks_lib
from tfmulti.plan import traffic

GPUS = [f'/device:GPU:{i}' for i in range(8)]


def _model(with_strings=False, dtype=None):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((8, 8, 3))
  x = keras.layers.Conv2D(16, 3, name='conv', dtype=dtype)(inputs)
  x = keras.layers.BatchNormalization(name='norm')(x)
  if with_strings:  # A user's op that has no GPU kernel.
    x = keras.layers.Lambda(lambda t: t + tf.strings.to_number(
        tf.strings.as_string(t)), name='through_strings')(x)
  x = keras.layers.GlobalAveragePooling2D()(x)
  x = keras.layers.Dense(64, activation='relu', name='hidden',
                         dtype=dtype)(x)
  return keras.Model(inputs, keras.layers.Dense(8, name='logits',
                                                dtype=dtype)(x))


def _batch(rows=16):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, 8, 8, 3)).astype(np.float32),
          rng.integers(0, 8, rows).astype(np.int32))


def _plan(config, model=None, dtype=None, rows=16, **fields):
  """The dry run of `config` (a model of `dtype` layers: 'mixed_float16'
  trains under a loss scale) on a batch of `rows`."""
  with plans.planning():
    with config.variables_scope():
      model = model or _model(dtype=dtype)
    with tf.device(config.optimizer_variables_device()):
      optimizer = keras.optimizers.Adam()
      if dtype:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return dry_run.plan(
        config, model, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), optimizer, *_batch(rows), **fields)


SHARDED = mesh_layouts.VariableLayouts(
    (8,), ('model',), (('hidden/kernel', (None, 'model')),
                       ('logits/kernel', ('model', None))))


def _slow(make, fields):
  return pytest.param(make, fields, marks=pytest.mark.slow)


def _clones(**config):
  return lambda: placement.DeploymentConfig(num_clones=8, **config)


def _stages(**config):
  return lambda: placement.DeploymentConfig(num_clones=4, num_stages=2,
                                            **config)


@pytest.mark.parametrize('make, fields', [
    (_clones(), {}),
    _slow(_clones(variables_device='spread'), {}),
    _slow(_clones(variable_layouts=SHARDED), {}),
    _slow(_stages(), dict(num_microbatches=2, pipeline_schedule='zb_h1')),
    _slow(_stages(), dict(num_microbatches=2, virtual_stages=2,
                          pipeline_schedule='interleaved_1f1b')),
    _slow(_stages(), dict(num_microbatches=4, pipeline_schedule='zb_v',
                          stage_boundaries=('norm', 'hidden', 'logits'))),
    _slow(_stages(), dict(num_microbatches=2, recompute=True)),
    _slow(_stages(), dict(num_microbatches=2, pipeline_schedule='gpipe')),
    _slow(_clones(), dict(summarize_gradients=True)),
    _slow(_clones(), dict(accumulation_steps=2)),
    _slow(_clones(), dict(reproducible_rows=2)),
    _slow(_clones(), dict(clone_shares=(3, 1, 1, 1, 1, 1, 1, 1))),
    _slow(_clones(variables_device='spread'), dict(gradient_packs='auto')),
    _slow(_clones(), dict(dtype='mixed_float16')),
    _slow(_clones(), dict(xla=False)),
    _slow(_clones(variables_device='spread', num_replicas=2), {}),
    _slow(_clones(), dict(sync_batch_norm=True)),
])
def test_every_op_on_eight_gpus_has_a_gpu_kernel(make, fields):
  config = make()
  assert not plans.absent('/device:CPU:0') and plans.absent(GPUS[7])
  found = _plan(config, **fields)
  assert set(GPUS) <= set(found.devices)
  for device in GPUS:
    report = found.devices[device]
    assert report.missing_kernels == [], device
    assert report.ops > 0 and report.flops > 0, device
    assert report.written_bytes > 0 and not report.kernels, device
  assert not tf.config.list_physical_devices('GPU')


@pytest.mark.slow
def test_spread_and_sharded_variables_are_held_where_planned():
  spread = _plan(placement.DeploymentConfig(num_clones=8,
                                            variables_device='spread'))
  sharded = _plan(placement.DeploymentConfig(num_clones=8,
                                             variable_layouts=SHARDED))
  central = _plan(placement.DeploymentConfig(num_clones=8))
  total = central.devices['/device:CPU:0'].held_bytes
  assert all(central.devices[d].held_bytes == 0 for d in GPUS)
  assert sum(spread.devices[d].held_bytes for d in GPUS) == pytest.approx(
      total, rel=0.01)  # The optimizer's own scalars stay on the host.
  # The hidden kernel (64 x 64 floats, 2 Adam slots) in 8 shards.
  shards = [path for _, path, _ in sharded.holders
            if path.startswith('hidden/kernel/shard_')]
  assert len(shards) == 8
  held = {d: sharded.devices[d].held_bytes for d in GPUS}
  assert max(held.values()) < max(spread.devices[d].held_bytes
                                  for d in GPUS)
  # Central variables cross between the host and the GPUs; spread ones
  # between GPUs.
  assert central.devices[GPUS[0]].received_bytes['host-gpu'] > 0
  assert spread.devices[GPUS[0]].received_bytes['gpu-gpu'] > 0


def test_an_op_without_a_gpu_kernel_is_named_in_one_line():
  found = _plan(placement.DeploymentConfig(num_clones=8),
                model=_model(with_strings=True))
  missing = found.devices[GPUS[3]].missing_kernels
  assert missing and all('\n' not in line for line in missing)
  assert any(line.startswith('AsString ') and 'through_strings' in line and
             'on /device:GPU:3: no GPU kernel for float32, string' in line
             for line in missing), missing


@pytest.mark.slow
def test_a_model_too_big_for_the_memory_names_its_biggest_holders():
  found = _plan(placement.DeploymentConfig(num_clones=8,
                                           variables_device='spread'))
  lines = dry_run.over_memory(found, memory_bytes=1024)
  assert len(lines) == 8
  assert 'hidden/kernel' in ''.join(lines)
  assert all(' over its 0.0 MiB; its biggest: ' in line for line in lines)
  assert dry_run.over_memory(found, memory_bytes=2**30) == []


def test_the_fix_for_a_device_over_its_memory_follows_what_fills_it():
  gib = 2**30
  found = dry_run.Plan(
      {GPUS[0]: dry_run.DeviceReport(held_bytes=3 * gib, peak_bytes=gib),
       GPUS[1]: dry_run.DeviceReport(held_bytes=gib, peak_bytes=3 * gib)},
      [(3 * gib, 'table/embeddings', GPUS[0])])
  variables, tensors = dry_run.over_memory(found, memory_bytes=2 * gib)
  assert variables.startswith(
      f'{GPUS[0]} needs 4.00 GiB (3.00 GiB of variables')
  assert 'its biggest: table/embeddings 3.00 GiB' in variables
  assert variables.endswith(dry_run.VARIABLES_FIX)
  assert tensors.endswith(dry_run.TENSORS_FIX)


@pytest.mark.slow
def test_the_command_line_plans_eight_gpus_and_writes_nothing(
    tmp_path, digits_dir, caplog):
  values = dict(model_dir=str(tmp_path / 'run'), data_dir=digits_dir,
                dry_run=True, num_clones=8, clone_on_cpu=False,
                variables_device='spread', batch_size=4)
  with caplog.at_level('INFO', logger='absl'):
    with flagsaver.flagsaver(**values, device_memory='h100'):
      cli.main(['train.py'])
  assert re.search(r'every device fits in 80.00 GiB \(the busiest, '
                   r'/device:GPU:\d, needs [\d.]+ [MG]iB: [\d.]+ GiB spare\)',
                   caplog.text)
  for i in range(8):
    assert re.search(rf'/device:GPU:{i}: holds [\d.]+ MiB of variables and '
                     r'slots.*GFLOP a step in \d+ ops; 0 without a GPU kernel',
                     caplog.text), i
  assert 'every op placed on a GPU has a GPU kernel' in caplog.text
  assert not (tmp_path / 'run').exists()
  with flagsaver.flagsaver(**values, device_memory='0.1MB'):
    with pytest.raises(SystemExit, match=r'8 device\(s\) do not fit: '
                       r'/device:GPU:\d needs [\d.]+ [MG]iB.*; its step.s '
                       r'tensors are the most of it: lower --batch_size'):
      cli.main(['train.py'])
  with flagsaver.flagsaver(**values, device_memory='lots'):
    with pytest.raises(SystemExit, match=r'device_memory=lots: give a '
                       r'size \(80GB, 16384MB\) or a device name'):
      cli.main(['train.py'])


def test_the_peak_counts_the_buffers_live_at_once():
  size = 1000 * 4
  weights = tf.Variable(tf.ones(1000))  # On CPU:0, the host.

  @tf.function
  def step(x):
    with tf.device('/device:CPU:0'):
      a = x + 1.0
      b = tf.reshape(a * 2.0, [10, 100])  # A view: b's buffer once.
      c = a + tf.reshape(b, [1000])  # Written into a's buffer: 2 live.
      unread = a * 3.0  # Pruned: nothing the step returns reads it.
      del unread
    with tf.device('/device:CPU:1'):
      d = c * weights  # c and the weights copied here.
    return d

  graph = step.get_concrete_function(
      tf.TensorSpec((1000,), tf.float32)).graph
  found = peaks_lib.peaks(graph)
  # The weights' read is held; the argument's copy becomes a's buffer.
  assert 2 * size <= found['/device:CPU:0'] < 2 * size + 100  # Scalars.
  assert found['/device:CPU:1'] == 2 * size  # c's and the weights' copies.


@pytest.mark.slow
def test_more_rows_a_clone_raise_each_gpus_peak_not_its_holdings():
  small, large = (_plan(placement.DeploymentConfig(num_clones=8), rows=rows)
                  for rows in (16, 64))
  for device in GPUS:
    assert small.devices[device].held_bytes == large.devices[device].held_bytes
    assert large.devices[device].peak_bytes > (
        2 * small.devices[device].peak_bytes)


@pytest.mark.slow
def test_accumulation_lowers_each_gpus_peak():
  whole, halves = (_plan(placement.DeploymentConfig(num_clones=8), rows=64,
                         accumulation_steps=steps) for steps in (1, 2))
  for device in GPUS:
    assert halves.devices[device].peak_bytes < (
        0.75 * whole.devices[device].peak_bytes)


@pytest.mark.slow
def test_a_towers_model_plans_as_the_towers_do():
  config = placement.DeploymentConfig(num_clones=8, variables_device='spread')
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  images, labels = _batch()
  with plans.planning():
    with config.variables_scope():
      model = _model()
    towers = fit.TowersModel(model, config)
    towers.compile(optimizer=keras.optimizers.Adam(), loss=loss)
    found = planned.plan(towers, images, labels)
  want = _plan(config)
  for device in GPUS:
    got = found.devices[device]
    assert got.missing_kernels == [], device
    assert got.held_bytes == want.devices[device].held_bytes, device
    assert got.received_bytes == want.devices[device].received_bytes, device
    # The same passes, metrics besides; the ops the step runs only (a
    # scalar the towers return and `fit`'s step does not, pruned).
    assert got.flops >= want.devices[device].flops - 1 > 0, device


def test_a_towers_model_not_compiled_or_not_planning_is_refused():
  towers = fit.TowersModel(_model(), placement.DeploymentConfig(
      num_clones=2, clone_on_cpu=True))
  with pytest.raises(errors.ConfigError, match='inside the plans.planning'):
    planned.plan(towers, *_batch())
  with plans.planning():
    with pytest.raises(errors.ConfigError, match='not compiled: call'):
      planned.plan(towers, *_batch())


@pytest.mark.slow
@pytest.mark.parametrize('config', [dict(variables_device='spread'),
                                    dict(variable_layouts=SHARDED)])
def test_the_plans_bytes_are_the_traffic_benchmarks(config):
  """Clone i on GPU:i moves what it moves on logical CPU:i, where the
  traffic benchmark counts it (CPU:0 is the host there too), neither
  pass compiled (a compiled pass receives every value it takes, the ops
  the runtime prunes from an uncompiled one included)."""
  planned_run = _plan(placement.DeploymentConfig(num_clones=8, **config),
                      xla=False)
  cpus = placement.DeploymentConfig(num_clones=8, clone_on_cpu=True, **config)
  with cpus.variables_scope():
    model = _model()
  with tf.device(cpus.optimizer_variables_device()):
    optimizer = keras.optimizers.Adam()
  measured = traffic.step_traffic(towers.deploy(
      cpus, model, keras.losses.SparseCategoricalCrossentropy(
          from_logits=True), optimizer), *_batch())
  for i in range(1, 8):
    gpu = planned_run.devices[GPUS[i]]
    cpu = measured[f'/device:CPU:{i}']
    assert sum(gpu.sent_bytes.values()) == sum(cpu.sent.values()), i
    assert sum(gpu.received_bytes.values()) == sum(cpu.received.values()), i
    assert gpu.held_bytes == cpu.held, i


@pytest.mark.slow
def test_a_worker_is_planned_with_the_workers_all_reduce():
  parameters = sum(v.numpy().nbytes for v in _model().trainable_variables)
  alone = _plan(placement.DeploymentConfig(num_clones=8))
  four = _plan(placement.DeploymentConfig(num_clones=8, num_replicas=4))
  host = '/device:CPU:0'  # Central variables: the sums are on the host.
  for way in ('sent_bytes', 'received_bytes'):
    network = getattr(four.devices[host], way)[dry_run.NETWORK]
    assert network == pytest.approx(2 * 3 / 4 * parameters, rel=1e-3)
    assert dry_run.NETWORK not in getattr(alone.devices[host], way)
  for device in GPUS:  # Each worker runs the same towers.
    assert four.devices[device].received_bytes == (
        alone.devices[device].received_bytes)


@pytest.mark.slow
def test_the_command_line_plans_a_worker_of_several(
    tmp_path, digits_dir, caplog):
  values = dict(model_dir=str(tmp_path / 'run'), data_dir=digits_dir,
                dry_run=True, num_clones=8, clone_on_cpu=False,
                variables_device='spread', batch_size=4,
                strategy='multi_worker', num_workers=2)
  with caplog.at_level('INFO', logger='absl'):
    with flagsaver.flagsaver(**values):
      cli.main(['train.py'])
  for i in range(8):
    assert re.search(rf'/device:GPU:{i}: .*network [\d.]+ MiB out',
                     caplog.text), i
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('flags, message', [
    (dict(strategy='multi_worker'), r'plans a worker of --num_workers: give '
     r'--num_workers=W, 2 or more'),
    (dict(strategy='multi_worker', num_workers=2, num_microbatches=2),
     r"num_microbatches=2 is not available with strategy='multi_worker'"),
    (dict(strategy='mirrored'), r'--dry_run with --strategy=mirrored: the '
     r'dry run plans the towers'),
])
def test_a_dry_run_the_real_run_would_refuse_is_one_line(
    tmp_path, digits_dir, flags, message):
  values = dict(model_dir=str(tmp_path / 'run'), data_dir=digits_dir,
                dry_run=True, num_clones=8, clone_on_cpu=False, **flags)
  with flagsaver.flagsaver(**values):
    with pytest.raises(SystemExit, match=message):
      cli.main(['train.py'])
  assert not (tmp_path / 'run').exists()
