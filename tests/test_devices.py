"""Tests for tfmulti.devices: logical CPUs, clone placement, checks."""

import pytest
import tensorflow as tf

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
