"""Tests for tfmulti.devices: logical CPUs, clone placement, checks."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tests.helpers import REPO
from tfmulti import devices
from tfmulti import errors

FAKE_GPU = tf.config.PhysicalDevice('/physical_device:GPU:0', 'GPU')


class TestLogicalCpus:

  def test_existing_devices_are_a_no_op(self):
    devices.create_logical_cpus(2)
    assert len(tf.config.list_logical_devices('CPU')) == 8

  def test_too_late_says_so(self):
    with pytest.raises(RuntimeError, match='already initialised with 8'):
      devices.create_logical_cpus(16)

  def test_bad_count(self):
    with pytest.raises(errors.ConfigError, match='count=0'):
      devices.create_logical_cpus(0)


_SHARE = """
import os, sys
import tensorflow as tf
from tfmulti import devices
devices.create_logical_cpus(2)
if sys.argv[1] == 'started':  # The runtime starts with TensorFlow's pool.
  tf.config.list_logical_devices()
print(devices.share_cores(1), devices.share_cores(2),
      tf.config.threading.get_intra_op_parallelism_threads())
"""


def _share_in_a_new_process(how, **env):
  """What a fresh process's `share_cores(1)`, `share_cores(2)` and pool
  are, `how`: 'fresh', or 'started' (its runtime started first)."""
  result = subprocess.run(
      [sys.executable, '-c', _SHARE, how], cwd=REPO, capture_output=True,
      text=True, timeout=120, check=True, env=dict(os.environ, **env))
  return result.stdout.split()


class TestShareCores:
  """The threads an op splits over, sized to the clones' share."""

  @pytest.mark.slow
  def test_a_fresh_process_gives_the_clones_their_share(self):
    # One clone keeps TensorFlow's own pool (0: all cores); two share them
    # (on one core, one thread is all an op had anyway).
    share = str(devices.cores() // 2) if devices.cores() > 1 else 'None'
    assert _share_in_a_new_process('fresh') == [
        'None', share, share.replace('None', '0')]

  @pytest.mark.slow
  def test_a_started_runtime_or_a_set_pool_stays(self):
    assert _share_in_a_new_process('started') == ['None', 'None', '0']
    # TensorFlow reads the variable where the pool is not set: it stays.
    assert _share_in_a_new_process(
        'fresh', TF_NUM_INTRAOP_THREADS='3') == ['None', 'None', '0']

  def test_a_pool_set_already_stays(self):
    pool = tf.config.threading.get_intra_op_parallelism_threads()
    assert devices.share_cores(devices.cores() * 2) is None
    assert tf.config.threading.get_intra_op_parallelism_threads() == pool


class TestPlaceClones:
  """The command line's placement, decided from physical devices only."""

  @pytest.fixture(autouse=True)
  def no_runtime_listing(self, monkeypatch):
    # Listing logical devices initialises TensorFlow, after which logical
    # CPUs (and a multi-worker strategy) can no longer be configured.
    def initialises(*args):
      raise AssertionError('place_clones listed logical devices')
    monkeypatch.setattr(tf.config, 'list_logical_devices', initialises)

  def _gpus(self, monkeypatch, count):
    physical = tf.config.list_physical_devices
    monkeypatch.setattr(
        tf.config, 'list_physical_devices',
        lambda kind=None: [FAKE_GPU] * count if kind == 'GPU'
        else physical(kind))

  def test_one_clone_without_a_gpu_runs_on_the_cpu(self, monkeypatch,
                                                   caplog):
    self._gpus(monkeypatch, 0)
    with caplog.at_level('INFO', logger='absl'):
      assert devices.place_clones(1, clone_on_cpu=False) is True
    assert 'no GPU found: the clone runs on the CPU (CPU:0)' in caplog.text

  def test_clones_on_gpus_when_there_are_enough(self, monkeypatch):
    self._gpus(monkeypatch, 2)
    assert devices.place_clones(2, clone_on_cpu=False) is False
    assert devices.place_clones(2, clone_on_cpu=False,
                                variables_gpu=1) is False

  def test_clone_on_cpu_creates_the_logical_cpus(self, monkeypatch):
    self._gpus(monkeypatch, 2)
    assert devices.place_clones(3, clone_on_cpu=True, variables_gpu=0)

  @pytest.mark.parametrize('gpus, kwargs, message', [
      (0, dict(num_clones=2), '--num_clones=2 needs 2 GPUs, and this '
       'machine has 0; add --clone_on_cpu'),
      (2, dict(num_clones=3), '--num_clones=3 needs 3 GPUs, and this '
       'machine has 2'),
      (3, dict(num_clones=2, num_stages=2), '--num_clones=2 --num_stages=2 '
       'needs 4 GPUs, and this machine has 3'),
      (2, dict(num_clones=1, variables_gpu=2),
       r'--variables_device=gpu:2: this machine has 2 GPU\(s\); use '
       '--variables_device=cpu or gpu:N with N < 2'),
  ])
  def test_too_few_gpus_say_what_to_do(self, monkeypatch, gpus, kwargs,
                                       message):
    self._gpus(monkeypatch, gpus)
    num_clones = kwargs.pop('num_clones')
    with pytest.raises(errors.DeviceError, match=message):
      devices.place_clones(num_clones, clone_on_cpu=False, **kwargs)


def _upstream(tensor):
  """Every op `tensor` reads from in its graph (by data, as TF's walk at a
  custom gradient goes)."""
  seen, frontier = set(), [tensor.op]
  while frontier:
    op = frontier.pop()
    if op.name not in seen:
      seen.add(op.name)
      frontier += [t.op for t in op.inputs]
  return seen


@pytest.mark.parametrize('collective', [False, True])
def test_a_collective_strategys_all_reduce_reads_only_its_replica(collective):
  """What keeps synchronized BatchNorm's trace linear: under the lockstep
  strategy a replica's all-reduced value depends on its own input alone
  (a reduction onto one device reads every replica's), so the gradient
  walk TF makes at each all-reduce stays local. Two such strategies live
  in one process (their collective keys differ)."""
  from tfmulti import deploy
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  make = devices.collective_strategy if collective else (
      devices.mirrored_strategy)
  for strategy in (make(config), make(config)):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group + 1)))
    inputs = []

    def replica_fn(value, inputs=inputs):
      x = tf.identity(value, name='replica_input')
      inputs.append(x.op.name)
      return tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, x)

    @tf.function
    def step(values, strategy=strategy):
      return strategy.run(replica_fn, args=(values,))
    outputs = step.get_concrete_function(values).structured_outputs
    first = strategy.experimental_local_results(outputs)[0]
    reached = [name for name in inputs if name in _upstream(first)]
    assert len(reached) == (1 if collective else 2)
    assert [float(v) for v in strategy.experimental_local_results(
        step(values))] == [3.0, 3.0]
