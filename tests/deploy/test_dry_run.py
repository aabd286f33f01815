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
from tfmulti import plans
from tfmulti.deploy import dry_run
from tfmulti.deploy import mesh_layouts
from tfmulti.deploy import placement

GPUS = [f'/device:GPU:{i}' for i in range(8)]


def _model(with_strings=False):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((8, 8, 3))
  x = keras.layers.Conv2D(16, 3, name='conv')(inputs)
  x = keras.layers.BatchNormalization(name='norm')(x)
  if with_strings:  # A user's op that has no GPU kernel.
    x = keras.layers.Lambda(lambda t: t + tf.strings.to_number(
        tf.strings.as_string(t)), name='through_strings')(x)
  x = keras.layers.GlobalAveragePooling2D()(x)
  x = keras.layers.Dense(64, activation='relu', name='hidden')(x)
  return keras.Model(inputs, keras.layers.Dense(8, name='logits')(x))


def _batch(rows=16):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, 8, 8, 3)).astype(np.float32),
          rng.integers(0, 8, rows).astype(np.int32))


def _plan(config, model=None, **fields):
  with plans.planning():
    with config.variables_scope():
      model = model or _model()
    with tf.device(config.optimizer_variables_device()):
      optimizer = keras.optimizers.Adam()
    return dry_run.plan(
        config, model, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), optimizer, *_batch(), **fields)


SHARDED = mesh_layouts.VariableLayouts(
    (8,), ('model',), (('hidden/kernel', (None, 'model')),
                       ('logits/kernel', ('model', None))))


def _slow(make, fields):
  return pytest.param(make, fields, marks=pytest.mark.slow)


@pytest.mark.parametrize('make, fields', [
    (lambda: placement.DeploymentConfig(num_clones=8), {}),
    _slow(lambda: placement.DeploymentConfig(num_clones=8,
                                             variables_device='spread'), {}),
    _slow(lambda: placement.DeploymentConfig(num_clones=8,
                                             variable_layouts=SHARDED), {}),
    _slow(lambda: placement.DeploymentConfig(num_clones=4, num_stages=2),
          dict(num_microbatches=2, pipeline_schedule='zb_h1')),
    _slow(lambda: placement.DeploymentConfig(num_clones=8),
          dict(accumulation_steps=2)),
    _slow(lambda: placement.DeploymentConfig(num_clones=8),
          dict(reproducible_rows=2)),
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
  assert all('GiB over its 0 GiB; its biggest: ' in line for line in lines)
  assert dry_run.over_memory(found, memory_bytes=2**30) == []


def test_the_command_line_plans_eight_gpus_and_writes_nothing(
    tmp_path, digits_dir, caplog):
  values = dict(model_dir=str(tmp_path / 'run'), data_dir=digits_dir,
                dry_run=True, num_clones=8, clone_on_cpu=False,
                variables_device='spread', batch_size=4)
  with caplog.at_level('INFO', logger='absl'):
    with flagsaver.flagsaver(**values):
      cli.main(['train.py'])
  for i in range(8):
    assert re.search(rf'/device:GPU:{i}: holds [\d.]+ MiB of variables and '
                     r'slots.*GFLOP a step in \d+ ops; 0 without a GPU kernel',
                     caplog.text), i
  assert 'every op placed on a GPU has a GPU kernel' in caplog.text
  assert not (tmp_path / 'run').exists()
  with flagsaver.flagsaver(**values, device_memory='0.1MB'):
    with pytest.raises(SystemExit, match=r'8 device\(s\) do not fit: '
                       r'/device:GPU:\d needs [\d.]+ GiB'):
      cli.main(['train.py'])
  with flagsaver.flagsaver(**values, device_memory='lots'):
    with pytest.raises(SystemExit, match=r'--device_memory=lots: give a '
                       r'size \(80GB, 16384MB\) or a device name'):
      cli.main(['train.py'])
