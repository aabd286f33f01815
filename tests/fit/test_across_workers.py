"""Tests for Keras's `fit` across workers: `TowersModel(..., workers=)`.

The runs of examples/fit_across_workers.py (2 workers from the launcher,
one process, plain Keras `fit`) are slow; the refusals, the row split and
`workers.start` alone run in the default suite, with a `MirroredStrategy`
over 2 logical CPUs standing in for the workers' strategy where only its
replica count and scope matter (a MultiWorkerMirroredStrategy must exist
before TensorFlow runs an op, so never in a test process).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import mlp
from tests.helpers import readings_apart
from tests.helpers import REPO
from tfmulti import deploy
from tfmulti import devices
from tfmulti import errors
from tfmulti import fit
from tfmulti import launch
from tfmulti import rows
from tfmulti import tf_config
from tfmulti.deploy import keras_distribution
from tfmulti.deploy import towers_in_strategy
from tfmulti.distribute import cluster as cluster_lib
from tfmulti.distribute import resolvers
from tfmulti.distribute import workers as workers_lib
from tfmulti.fit import backup

_EXAMPLE = os.path.join('examples', 'fit_across_workers.py')
_TIMEOUT_S = 600


def test_a_worker_takes_its_consecutive_rows_of_the_global_batch():
  batch = (tf.reshape(tf.range(12), [6, 2]), (tf.range(6), None))
  part = rows.worker_part(batch, worker=1, num_workers=3)
  np.testing.assert_array_equal(part[0], [[4, 5], [6, 7]])
  np.testing.assert_array_equal(part[1][0], [2, 3])
  assert part[1][1] is None
  with pytest.raises(errors.ConfigError, match='a batch of 6 rows does not '
                     'split over 4 workers; give every batch'):
    rows.worker_part(batch, worker=0, num_workers=4)


def test_an_evaluation_batch_splits_over_the_workers_by_a_row_at_most():
  batch = (tf.reshape(tf.range(10), [5, 2]), (tf.range(5), None))
  parts = [rows.evaluation_part(batch, worker=w, num_workers=2)
           for w in range(2)]
  assert [share for _, share in parts] == [3 / 5, 2 / 5]
  np.testing.assert_array_equal(parts[0][0][1][0], [0, 1, 2])
  np.testing.assert_array_equal(parts[1][0][0], [[6, 7], [8, 9]])
  assert parts[1][0][1][1] is None
  # Fewer rows than workers: every worker evaluates the whole batch.
  alone, share = rows.evaluation_part(batch, worker=5, num_workers=8)
  assert share == 1.0 and alone is batch

def test_alone_start_gives_worker_0_of_1_and_no_strategy(monkeypatch):
  monkeypatch.delenv('TF_CONFIG', raising=False)
  workers = workers_lib.start()
  assert (workers.index, workers.num_workers, workers.is_chief) == (0, 1,
                                                                    True)
  assert workers.strategy is None
  with workers.scope():
    assert not tf.distribute.has_strategy()


def test_start_names_a_malformed_environment(monkeypatch):
  monkeypatch.setenv('TF_CONFIG', '{"cluster": {}}')
  with pytest.raises(errors.ClusterError, match='is not a cluster'):
    workers_lib.start()


def test_start_in_a_slurm_step_takes_the_command_lines_port(monkeypatch):
  """A `fit` script in a Slurm step gives no port: the first is the one
  the command line's `--port` defaults to."""
  # No MultiWorkerMirroredStrategy in a test process (see the module).
  monkeypatch.setattr(cluster_lib, 'multi_worker_strategy',
                      lambda found, **kwargs: 'strategy')
  monkeypatch.setenv('TF_CONFIG', '')  # `start` writes one; undone after.
  for name, value in {'SLURM_PROCID': '1', 'SLURM_STEP_NUM_TASKS': '2',
                      'SLURM_STEP_NODELIST': 'n9',
                      'SLURM_STEP_TASKS_PER_NODE': '2'}.items():
    monkeypatch.setenv(name, value)
  workers = workers_lib.start()
  port = resolvers.DEFAULT_PORT
  assert workers.cluster.workers == (f'n9:{port}', f'n9:{port + 1}')
  assert (workers.index, workers.strategy) == (1, 'strategy')


