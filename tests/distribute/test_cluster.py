"""Tests for multi-worker training: TF_CONFIG, and 2 workers on loopback."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from tests import test_cli_layouts as user_models
from tests.data import test_tfrecords
from tests.helpers import assert_same_checkpoints
from tests.helpers import checkpoint_tensors
from tests.helpers import indexed_job_flags
from tests.helpers import REPO
from tfmulti import errors
from tfmulti.distribute import cluster

TIMEOUT_S = 300  # Per worker process; a run here takes 10 to 30 seconds.
# Besides TF_CONFIG, what places a task.
_PLACING = ('SLURM_', 'JOB_COMPLETION_INDEX')


def _tf_config(ports, index, task_type='worker'):
  return json.dumps({'cluster': {'worker': [f'localhost:{p}' for p in ports]},
                     'task': {'type': task_type, 'index': index}})


def _free_ports(count):
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(('localhost', 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


class TestFromEnvironment:

  def test_workers_and_chief(self):
    info = cluster.from_environment({'TF_CONFIG': _tf_config([1, 2], 1)})
    assert info.workers == ('localhost:1', 'localhost:2')
    assert (info.index, info.num_workers, info.is_chief) == (1, 2, False)
    assert info.peers == ('localhost:1',)

  def test_a_chief_job_comes_first(self):
    raw = json.dumps({'cluster': {'chief': ['a:1'], 'worker': ['b:1', 'c:1']},
                      'task': {'type': 'worker', 'index': 0}})
    info = cluster.from_environment({'TF_CONFIG': raw})
    assert info.workers == ('a:1', 'b:1', 'c:1') and info.index == 1
    assert info.num_chiefs == 1  # TF's worker task 0 is workers[1].

  @pytest.mark.parametrize('raw, message', [
      (None, 'strategy=multi_worker needs TF_CONFIG'),
      ('{"cluster": {}}', 'is not a cluster'),
      (_tf_config([1, 2], 2), 'is not in the cluster'),
      (json.dumps({'cluster': {'worker': ['a:1'], 'ps': ['p:1']},
                   'task': {'type': 'worker', 'index': 0}}),
       'parameter servers'),
  ])
  def test_bad_tf_config(self, raw, message):
    with pytest.raises(errors.ClusterError, match=message):
      cluster.from_environment({} if raw is None else {'TF_CONFIG': raw})

  def test_flags_must_agree(self):
    info = cluster.from_environment({'TF_CONFIG': _tf_config([1, 2], 1)})
    cluster.check_flags(info, None, None)
    cluster.check_flags(info, 2, 1)
    with pytest.raises(errors.ClusterError, match='--num_workers=3'):
      cluster.check_flags(info, 3, None)
    with pytest.raises(errors.ClusterError, match='--worker_index=0'):
      cluster.check_flags(info, None, 0)


# What TensorFlow 2.21 raised on worker 0 of two on loopback when worker 1
# was killed mid-step (an UnavailableError from a collective).
_LOST_WORKER_1 = (
    'Collective ops is aborted by: failed to connect to all addresses; last '
    'error: UNKNOWN: ipv4:127.0.0.1:35667: Failed to connect to remote '
    'host: Connection refused\nAdditional GRPC error information from '
    'remote target /job:worker/replica:0/task:1 while calling '
    '/tensorflow.WorkerService/RecvBuf:\n[[{{node CollectiveReduceV2}}]]')


def _unavailable(text):
  return tf.errors.UnavailableError(None, None, text)


class TestLostPeers:
  """The one line for a lost peer names it, from TensorFlow's error."""

  def test_tensorflows_error_names_the_peer(self):
    info = cluster.Cluster(('localhost:35666', 'localhost:35667'), 0, True)
    assert cluster.lost_peers(info, _LOST_WORKER_1) == [1]
    assert cluster.lost_peer_message(info, _unavailable(_LOST_WORKER_1)) == (
        'worker 0 lost a peer mid-step: worker 1 at localhost:35667 '
        '(UnavailableError); restart every worker with the same command: '
        'they resume from the latest checkpoint.')

  @pytest.mark.parametrize('text, named', [
      ('from remote target /job:worker/replica:0/task:1', [2]),
      ('from remote target /job:chief/replica:0/task:0', [0]),
      ('cannot reach w1:2222 nor c:2222', [0, 2]),  # The addresses, sorted.
      ('cannot reach w1:22220', []),  # Another port.
      ('ipv4:10.0.0.3:2222: Connection refused', []),  # Every peer's port.
      ('/job:worker/replica:0/task:0 failed', []),  # This worker itself.
  ])
  def test_a_peer_is_named_by_its_task_or_its_address(self, text, named):
    info = cluster.Cluster(('c:2222', 'w0:2222', 'w1:2222'), 1, False,
                           num_chiefs=1)
    assert cluster.lost_peers(info, text) == named

  def test_without_a_name_every_peer_is_listed_the_first_few(self):
    few = cluster.Cluster(('a:1', 'b:1', 'c:1'), 1, False)
    assert ('worker 1 lost a peer mid-step: one of worker 0 at a:1, worker 2 '
            'at c:1 (DeadlineExceededError)') in cluster.lost_peer_message(
                few, tf.errors.DeadlineExceededError(None, None, 'timed out'))
    many = cluster.Cluster(tuple(f'h{i}:1' for i in range(8)), 0, True)
    assert ('one of worker 1 at h1:1, worker 2 at h2:1, worker 3 at h3:1, '
            'worker 4 at h4:1 and 3 more (') in cluster.lost_peer_message(
                many, _unavailable('Socket closed'))

  def test_a_collective_that_failed_is_one_line_across_workers_only(self):
    info = cluster.Cluster(('localhost:35666', 'localhost:35667'), 0, True)
    with pytest.raises(errors.ClusterError) as raised:
      with cluster.lost_peers_as_errors(info, resume='they start again'):
        raise _unavailable(_LOST_WORKER_1)
    message = str(raised.value)
    assert '\n' not in message and message.endswith(
        'worker 1 at localhost:35667 (UnavailableError); restart every '
        'worker with the same command: they start again.')
    with pytest.raises(tf.errors.UnavailableError):  # One process.
      with cluster.lost_peers_as_errors(None):
        raise _unavailable(_LOST_WORKER_1)


