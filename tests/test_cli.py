"""End-to-end tests of the command line: models, datasets, signals, flags."""

import gc
import json
import math
import random
import re
import signal
import subprocess
import sys
import time

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tests.data import tfds_store
from tests.data.test_tfrecords import write_records
from tests.helpers import assert_same_checkpoints
from tests.helpers import CHATTER
from tests.helpers import checkpoint_tensors
from tests.helpers import REPO
from tfmulti import cli
from tfmulti import data
from tfmulti import models

SUBPROCESS_TIMEOUT_S = 240  # A train.py run here takes 5 to 20 seconds.
METRIC_KEYS = {'eval_accuracy', 'train_loss', 'steps', 'images_per_sec',
               'strategy', 'num_clones', 'global_batch_size', 'model',
               'dataset', 'seed'}


# resnet18 trains through the towers in test_models.py: its evaluation here
# would take most of this file's time.
@pytest.mark.parametrize('model, num_clones', [
    pytest.param('lenet', 1, marks=pytest.mark.slow),
    pytest.param('lenet', 2, marks=pytest.mark.slow),
    pytest.param('resnet20', 1, marks=pytest.mark.slow),
    pytest.param('resnet8_thin', 2, marks=pytest.mark.slow)])
def test_each_model_trains(run_train, model, num_clones):
  metrics = run_train(model=model, num_clones=num_clones, train_steps=1,
                      batch_size=32)  # Evaluates in 360 / (32 * N) batches.
  assert metrics['model'] == model
  assert metrics['steps'] == 1
  assert metrics['num_clones'] == num_clones
  assert metrics['global_batch_size'] == 32 * num_clones
  # It trained the model named, whole: its checkpoint holds every value of
  # the registry's model on digits' 28x28x1 images.
  saved = checkpoint_tensors(metrics['checkpoint'],
                             ('model/', 'optimizer/_trainable_variables/'))
  assert sum(value.size for value in saved.values()) == models.get_model(
      model, input_shape=(28, 28, 1), num_classes=10).count_params()


@pytest.mark.slow
@pytest.mark.parametrize('schedule, virtual_stages, chunk_devices', [
    ('1f1b', 1, [0, 1]), ('gpipe', 1, [0, 1]), ('zb_h1', 1, [0, 1]),
    ('interleaved_1f1b', 2, [0, 1, 0, 1]), ('zb_v', 1, [0, 1, 1, 0])])
def test_every_pipeline_schedule_trains_through_the_command_line(
    run_train, caplog, schedule, virtual_stages, chunk_devices):
  """2 clones x 2 stages x 4 micro-batches under each schedule; the log
  places each stage (each chunk: 4 under interleaved 1F1B, chunk c of
  clone i on stage device c mod 2 of that clone; 4 in a V under ZB-V)."""
  with caplog.at_level('INFO', logger='absl'):
    metrics = run_train(num_clones=2, num_stages=2, num_microbatches=4,
                        pipeline_schedule=schedule,
                        virtual_stages=virtual_stages, batch_size=8)
  assert (metrics['steps'], metrics['num_stages'],
          metrics['num_microbatches']) == (2, 2, 4)
  assert math.isfinite(metrics['train_loss'])
  placed = re.findall(r"stage (\d+): from layer '\w+', on \[(.*)\]",
                      caplog.text)
  assert [int(s) for s, _ in placed] == list(range(len(chunk_devices)))
  for chunk, devices_ in placed:
    d = chunk_devices[int(chunk)]
    assert devices_ == f"'/device:CPU:{d}', '/device:CPU:{2 + d}'"


@pytest.mark.slow
def test_steps_per_loop_trains_the_bits_of_one_step_a_call(run_train):
  """7 steps, a progress line every 5: calls of 1, 3 and 1 steps to the
  line, then 2; the checkpoint equals one step a call's, bit for bit, and
  metrics.json records N."""
  looped = run_train(steps_per_loop='3', train_steps=7, log_every_steps=5)
  one = run_train(steps_per_loop='1', train_steps=7, log_every_steps=5)
  assert (looped['steps_per_loop'], one['steps_per_loop']) == (3, 1)
  assert looped['steps'] == 7
  assert_same_checkpoints(looped['checkpoint'], one['checkpoint'],
                          exact=True)


@pytest.mark.slow
def test_zb_v_through_the_command_line_equals_one_device(run_train):
  """2 clones x 2 stage devices x 4 chunks of LeNet in a V, 4 micro-batches:
  the checkpoint of 3 steps equals one device's on the same 16 rows a step
  (to 1e-5)."""
  got = run_train(num_clones=2, num_stages=2, num_microbatches=4,
                  pipeline_schedule='zb_v', batch_size=8, train_steps=3)
  one = run_train(batch_size=16, train_steps=3)
  assert got['global_batch_size'] == one['global_batch_size'] == 16
  assert_same_checkpoints(got['checkpoint'], one['checkpoint'])


