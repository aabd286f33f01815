"""A step's readings: its model FLOPs counted from the traced graph equal
the layers' own count, on every device that computes them; MFU divides
them by the time and the devices' peak; memory is the runtime's or the
plan's, labelled; tokens are counted only where the input is tokens."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import make_deployed
from tests.helpers import make_loss
from tfmulti import device_kinds
from tfmulti import errors
from tfmulti import plans
from tfmulti.bench import flops as flops_lib
from tfmulti.deploy import placement
from tfmulti.deploy import towers
from tfmulti.engine import readings

ROWS = 16


def _convnet():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((8, 8, 3))
  x = keras.layers.Conv2D(8, 3, activation='relu')(inputs)  # 'valid'.
  x = keras.layers.Conv2D(8, 3, padding='same')(x)
  x = keras.layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, keras.layers.Dense(5)(x))


def _einsum_net():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((4, 8))
  x = keras.layers.EinsumDense('abc,cd->abd', (4, 16))(inputs)
  x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(5)(x))


def _batch(model):
  rng = np.random.default_rng(0)
  shape = (ROWS,) + tuple(model.input_shape[1:])
  return (rng.normal(size=shape).astype(np.float32),
          rng.integers(0, 5, ROWS).astype(np.int32))


def _trained(make, **config):
  deployed = make_deployed(placement.DeploymentConfig(
      clone_on_cpu=True, **config), make)
  deployed.train_step(*_batch(deployed.model))
  return deployed


@pytest.mark.parametrize('make, num_clones', [
    (_convnet, 2), (_einsum_net, 1),
    pytest.param(_convnet, 1, marks=pytest.mark.slow),
    pytest.param(_einsum_net, 2, marks=pytest.mark.slow)])
def test_model_flops_are_the_layers_count_on_each_clone(make, num_clones):
  deployed = _trained(make, num_clones=num_clones)
  cost = readings.step_cost(deployed.step_function)
  want = flops_lib.step_flops(deployed.model, ROWS)  # From the layers.
  compute = cost.compute_devices()
  assert compute == [f'/device:CPU:{i}' for i in range(num_clones)]
  assert sum(cost.flops[d] for d in compute) == pytest.approx(want)
  for device in compute:  # Each clone computes its rows' share.
    assert cost.flops[device] == pytest.approx(want / num_clones)


@pytest.mark.slow
@pytest.mark.parametrize('config, options', [
    (dict(num_clones=2), dict(accumulation_steps=2)),
    (dict(num_clones=2), dict(accumulation_steps=4)),  # A loop of 3.
    (dict(num_clones=2), dict(reproducible_rows=4)),
    (dict(num_clones=2), dict(clone_shares=(3, 1))),
    (dict(num_clones=1, num_stages=2), dict(num_microbatches=4,
                                            recompute=True)),
    (dict(num_clones=2, variables_device='spread'), {})])
def test_model_flops_are_the_layers_count_under_each_option(config,
                                                            options):
  """Accumulated, in atoms, by shares, in micro-batches recomputed (not
  counted again: PaLM's MFU) or spread: the rows' FLOPs, once."""
  deployed = make_deployed(placement.DeploymentConfig(
      clone_on_cpu=True, **config), _convnet, **options)
  deployed.train_step(*_batch(deployed.model))
  cost = readings.step_cost(deployed.step_function)
  assert sum(cost.flops.values()) == pytest.approx(
      flops_lib.step_flops(deployed.model, ROWS))


def test_a_bfloat16_step_is_read_at_the_kinds_bfloat16_rate():
  deployed = _trained(_convnet, num_clones=2)
  want = flops_lib.step_flops(deployed.model, ROWS)
  rates = {}
  for dtype in ('float32', 'bfloat16'):
    reading = readings.Meter(deployed.step_function, ROWS,
                             compute_dtype=dtype,
                             kind=device_kinds.KINDS['a100']).reading(1, 1)
    rates[dtype] = want / reading.mfu / 2
  assert rates == {'float32': pytest.approx(19.5e12),  # No TF32 on a CPU.
                   'bfloat16': pytest.approx(312e12)}


@pytest.mark.slow
def test_stages_count_each_stage_on_its_own_device():
  deployed = _trained(_convnet, num_clones=1, num_stages=2)
  cost = readings.step_cost(deployed.step_function)
  assert len(cost.compute_devices()) == 2
  assert sum(cost.flops.values()) == pytest.approx(
      flops_lib.step_flops(deployed.model, ROWS))


def test_mfu_is_the_flops_a_second_over_the_devices_peak():
  deployed = _trained(_convnet, num_clones=2)
  meter = readings.Meter(deployed.step_function, ROWS,
                         kind=device_kinds.peak_rate('2G'))
  reading = meter.reading(seconds=3.0, steps=4)
  want = flops_lib.step_flops(deployed.model, ROWS)
  assert reading.step_time == 0.75
  assert reading.examples_per_sec == ROWS / 0.75
  assert reading.mfu == pytest.approx(want / 0.75 / (2 * 2e9))
  assert reading.tokens_per_sec is None
  assert readings.Meter(deployed.step_function, ROWS).reading(
      1.0, 1).mfu is None  # A CPU has no known peak: none given, none shown.
  # Over the devices the run computes on, not only those with matmuls.
  over_four = readings.Meter(deployed.step_function, ROWS, devices=4,
                             kind=device_kinds.peak_rate('2G'))
  assert over_four.reading(3.0, 4).mfu == pytest.approx(reading.mfu / 2)


def test_gpus_planned_here_are_the_compute_devices_at_their_tf32_rate():
  """Traced for two GPUs this machine lacks, central variables on the
  CPU: the GPUs compute, and a float32 step's peak is the kind's TF32."""
  config = placement.DeploymentConfig(num_clones=2)
  with plans.planning():
    with config.variables_scope():
      model = _convnet()
    with tf.device(config.optimizer_variables_device()):
      optimizer = keras.optimizers.SGD(0.1)
    deployed = towers.deploy(config, model, make_loss(), optimizer)
    graph = deployed.traced_step(*_batch(model)).graph
  cost = readings.cost_of(graph)
  assert cost.compute_devices() == ['/device:GPU:0', '/device:GPU:1']
  assert sum(cost.flops.values()) == pytest.approx(
      flops_lib.step_flops(model, ROWS))
  assert readings.rate_dtype('float32', '/device:GPU:0') == 'tf32'
  assert readings.rate_dtype('float32', '/device:CPU:0') == 'float32'
  assert device_kinds.KINDS['a100'].rate('tf32') == 156e12


@pytest.mark.parametrize('kind, dtype, rate', [
    ('a100', 'bfloat16', 312e12), ('a100', 'float32', 19.5e12),
    ('h100', 'float16', 989.4e12), ('t4', 'bfloat16', 8.1e12),
    ('v100', 'tf32', 15.7e12)])
def test_a_kinds_rate_follows_the_compute_dtype(kind, dtype, rate):
  # A dtype a kind lacks runs at its float32 rate.
  assert device_kinds.KINDS[kind].rate(dtype) == rate


@pytest.mark.parametrize('name, kind', [
    ('NVIDIA H100 80GB HBM3', 'h100'), ('NVIDIA A100-SXM4-40GB', 'a100_40gb'),
    ('NVIDIA A100-SXM4-80GB', 'a100'), ('NVIDIA L4', 'l4'),
    ('NVIDIA L40S', 'l40s'), ('Tesla T4', 't4'),
    ('Tesla V100-SXM2-16GB', 'v100_16gb'), ('NVIDIA A10G', 'a10g'),
    ('NVIDIA GeForce RTX 4090', None)])
def test_a_gpus_own_name_tells_its_kind(name, kind):
  assert device_kinds.kind_of(name) == kind


def test_a_peak_is_a_rate_or_a_kind_and_nothing_else():
  assert device_kinds.peak_rate('312T').rate('bfloat16') == 312e12
  assert device_kinds.peak_rate('1.5e14').rate('float32') == 1.5e14
  assert device_kinds.peak_rate('900G').rate('float16') == 900e9
  assert device_kinds.peak_rate('L4') is device_kinds.KINDS['l4']
  assert device_kinds.peak_rate(None) is None
  for bad in ('fast', '0', '-3T', '12X'):
    with pytest.raises(errors.ConfigError,
                       match=f'device_peak_flops={bad}: give a rate'):
      device_kinds.peak_rate(bad)


def test_memory_is_the_process_and_each_devices_plan_on_logical_cpus():
  deployed = _trained(_convnet, num_clones=2)
  process, *planned = readings.Meter(deployed.step_function,
                                     ROWS).memory()
  assert process.device == readings.PROCESS and not process.planned
  assert 0 < process.in_use <= process.peak < process.total
  assert [m.device for m in planned] == ['/device:CPU:0', '/device:CPU:1']
  assert all(m.planned and m.peak > 0 and m.in_use is None
             for m in planned)
  text = readings.Reading(0.5, 32.0, None, None, (process, *planned)).text()
  assert 'process' in text and 'CPU:1' in text and 'planned peak' in text


@pytest.mark.parametrize('inputs, positions', [
    (np.zeros((4, 7), np.int32), 7),  # A language model's token ids.
    ({'token_ids': np.zeros((4, 9), np.int32),
      'padding_mask': np.ones((4, 9), bool)}, 9),  # keras-hub's.
    (np.zeros((4, 7), np.float32), None),  # Features.
    (np.zeros((4, 8, 8, 3), np.float32), None),  # Images.
    ({'user': np.zeros((4, 3), np.int32),
      'item': np.zeros((4, 5), np.int32)}, None),  # Ids, not tokens.
    ((np.zeros((4, 7), np.int32), np.zeros((4, 7), np.int32)), None)])
def test_tokens_are_counted_only_where_the_input_is_tokens(inputs,
                                                            positions):
  tensors = tf.nest.map_structure(tf.constant, inputs)
  assert readings.tokens_per_row(tensors) == positions


def test_each_gpu_reports_its_own_memory_of_its_size(monkeypatch):
  """GPUs (traced for, none here): each device's figure is the runtime's
  own, as a share of `device_memory`; no planned figure stands in."""
  asked = []

  def memory_info(device):
    asked.append(device)
    return {'current': 2 * 2**30, 'peak': 4 * 2**30}
  monkeypatch.setattr(tf.config.experimental, 'get_memory_info',
                      memory_info)
  cost = readings.StepCost({'/device:GPU:0': 10, '/device:GPU:1': 10,
                            '/device:CPU:0': 1}, {'/device:GPU:0': 5})
  memory = readings.memory_of(cost, device_kinds.memory_bytes('80GB'))
  assert asked == ['/device:GPU:0', '/device:GPU:1']
  assert [m.text() for m in memory] == [
      'GPU:0 2.00 GiB in use, 4.00 GiB peak (5.0%)',
      'GPU:1 2.00 GiB in use, 4.00 GiB peak (5.0%)']
  logs = readings.Reading(1.0, 8.0, None, None, tuple(memory)).logs()
  assert (logs['memory_gib'], logs['memory_peak_gib']) == (2.0, 4.0)
