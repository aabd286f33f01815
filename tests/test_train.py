"""End-to-end tests of train.py: every model and dataset, metrics, bad flags."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow_datasets as tfds
from absl import flags
from absl.testing import flagsaver

import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC_KEYS = {'eval_accuracy', 'train_loss', 'steps', 'images_per_sec',
               'strategy', 'num_clones', 'global_batch_size', 'model',
               'dataset', 'seed'}


@pytest.fixture
def run_train(tmp_path, digits_dir):
  """Runs train.main in-process with flags; returns metrics.json."""
  def run(**flag_values):
    model_dir = tmp_path / 'run'
    values = dict(model_dir=str(model_dir), data_dir=digits_dir,
                  clone_on_cpu=True, train_steps=2, batch_size=4,
                  log_every_steps=1)
    values.update(flag_values)
    with flagsaver.flagsaver(**values):
      train.main(['train.py'])
    return json.loads((model_dir / 'metrics.json').read_text())
  return run


@pytest.mark.parametrize('model', ['lenet', 'resnet18', 'resnet20'])
@pytest.mark.parametrize('num_clones', [1, 2])
def test_each_model_trains(run_train, model, num_clones):
  metrics = run_train(model=model, num_clones=num_clones, train_steps=1,
                      batch_size=2)
  assert metrics['model'] == model
  assert metrics['steps'] == 1
  assert metrics['num_clones'] == num_clones
  assert metrics['global_batch_size'] == 2 * num_clones
  assert 0.0 <= metrics['eval_accuracy'] <= 1.0


@pytest.mark.parametrize('dataset', ['digits', 'mnist', 'fashion_mnist',
                                     'cifar10', 'synthetic'])
@pytest.mark.parametrize('num_clones', [1, 2])
def test_each_dataset_trains(run_train, dataset, num_clones):
  with tfds.testing.mock_data(num_examples=16):  # Only TFDS's own sets.
    metrics = run_train(dataset=dataset, num_clones=num_clones,
                        batch_size=32 if dataset == 'synthetic' else 4)
  assert metrics['dataset'] == dataset
  assert metrics['steps'] == 2
  assert METRIC_KEYS <= set(metrics)


def test_digits_learns(run_train):
  metrics = run_train(num_clones=2, train_steps=None, epochs=15,
                      batch_size=64, log_every_steps=50)
  assert metrics['eval_accuracy'] >= 0.9
  assert metrics['train_loss'] < 0.5
  assert metrics['strategy'] == 'towers'
  assert metrics['global_batch_size'] == 128
  assert metrics['steps'] == 15 * (1437 // 128)


@pytest.mark.parametrize('strategy', ['mirrored', 'single'])
def test_distribute_paths_share_the_contract(run_train, strategy):
  metrics = run_train(strategy=strategy, num_clones=2)
  assert metrics['strategy'] == strategy
  assert metrics['global_batch_size'] == 8
  assert METRIC_KEYS <= set(metrics)


def test_batch_norm_model_learns_on_every_path(run_train):
  accuracy = {}
  for strategy in ('towers', 'mirrored', 'single'):
    accuracy[strategy] = run_train(
        strategy=strategy, model='resnet8_thin', num_clones=2, batch_size=32,
        train_steps=None, epochs=12, optimizer='momentum',
        learning_rate=0.05, log_every_steps=100)['eval_accuracy']
  # Chance is 0.1. The paths' accuracies differ more than the issue's "a few
  # points" (towers normalise each clone's shard); see the README.
  assert min(accuracy.values()) >= 0.6, accuracy


@pytest.mark.parametrize('values, message', [
    (dict(num_clones=2, clone_on_cpu=False),
     '--num_clones=2 needs as many GPUs.*add --clone_on_cpu'),
    (dict(variables_device='gpu:3'),
     '--variables_device=gpu:3: this machine has 0 GPU'),
    (dict(strategy='mirrored', xla=True),
     "xla=True works with the towers only, not strategy='mirrored'"),
])
def test_conflicting_flags_stop_with_one_line(tmp_path, values, message):
  with flagsaver.flagsaver(model_dir=str(tmp_path / 'run'), **values):
    with pytest.raises(SystemExit, match=message):
      train.main(['train.py'])
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('name, value', [
    ('num_clones', 0), ('batch_size', -1), ('learning_rate', 0.0),
    ('epochs', 0), ('train_steps', 0), ('model', 'vgg'),
    ('dataset', 'imagenet'), ('variables_device', 'tpu:0'),
    ('strategy', 'ring'),
])
def test_bad_flag_values_are_refused(name, value):
  with flagsaver.flagsaver():  # Parsing sets flags; restore them after.
    with pytest.raises(flags.IllegalFlagValueError,
                       match=f'--{name}={value}'):
      flags.FLAGS(['train.py', f'--{name}={value}'])


@pytest.mark.parametrize('argv, message', [
    (['--num_clones=0'], '--num_clones=0'),
    (['--model=vgg'], '--model'),
    (['--num_clones=3'], '--num_clones=3 needs as many GPUs'),
])
def test_bad_flags_exit_without_traceback(argv, message, tmp_path):
  result = subprocess.run(
      [sys.executable, 'train.py', f'--model_dir={tmp_path}/run'] + argv,
      cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode != 0
  assert message in result.stderr
  assert 'Traceback' not in result.stderr