@pytest.mark.parametrize('dataset, num_clones', [
    pytest.param('digits', 1, marks=pytest.mark.slow), ('synthetic', 1)] + [
        pytest.param(name, 2, marks=pytest.mark.slow)
        for name in ('digits', 'mnist', 'fashion_mnist', 'cifar10',
                     'synthetic')])
def test_each_dataset_trains(run_train, tmp_path, dataset, num_clones):
  values = {}
  if dataset in data.DOWNLOADABLE:  # A copy of TFDS's own, written here.
    builder = tfds.builder(dataset)
    tfds_store.store(dataset, tmp_path / 'tfds',
                     features=builder.info.features, version=builder.version,
                     rows={'train': 16, 'test': 8})
    values['data_dir'] = str(tmp_path / 'tfds')
  metrics = run_train(dataset=dataset, num_clones=num_clones,
                      batch_size=32 if dataset == 'synthetic' else 4,
                      **values)
  assert metrics['dataset'] == dataset
  assert metrics['steps'] == 2
  assert METRIC_KEYS <= set(metrics)


@pytest.mark.slow
def test_a_pipelined_clone_learns_digits(run_train, caplog):
  with caplog.at_level('INFO', logger='absl'):
    metrics = run_train(num_stages=2, num_microbatches=4, train_steps=None,
                        epochs=8, batch_size=64, log_every_steps=50)
  assert metrics['eval_accuracy'] >= 0.9
  assert metrics['global_batch_size'] == 64
  assert "stage 1: from layer" in caplog.text
  assert "['/device:CPU:1']" in caplog.text


