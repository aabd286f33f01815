"""Test setup: 4 logical CPU devices and soft placement off.

Both must happen before TensorFlow initialises its runtime, so they run when
pytest loads this file, before any test module imports TensorFlow code.
With soft placement off an op pinned to a device that does not exist fails
loudly instead of falling back to CPU:0.
"""

import os

import pytest

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from tfmulti import devices  # pylint: disable=g-import-not-at-top

NUM_LOGICAL_CPUS = 4

devices.create_logical_cpus(NUM_LOGICAL_CPUS)
tf.config.set_soft_device_placement(False)
tf.config.list_logical_devices()  # Initialises the runtime with them now.


def pytest_configure(config):
  del config  # Unused.
  # absl FlagHolders and flagsaver refuse to work before flags are parsed.
  flags.FLAGS.mark_as_parsed()


@pytest.fixture(scope='session')
def digits_dir(tmp_path_factory):
  """A TFDS data_dir in which digits is prepared once per session."""
  return str(tmp_path_factory.mktemp('tfds'))
