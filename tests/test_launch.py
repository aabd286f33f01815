"""Tests for the one-machine launcher (`python -m tfmulti.launch`).

The workers here are small Python scripts, so each test takes a second: the
launcher starts any script, and what it owes them (a place each, their
logs, signals once, no orphans) does not depend on TensorFlow. The
launcher's run of train.py and of a `fit` script is in
tests/distribute/test_cluster.py (slow).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from tfmulti import errors
from tfmulti import launch

# A worker: says its place, writes its PID and its place for each elastic
# start, counts the signals it gets; it exits 3 if it is the worker named
# by --fail (once all are ready), by --fail_first (so, on the first start
# only) or by --fail_on_signal (on a signal); on the first start with
# --peer_lost I, every worker but I exits 75 (a lost peer's status) and I
# hangs; else it exits after a signal to it or to any worker (128 + N, as
# train.py after the save the workers agree on) or after the seconds given.
_WORKER = """
import json, os, pathlib, signal, sys, time
place = json.loads(os.environ['TF_CONFIG'])
index = place['task']['index']
out = pathlib.Path(sys.argv[1])
print('place', json.dumps(place))
print('to stderr', file=sys.stderr)
(out / f'pid{index}').write_text(str(os.getpid()))
got = []
def count(signum, frame):
  got.append(signum)
  (out / f'signals{index}').write_text(str(len(got)))
signal.signal(signal.SIGTERM, count)
signal.signal(signal.SIGINT, count)
(out / f'ready{index}').write_text('')
mode = sys.argv[2:4]
start = os.environ.get('TFMULTI_ELASTIC_START')
(out / f'start{start}-worker{index}').write_text(json.dumps(place))
def all_ready():
  while not all((out / f'ready{i}').exists()
                for i in range(len(place['cluster']['worker']))):
    time.sleep(0.05)
if mode == ['--fail_first', str(index)] and start == '0':
  all_ready()
  sys.exit(3)
if mode[:1] == ['--peer_lost'] and start == '0':
  all_ready()
  if index != int(mode[1]):
    sys.exit(75)  # Its peer `mode[1]` stopped answering.
  time.sleep(300)
if mode == ['--fail', str(index)]:
  # Once every worker can count its signals: a worker still starting would
  # die of the SIGTERM, as it should, without counting it.
  while not all((out / f'ready{i}').exists()
                for i in range(len(place['cluster']['worker']))):
    time.sleep(0.05)
  sys.exit(3)
deadline = time.monotonic() + float(sys.argv[-1])
while time.monotonic() < deadline:
  if got and mode == ['--fail_on_signal', str(index)]:
    sys.exit(3)  # Its save failed.
  if got:
    (out / 'agreed').write_text('')  # Every worker stops at the same step.
  if got or (out / 'agreed').exists():
    # "Saving", longer for a worker stopped by the agreement: a second
    # signal would be counted.
    time.sleep(0.5 if got else 1.5)
    sys.exit(128 + (got[0] if got else signal.SIGTERM))
  time.sleep(0.05)
"""


@pytest.fixture
def worker_script(tmp_path):
  path = tmp_path / 'worker.py'
  path.write_text(_WORKER)
  return path


def _launch(*args, **kwargs):
  return subprocess.Popen(
      [sys.executable, '-m', 'tfmulti.launch', *args], cwd=REPO,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _gone(pid):
  """Whether process `pid` has ended (a zombie left to init counts)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] == 'Z'
  except FileNotFoundError:
    return True


def _wait_for(paths, timeout_s=60):
  deadline = time.monotonic() + timeout_s
  while not all(p.exists() for p in paths):
    assert time.monotonic() < deadline, f'never written: {paths}'
    time.sleep(0.05)


def test_each_worker_gets_its_place_and_its_lines_a_prefix(tmp_path,
                                                          worker_script):
  launcher = _launch('--num_workers=3', '--', str(worker_script),
                     str(tmp_path), '0')
  out, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 0, err
  places = {}
  for line in out.splitlines():
    prefix, _, text = line.partition('] ')
    assert prefix.startswith('[worker ')
    places[int(prefix[len('[worker '):])] = json.loads(text.split(' ', 1)[1])
  assert sorted(places) == [0, 1, 2]
  addresses = places[0]['cluster']['worker']
  assert len(set(addresses)) == 3
  assert all(a.startswith('localhost:') for a in addresses)
  for index, place in places.items():
    assert place == {'cluster': {'worker': addresses},
                     'task': {'type': 'worker', 'index': index}}
  for index in range(3):
    assert f'[worker {index}] to stderr' in err.splitlines()