@pytest.mark.slow
def test_digits_learns(run_train):
  metrics = run_train(num_clones=2, train_steps=None, epochs=8,
                      batch_size=64, log_every_steps=50)
  assert metrics['eval_accuracy'] >= 0.9
  assert metrics['train_loss'] < 0.5
  assert metrics['strategy'] == 'towers'
  assert metrics['global_batch_size'] == 128
  assert metrics['steps'] == 8 * (1437 // 128)


@pytest.mark.slow
@pytest.mark.parametrize('strategy', ['mirrored', 'single'])
def test_distribute_paths_share_the_contract(run_train, strategy):
  metrics = run_train(strategy=strategy, num_clones=2)
  assert metrics['strategy'] == strategy
  assert metrics['global_batch_size'] == 8
  assert METRIC_KEYS <= set(metrics)


@pytest.mark.slow
def test_batch_norm_model_learns_alike_on_every_path(run_train):
  # Mirrored equals the towers to 1e-5 step for step on a BatchNorm model
  # (tests/distribute/test_distributed_model.py); here the towers and one
  # device, trained
  # alike, must end alike.
  accuracy = {}
  for strategy in ('towers', 'single'):
    accuracy[strategy] = run_train(
        strategy=strategy, model='resnet8_thin', num_clones=2, batch_size=32,
        train_steps=None, epochs=4, optimizer='adam', learning_rate=0.008,
        lr_schedule='cosine', log_every_steps=100)['eval_accuracy']
  # Chance is 0.1. The paths run the same algorithm
  # (tests/distribute/test_distributed_model.py)
  # and part only by float rounding, which training amplifies; the cosine
  # decay settles the weights, so the final accuracy is not one noisy step's.
  assert min(accuracy.values()) >= 0.85, accuracy
  assert max(accuracy.values()) - min(accuracy.values()) <= 0.04, accuracy


@pytest.mark.slow
def test_the_plain_command_runs_one_clone_on_the_cpu(run_train, caplog,
                                                     tmp_path):
  """`python train.py` on a machine without a GPU: one clone, on CPU:0."""
  caplog.set_level('INFO', logger='absl')
  model_dir = str(tmp_path / 'plain')
  metrics = run_train(clone_on_cpu=False, batch_size=64, model_dir=model_dir)
  assert metrics['clone_devices'] == ['/device:CPU:0']
  assert metrics['variables_device'] == '/device:CPU:0'
  assert 'no GPU found: the clone runs on the CPU (CPU:0)' in caplog.text
  # The first step's tracing is announced, then timed, not silent.
  lines = caplog.text.splitlines()
  tracing = [i for i, line in enumerate(lines)
             if line.endswith('tracing the step (its first call builds the '
                              'graph)')]
  took = [i for i, line in enumerate(lines)
          if re.search(r'tracing the step .*: done in \d+\.\d s', line)]
  assert len(tracing) == len(took) == 1 and tracing[0] < took[0]
  assert f'writing to {model_dir}' in caplog.text


@pytest.mark.parametrize('values, message', [
    (dict(num_clones=2, clone_on_cpu=False),
     '--num_clones=2 needs 2 GPUs.*add --clone_on_cpu'),
    (dict(variables_device='gpu:3'),
     '--variables_device=gpu:3: this machine has 0 GPU'),
    (dict(variables_device='tpu:0'), "--variables_device=tpu:0: use 'cpu'"),
    (dict(variables_device='spread', strategy='mirrored', num_clones=2,
          clone_on_cpu=True),
     "variables_device='spread' spreads the towers' variables over their "
     "clones; strategy='mirrored' places its own"),
    (dict(gradient_packs='-1'), "gradient_packs='-1': use 'auto'"),
    (dict(strategy='mirrored', xla=True),
     "xla=True is not available with strategy='mirrored'; use "
     '--strategy=towers'),
    (dict(model='resnet8_thin', sync_batch_norm=True, xla=True),
     'xla=True cannot be combined with sync_batch_norm=True'),
    (dict(num_workers=2),
     '--num_workers and --worker_index describe a multi-worker job'),
    (dict(strategy='multi_worker'),
     'strategy=multi_worker needs a cluster, and --cluster=auto found none'),
    (dict(strategy='multi_worker', cluster='slurm'),
     'SLURM_PROCID is not set: --cluster=slurm reads it'),
    (dict(strategy='multi_worker', cluster='indexed_job',
          worker_hosts='h:1'), 'JOB_COMPLETION_INDEX is not set'),
    (dict(peer_timeout_s=0.0), 'peer_timeout_s=0.0: must be a finite'),
    (dict(learning_rate=float('inf')), 'learning_rate=inf: must be a finite'),
    (dict(sync_batch_norm=True, strategy='mirrored'),
     "model='lenet' has no BatchNorm"),
    (dict(num_clones=0), 'num_clones=0: must be an integer >= 1'),
    (dict(num_clones=0, clone_on_cpu=True),
     'num_clones=0: must be an integer >= 1'),
    (dict(batch_size=-1), 'batch_size=-1: must be an integer >= 1'),
    (dict(learning_rate=0.0), 'learning_rate=0.0: must be a finite'),
    (dict(epochs=0), 'epochs=0: must be an integer >= 1'),
    (dict(train_steps=0), 'train_steps=0: must be an integer >= 1'),
    (dict(seed=2**32), 'seed=4294967296: must be below 2\\*\\*32'),
    (dict(model_dir=''), "model_dir='': name an output directory"),
    (dict(data_dir='/dev/null'), '--data_dir=/dev/null is a file'),
    (dict(num_stages=2, strategy='mirrored', clone_on_cpu=True),
     r"strategy='mirrored' runs whole model copies; stages \(num_stages=2\)"),
    (dict(num_stages=2, xla=True, clone_on_cpu=True),
     'xla=True runs whole clones; it cannot run a clone cut into stages'),
    (dict(num_microbatches=2, model='resnet8_thin', sync_batch_norm=True),
     'sync_batch_norm=True runs whole clones'),
    (dict(num_microbatches=5, batch_size=4),
     'num_microbatches=5 is more than the 4 rows of clone 0'),
    (dict(reproducible_rows=7, batch_size=32),
     r'reproducible_rows=7: a batch of 32 rows on a worker is not 1 '
     r'accumulation step\(s\) of whole atoms of 7 rows; give every batch a '
     r'multiple of 7 rows \(a last, partial batch too\)\.$'),
    (dict(num_clones=2, clone_on_cpu=True, clone_shares=['100', '1'],
          batch_size=4),
     'a batch of 8 rows leaves clone 1 of 2 no rows'),
    (dict(num_stages=0), 'num_stages=0: must be an integer >= 1'),
    # Settings that one stage would ignore.
    (dict(stage_boundaries=['dense']),
     r"stage_boundaries=\('dense',\) says how to cut a clone into stages, "
     'and num_stages=1 makes none: set num_stages=2'),
    (dict(recompute=True), 'recompute=True says how to cut a clone'),
    (dict(num_stages=2, clone_on_cpu=True, virtual_stages=2),
     "virtual_stages=2 gives each device several chunks of the model, which "
     "only pipeline_schedule='interleaved_1f1b' runs"),
    (dict(num_stages=2, clone_on_cpu=True,
          pipeline_schedule='interleaved_1f1b', virtual_stages=2,
          num_microbatches=3),
     "num_microbatches=3: 'interleaved_1f1b' runs micro-batches in groups"),
    (dict(num_stages=4, clone_on_cpu=True,
          pipeline_schedule='interleaved_1f1b', virtual_stages=3,
          num_microbatches=4),
     "virtual_stages=3: 4 stages of 3 chunks cut 'lenet' into 12 chunks"),
    (dict(stage_costs='measured'), "stage_costs='measured' says how to cut"),
    (dict(image_size=['32']), '--image_size=32: give HEIGHT,WIDTH in pixels'),
    (dict(image_size=['0', '8']), 'image_size=0: must be an integer >= 1'),
    (dict(model='keras.applications.MobileNetV2', image_size=['16', '16']),
     r'cannot take images of shape \(16, 16, 1\)'),
    (dict(augment=['flip', 'rotate']),
     r"augment='rotate': choose one of \('flip', 'crop'\)"),
    (dict(label_offset=-1), 'label_offset=-1: must be an integer >= 0'),
    (dict(shard_files=True), '--shard_files shares files out over the '
     "workers of --strategy=multi_worker; strategy='towers' reads every "
     'row'),
    (dict(weights='/nonexistent.weights.h5'),
     '--weights=/nonexistent.weights.h5: no such file'),
    (dict(num_classes=1), 'num_classes=1: must be an integer >= 2'),
    (dict(dataset='tfrecord:'), '--dataset=tfrecord: names nothing after '
     'the colon; name what to read, e.g. '
     '--dataset=tfrecord:/data/imagenet/train-\\*'),
    (dict(dataset='tfrecord:/nonexistent/train-*'),
     r'--dataset=tfrecord:/nonexistent/train-\*: no file matches'),
    (dict(batch_norm_momentum=1.5, model='resnet8_thin'),
     r'--batch_norm_momentum=1.5: give a momentum in \[0, 1\)'),
    (dict(batch_norm_momentum=0.9),
     "--batch_norm_momentum=0.9: model 'lenet' has no BatchNormalization"),
    (dict(steps_per_loop='many'), "--steps_per_loop=many: give a number of "
     "steps, e.g. 20, or 'auto'"),
    (dict(steps_per_loop='0'), 'steps_per_loop=0: must be an integer >= 1'),
    (dict(steps_per_loop='4', clone_shares=['auto']),
     'steps_per_loop=4 with clone_shares=auto: the balancer times'),
])
def test_bad_flags_stop_with_one_line(tmp_path, values, message):
  values = dict(dict(model_dir=str(tmp_path / 'run')), **values)
  with flagsaver.flagsaver(**values):
    with pytest.raises(SystemExit, match=message) as refused:
      cli.main(['train.py'])
  assert '\n' not in str(refused.value) and len(str(refused.value)) < 300
  assert not (tmp_path / 'run').exists()


# A user's module of model functions that cannot train.
_USER_MODULE = """
import keras


def nothing(input_shape, num_classes):
  return None


def three_outputs(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  return keras.Model(inputs, keras.layers.Dense(3)(
      keras.layers.Flatten()(inputs)))


def broken(input_shape, num_classes):
  raise RuntimeError('a bug in my model')
"""


def _image_folder(folder, *, classes=2, sizes=((8, 8),), per_class=3):
  """`--dataset=folder:...` of small grey PNGs, the sizes taken in turn."""
  pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 1), np.uint8)
  for label in range(classes):
    for index in range(per_class):
      height, width = sizes[index % len(sizes)]
      path = folder / f'class{label}' / f'{index}.png'
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_bytes(tf.io.encode_png(pixels[:height, :width]).numpy())
  return f'folder:{folder}'