def _with_watchdog(peer, timeout_s, then):
  """A Python process that starts the watchdog over `peer`, then runs the
  statement `then`; returns (its exit status, its and the watchdog's
  stderr, seconds until both closed it)."""
  script = (f'import time\nfrom tfmulti.distribute import cluster\n'
            f'info = cluster.Cluster(("localhost:1", "{peer}"), 0, True)\n'
            f'cluster.start_watchdog(info, {timeout_s})\n{then}\n')
  start = time.monotonic()
  result = subprocess.run([sys.executable, '-c', script], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  return result.returncode, result.stderr, time.monotonic() - start


@pytest.mark.slow
def test_the_watchdog_kills_a_worker_whose_peer_never_answers():
  port, = _free_ports(1)  # Nothing listens there.
  code, stderr, _ = _with_watchdog(f'localhost:{port}', 1.0, 'time.sleep(60)')
  assert code == -signal.SIGKILL
  assert f'cannot reach its peer localhost:{port} after 1 s' in stderr


@pytest.mark.slow
def test_the_watchdog_lets_a_worker_whose_peers_answer_be():
  listener = socket.create_server(('localhost', 0))
  try:
    code, stderr, _ = _with_watchdog(
        f'localhost:{listener.getsockname()[1]}', 5.0, 'time.sleep(3)')
  finally:
    listener.close()
  assert code == 0 and 'cannot reach' not in stderr


@pytest.mark.slow
def test_the_watchdog_ends_with_its_worker():
  """It never outlives the worker, nor signals a PID that may be reused."""
  port, = _free_ports(1)
  code, stderr, seconds = _with_watchdog(f'localhost:{port}', 30.0, 'pass')
  # The pipe closes when the watchdog ends too: soon after the worker (the
  # worker's start takes a few seconds), long before the watchdog's
  # deadline, and without its error.
  assert code == 0 and 'cannot reach' not in stderr
  assert seconds < 20


def _worker_command(model_dir, digits_dir, *extra):
  return [sys.executable, 'train.py', f'--model_dir={model_dir}',
          f'--data_dir={digits_dir}', '--clone_on_cpu', '--batch_size=4',
          '--optimizer=momentum', '--learning_rate=0.05',
          '--log_every_steps=1', '--peer_timeout_s=60', *extra]


def _run_job(model_dir, digits_dir, temp_root, *flags, places=None):
  """Runs 2 workers on loopback; returns their logs (stderr). `places`:
  each worker's environment variables that place it (a TF_CONFIG on free
  ports by default)."""
  ports = _free_ports(2)
  places = places or [{'TF_CONFIG': _tf_config(ports, index)}
                      for index in range(2)]
  workers = []
  for index in range(2):
    temp = temp_root / f'tmp{index}'
    temp.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items()
           if key != 'TF_CONFIG' and not key.startswith(_PLACING)}
    env.update(TMPDIR=str(temp), **places[index])
    workers.append(subprocess.Popen(
        _worker_command(model_dir, digits_dir, *flags), cwd=REPO, env=env,
        stderr=subprocess.PIPE, text=True))
  logs = [w.communicate(timeout=TIMEOUT_S)[1] for w in workers]
  for index, worker in enumerate(workers):
    assert worker.returncode == 0, logs[index][-3000:]
  digests = [re.search(r'final weights sha256 (\w+)', log).group(1)
             for log in logs]
  assert digests[0] == digests[1]  # Identical weights on both workers.
  assert 'done:' not in logs[1]  # Only the chief writes metrics.json.
  assert not os.listdir(temp_root / 'tmp1')  # Its temporary dir is gone.
  return logs


@pytest.mark.slow
@pytest.mark.parametrize('strategy, clones', [
    ('multi_worker', 2), ('multi_worker_mirrored', 1)])
def test_two_workers_train_like_one_process(tmp_path, digits_dir, run_train,
                                            strategy, clones):
  """2 workers x K clones = one process with 2K clones, same global batch."""
  reference = run_train(model_dir=str(tmp_path / 'one'), num_clones=2 * clones,
                        batch_size=4, train_steps=3, optimizer='momentum',
                        learning_rate=0.05)  # Also prepares digits.
  model_dir = tmp_path / 'job'
  flags = [f'--strategy={strategy}', f'--num_clones={clones}']
  _run_job(model_dir, digits_dir, tmp_path, *flags, '--train_steps=3')
  metrics = json.loads((model_dir / 'metrics.json').read_text())
  assert metrics['num_workers'] == 2 and metrics['steps'] == 3
  assert metrics['global_batch_size'] == 8 * clones
  assert_same_checkpoints(metrics['checkpoint'], reference['checkpoint'])
  if strategy == 'multi_worker':  # A whole-cluster restart resumes.
    _run_job(model_dir, digits_dir, tmp_path, *flags, '--train_steps=5')
    metrics = json.loads((model_dir / 'metrics.json').read_text())
    assert (metrics['resumed_from_step'], metrics['steps']) == (3, 5)