def test_a_port_places_the_workers_on_it_and_the_next(tmp_path, worker_script):
  launcher = _launch('--num_workers=2', '--port=23456', str(worker_script),
                     str(tmp_path), '0')
  out, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 0, err
  assert ('"worker": ["localhost:23456", "localhost:23457"]' in out)


def test_a_failed_worker_stops_the_others_and_sets_the_status(
    tmp_path, worker_script):
  start = time.monotonic()
  launcher = _launch('--num_workers=3', '--grace_s=5', '--',
                     str(worker_script), str(tmp_path), '--fail', '1', '300')
  _, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 3
  assert 'worker 1 exited with status 3; stopping the others' in err
  assert time.monotonic() - start < 30
  for index in (0, 2):  # Asked to stop once, and gone.
    assert (tmp_path / f'signals{index}').read_text() == '1'
    assert _gone(int((tmp_path / f'pid{index}').read_text()))


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_reaches_every_worker_once(tmp_path, worker_script, signum):
  launcher = _launch('--num_workers=2', '--', str(worker_script),
                     str(tmp_path), '300')
  _wait_for([tmp_path / f'ready{i}' for i in range(2)])
  launcher.send_signal(signum)
  _, err = launcher.communicate(timeout=60)
  # Each worker stops by itself after one signal, as train.py after its
  # checkpoint, and the launcher reports their status.
  assert launcher.returncode == 128 + signum, err
  assert 'stopping the others' not in err
  for index in range(2):
    assert (tmp_path / f'signals{index}').read_text() == '1'
    assert _gone(int((tmp_path / f'pid{index}').read_text()))


def test_a_signal_to_one_worker_stops_the_job_without_a_failure(
    tmp_path, worker_script):
  """SIGTERM to a worker, not the launcher (a preemption): every worker
  saves the step they agree on and exits 143, and the launcher signals
  none of them, which would cut a save short."""
  launcher = _launch('--num_workers=2', '--', str(worker_script),
                     str(tmp_path), '300')
  _wait_for([tmp_path / f'ready{i}' for i in range(2)])
  os.kill(int((tmp_path / 'pid0').read_text()), signal.SIGTERM)
  _, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 128 + signal.SIGTERM, err
  assert 'stopping the others' not in err
  assert (tmp_path / 'signals0').read_text() == '1'
  assert not (tmp_path / 'signals1').exists()  # It stopped by itself.
  for index in range(2):
    assert _gone(int((tmp_path / f'pid{index}').read_text()))


def test_a_failure_after_a_forwarded_signal_still_stops_the_others(
    tmp_path, worker_script):
  launcher = _launch('--num_workers=2', '--grace_s=5', '--',
                     str(worker_script), str(tmp_path), '--fail_on_signal',
                     '1', '300')
  _wait_for([tmp_path / f'ready{i}' for i in range(2)])
  launcher.send_signal(signal.SIGTERM)
  _, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 3, err
  assert 'worker 1 exited with status 3; stopping the others' in err
  # The forwarded signal, then the launcher's own.
  assert (tmp_path / 'signals0').read_text() == '2'
  assert _gone(int((tmp_path / 'pid0').read_text()))


@pytest.mark.parametrize('returncode, forwarded, stop', [
    (128 + signal.SIGTERM, False, True),  # It saved on its own signal.
    (128 + signal.SIGINT, True, True),
    (-signal.SIGTERM, True, True),  # Killed by the forwarded signal.
    (-signal.SIGTERM, False, False),  # Killed, unsaved, by another's.
    (-signal.SIGKILL, True, False),
    (1, True, False),
    (3, False, False),
])
def test_a_signal_stop_is_not_a_failure(returncode, forwarded, stop):
  assert launch.is_stop(returncode, forwarded) is stop


def test_workers_die_with_a_killed_launcher(tmp_path, worker_script):
  launcher = _launch('--num_workers=2', '--', str(worker_script),
                     str(tmp_path), '300')
  _wait_for([tmp_path / f'ready{i}' for i in range(2)])
  launcher.kill()
  launcher.communicate(timeout=60)
  pids = [int((tmp_path / f'pid{i}').read_text()) for i in range(2)]
  deadline = time.monotonic() + 30
  while not all(_gone(pid) for pid in pids):
    assert time.monotonic() < deadline, 'a worker outlived its launcher'
    time.sleep(0.1)