def _truncated_png(folder):
  dataset = _image_folder(folder)
  image = folder / 'class1' / '2.png'
  image.write_bytes(image.read_bytes()[:60])  # Its header, half its pixels.
  return dict(dataset=dataset)


def _garbage_jpeg(folder):
  dataset = _image_folder(folder)
  (folder / 'class0' / 'bad.jpg').write_bytes(b'\xff\xd8' + b'junk' * 20)
  return dict(dataset=dataset)


def _records(folder, **kwargs):
  """`--dataset=tfrecord:...` of 20 digits (`write_records`' `kwargs`)."""
  write_records(folder, 'train', 20, **kwargs)
  return f'tfrecord:{folder}/train-*'


def _truncated_record(image):
  return tf.constant(tf.io.encode_png(image).numpy()[:40])


def _users_model(function):
  def make(folder):
    folder.mkdir()
    (folder / 'user_models.py').write_text(_USER_MODULE)
    return dict(dataset=_image_folder(folder / 'images'), batch_size=2,
                model=f'{folder / "user_models.py"}:{function}')
  return make


# Bad input the data or the model show, each built in a folder of its own
# by a function of that folder that returns the flags which read it.
BAD_INPUTS = {
    'missing_folder': (
        lambda folder: dict(dataset=f'folder:{folder}'),
        r'--dataset=folder:\S+/input: no such folder; give a folder of class '
        'subfolders'),
    'one_class': (
        lambda folder: dict(dataset=_image_folder(folder, classes=1)),
        r"has 1 class folder\(s\) \['class0'\]; a classifier needs at "
        'least 2'),
    'truncated_png': (
        _truncated_png, r'class1/2.png does not decode as an image \(.+\); '
        're-save it as a PNG or JPEG, or remove it'),
    'garbage_jpeg': (
        _garbage_jpeg, r'class0/bad.jpg does not decode as an image \(.+\); '
        're-save it'),
    'mixed_sizes': (
        lambda folder: dict(dataset=_image_folder(folder,
                                                  sizes=((8, 8), (9, 9)))),
        r'holds images of several sizes .*pass --image_size=HEIGHT,WIDTH'),
    'label_past_classes': (
        lambda folder: dict(dataset=_records(folder), num_classes=5),
        r'a label of 9 \(after --label_offset\) is at or past '
        '--num_classes=5; raise --num_classes'),
    'record_keys': (
        lambda folder: dict(dataset=_records(
            folder, keys=('image/bytes', 'label'))),
        r"holds records with keys \['image/bytes', 'label'\]; tfrecord: "
        "reads 'image/encoded'"),
    'record_image': (
        lambda folder: dict(dataset=_records(
            folder, files=1, encode=_truncated_record)),
        r"train-00000: record 0 holds 'image/encoded' bytes that do not "
        r'decode \(.+\); re-encode its image'),
    'function_returns_no_model': (
        _users_model('nothing'),
        r'user_models.py:nothing returned NoneType, not a keras.Model; '
        'return keras.Model'),
    'model_of_another_output_size': (
        _users_model('three_outputs'),
        r'outputs \[\(None, 3\)\]; the data has 2 classes: return one '
        'output of 2 logits'),
}