@pytest.mark.slow
def test_two_workers_accumulate_like_one_process(tmp_path, digits_dir,
                                                 run_train):
  """2 workers x 2 clones x 2 accumulation steps = one process with 4 clones
  x 2 accumulation steps: one all-reduce an update, after both."""
  reference = run_train(model_dir=str(tmp_path / 'one'), num_clones=4,
                        batch_size=4, train_steps=3, optimizer='momentum',
                        learning_rate=0.05, accumulation_steps=2)
  model_dir = tmp_path / 'job'
  _run_job(model_dir, digits_dir, tmp_path, '--strategy=multi_worker',
           '--num_clones=2', '--accumulation_steps=2', '--train_steps=3')
  metrics = json.loads((model_dir / 'metrics.json').read_text())
  assert metrics['global_batch_size'] == 32 and metrics['steps'] == 3
  assert_same_checkpoints(metrics['checkpoint'], reference['checkpoint'])


@pytest.mark.slow
def test_two_workers_with_atoms_train_the_bits_of_one_clone(
    tmp_path, digits_dir):
  """With --reproducible_rows, 2 workers train bit for bit what one process
  with one clone trains on the same global batch (16 rows, 4 atoms), over
  50 steps: the atoms are gathered, not all-reduced."""
  # The reference is a process of its own too: the guarantee holds for one
  # TensorFlow build and thread count, and a pytest worker runs fewer
  # threads than a fresh process.
  flags = ('--reproducible_rows=4', '--train_steps=50',
           '--log_every_steps=10')
  one = tmp_path / 'one'
  subprocess.run(_worker_command(one, digits_dir, '--batch_size=16', *flags),
                 cwd=REPO, check=True, timeout=TIMEOUT_S,
                 capture_output=True)
  reference = json.loads((one / 'metrics.json').read_text())
  model_dir = tmp_path / 'job'
  _run_job(model_dir, digits_dir, tmp_path, '--strategy=multi_worker',
           '--num_clones=1', '--batch_size=8', *flags)
  metrics = json.loads((model_dir / 'metrics.json').read_text())
  assert metrics['global_batch_size'] == 16 and metrics['steps'] == 50
  assert reference['global_batch_size'] == 16 and reference['num_clones'] == 1
  assert_same_checkpoints(metrics['checkpoint'], reference['checkpoint'],
                          exact=True)
  assert metrics['train_loss'] == reference['train_loss']


@pytest.mark.slow
def test_two_workers_with_spread_variables_train_the_central_bits(
    tmp_path, digits_dir, run_train):
  """--variables_device=spread on 2 workers x 2 clones: each worker's copy
  of every variable and slot lives on one of its own clone devices, and
  the job trains, bit for bit under --reproducible_rows, the weights of
  the same job with each worker's variables on its CPU."""
  run_train(train_steps=1)  # Prepares digits before two workers read it.
  flags = ('--strategy=multi_worker', '--num_clones=2', '--model=lenet',
           '--reproducible_rows=2', '--train_steps=4')
  central = _run_job(tmp_path / 'central', digits_dir, tmp_path / 'c',
                     *flags)
  spread = _run_job(tmp_path / 'spread', digits_dir, tmp_path / 's', *flags,
                    '--variables_device=spread')
  for index, log in enumerate(spread):
    held = re.search(r"this worker's variables and slots: (.*)", log)
    where = dict((device, int(count)) for count, device in re.findall(
        r'(\d+) on (\S+?)(?:,|$)', held.group(1)))
    task = f'/job:worker/replica:0/task:{index}/device:CPU:'
    # LeNet's 10 variables, their 10 momentum slots and `iterations`.
    # Largest first to the least-loaded device: the first dense kernel
    # (most of the bytes) and its momentum on CPU:0, beside `iterations`
    # (made outside the spreading); every other variable and slot on CPU:1.
    assert where == {task + '0': 3, task + '1': 18}, held.group(0)
    assert re.search(f"variables and slots: 21 on {task}0$", central[index],
                     re.MULTILINE)
  metrics = [json.loads((tmp_path / name / 'metrics.json').read_text())
             for name in ('spread', 'central')]
  assert metrics[0]['steps'] == metrics[1]['steps'] == 4
  assert_same_checkpoints(metrics[0]['checkpoint'], metrics[1]['checkpoint'],
                          exact=True)


