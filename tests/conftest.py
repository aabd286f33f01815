"""Test setup: 8 logical CPU devices and soft placement off.

Both must happen before TensorFlow initialises its runtime, so they run when
pytest loads this file, before any test module imports TensorFlow code.
With soft placement off an op pinned to a device that does not exist fails
loudly instead of falling back to CPU:0.
"""

import json
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from absl import flags  # noqa: E402
from absl.testing import flagsaver  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti import devices  # noqa: E402

NUM_LOGICAL_CPUS = 8  # 8 clones, or 4 clones of 2 stages.

devices.create_logical_cpus(NUM_LOGICAL_CPUS)
tf.config.set_soft_device_placement(False)
if os.environ.get('PYTEST_XDIST_WORKER_COUNT'):
  # Each pytest-xdist worker gets its share of the cores for the ops'
  # own threads, instead of every worker using them all at once.
  tf.config.threading.set_intra_op_parallelism_threads(max(
      1, devices.cores() // int(os.environ['PYTEST_XDIST_WORKER_COUNT'])))
tf.config.list_logical_devices()  # Initialises the runtime with them now.


@pytest.fixture(autouse=True)
def _no_launcher_around(monkeypatch):
  """No test sees the Slurm step or Kubernetes pod that may run the suite:
  `--cluster=auto` would read them."""
  for key in list(os.environ):
    if key.startswith('SLURM_') or key == 'JOB_COMPLETION_INDEX':
      monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _op_determinism_off_after():
  """`reproducible_rows` turns op determinism on and Grappler's remapper
  off for the whole process (`devices.same_kernels_everywhere`); the next
  test starts without either."""
  yield
  import tensorflow as tf
  from tensorflow.python.framework import config as tf_config
  tf_config.disable_op_determinism()
  tf.config.optimizer.set_experimental_options({'remapping': True})


def pytest_configure(config):
  del config  # Unused.
  # absl FlagHolders and flagsaver refuse to work before flags are parsed.
  flags.FLAGS.mark_as_parsed()


@pytest.fixture(scope='session')
def digits_dir(tmp_path_factory):
  """A TFDS data_dir in which digits is prepared once per session."""
  return str(tmp_path_factory.mktemp('tfds'))


@pytest.fixture
def run_train(tmp_path, digits_dir):
  """Runs the command line's main in-process with flags; returns metrics.

  Tiny by default: 2 steps of 4 rows per clone on logical CPUs, writing to
  a fresh directory under `tmp_path` unless `model_dir` is given (a
  directory with checkpoints resumes), without the export (test_export.py
  asks for it).
  """
  from tfmulti import cli  # Defines the flags.
  runs = []

  def run(**flag_values):
    runs.append(len(runs))
    values = dict(model_dir=str(tmp_path / f'run{len(runs)}'),
                  data_dir=digits_dir,
                  clone_on_cpu=True, train_steps=2, batch_size=4,
                  log_every_steps=1, export=False)
    values.update(flag_values)
    with flagsaver.flagsaver(**values):
      cli.main(['train.py'])
    with open(os.path.join(values['model_dir'], 'metrics.json')) as f:
      return json.load(f)
  return run