@pytest.mark.parametrize('bad', BAD_INPUTS)
def test_bad_input_stops_with_one_line_before_training(tmp_path, bad):
  make, message = BAD_INPUTS[bad]
  values = make(tmp_path / 'input')
  before = sorted(tmp_path.rglob('*'))
  with flagsaver.flagsaver(model_dir=str(tmp_path / 'run'), **values):
    with pytest.raises(SystemExit, match=message) as refused:
      cli.main(['train.py'])
  # A message, not a traceback, and exit status 1.
  assert isinstance(refused.value.code, str)
  assert '\n' not in str(refused.value) and len(str(refused.value)) < 300
  assert sorted(tmp_path.rglob('*')) == before  # No model_dir, no file.


def test_an_error_in_a_users_model_function_is_theirs_and_leaves_nothing(
    tmp_path):
  values = _users_model('broken')(tmp_path / 'input')
  before = sorted(tmp_path.rglob('*'))
  with flagsaver.flagsaver(model_dir=str(tmp_path / 'new' / 'run'), **values):
    with pytest.raises(RuntimeError, match='a bug in my model') as raised:
      cli.main(['train.py'])
  # Its traceback reaches the line of the user's that raised it.
  assert raised.traceback[-1].path.name == 'user_models.py'
  assert sorted(tmp_path.rglob('*')) == before


def test_help_shows_plain_text():
  helps = [flag.help for flag in flags.FLAGS.flags_by_module_dict()[
      cli.__name__]]
  assert helps and not [text for text in helps if '%%' in text]


@pytest.mark.parametrize('values, message', [
    (dict(strategy='central_storage', model='resnet8_thin', num_clones=2),
     "strategy='central_storage' cannot train 'resnet8_thin' on 2 replicas: "
     'CentralStorageStrategy fails on Keras 3 BatchNormalization'),
    (dict(warmup_steps=5, train_steps=5),
     r'warmup_steps=5 must be in \[0, total_steps=5\): the run has 5 '
     'global steps; shorten the warm-up or train longer'),
    (dict(profile_steps=['1', '3'], train_steps=2),
     'profile_steps=1,3: the run ends at step 2'),
])
def test_conflicts_found_before_training_stop_with_one_line(run_train,
                                                            tmp_path, values,
                                                            message):
  with pytest.raises(SystemExit, match=message):
    run_train(model_dir=str(tmp_path / 'new' / 'run'), **values)
  # The refused run leaves no trace: not even the directories it made.
  assert not (tmp_path / 'new').exists()


@pytest.mark.parametrize('tf_config, message', [
    ('not json', "TF_CONFIG='not json' is not a cluster"),
    ('{"cluster": {"ps": ["h:1"], "worker": ["h:2"]}, '
     '"task": {"type": "worker", "index": 0}}',
     'TF_CONFIG names parameter servers'),
])
def test_tf_config_is_checked_under_every_strategy(tmp_path, monkeypatch,
                                                   tf_config, message):
  monkeypatch.setenv('TF_CONFIG', tf_config)
  with flagsaver.flagsaver(model_dir=str(tmp_path / 'run')):
    with pytest.raises(SystemExit, match=message):
      cli.main(['train.py'])
  assert not (tmp_path / 'run').exists()