@pytest.mark.slow
def test_two_workers_with_a_mesh_each_train_as_one_process(
    tmp_path, digits_dir, run_train):
  """A mesh of each worker's 2 clones (--plan_tables: a pixel table split
  by rows over them), on 2 workers: each worker's shards and slots on its
  own two devices, the shards' gradients all-reduced across the workers,
  and the weights one process of 4 clones trains, whole."""
  module = tmp_path / 'user_models.py'
  module.write_text(user_models.USER_MODULE)
  model = f'--model={module}:pixels'
  reference = run_train(model_dir=str(tmp_path / 'one'), num_clones=4,
                        batch_size=4, train_steps=3, optimizer='momentum',
                        learning_rate=0.05, model=f'{module}:pixels')
  logs = _run_job(tmp_path / 'job', digits_dir, tmp_path,
                  '--strategy=multi_worker', '--num_clones=2', model,
                  '--mesh_shape=2', '--mesh_axes=model', '--plan_tables',
                  '--train_steps=3')
  for index, log in enumerate(logs):
    assert 'table pixels/embeddings: by rows over model' in log
    held = re.search(r"this worker's variables and slots: (.*)", log)
    task = f'/job:worker/replica:0/task:{index}/device:CPU:'
    assert {device for device in re.findall(r'\d+ on (\S+?)(?:,|$)',
                                            held.group(1))} == {
        task + '0', task + '1'}, held.group(0)
  metrics = json.loads((tmp_path / 'job' / 'metrics.json').read_text())
  assert metrics['global_batch_size'] == 16 and metrics['steps'] == 3
  assert_same_checkpoints(metrics['checkpoint'], reference['checkpoint'])


@pytest.mark.slow
def test_two_workers_joining_in_their_layers_calls_train_as_one_process(
    tmp_path, digits_dir, run_train):
  """Each worker's kernels split over its 2 clones (FSDP's layout),
  joined in the layers' calls and again for their gradients, the
  shards' gradients all-reduced across the workers: the weights one
  process of 4 clones trains."""
  module = tmp_path / 'user_models.py'
  module.write_text(user_models.USER_MODULE)
  reference = run_train(model_dir=str(tmp_path / 'one'), num_clones=4,
                        batch_size=4, train_steps=3, optimizer='momentum',
                        learning_rate=0.05, model=f'{module}:dense')
  logs = _run_job(tmp_path / 'job', digits_dir, tmp_path,
                  '--strategy=multi_worker', '--num_clones=2',
                  f'--model={module}:dense', '--mesh_shape=2',
                  '--mesh_axes=batch', f'--layout_map={module}:fsdp',
                  '--train_steps=3')
  for log in logs:
    assert 'Variables sharded by their layouts: 2 of 4' in log, log[-2000:]
  metrics = json.loads((tmp_path / 'job' / 'metrics.json').read_text())
  assert metrics['global_batch_size'] == 16 and metrics['steps'] == 3
  assert_same_checkpoints(metrics['checkpoint'], reference['checkpoint'])