def test_a_slurm_step_is_written_as_the_tf_config_the_strategy_reads():
  environ = {'SLURM_PROCID': '1', 'SLURM_STEP_NUM_TASKS': '2',
             'SLURM_STEP_NODELIST': 'n[9-10]',
             'SLURM_STEP_TASKS_PER_NODE': '1(x2)'}
  found = resolvers.resolve_into('auto', environ, port=2222)
  assert json.loads(environ['TF_CONFIG']) == {
      'cluster': {'worker': ['n9:2222', 'n10:2222']},
      'task': {'type': 'worker', 'index': 1}}
  assert found.index == 1


def _stand_in(config):
  """Workers whose strategy is a 2-replica MirroredStrategy: the workers'
  strategy's count and scope (collective keys its own: two strategies of
  one process with the same keys clash in their gathers)."""
  return workers_lib.Workers(None, devices.collective_strategy(config))


def test_the_workers_must_match_the_config_and_hold_the_model():
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  workers = _stand_in(config)
  two = deploy.DeploymentConfig(clone_on_cpu=True, replica_id=0,
                                num_replicas=2)
  with workers.scope():
    inside = mlp()
  with pytest.raises(errors.ConfigError, match='the DeploymentConfig has '
                     'num_replicas=1 workers and the strategy 2'):
    fit.TowersModel(inside, config, workers=workers)
  with pytest.raises(errors.ConfigError, match=r"variables \(.*\) were made "
                     "outside the workers' strategy; build the model in"):
    fit.TowersModel(mlp(), two, workers=workers)


def test_a_keras_distribution_across_workers_takes_this_workers_place():
  """Keras's DataParallel or ModelParallel across workers: a mesh of each
  worker's devices, the config this worker's place in the job."""
  mesh = keras.distribution.DeviceMesh(
      (2,), ['model'], keras.distribution.list_devices()[:2])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map['dense/kernel'] = (None, 'model')
  found = cluster_lib.Cluster(('a:1', 'b:2'), index=1, is_chief=False)
  workers = workers_lib.Workers(found, _stand_in(deploy.DeploymentConfig(
      num_clones=2, clone_on_cpu=True)).strategy)
  devices_2 = keras.distribution.list_devices()[:2]
  for distribution in (keras.distribution.DataParallel(devices=devices_2),
                       keras.distribution.ModelParallel(
                           layout_map=layout_map, batch_dim_name='model')):
    config = keras_distribution.config_for(distribution, workers)
    assert (config.num_clones, config.worker_index, config.num_workers) == (
        2, 1, 2)
  assert keras_distribution.config_for(distribution).num_workers == 1


@pytest.mark.parametrize('option, message', [
    (dict(num_microbatches=2), "num_microbatches=2 is not available with "
     "strategy='multi_worker'; use --strategy=towers"),
    (dict(clone_shares=(3, 1)), r"clone_shares=\(3, 1\) is not available "
     "with strategy='multi_worker'"),
    (dict(gradient_packs='auto'), "gradient_packs='auto' is not available "
     "with strategy='multi_worker'"),
    (dict(accumulation_steps=2, summarize_gradients=True),
     'summarize_gradients=True: fit writes no gradient summaries'),
])
def test_fit_across_workers_refuses_what_the_command_line_refuses(
    option, message):
  """The command line's gate for --strategy=multi_worker, in one line,
  before anything is built."""
  stand_in = _stand_in(deploy.DeploymentConfig(num_clones=2,
                                               clone_on_cpu=True))
  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True,
                                   replica_id=0, num_replicas=2)
  with stand_in.scope():
    model = mlp()
  with pytest.raises(errors.UserError, match=message) as refused:
    fit.TowersModel(model, config, workers=stand_in, **option)
  assert '\n' not in str(refused.value)