def test_a_cluster_that_one_process_ignores_is_named(monkeypatch, caplog):
  monkeypatch.setenv('TF_CONFIG', json.dumps({
      'cluster': {'worker': ['h:1', 'h:2']},
      'task': {'type': 'worker', 'index': 0}}))
  with caplog.at_level('WARNING', logger='absl'):
    with flagsaver.flagsaver(clone_on_cpu=True):
      _, _, cluster_info = cli.configs_from_flags()
  assert cluster_info is None
  assert ('TF_CONFIG describes a cluster of 2 workers; strategy=towers runs '
          'in this process alone') in caplog.text


@pytest.mark.parametrize('flag_values, shared', [
    (dict(num_clones=2), [2]),
    (dict(num_clones=2, strategy='mirrored'), [2]),
    (dict(num_clones=2, deterministic=True), [2]),  # Reruns: one pool.
    (dict(num_clones=2, reproducible_rows=8), []),
])
def test_clones_share_the_cores_unless_bits_must_match(monkeypatch,
                                                       flag_values, shared):
  """Clones on logical CPUs share the cores; runs whose bits must match
  another layout's (atoms) keep TensorFlow's own pool."""
  calls = []
  monkeypatch.setattr(cli.devices, 'share_cores', calls.append)
  with flagsaver.flagsaver(clone_on_cpu=True, **flag_values):
    cli.configs_from_flags()
  assert calls == shared


# The README's commands, as flags: each trains in a directory of its own.
README_COMMANDS = [
    dict(num_clones=2, clone_on_cpu=True),
    dict(num_clones=2, clone_on_cpu=True, num_stages=2, num_microbatches=4),
    dict(num_clones=2, clone_on_cpu=True, clone_shares=['3', '1']),
    dict(num_clones=2, clone_on_cpu=True, clone_shares=['auto']),
    dict(num_clones=2, clone_on_cpu=True, accumulation_steps=2),
    dict(num_clones=2, clone_on_cpu=True, reproducible_rows=8),
    dict(num_clones=2, clone_on_cpu=True, batch_norm_policy='full_batch',
         model='resnet20'),
    dict(num_clones=2, clone_on_cpu=True, batch_norm_policy='mean',
         model='resnet20'),
    dict(num_clones=2, clone_on_cpu=True, sync_batch_norm=True,
         model='resnet20'),
]


def test_every_step_setting_names_the_default_model_dir():
  names = []
  for values in README_COMMANDS:
    with flagsaver.flagsaver(**values):
      names.append(cli.default_model_dir(cli._step_options()))
  assert len(set(names)) == len(names), names
  assert names[:5] == [
      'runs/lenet-digits-towers-2clones',
      'runs/lenet-digits-towers-2clones-2stages-4microbatches',
      'runs/lenet-digits-towers-2clones-shares3:1',
      'runs/lenet-digits-towers-2clones-sharesauto',
      'runs/lenet-digits-towers-2clones-2accumulation']
  assert names[5] == 'runs/lenet-digits-towers-2clones-reproducible8'


@pytest.mark.slow
def test_a_readme_command_after_another_trains_its_own_run(
    tmp_path, monkeypatch, digits_dir):
  monkeypatch.chdir(tmp_path)  # The default model_dir is under runs/.
  for values in README_COMMANDS[:2]:
    with flagsaver.flagsaver(data_dir=digits_dir, train_steps=2, batch_size=4,
                             export=False, **values):
      cli.main(['train.py'])
  runs = sorted(p.name for p in (tmp_path / 'runs').iterdir())
  assert runs == ['lenet-digits-towers-2clones',
                  'lenet-digits-towers-2clones-2stages-4microbatches']
  for name in runs:
    metrics = json.loads((tmp_path / 'runs' / name / 'metrics.json')
                         .read_text())
    assert metrics['resumed_from_step'] is None and metrics['steps'] == 2
  assert metrics['num_stages'] == 2 and metrics['num_microbatches'] == 4


def test_help_lists_every_flag_once_by_group():
  listed = [name for _, names in cli.HELP_GROUPS for name in names]
  defined = {flag.name
             for flag in flags.FLAGS.get_flags_for_module(cli.__name__)}
  assert sorted(listed) == sorted(defined)
  text = cli.help_text()
  for title, _ in cli.HELP_GROUPS:
    assert f'\n{title}:\n' in text
  assert '  --num_clones (default: 1)\n' in text
  assert '  --model_dir (default: unset)\n' in text


@pytest.mark.parametrize('where', ['file', 'under_file'])
def test_an_unusable_model_dir_stops_with_one_line(run_train, tmp_path,
                                                   where):
  (tmp_path / 'file').write_text('not a directory')
  model_dir = tmp_path / 'file' / ('sub' if where == 'under_file' else '')
  with pytest.raises(SystemExit, match=f'--model_dir={model_dir}'.rstrip('/')
                     + ' (is a file|cannot be used)'):
    run_train(model_dir=str(model_dir).rstrip('/'))