@pytest.mark.parametrize('args, message', [
    (['--num_workers=0', '--', '{script}'], 'num_workers=0: must be'),
    (['--num_workers=2', '--', 'missing.py'], "script 'missing.py' does not "
     'exist'),
    (['--num_workers=2'], 'no script to run; give it after --'),
    (['--num_workers=2', '--port=65535', '{script}'], '--port=65535 leaves '
     'no room for 2 workers'),
    (['--num_workers=2', '--grace_s=-1', '{script}'], '--grace_s=-1.0 is '
     'negative'),
    (['--num_workers=2', '--min_workers=3', '{script}'], '--min_workers=3: '
     'give from 1 to --num_workers=2'),
    (['--num_workers=2', '--bogus=1', '--', '{script}'], 'unrecognized '
     'arguments: --bogus=1; see python -m tfmulti.launch --help'),
    (['--', '{script}'], 'the following arguments are required: '
     '--num_workers'),
])
def test_bad_input_is_one_line_and_starts_nothing(tmp_path, worker_script,
                                                  args, message):
  if '{script}' in args:  # The worker would write to tmp_path.
    args = [*args, str(tmp_path), '0']
  launcher = _launch(*(a.format(script=worker_script) for a in args))
  out, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 1
  assert err.startswith(f'python -m tfmulti.launch: error: {message}')
  assert len(err.strip().splitlines()) == 1 and not out
  assert sorted(os.listdir(tmp_path)) == ['worker.py']


def test_config_from_args_takes_the_script_with_or_without_dashes(
    worker_script):
  script = str(worker_script)
  with_dashes = launch.config_from_args(['--num_workers=2', '--', script,
                                         '--x=1'])
  assert with_dashes.command == (script, '--x=1')
  assert launch.config_from_args(['--num_workers=2', script]).command == (
      script,)
  # Not a file: a module, for instance (-m NAME).
  module = launch.config_from_args(['--num_workers=1', '--', '-m', 'x'])
  assert module.command == ('-m', 'x')
  with pytest.raises(errors.ConfigError, match='give it after --'):
    launch.config_from_args(['--num_workers=2', '--'])


def _places(tmp_path, start):
  """Each worker's TF_CONFIG at elastic start `start`, by index."""
  return {int(path.name.rsplit('worker', 1)[1]): json.loads(path.read_text())
          for path in tmp_path.glob(f'start{start}-worker*')}


@pytest.mark.slow
def test_an_elastic_job_goes_on_with_the_workers_left(tmp_path,
                                                      worker_script):
  launcher = _launch('--num_workers=3', '--min_workers=2', '--',
                     str(worker_script), str(tmp_path), '--fail_first', '1',
                     '1')
  _, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 0, err
  assert ('lost worker 1 (exited with status 3): restart 1 goes on with 2 '
          'workers from the latest intact checkpoint') in err
  first, second = _places(tmp_path, 0), _places(tmp_path, 1)
  assert sorted(first) == [0, 1, 2] and sorted(second) == [0, 1]
  addresses = second[0]['cluster']['worker']
  assert len(addresses) == 2
  assert not set(addresses) & set(first[0]['cluster']['worker'])  # Fresh.
  assert not list(tmp_path.glob('start2-*'))  # One restart.


@pytest.mark.slow
def test_a_worker_that_stops_answering_is_the_one_lost(tmp_path,
                                                       worker_script):
  """Its peers exit with the lost-peer status; it is killed and the job
  goes on without it."""
  launcher = _launch('--num_workers=3', '--min_workers=2', '--grace_s=1',
                     '--', str(worker_script), str(tmp_path), '--peer_lost',
                     '2', '1')
  _, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 0, err
  assert 'lost worker 2 (stopped answering): restart 1 goes on with 2' in err
  assert sorted(_places(tmp_path, 1)) == [0, 1]


@pytest.mark.slow
def test_fewer_than_min_workers_left_stops_with_one_line(tmp_path,
                                                         worker_script):
  launcher = _launch('--num_workers=3', '--min_workers=2', '--',
                     str(worker_script), str(tmp_path), '--fail', '1', '300')
  _, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 3, err
  assert ('lost worker 1 (exited with status 3): 1 workers left, fewer than '
          '--min_workers=2; the job stops') in err
  assert sorted(_places(tmp_path, 1)) == [0, 1]  # It went on once.
  assert not list(tmp_path.glob('start2-*'))
  for index in (0,):  # Killed, not left behind.
    assert _gone(int((tmp_path / f'pid{index}').read_text()))


def test_without_min_workers_no_start_is_numbered(tmp_path, worker_script):
  launcher = _launch('--num_workers=2', '--', str(worker_script),
                     str(tmp_path), '0')
  launcher.communicate(timeout=60)
  assert sorted(_places(tmp_path, None)) == [0, 1]