def test_fit_across_workers_refuses_input_the_workers_cannot_share():
  config = deploy.DeploymentConfig(clone_on_cpu=True, replica_id=0,
                                   num_replicas=2)
  workers = _stand_in(deploy.DeploymentConfig(num_clones=2,
                                              clone_on_cpu=True))
  with workers.scope():
    model = mlp()
  towers = fit.TowersModel(model, config, workers=workers)
  towers.compile(optimizer='sgd', loss='mse')
  before = [w.copy() for w in model.get_weights()]
  endless = tf.data.Dataset.from_tensors(
      (tf.zeros([4, 8]), tf.zeros([4, 4]))).repeat()
  with pytest.raises(errors.ConfigError, match='fit across workers on '
                     '_RepeatDataset input of unknown length: every worker '
                     'must take as many steps; pass steps_per_epoch'):
    towers.fit(endless, epochs=1, verbose=0)
  x, y = np.zeros([10, 8], np.float32), np.zeros([10, 4], np.float32)
  with pytest.raises(errors.ConfigError, match=r'a batch of 1 rows \(fit '
                     r'with batch_size=4 on 9 rows\) does not split over 2 '
                     'workers'):
    towers.fit(x[:9], y[:9], batch_size=4, verbose=0)
  with pytest.raises(errors.ConfigError, match=r'a batch of 3 rows \(fit '
                     'with batch_size=3 on 10 rows'):
    towers.fit(x, y, batch_size=3, verbose=0)
  for got, want in zip(model.get_weights(), before):
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_only_the_chief_keeps_the_callbacks_that_write_files(tmp_path):
  """ModelCheckpoint, TensorBoard and CSVLogger write on worker 0 alone;
  worker 1 trains the same epoch and writes nothing (each worker given a
  directory of its own here, so a second writer would show)."""
  stand_in = _stand_in(deploy.DeploymentConfig(num_clones=2,
                                               clone_on_cpu=True))
  x, y = np.zeros([8, 6], np.float32), np.zeros([8], np.int32)
  for index in (0, 1):
    config = deploy.DeploymentConfig(clone_on_cpu=True, replica_id=index,
                                     num_replicas=2)
    with stand_in.scope():
      model = mlp()
    towers = fit.TowersModel(model, config, workers=stand_in)
    towers.compile(optimizer='sgd', loss=keras.losses.
                   SparseCategoricalCrossentropy(from_logits=True))
    written = tmp_path / f'worker{index}'
    history = towers.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(str(written / 'model.keras')),
        keras.callbacks.TensorBoard(str(written / 'logs')),
        keras.callbacks.CSVLogger(str(written / 'history.csv'))])
    assert len(history.history['loss']) == 1  # Both trained the epoch.
  chief = tmp_path / 'worker0'
  assert (chief / 'model.keras').is_file()
  assert list((chief / 'logs').glob('train/events.out.tfevents.*'))
  assert len((chief / 'history.csv').read_text().splitlines()) == 2
  assert not (tmp_path / 'worker1').exists()



@pytest.mark.slow
def test_a_worker_evaluates_its_rows_and_gathers_everyones():
  """Worker 1 of 2 runs its 2 rows of a batch of 5 and gathers its peers'
  outputs; in the stand-in both replicas are worker 1, so the gathered
  outputs are its rows twice, and the model's losses (the L2 penalties)
  come back once a replica, weighted by its share of the rows."""
  stand_in = _stand_in(deploy.DeploymentConfig(num_clones=2,
                                               clone_on_cpu=True))
  config = deploy.DeploymentConfig(clone_on_cpu=True, replica_id=1,
                                   num_replicas=2)
  with stand_in.scope():
    model = mlp()
  towers = fit.TowersModel(model, config, workers=stand_in)
  towers.compile(optimizer='sgd', loss='mse')
  images = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
  outputs, regularization = tf.function(towers.towers.evaluate_outputs)(
      tf.constant(images))
  mine = model(images[3:], training=False)
  np.testing.assert_allclose(outputs, np.concatenate([mine, mine]),
                             rtol=1e-6)
  penalties = float(sum(model.losses))
  np.testing.assert_allclose(float(regularization), 2 * 0.4 * penalties,
                             rtol=1e-6)

class _LosePeer(keras.callbacks.Callback):
  """Fails as TensorFlow's collective does when worker 1 is gone."""

  def on_train_begin(self, logs=None):
    raise tf.errors.UnavailableError(
        None, None, 'Collective ops is aborted by: failed to connect to all '
        'addresses\nAdditional GRPC error information from remote target '
        '/job:worker/replica:0/task:1')