def test_a_global_batch_larger_than_the_data_stops_with_one_line(run_train):
  with pytest.raises(SystemExit, match='the global batch of 2048 is larger '
                     'than the 1437 training examples'):
    run_train(num_clones=2, batch_size=1024)


@pytest.mark.parametrize('name, value', [
    ('strategy', 'ring'),
    ('optimizer', 'lamb'),
])
def test_bad_choices_are_refused_by_the_flags(name, value):
  with flagsaver.flagsaver():  # Parsing sets flags; restore them after.
    with pytest.raises(flags.IllegalFlagValueError,
                       match=f'--{name}={value}'):
      flags.FLAGS(['train.py', f'--{name}={value}'])


def test_the_command_leaves_its_objects_to_the_system_at_exit(tmp_path):
  """`run` freezes the objects it made once `main` ends, failed or not: the
  interpreter's last collection would walk them all (most of a job's exit,
  BENCHMARKS.md), and the operating system frees them anyway."""
  assert gc.get_freeze_count() == 0
  try:
    with flagsaver.flagsaver(), pytest.raises(SystemExit):
      cli.run(['train.py', f'--model_dir={tmp_path}/run', '--model=vgg'])
    assert gc.get_freeze_count() > 0
  finally:
    gc.unfreeze()
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('argv, message', [
    (['--num_clones=3'], 'train.py: error: --num_clones=3 needs 3 GPUs'),
    (['--model=vgg', '--verbosity=1'],
     "train.py: error: model='vgg' is not one"),
])
@pytest.mark.slow
def test_bad_flags_exit_without_traceback(argv, message, tmp_path):
  result = subprocess.run(
      [sys.executable, 'train.py', f'--model_dir={tmp_path}/run'] + argv,
      cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode != 0
  assert message in result.stderr
  assert 'Traceback' not in result.stderr
  if '--verbosity=1' not in argv:  # A clean screen: no C++ chatter.
    assert not [part for part in CHATTER if part in result.stderr]


def _train_command(model_dir, digits_dir, *extra):
  """train.py on 2 logical CPUs: resnet8_thin (BatchNorm), digits."""
  return [sys.executable, 'train.py', f'--model_dir={model_dir}',
          f'--data_dir={digits_dir}', '--clone_on_cpu', '--num_clones=2',
          '--model=resnet8_thin', '--batch_size=16', '--optimizer=momentum',
          '--learning_rate=0.05', '--log_every_steps=1', *extra]


def _start_and_signal(command, line_part, signum, delay_s=0.0, times=1):
  """Starts `command`; sends `signum` once `times` log lines have had
  `line_part`."""
  process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE,
                             text=True)
  seen = []
  for line in process.stderr:
    seen.append(line)
    times -= line_part in line
    if not times:
      time.sleep(delay_s)
      process.send_signal(signum)
      break
  _, rest = process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
  return process.returncode, ''.join(seen) + rest