@pytest.mark.slow
def test_a_worker_without_its_peer_fails_with_the_address(tmp_path,
                                                          digits_dir):
  ports = _free_ports(2)
  env = dict(os.environ, TF_CONFIG=_tf_config(ports, 0))
  start = time.monotonic()
  result = subprocess.run(
      _worker_command(tmp_path / 'alone', digits_dir, '--peer_timeout_s=3',
                      '--strategy=multi_worker', '--train_steps=3'),
      cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
  assert (f'error: worker 0 cannot reach its peer localhost:{ports[1]} after '
          '3 s') in result.stderr
  assert time.monotonic() - start < 60


@pytest.mark.slow
def test_workers_started_with_different_flags_stop_with_one_line(
    tmp_path, digits_dir, run_train):
  run_train(train_steps=1)  # Prepares digits in digits_dir once.
  ports = _free_ports(2)
  workers = []
  for index, batch_size in enumerate((4, 8)):
    env = dict(os.environ, TF_CONFIG=_tf_config(ports, index))
    workers.append(subprocess.Popen(
        _worker_command(tmp_path / 'job', digits_dir,
                        '--strategy=multi_worker', '--train_steps=3',
                        f'--batch_size={batch_size}'),
        cwd=REPO, env=env, stderr=subprocess.PIPE, text=True))
  logs = [w.communicate(timeout=TIMEOUT_S)[1] for w in workers]
  for worker, log, batch_size in zip(workers, logs, (4, 8)):
    assert worker.returncode == 1, log[-2000:]
    assert ('train.py: error: the workers of this job disagree on '
            f'global_batch_size (this worker has global_batch_size='
            f'{batch_size * 2})') in log
    assert 'Traceback' not in log
  assert not (tmp_path / 'job' / 'ckpt-1.index').exists()


@pytest.mark.slow
def test_a_peer_lost_mid_run_stops_the_others_with_one_line(
    tmp_path, digits_dir, run_train):
  run_train(train_steps=1)  # Prepares digits in digits_dir once.
  ports = _free_ports(2)
  workers = [subprocess.Popen(
      _worker_command(tmp_path / 'job', digits_dir, '--strategy=multi_worker',
                      '--train_steps=500', '--peer_timeout_s=10'),
      cwd=REPO, env=dict(os.environ, TF_CONFIG=_tf_config(ports, index)),
      stderr=subprocess.PIPE, text=True) for index in range(2)]
  for line in workers[1].stderr:
    if 'step 5/500' in line:
      workers[1].kill()  # A machine lost mid-run.
      break
  workers[1].communicate(timeout=TIMEOUT_S)
  start = time.monotonic()
  log = workers[0].communicate(timeout=TIMEOUT_S)[1]
  # The status that tells an elastic launcher this worker is well.
  assert workers[0].returncode == errors.PEER_LOST_EXIT, log[-2000:]
  assert (f'train.py: error: worker 0 lost a peer mid-step: worker 1 at '
          f'localhost:{ports[1]} (' in log
          and 'resume from the latest checkpoint' in log)
  assert 'Traceback' not in log
  assert time.monotonic() - start < 60


@pytest.mark.slow
def test_a_worker_whose_port_is_taken_stops_with_one_line(tmp_path,
                                                          digits_dir):
  taken = socket.create_server(('localhost', 0))
  peer, = _free_ports(1)
  env = dict(os.environ, TF_CONFIG=json.dumps(
      {'cluster': {'worker': [f'localhost:{taken.getsockname()[1]}',
                              f'localhost:{peer}']},
       'task': {'type': 'worker', 'index': 0}}))
  try:
    # The watchdog holds stderr too: run() returns once it has ended.
    result = subprocess.run(
        _worker_command(tmp_path / 'job', digits_dir,
                        '--strategy=multi_worker', '--peer_timeout_s=30'),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  finally:
    taken.close()
  assert result.returncode == 1, result.stderr[-2000:]
  assert ('train.py: error: worker 0 cannot start the multi-worker strategy '
          'on localhost:') in result.stderr
  assert 'the port is free' in result.stderr
  assert 'Traceback' not in result.stderr
  assert 'cannot reach its peer' not in result.stderr  # No stale watchdog.


def _free_run(count, digits=1):
  """A first port whose next `count - 1` ports (or, with `digits`, the
  ports made by appending 0..count-1) are free on loopback."""
  for _ in range(100):
    (first,) = _free_ports(1)
    base = first // 10 if digits == 2 else first
    ports = ([base * 10 + i for i in range(count)] if digits == 2
             else [first + i for i in range(count)])
    if all(port < 65536 for port in ports) and _are_free(ports):
      return base
  raise AssertionError('no run of free ports')


def _are_free(ports):
  for port in ports:
    with socket.socket() as probe:
      try:
        probe.bind(('localhost', port))
      except OSError:
        return False
  return True


@pytest.mark.slow
def test_a_slurm_step_and_an_indexed_job_train_like_tf_config(
    tmp_path, digits_dir, run_train):
  """Two tasks of one fake Slurm step on one node (no GPUs), and two pods
  of a fake Indexed Job, train the bits of the same job under TF_CONFIG,
  which trains as one process of 2 clones."""
  reference = run_train(model_dir=str(tmp_path / 'one'), num_clones=2,
                        batch_size=4, train_steps=2, optimizer='momentum',
                        learning_rate=0.05)  # Also prepares digits.
  flags = ['--strategy=multi_worker', '--num_clones=1', '--train_steps=2']
  runs = {}
  port = _free_run(2)
  slurm = [{'SLURM_PROCID': str(i), 'SLURM_STEP_NUM_TASKS': '2',
            'SLURM_STEP_NODELIST': 'localhost',
            'SLURM_STEP_TASKS_PER_NODE': '2'} for i in range(2)]
  prefix = _free_run(2, digits=2)
  pods = [{'JOB_COMPLETION_INDEX': str(i)} for i in range(2)]
  # The pods run docs/indexed_job.yaml's command, on loopback.
  indexed = indexed_job_flags(f'localhost:{prefix}{{index}}')
  for name, extra, places in (
      ('tf_config', [], None),
      ('slurm', [f'--port={port}'], slurm),
      ('indexed_job', indexed, pods)):
    model_dir = tmp_path / name
    _run_job(model_dir, digits_dir, tmp_path / f'temp_{name}', *flags,
             *extra, places=places)
    runs[name] = json.loads((model_dir / 'metrics.json').read_text())
    assert runs[name]['num_workers'] == 2
  assert_same_checkpoints(runs['tf_config']['checkpoint'],
                          reference['checkpoint'])
  for name in ('slurm', 'indexed_job'):
    assert_same_checkpoints(runs[name]['checkpoint'],
                            runs['tf_config']['checkpoint'], exact=True)


_STEPS = 30
# A job whose every update is bit for bit one process's: 2 workers x 1 clone
# x 8 rows, in atoms of 4 rows, one checkpoint at the end unless stopped.
_EXACT_JOB = ('--strategy=multi_worker', '--num_clones=1', '--batch_size=8',
              '--reproducible_rows=4', f'--train_steps={_STEPS}',
              f'--checkpoint_steps={_STEPS}')


@pytest.fixture(scope='module')
def one_process(tmp_path_factory, digits_dir):
  """metrics.json of the exact job's global batch trained by one process
  with one clone (a process of its own: the bits hold for one thread
  count)."""
  model_dir = tmp_path_factory.mktemp('one_process')
  subprocess.run(_worker_command(
      model_dir, digits_dir, '--batch_size=16', '--reproducible_rows=4',
      f'--train_steps={_STEPS}'), cwd=REPO, check=True, timeout=TIMEOUT_S,
                 capture_output=True)
  return json.loads((model_dir / 'metrics.json').read_text())


def _launch(model_dir, digits_dir, *flags, stderr=subprocess.PIPE,
            launcher_flags=('--num_workers=2',)):
  return subprocess.Popen(
      [sys.executable, '-m', 'tfmulti.launch', *launcher_flags, '--',
       *_worker_command(model_dir, digits_dir, *flags)[1:]],
      cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True)


def _wait_for_line(path, text, process):
  """Waits until the log file `path` holds `text` (or `process` ends)."""
  deadline = time.monotonic() + TIMEOUT_S
  while text not in path.read_text():
    assert process.poll() is None, path.read_text()[-3000:]
    assert time.monotonic() < deadline, f'no {text!r} in {path}'
    time.sleep(0.1)


@pytest.mark.slow
def test_the_launcher_runs_the_command_line_on_two_workers(
    tmp_path, digits_dir, one_process):
  launcher = _launch(tmp_path / 'job', digits_dir, *_EXACT_JOB)
  _, log = launcher.communicate(timeout=TIMEOUT_S)
  assert launcher.returncode == 0, log[-3000:]
  # Each worker's lines carry its prefix: both trained the same weights.
  digests = {re.search(rf'\[worker {i}\] .*final weights sha256 (\w+)',
                       log).group(1) for i in range(2)}
  assert len(digests) == 1
  # Each line once; each worker names the directory it really writes to.
  lines = log.splitlines()
  assert len(lines) == len(set(lines))
  assert re.search(
      rf'\[worker 0\] .*writing to {re.escape(str(tmp_path / "job"))}$',
      log, re.M)
  assert re.search(r'\[worker 1\] .*writing to \S*tfmulti-worker1-\S+ '
                   r'\(worker files, removed at the end', log)
  metrics = json.loads((tmp_path / 'job' / 'metrics.json').read_text())
  assert metrics['num_workers'] == 2 and metrics['global_batch_size'] == 16
  assert_same_checkpoints(metrics['checkpoint'], one_process['checkpoint'],
                          exact=True)


def _saved_step(log, label):
  found = re.search(rf'{label} at step (\d+): saved ', log)
  assert found, log[-3000:]
  return int(found.group(1))


def _resume_and_compare(model_dir, digits_dir, tmp_path, saved, one_process):
  """Relaunches the stopped job; it ends with one process's bits."""
  _run_job(model_dir, digits_dir, tmp_path / 'resume', *_EXACT_JOB)
  metrics = json.loads((model_dir / 'metrics.json').read_text())
  assert (metrics['resumed_from_step'], metrics['steps']) == (saved, _STEPS)
  assert_same_checkpoints(metrics['checkpoint'], one_process['checkpoint'],
                          exact=True)


@pytest.mark.slow
@pytest.mark.parametrize('signalled', [0, 1])
def test_a_signal_to_one_worker_saves_every_worker_at_one_step(
    tmp_path, digits_dir, one_process, signalled):
  """SIGTERM to the chief or to the other: both save the same step, exit
  as by SIGTERM, and the relaunched job ends as if never stopped."""
  ports = _free_ports(2)
  model_dir = tmp_path / 'job'
  logs = [tmp_path / f'worker{i}.log' for i in range(2)]
  workers = []
  for index in range(2):
    with open(logs[index], 'w') as log:
      workers.append(subprocess.Popen(
          _worker_command(model_dir, digits_dir, *_EXACT_JOB), cwd=REPO,
          env=dict(os.environ, TF_CONFIG=_tf_config(ports, index)),
          stderr=log))
  _wait_for_line(logs[signalled], f'step 5/{_STEPS}', workers[signalled])
  workers[signalled].send_signal(signal.SIGTERM)
  for worker in workers:
    worker.wait(timeout=TIMEOUT_S)
  texts = [log.read_text() for log in logs]
  assert [w.returncode for w in workers] == [128 + signal.SIGTERM] * 2, (
      texts[0][-2000:], texts[1][-2000:])
  label = f'SIGTERM to worker {signalled}'
  saved = {_saved_step(text, label) for text in texts}
  assert len(saved) == 1 and 5 < min(saved) < _STEPS
  saved, = saved
  assert (model_dir / f'ckpt-{saved}.index').exists()
  _resume_and_compare(model_dir, digits_dir, tmp_path, saved, one_process)


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_saves_every_worker_at_one_step(
    tmp_path, digits_dir, one_process):
  """SIGINT reaches both workers at once: the first to publish its step
  wins, both save it, and the relaunched job ends as if never stopped."""
  model_dir = tmp_path / 'job'
  log = tmp_path / 'launcher.log'
  with open(log, 'w') as stderr:
    launcher = _launch(model_dir, digits_dir, *_EXACT_JOB, stderr=stderr)
  _wait_for_line(log, f'step 5/{_STEPS}', launcher)
  launcher.send_signal(signal.SIGINT)
  launcher.communicate(timeout=TIMEOUT_S)
  text = log.read_text()
  assert launcher.returncode == 128 + signal.SIGINT, text[-3000:]
  found = re.findall(r'\[worker (\d)\] .*SIGINT to worker \d at step (\d+): '
                     'saved ', text)
  assert sorted(index for index, _ in found) == ['0', '1'], text[-3000:]
  saved = {int(step) for _, step in found}
  assert len(saved) == 1 and 5 < min(saved) < _STEPS
  _resume_and_compare(model_dir, digits_dir, tmp_path, min(saved),
                      one_process)


def _descendants(pid):
  """The PIDs of every process under `pid` (Linux /proc)."""
  found, frontier = [], [pid]
  while frontier:
    parent = frontier.pop()
    try:
      tasks = os.listdir(f'/proc/{parent}/task')
    except FileNotFoundError:  # It ended while we looked.
      continue
    for task in tasks:
      try:
        with open(f'/proc/{parent}/task/{task}/children') as f:
          children = [int(c) for c in f.read().split()]
      except FileNotFoundError:
        continue
      found += children
      frontier += children
  return found


def _alive(pid):
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


@pytest.mark.slow
def test_a_worker_lost_under_the_launcher_ends_the_job_and_every_process(
    tmp_path, digits_dir, run_train):
  run_train(train_steps=1)  # Prepares digits in digits_dir once.
  log = tmp_path / 'launcher.log'
  with open(log, 'w') as stderr:
    launcher = _launch(tmp_path / 'job', digits_dir, '--strategy=multi_worker',
                       '--train_steps=500', '--peer_timeout_s=10',
                       stderr=stderr)
  _wait_for_line(log, 'step 5/500', launcher)
  started = _descendants(launcher.pid)
  workers = [p for p in started if 'train.py' in open(
      f'/proc/{p}/cmdline').read()]
  assert len(workers) == 2
  os.kill(max(workers), signal.SIGKILL)  # One machine lost mid-run.
  launcher.communicate(timeout=TIMEOUT_S)
  text = log.read_text()
  assert launcher.returncode != 0, text[-3000:]
  assert re.search(r'worker \d exited with status \d+; stopping the others',
                   text)
  assert not [p for p in started if _alive(p)]


@pytest.mark.slow
def test_two_workers_train_their_own_files_the_same_steps(tmp_path,
                                                          digits_dir):
  """--shard_files: worker 0 reads 100 rows, worker 1 50; both train the
  50 rows' steps, so neither waits in a collective at the epoch's end."""
  records = tmp_path / 'records'
  test_tfrecords.write_records(records, 'train', 150, files=3)
  test_tfrecords.write_records(records, 'validation', 20, files=1,
                               start=150)
  model_dir = tmp_path / 'job'
  _run_job(model_dir, digits_dir, tmp_path, '--strategy=multi_worker',
           '--num_clones=1', f'--dataset=tfrecord:{records}/train-*',
           f'--validation_glob={records}/validation-*', '--shard_files',
           '--image_size=28,28', '--epochs=1')
  metrics = json.loads((model_dir / 'metrics.json').read_text())
  assert metrics['steps'] == 50 // 4  # 4 rows a worker a step.
  job = json.loads((model_dir / 'job.json').read_text())['job']
  assert job['input_options']['shard_files'] is True


# An elastic job: global batches of 48 rows in atoms of 4 (16 rows on each
# of 3 workers, 24 on 2), a checkpoint every 10 steps.
_ELASTIC_STEPS = 30
_ELASTIC_JOB = ('--strategy=multi_worker', '--num_clones=1',
                '--reproducible_rows=4', f'--train_steps={_ELASTIC_STEPS}',
                '--checkpoint_steps=10')
_ELASTIC = ('--num_workers=3', '--min_workers=2')


@pytest.fixture(scope='module')
def one_process_48(tmp_path_factory, digits_dir):
  """metrics.json of the elastic job's global batch on one process."""
  model_dir = tmp_path_factory.mktemp('one_process_48')
  subprocess.run(_worker_command(
      model_dir, digits_dir, '--batch_size=48', '--reproducible_rows=4',
      f'--train_steps={_ELASTIC_STEPS}'), cwd=REPO, check=True,
                 timeout=TIMEOUT_S, capture_output=True)
  return json.loads((model_dir / 'metrics.json').read_text())


def _worker_pid(launcher_pid, index):
  """The PID of the launcher's train.py worker `index`."""
  for pid in _descendants(launcher_pid):
    try:
      with open(f'/proc/{pid}/environ', 'rb') as f:
        env = dict(item.split(b'=', 1) for item in f.read().split(b'\0')
                   if b'=' in item)
    except OSError:  # Gone, or a zombie.
      continue
    if b'TF_CONFIG' in env and json.loads(env[b'TF_CONFIG'])['task'][
        'index'] == index:
      return pid
  raise AssertionError(f'no worker {index} under {launcher_pid}')


@pytest.mark.slow
def test_a_job_that_loses_a_worker_goes_on_with_the_bits_of_one_process(
    tmp_path, digits_dir, one_process_48):
  """3 workers, worker 2 killed (SIGKILL) after step 20: the launcher goes
  on with 2 from the latest checkpoint, 24 rows each, and the weights are
  those of one process (and of 3 workers never interrupted)."""
  model_dir = tmp_path / 'job'
  log = tmp_path / 'launcher.log'
  with open(log, 'w') as stderr:
    launcher = _launch(model_dir, digits_dir, '--batch_size=16',
                       *_ELASTIC_JOB, stderr=stderr, launcher_flags=_ELASTIC)
  _wait_for_line(log, f'step 20/{_ELASTIC_STEPS}', launcher)
  os.kill(_worker_pid(launcher.pid, 2), signal.SIGKILL)
  launcher.communicate(timeout=TIMEOUT_S)
  text = log.read_text()
  assert launcher.returncode == 0, text[-3000:]
  assert ('lost worker 2 (killed by SIGKILL): restart 1 goes on with 2 '
          'workers') in text
  assert re.search(r"\[worker 0\] .*elastic start 1 on 2 workers: the job's "
                   'global batch of 48 rows is kept, 24 rows a clone', text)
  metrics = json.loads((model_dir / 'metrics.json').read_text())
  assert metrics['steps'] == _ELASTIC_STEPS
  assert metrics['resumed_from_step'] in (10, 20)
  assert (metrics['num_workers'], metrics['global_batch_size'],
          metrics['elastic_restarts']) == (2, 48, 1)
  assert_same_checkpoints(metrics['checkpoint'], one_process_48['checkpoint'],
                          exact=True)
  whole = tmp_path / 'uninterrupted'
  launcher = _launch(whole, digits_dir, '--batch_size=16', *_ELASTIC_JOB,
                     launcher_flags=('--num_workers=3',))
  _, text = launcher.communicate(timeout=TIMEOUT_S)
  assert launcher.returncode == 0, text[-3000:]
  assert_same_checkpoints(
      json.loads((whole / 'metrics.json').read_text())['checkpoint'],
      metrics['checkpoint'], exact=True)


@pytest.mark.slow
@pytest.mark.parametrize('workers, cut', [
    (3, '16 rows a clone'), (5, "the workers' parts 12/12/8/8/8 rows")])
def test_two_workers_grow_with_the_bits_of_one_process(
    tmp_path, digits_dir, one_process_48, workers, cut):
  """2 workers train 15 steps of 48 rows; an elastic launch of 3 or 5 (the
  same --batch_size, which would make 72 or 120) keeps 48 (on 5 workers,
  parts of whole atoms that differ) and ends with one process's
  weights."""
  model_dir = tmp_path / 'job'
  flags = ('--batch_size=24', *_ELASTIC_JOB)
  launcher = _launch(model_dir, digits_dir, *flags, '--train_steps=15')
  _, text = launcher.communicate(timeout=TIMEOUT_S)
  assert launcher.returncode == 0, text[-3000:]
  launcher = _launch(model_dir, digits_dir, *flags, launcher_flags=(
      f'--num_workers={workers}', '--min_workers=2'))
  _, text = launcher.communicate(timeout=TIMEOUT_S)
  assert launcher.returncode == 0, text[-3000:]
  assert re.search(rf"\[worker 0\] .*elastic start 0 on {workers} workers: "
                   f"the job's global batch of 48 rows is kept, {cut}", text)
  metrics = json.loads((model_dir / 'metrics.json').read_text())
  assert (metrics['resumed_from_step'], metrics['steps']) == (
      15, _ELASTIC_STEPS)
  assert (metrics['num_workers'], metrics['global_batch_size']) == (
      workers, 48)
  assert_same_checkpoints(metrics['checkpoint'], one_process_48['checkpoint'],
                          exact=True)


@pytest.mark.slow
def test_a_job_without_atoms_goes_on_with_the_steps_of_one_process(
    tmp_path, digits_dir):
  """Without --reproducible_rows: 3 workers lose one after step 8 and go on
  with 2 at the same global batch and rate; the weights after 24 steps
  are one process's on the same 48-row batches, to 1e-5."""
  flags = ('--strategy=multi_worker', '--num_clones=1', '--train_steps=24',
           '--checkpoint_steps=4')
  one = tmp_path / 'one'
  subprocess.run(_worker_command(one, digits_dir, '--batch_size=48',
                                 '--train_steps=24'), cwd=REPO, check=True,
                 timeout=TIMEOUT_S, capture_output=True)
  model_dir = tmp_path / 'job'
  log = tmp_path / 'launcher.log'
  with open(log, 'w') as stderr:
    launcher = _launch(model_dir, digits_dir, '--batch_size=16', *flags,
                       stderr=stderr, launcher_flags=_ELASTIC)
  _wait_for_line(log, 'step 8/24', launcher)
  os.kill(_worker_pid(launcher.pid, 1), signal.SIGKILL)
  launcher.communicate(timeout=TIMEOUT_S)
  text = log.read_text()
  assert launcher.returncode == 0, text[-3000:]
  assert 'lost worker 1 (killed by SIGKILL): restart 1 goes on with 2' in text
  metrics = json.loads((model_dir / 'metrics.json').read_text())
  # Resumed from a checkpoint before the end (the kill may land late).
  assert 0 < metrics['resumed_from_step'] < 24 and metrics['steps'] == 24
  assert (metrics['global_batch_size'], metrics['learning_rate']) == (
      48, json.loads((one / 'metrics.json').read_text())['learning_rate'])
  assert_same_checkpoints(
      metrics['checkpoint'],
      json.loads((one / 'metrics.json').read_text())['checkpoint'])


@pytest.mark.slow
def test_fewer_workers_than_min_workers_stop_with_the_checkpoints_intact(
    tmp_path, digits_dir):
  """3 workers with --min_workers=2 lose two at once: the launcher stops
  with one line and a failure status; the latest checkpoint reads whole,
  and no record says the job finished."""
  model_dir = tmp_path / 'job'
  log = tmp_path / 'launcher.log'
  with open(log, 'w') as stderr:
    launcher = _launch(model_dir, digits_dir, '--batch_size=16',
                       *_ELASTIC_JOB, stderr=stderr, launcher_flags=_ELASTIC)
  _wait_for_line(log, f'step 12/{_ELASTIC_STEPS}', launcher)
  for index in (1, 2):
    os.kill(_worker_pid(launcher.pid, index), signal.SIGKILL)
  launcher.communicate(timeout=TIMEOUT_S)
  text = log.read_text()
  assert launcher.returncode == 128 + signal.SIGKILL, text[-3000:]
  assert re.search(r'lost worker 1 \(killed by SIGKILL\), worker 2 \(killed '
                   r'by SIGKILL\): 1 workers left, fewer than '
                   r'--min_workers=2; the job stops', text), text[-3000:]
  assert 'restart 1' not in text
  latest = tf.train.latest_checkpoint(str(model_dir))
  assert re.search(r'ckpt-(10|20)$', latest)  # Where the kill found it.
  assert checkpoint_tensors(latest)  # Every tensor reads back.
  assert not (model_dir / 'metrics.json').exists()