def test_fit_across_workers_ends_a_lost_peer_with_one_line(capsys):
  config = deploy.DeploymentConfig(clone_on_cpu=True, replica_id=0,
                                   num_replicas=2)
  stand_in = _stand_in(deploy.DeploymentConfig(num_clones=2,
                                               clone_on_cpu=True))
  workers = workers_lib.Workers(
      cluster_lib.Cluster(('localhost:1', 'localhost:2'), 0, True),
      stand_in.strategy)
  with workers.scope():
    model = mlp()
  towers = fit.TowersModel(model, config, workers=workers)
  towers.compile(optimizer='sgd', loss='mse')
  x, y = np.zeros([8, 6], np.float32), np.zeros([8, 3], np.float32)
  with pytest.raises(SystemExit) as exited:
    towers.fit(x, y, batch_size=4, verbose=0, callbacks=[_LosePeer()])
  # This worker is well: the status an elastic launcher restarts.
  assert exited.value.code == errors.PEER_LOST_EXIT
  assert capsys.readouterr().err == (
      'error: worker 0 lost a peer mid-step: worker 1 at localhost:2 '
      '(UnavailableError); restart every worker with the same command: with '
      'a BackupAndRestore, they resume from its last save; without, they '
      'start again.\n')


@pytest.mark.slow
def test_fit_across_workers_names_a_peer_lost_mid_run(tmp_path):
  """Worker 1 killed mid-run: worker 0 ends with one line naming it, not
  TensorFlow's traceback."""
  ports = launch.free_ports(2)
  logs = [tmp_path / f'worker{i}.log' for i in range(2)]
  workers = []
  for index in range(2):
    with open(logs[index], 'w') as log:
      workers.append(subprocess.Popen(
          [sys.executable, _EXAMPLE, f'--model_dir={tmp_path}',
           '--epochs=100'], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
          env=dict(os.environ, TF_CONFIG=tf_config.for_worker(
              [f'localhost:{p}' for p in ports], index))))
  deadline = time.monotonic() + _TIMEOUT_S
  while 'Epoch 2/' not in logs[0].read_text():
    assert workers[0].poll() is None, logs[0].read_text()[-3000:]
    assert time.monotonic() < deadline, 'worker 0 never began epoch 2'
    time.sleep(0.1)
  workers[1].kill()  # A machine lost mid-run.
  workers[1].wait()
  workers[0].wait(timeout=_TIMEOUT_S)
  text = logs[0].read_text()
  assert workers[0].returncode == errors.PEER_LOST_EXIT, text[-3000:]
  assert ('error: worker 0 lost a peer mid-step: worker 1 at '
          f'localhost:{ports[1]} (') in text
  assert 'Traceback' not in text