@pytest.mark.slow
def test_sigterm_then_rerun_equals_an_uninterrupted_run(tmp_path, digits_dir,
                                                        run_train):
  run_train(train_steps=1)  # Prepares digits in digits_dir once.
  steps = ['--train_steps=24', '--deterministic']
  # The uninterrupted reference runs beside the interrupted one.
  whole = subprocess.Popen(
      _train_command(tmp_path / 'whole', digits_dir, *steps), cwd=REPO,
      stderr=subprocess.PIPE, text=True)

  parts = _train_command(tmp_path / 'parts', digits_dir, *steps)
  code, stderr = _start_and_signal(parts, 'step 6/24', signal.SIGTERM)
  assert code == 128 + signal.SIGTERM, stderr[-2000:]
  assert 'Traceback' not in stderr
  stopped = re.search(r'SIGTERM at step (\d+): saved \S+ckpt-(\d+); run the '
                      'same command again to resume', stderr)
  assert stopped and stopped.group(1) == stopped.group(2), stderr[-2000:]
  assert 6 <= int(stopped.group(1)) < 24
  rerun = subprocess.run(parts, cwd=REPO, capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  # The screen holds tfmulti's own lines, not the libraries' INFO lines.
  assert 'restored ' in rerun.stderr and 'dataset_info.py' not in (
      rerun.stderr)

  whole_log = whole.communicate(timeout=SUBPROCESS_TIMEOUT_S)[1]
  assert whole.returncode == 0, whole_log[-2000:]
  if cli.devices.cores() > 1:  # The clones shared the cores, bits and all.
    share = cli.devices.cores() // 2
    assert (f'2 clones on logical CPUs: an op splits over {share} '
            'thread') in whole_log
  metrics = json.loads((tmp_path / 'parts' / 'metrics.json').read_text())
  assert metrics['resumed_from_step'] == int(stopped.group(1))
  assert metrics['steps'] == 24
  expected = checkpoint_tensors(str(tmp_path / 'whole' / 'ckpt-24'))
  got = checkpoint_tensors(metrics['checkpoint'])
  assert got.keys() == expected.keys()
  for key, value in expected.items():  # Bitwise, not approximately.
    np.testing.assert_array_equal(got[key], value, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize('flag, written, times', [
    # A background write starts once the one before is on disk: the
    # second start means a whole checkpoint exists.
    ('--async_checkpoint', 'writing in the background', 2),
    ('--noasync_checkpoint', 'saved', 1)])
def test_a_killed_run_leaves_a_checkpoint_that_loads(tmp_path, digits_dir,
                                                     run_train, flag,
                                                     written, times):
  run_train(train_steps=1)  # Prepares digits in digits_dir once.
  model_dir = tmp_path / 'killed'
  command = _train_command(model_dir, digits_dir, '--train_steps=20',
                           '--checkpoint_steps=1', '--keep_checkpoints=2',
                           flag)
  # SIGKILL at a random moment after a checkpoint, often mid-write.
  code, stderr = _start_and_signal(command, written, signal.SIGKILL,
                                   random.Random(0).uniform(0.0, 0.5), times)
  assert code == -signal.SIGKILL, stderr[-2000:]
  latest = tf.train.latest_checkpoint(str(model_dir))
  tensors = checkpoint_tensors(latest)  # Every tensor reads back.
  assert any(key.startswith('model/') for key in tensors)
  finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT_S)
  assert finished.returncode == 0, finished.stderr[-2000:]
  metrics = json.loads((model_dir / 'metrics.json').read_text())
  assert metrics['steps'] == 20 and metrics['resumed_from_step'] >= 1
  # No partial write is left.
  assert not list(model_dir.glob('*_temp')) + list(
      model_dir.glob('*.tempstate*'))


@pytest.mark.slow
def test_help_shows_the_project_flags_and_exits_0():
  result = subprocess.run([sys.executable, 'train.py', '--help'], cwd=REPO,
                          capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
  assert result.returncode == 0, result.stderr
  assert 'How each step runs (the step options):' in result.stdout
  assert '  --accumulation_steps (default: 1)' in result.stdout
  assert not any(chatter in result.stderr for chatter in CHATTER)


@pytest.mark.slow
@pytest.mark.parametrize('module', ['tfmulti.train.export', 'tfmulti.bench'])
def test_module_commands_start_as_quietly_as_the_main_one(module, tmp_path):
  # A bad argument, so the command stops at once after its start-up.
  result = subprocess.run(
      [sys.executable, '-m', module, f'--model_dir={tmp_path}', '--model=x'],
      cwd=REPO, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
  assert result.returncode != 0
  assert not any(chatter in result.stderr for chatter in CHATTER), (
      result.stderr)


@pytest.mark.slow
def test_batch_norm_momentum_sets_the_moving_statistics_decay(run_train,
                                                              tmp_path):
  """--batch_norm_momentum reaches every BatchNormalization of the job's
  model: the same weights as at the model's own momentum (training
  normalises by the batch's statistics), other moving statistics; the
  job's record says which momentum trained."""
  runs = {momentum: run_train(model_dir=str(tmp_path / str(momentum)),
                              model='resnet8_thin', image_size=['8', '8'],
                              batch_norm_momentum=momentum)
          for momentum in (None, 0.5)}
  tensors = {momentum: checkpoint_tensors(metrics['checkpoint'])
             for momentum, metrics in runs.items()}
  for key, value in tensors[None].items():
    if key.startswith('optimizer/_trainable_variables/'):
      np.testing.assert_array_equal(tensors[0.5][key], value, err_msg=key)
  assert any(not np.array_equal(tensors[0.5][key], value)
             for key, value in tensors[None].items()
             if key.startswith('model/'))
  assert runs[0.5]['stretches'][0]['settings']['batch_norm_momentum'] == 0.5


@pytest.mark.slow
def test_checkpoints_in_the_background_hold_the_bits_of_the_foreground(
    run_train):
  """The towers and MirroredStrategy write in the background by default
  and save the same bits as in the foreground."""
  common = dict(num_clones=2, train_steps=6, checkpoint_steps=2,
                deterministic=True)
  background = run_train(**common)
  foreground = run_train(async_checkpoint=False, **common)
  assert (background['async_checkpoint'],
          foreground['async_checkpoint']) == (True, False)
  assert background['checkpoint'].endswith('ckpt-6')
  assert_same_checkpoints(background['checkpoint'],
                          foreground['checkpoint'], exact=True)
  mirrored = run_train(strategy='mirrored', **common)
  mirrored_foreground = run_train(strategy='mirrored', async_checkpoint=False,
                                  **common)
  assert mirrored['async_checkpoint'] is True
  assert_same_checkpoints(mirrored['checkpoint'],
                          mirrored_foreground['checkpoint'], exact=True)