def _run(model_dir, *flags, workers=0):
  """Runs the example (on `workers` workers from the launcher, else alone);
  returns its log and each worker's logged history."""
  command = [_EXAMPLE, f'--model_dir={model_dir}', *flags]
  if workers:
    command = ['-m', 'tfmulti.launch', f'--num_workers={workers}', '--',
               *command]
  result = subprocess.run([sys.executable, *command], cwd=REPO,
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
  log = result.stdout + result.stderr
  assert result.returncode == 0, log[-3000:]
  histories = [readings_apart(json.loads(h))  # Each worker's own times.
               for h in re.findall(r'history (\{.*\})', log)]
  assert len(histories) == max(workers, 1)
  return log, histories


def _weights(model_dir):
  """The arrays of final.weights.h5, in the file's order."""
  found = []
  with h5py.File(os.path.join(model_dir, 'final.weights.h5')) as f:
    f.visititems(lambda name, item: found.append(item[()]) if isinstance(
        item, h5py.Dataset) else None)
  return found


def _assert_same_bits(got_dir, want_dir):
  """The two runs' final weights, equal bit for bit."""
  for got, want in zip(_weights(got_dir), _weights(want_dir)):
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_fit_across_two_workers_trains_as_plain_fit_on_one_device(tmp_path):
  """2 workers (the launcher) equal one process of 2 clones and plain
  Keras `fit` on one device, to 1e-5, metrics included, over an epoch of
  20 steps (momentum then grows the rounding of another summation order:
  6e-5 after 60); only worker 0 prints the epochs and writes."""
  _, (plain,) = _run(tmp_path / 'plain', '--plain', '--epochs=1')
  _, (one,) = _run(tmp_path / 'one', '--num_clones=2', '--epochs=1')
  log, histories = _run(tmp_path / 'workers', '--epochs=1', workers=2)
  assert histories[0] == histories[1]  # The same figures on every worker.
  for history in (one, histories[0]):
    assert history.keys() == plain.keys()
    for name, values in plain.items():
      np.testing.assert_allclose(history[name], values, rtol=1e-5,
                                 err_msg=name)
  assert plain['val_accuracy'][-1] > 0.5  # It learns: chance is 0.1.
  for got, want in zip(_weights(tmp_path / 'workers'),
                       _weights(tmp_path / 'plain')):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert '[worker 0] 20/20 - ' in log and '[worker 1] 20/20' not in log
  assert len((tmp_path / 'workers' / 'history.csv').read_text()
             .splitlines()) == 2  # A header and the epoch: one writer.


@pytest.mark.slow
@pytest.mark.parametrize('model', ['sequential', 'subclassed', 'embedding'])
def test_every_keras_model_class_across_workers_trains_one_process_bits(
    tmp_path, model):
  """A Sequential, a subclassed model and an Embedding (its slices joined
  across the workers' atoms) on 2 workers: one process's bits."""
  flags = (f'--model={model}', '--reproducible_rows=4', '--epochs=1')
  _run(tmp_path / 'one', '--num_clones=2', *flags)
  _run(tmp_path / 'workers', *flags, workers=2)
  _assert_same_bits(tmp_path / 'workers', tmp_path / 'one')


@pytest.mark.slow
def test_a_fixed_lookups_slices_meet_across_workers_as_on_one_device(
    tmp_path):
  """Positions looked up by `arange` under Adam: each worker's slices of
  a position summed over the workers (not one slice a worker), as one
  device gives them, to 1e-5 of plain fit; and, with reproducible rows,
  one process's bits."""
  flags = ('--model=positions', '--optimizer=adam', '--epochs=1')
  _run(tmp_path / 'plain', '--plain', *flags)
  _run(tmp_path / 'workers', *flags, workers=2)
  for got, want in zip(_weights(tmp_path / 'workers'),
                       _weights(tmp_path / 'plain')):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  _run(tmp_path / 'one', '--num_clones=2', '--reproducible_rows=8', *flags)
  _run(tmp_path / 'atoms', '--reproducible_rows=8', *flags, workers=2)
  _assert_same_bits(tmp_path / 'atoms', tmp_path / 'one')


@pytest.mark.slow
def test_a_mesh_on_each_worker_trains_as_one_device(tmp_path):
  """Each worker's tables and Dense kernel split over its 2 clones
  (`--layouts`: a mesh of them), on 2 workers: under Adam with 2
  accumulation steps, plain fit on one device to 1e-5, each worker's
  slots on both of its devices; with reproducible rows, the bits of one
  process of 2 clones without layouts."""
  flags = ('--model=positions', '--optimizer=adam', '--epochs=1')
  _run(tmp_path / 'plain', '--plain', *flags)
  log, _ = _run(tmp_path / 'workers', '--num_clones=2', '--layouts',
                '--accumulation_steps=2', *flags, workers=2)
  for got, want in zip(_weights(tmp_path / 'workers'),
                       _weights(tmp_path / 'plain')):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Both tables and the Dense kernel, on each worker.
  assert len(re.findall(r'Variables sharded by their layouts: 3 of', log)
             ) == 2
  for index in range(2):
    where = re.search(rf'\[worker {index}\].*variables and slots on '
                      r'(\[.*\])', log).group(1)
    task = f'/job:worker/replica:0/task:{index}/device:CPU:'
    assert f"'{task}0'" in where and f"'{task}1'" in where, where
  atoms = ('--model=embedding', '--reproducible_rows=4', '--epochs=1')
  _run(tmp_path / 'one', '--num_clones=2', *atoms)
  _run(tmp_path / 'atoms', '--num_clones=2', '--layouts', *atoms, workers=2)
  _assert_same_bits(tmp_path / 'atoms', tmp_path / 'one')


@pytest.mark.slow
def test_blocks_on_each_worker_train_as_one_device(tmp_path):
  """Each worker's Dense and convolution kernels split over 'model' of a
  mesh (1, 2) of its clones and computed where their blocks live
  (`--blocks`), on 2 workers and on one worker alone (its step already in
  the strategy's replica): under Adam, plain fit on one device to 1e-5."""
  flags = ('--optimizer=adam', '--epochs=1')
  _run(tmp_path / 'plain', '--plain', *flags)
  for workers in (1, 2):
    log, _ = _run(tmp_path / str(workers), '--num_clones=2', '--layouts',
                  '--blocks', *flags, workers=workers)
    assert len(re.findall(r"kernels' blocks live: conv2d, dense, dense_1",
                          log)) == workers
    for got, want in zip(_weights(tmp_path / str(workers)),
                         _weights(tmp_path / 'plain')):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_blocks_without_layouts_stop_with_one_line():
  result = subprocess.run([sys.executable, _EXAMPLE, '--blocks'], cwd=REPO,
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
  assert result.returncode != 0
  assert '--blocks lays out the --layouts map: give --layouts too.' in (
      result.stderr)
  assert 'Traceback' not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize('options', [
    (), ('--accumulation_steps=2',),
    # Each worker's calls run 4 steps in one compiled loop (`step_loop`).
    ('--steps_per_execution=4',)])
def test_fit_across_workers_with_atoms_trains_one_process_bits(tmp_path,
                                                               options):
  """Reproducible rows (and accumulation steps, each step option fit runs
  across workers; and Keras's steps_per_execution): 2 workers end with
  one process's bits."""
  _, (one,) = _run(tmp_path / 'one', '--num_clones=2',
                   '--reproducible_rows=8', *options)
  log, histories = _run(tmp_path / 'workers', '--reproducible_rows=8',
                        *options, workers=2)
  assert histories == [one, one]
  # Each worker traced its loop once.
  assert log.count('up to 4 steps of 64 rows a compiled call') == (
      2 if '--steps_per_execution=4' in options else 0), log[-3000:]
  _assert_same_bits(tmp_path / 'workers', tmp_path / 'one')


@pytest.mark.slow
def test_fit_across_workers_with_spread_variables_trains_central_bits(
    tmp_path):
  """Each worker's variables spread over its 2 clones (the model built in
  `config.variables_scope()` inside the workers' scope): the histories and
  weights of central placement, bit for bit under reproducible_rows."""
  flags = ('--num_clones=2', '--reproducible_rows=8', '--epochs=1')
  central_log, central = _run(tmp_path / 'central', *flags, workers=2)
  spread_log, spread = _run(tmp_path / 'spread', *flags,
                            '--variables_device=spread', workers=2)
  for index in range(2):
    task = f'/job:worker/replica:0/task:{index}/device:CPU:'
    assert f"variables and slots on ['{task}0']" in central_log
    assert f"variables and slots on ['{task}0', '{task}1']" in spread_log
  assert spread == central
  _assert_same_bits(tmp_path / 'spread', tmp_path / 'central')


@pytest.mark.slow
def test_a_batch_norm_policy_across_workers_changes_only_the_statistics(
    tmp_path):
  """batch_norm_policy=mean on 2 workers x 2 clones: the trainable weights
  of clone 0's policy bit for bit (a training step normalises by the batch,
  not the moving statistics), and other moving statistics."""
  flags = ('--num_clones=2', '--batch_norm', '--epochs=1')
  _run(tmp_path / 'clone_0', *flags, workers=2)
  _run(tmp_path / 'mean', *flags, '--batch_norm_policy=mean', workers=2)
  with h5py.File(tmp_path / 'clone_0' / 'final.weights.h5') as f:
    paths = []
    f.visititems(lambda name, item: paths.append(name) if isinstance(
        item, h5py.Dataset) else None)
  moving = [i for i, path in enumerate(paths) if 'batch_norm' in path]
  assert len(moving) == 4  # gamma, beta, moving mean and variance.
  got, want = _weights(tmp_path / 'mean'), _weights(tmp_path / 'clone_0')
  for i, (a, b) in enumerate(zip(got, want)):
    if i in moving[2:]:
      assert not np.array_equal(a, b), paths[i]
    else:
      np.testing.assert_array_equal(a, b, err_msg=paths[i])


def test_each_epoch_of_arrays_is_rebuilt_alone_in_its_order():
  arrays = (np.arange(10, dtype=np.float32), np.arange(10) * 10)
  whole = [tuple(t.numpy().tolist() for t in batch)
           for batch in backup.epochs_of_arrays(
               arrays, batch_size=4, shuffle=True, seed=7, first_epoch=0,
               epochs=3)]
  assert len(whole) == 9  # 3 epochs of batches of 4, 4 and 2 rows.
  epochs = [sorted(sum((list(b[0]) for b in whole[3 * e:3 * e + 3]), []))
            for e in range(3)]
  assert epochs == [list(range(10))] * 3  # Every row once an epoch.
  assert whole[0:3] != whole[3:6]  # Each epoch its own order.
  later = [tuple(t.numpy().tolist() for t in batch)
           for batch in backup.epochs_of_arrays(
               arrays, batch_size=4, shuffle=True, seed=7, first_epoch=1,
               epochs=3)]
  assert later == whole[3:]  # A restart rebuilds epoch 1 on.
  for x, y in whole:
    assert [10 * v for v in x] == list(y)  # Rows stay whole.


# examples/fit_across_workers.py with a SIGTERM to one worker at a step, as
# a cluster manager would send it then.
_SIGNALLING = '''
import json, os, signal, sys
sys.path.insert(0, 'examples')
from absl import app, flags
import keras
import fit_across_workers as example
from tfmulti import devices

_AT = flags.DEFINE_integer('signal_at_step', 0, 'Global step to signal at.')
_ON = flags.DEFINE_integer('signal_worker', 0, 'The worker signalled.')
_SIGNAL = flags.DEFINE_string('signal', 'SIGTERM', 'The signal sent.')


class Signal(keras.callbacks.Callback):

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    place = json.loads(os.environ.get('TF_CONFIG', '{"task": {"index": 0}}'))
    if (self.epoch * 20 + batch + 1 == _AT.value
        and place['task']['index'] == _ON.value):
      os.kill(os.getpid(), getattr(signal, _SIGNAL.value))


def main(argv):
  devices.create_logical_cpus(example._NUM_CLONES.value)
  _, history = example.fit(example._MODEL_DIR.value, example._EPOCHS.value,
                           callbacks=[Signal()])
  print('history', json.dumps(history.history), flush=True)


app.run(main)
'''
_ATOMS = ('--reproducible_rows=8',)


def _signalling(tmp_path, name, *flags, workers=0, status=0,
                launcher_flags=()):
  """Runs the signalling script; returns its log."""
  script = tmp_path / 'signalling.py'
  script.write_text(_SIGNALLING)
  command = [str(script), f'--model_dir={tmp_path / name}',
             f'--backup_dir={tmp_path / (name + "_backup")}', *_ATOMS, *flags]
  if workers:
    command = ['-m', 'tfmulti.launch', f'--num_workers={workers}',
               *launcher_flags, '--', *command]
  result = subprocess.run([sys.executable, *command], cwd=REPO,
                          capture_output=True, text=True, timeout=_TIMEOUT_S)
  log = result.stdout + result.stderr
  assert result.returncode == status, log[-3000:]
  return log


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  """The weights of an uninterrupted preemptible fit, in one process with
  2 clones (the run every stopped one must end as)."""
  tmp_path = tmp_path_factory.mktemp('uninterrupted')
  _signalling(tmp_path, 'run', '--num_clones=2')
  assert not (tmp_path / 'run_backup').exists()  # Removed at the end.
  return _weights(tmp_path / 'run')


@pytest.mark.slow
@pytest.mark.parametrize('workers, signalled', [(0, 0), (2, 0), (2, 1)])
def test_a_preempted_fit_resumes_as_if_never_stopped(
    tmp_path, uninterrupted, workers, signalled):
  """SIGTERM mid-epoch (step 27 of 3 x 20) to the one process, the chief
  or the other worker: the job saves one step and exits 143; the same
  command resumes it there and ends with the uninterrupted run's bits."""
  clones = () if workers else ('--num_clones=2',)
  log = _signalling(tmp_path, 'run', *clones, '--signal_at_step=27',
                    f'--signal_worker={signalled}', workers=workers,
                    status=128 + signal.SIGTERM)
  saved = 28 if workers else 27  # Workers agree on the step after.
  label = 'SIGTERM' if not workers else f'SIGTERM to worker {signalled}'
  assert log.count(f'{label} at step {saved}: the job saved it') == max(
      workers, 1)
  position, path = backup.read_position(str(tmp_path / 'run_backup'))
  epoch, steps = position.epoch, position.step - 20 * position.epoch
  assert (epoch, steps, os.path.basename(path)) == (1, saved - 20,
                                                    f'ckpt-{saved}')
  log = _signalling(tmp_path, 'run', *clones, workers=workers)
  assert log.count(f'epoch 2, {saved - 20} steps done in it') == max(
      workers, 1)
  for got, want in zip(_weights(tmp_path / 'run'), uninterrupted):
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_a_fit_that_loses_a_worker_goes_on_from_the_backup(tmp_path,
                                                           uninterrupted):
  """2 workers, worker 1 killed (SIGKILL) at step 27 of 3 x 20: an elastic
  launch goes on with worker 0 alone from the backup of epoch 1's end, at
  the same global batch (64 rows: fit's batch_size), and ends with the
  uninterrupted run's bits."""
  log = _signalling(tmp_path, 'run', '--signal_at_step=27',
                    '--signal_worker=1', '--signal=SIGKILL', workers=2,
                    launcher_flags=('--min_workers=1',))
  assert ('lost worker 1 (killed by SIGKILL): restart 1 goes on with 1 '
          'workers') in log, log[-3000:]
  # The restart resumed (epoch 2 from its start, or mid-way), not anew.
  assert re.search(r'\[worker 0\] .*restored \S+ckpt-(\d+): epoch 2, \d+ '
                   'steps done in it', log), log[-3000:]
  for got, want in zip(_weights(tmp_path / 'run'), uninterrupted):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('x, message', [
    (tf.data.Dataset.from_tensors((tf.zeros([4, 8]), tf.zeros([4, 4])))
     .repeat(), 'on a tf.data input of unknown length: the backup counts '
     'steps in an epoch; pass steps_per_epoch'),
    (keras.utils.PyDataset, 'cannot rebuild a step of a'),
])
def test_a_backup_refuses_an_input_it_cannot_rebuild(tmp_path, x, message):
  if x is keras.utils.PyDataset:
    class Batches(keras.utils.PyDataset):
      def __len__(self):
        return 1

      def __getitem__(self, index):
        return np.zeros([4, 8], np.float32), np.zeros([4, 4], np.float32)
    x = Batches()
  towers = fit.TowersModel(
      mlp(), deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True))
  towers.compile(optimizer='sgd', loss='mse')
  backup = keras.callbacks.BackupAndRestore(str(tmp_path / 'backup'))
  with pytest.raises(errors.ConfigError, match=message):
    towers.fit(x, epochs=1, verbose=0, callbacks=[backup])
  assert not (tmp_path / 'backup').exists()


def test_a_batch_fingerprint_follows_its_rows_and_their_order():
  images = tf.reshape(tf.range(24, dtype=tf.float32), [6, 2, 2])
  labels = tf.range(6)
  fingerprint = towers_in_strategy.batch_fingerprint
  same = fingerprint((tf.identity(images), (labels, None)))
  assert same.dtype == tf.int64 and same.shape == []
  assert int(fingerprint((images, (labels, None)))) == int(same)
  reordered = [1, 0, 2, 3, 4, 5]
  for other in ((tf.gather(images, reordered), (labels, None)),
                (images, (tf.gather(labels, reordered), None)),
                (images[:4], (labels[:4], None))):
    assert int(fingerprint(other)) != int(same)


# examples/fit_across_workers.py with each worker seeding Keras by its own
# index, as a script that never seeds does by chance.
_UNSEEDED = '''
import json, os, sys
sys.path.insert(0, 'examples')
from absl import app
import keras
import fit_across_workers as example
from tfmulti import devices

_INDEX = json.loads(os.environ['TF_CONFIG'])['task']['index']
_SEED = keras.utils.set_random_seed
keras.utils.set_random_seed = lambda seed: _SEED(seed + _INDEX)


def main(argv):
  devices.create_logical_cpus(example._NUM_CLONES.value)
  example.fit(example._MODEL_DIR.value, example._EPOCHS.value)


app.run(main)
'''


@pytest.mark.slow
def test_workers_that_shuffle_alike_by_chance_stop_before_a_step(tmp_path):
  """Workers whose Keras generators differ shuffle the arrays into other
  global batches: each stops at step 1, before any update, with one line
  saying how to seed them; worker 0 writes nothing."""
  script = tmp_path / 'unseeded.py'
  script.write_text(_UNSEEDED)
  result = subprocess.run(
      [sys.executable, '-m', 'tfmulti.launch', '--num_workers=2', '--',
       str(script), f'--model_dir={tmp_path / "run"}'], cwd=REPO,
      capture_output=True, text=True, timeout=_TIMEOUT_S)
  log = result.stdout + result.stderr
  assert result.returncode == 1, log[-3000:]
  for index in (0, 1):
    assert (f'[worker {index}] error: {towers_in_strategy.BATCHES_DIFFER} '
            'at step 1, each taking its rows of its own: seed Keras alike '
            'on every worker before fit (keras.utils.set_random_seed(0))'
            ) in log, log[-3000:]
  assert 'Traceback' not in log
  assert not (tmp_path / 'run' / 'final.weights.h5').exists()
