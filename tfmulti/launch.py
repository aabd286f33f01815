"""Several workers on one machine: the way to try multi-worker on a laptop.

  python -m tfmulti.launch --num_workers=2 -- train.py --strategy=multi_worker
  python -m tfmulti.launch --num_workers=2 -- my_fit_script.py --epochs=3

starts `--num_workers` Python processes of the script, each with the
`TF_CONFIG` that places it (worker i of `localhost:PORT`, ..., on free
loopback ports unless `--port` gives the first), as `torchrun --standalone`
does for PyTorch. It prefixes each line a worker writes with `[worker i]`,
on the stream it was written to; it forwards SIGINT (Ctrl-C) and SIGTERM to
every worker, once per signal (each worker saves and stops: a second one
stops it at once); and when a worker fails it stops the others (SIGTERM,
then SIGKILL after `--grace_s`) and exits with the failed worker's code. A
worker that saved and stopped on a signal (status 130 or 143, after one
the launcher forwarded or one that reached any worker of the job, which
all agree to stop) has not failed: the others stop by themselves.
Workers die with the launcher even when it is killed (Linux), and each
worker's own watchdog ends with its worker, so nothing is left behind.

  python -m tfmulti.launch --num_workers=3 --min_workers=2 -- \
      train.py --strategy=multi_worker ...

is elastic: when a worker dies (any failure but a lost peer's status,
`errors.PEER_LOST_EXIT`) or stops answering (its peers exit with that
status after `--peer_timeout_s` and it does not), the launcher kills the
others at once (checkpoints are whole or absent, so nothing partial is
left) and starts the job again on the workers it still has, on fresh
ports, with `ELASTIC_START` (see `tf_config`) set to the restart's
number: train.py then resumes from the latest intact checkpoint with the
global batch its job.json recorded at the first start (`run_dir`), so
the weights go on as if no worker had been lost. Fewer than
`--min_workers` left: one line, the lost worker's status, and the
checkpoints as they were.

The launcher imports no TensorFlow: it only starts, watches and stops.
"""

import argparse
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags
from absl import logging

from tfmulti import errors
from tfmulti import tf_config

PROGRAM = 'python -m tfmulti.launch'
_FORWARDED = (signal.SIGINT, signal.SIGTERM)
# The statuses of a worker that saved and stopped on a signal (train.py's,
# a `fit` script's): 128 + N, as a shell reports death by signal N.
_STOP_CODES = tuple(128 + s for s in _FORWARDED)
_POLL_S = 0.1
_SETTLE_S = 1.0  # After a failure, how long others have to show theirs.
_PR_SET_PDEATHSIG = 1  # From <linux/prctl.h>.


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """What to start.

  Attributes:
    num_workers: processes to start, worker 0 (the chief) first.
    min_workers: the fewest workers the job goes on with after losing
      some (elastic when below `num_workers`).
    port: the first worker's port, the others' following it; 0 picks free
      loopback ports.
    grace_s: seconds a worker has to stop after SIGTERM once another has
      failed, before SIGKILL.
    command: the script and its arguments, run with this Python.
  """
  num_workers: int
  port: int
  grace_s: float
  command: tuple
  min_workers: int = 0  # 0: num_workers.

  def __post_init__(self):
    errors.check_count('num_workers', self.num_workers, 1)
    if not self.min_workers:
      object.__setattr__(self, 'min_workers', self.num_workers)
    if not 1 <= self.min_workers <= self.num_workers:
      raise errors.ConfigError(
          f'--min_workers={self.min_workers}: give from 1 to --num_workers='
          f'{self.num_workers}, the fewest workers the job goes on with.')
    if self.port and not 1024 <= self.port <= 65536 - self.num_workers:
      raise errors.ConfigError(
          f'--port={self.port} leaves no room for {self.num_workers} '
          'workers; give a port from 1024 to '
          f'{65536 - self.num_workers}, or 0 for free ports.')
    if self.grace_s < 0:
      raise errors.ConfigError(f'--grace_s={self.grace_s} is negative; give '
                               'the seconds a worker has to stop, e.g. 30.')
    if not self.command:
      raise errors.ConfigError(
          f'no script to run; give it after --, e.g. {PROGRAM} '
          '--num_workers=2 -- train.py --strategy=multi_worker')
    script = self.command[0]
    if script.endswith('.py') and not os.path.isfile(script):
      raise errors.ConfigError(
          f'script {script!r} does not exist (from {os.getcwd()}); give its '
          'path after --.')


def _elastic(launch_config):
  return launch_config.min_workers < launch_config.num_workers


class _Parser(argparse.ArgumentParser):

  def error(self, message):
    """One line, without argparse's usage block."""
    raise errors.ConfigError(f'{message}; see {PROGRAM} --help.')


def config_from_args(argv):
  """The `LaunchConfig` of the command line `argv` (without the program).

  Raises:
    errors.ConfigError: a bad value, or no script.
  """
  parser = _Parser(prog=PROGRAM, description=__doc__.split('\n\n')[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--num_workers', type=int, required=True,
                      help='Worker processes to start on this machine.')
  parser.add_argument('--port', type=int, default=0,
                      help='Worker 0\'s port; worker i uses PORT+i. '
                      '0 (default): free loopback ports.')
  parser.add_argument('--min_workers', type=int, default=0,
                      help='Elastic: when workers are lost, go on with the '
                      'others from the latest checkpoint, at the same global '
                      'batch, while at least MIN_WORKERS are left. Default: '
                      'num_workers (a lost worker stops the job).')
  parser.add_argument('--grace_s', type=float, default=30.0,
                      help='Once a worker fails, seconds the others have to '
                      'stop after SIGTERM before SIGKILL (default 30).')
  parser.add_argument('command', nargs=argparse.REMAINDER,
                      help='-- SCRIPT ARGS...: run on every worker.')
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  return LaunchConfig(args.num_workers, args.port, args.grace_s,
                      tuple(command), args.min_workers)


def free_ports(count):
  """`count` loopback ports that were free a moment ago."""
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(('localhost', 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def _die_with_parent():
  """In the child, before exec: SIGKILL when the launcher dies (Linux)."""
  if sys.platform.startswith('linux'):
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG,
                                            int(signal.SIGKILL))


def _stream(pipe, prefix, out, lock):
  """Copies `pipe` to `out` line by line, each line after `prefix`."""
  for line in iter(pipe.readline, b''):
    with lock:
      out.write(prefix + line)
      out.flush()
  pipe.close()


def _exit_code(returncode):
  """A child's status as a shell reports it (128 + N for signal N)."""
  return 128 - returncode if returncode < 0 else returncode


def is_stop(returncode, forwarded):
  """Whether a worker that ended with `returncode` (Popen's) stopped as
  asked rather than failed, so its peers are left to stop by themselves.

  A worker that saved on a signal exits 130 or 143 itself: the launcher
  forwarded the signal, or the job agreed to stop on one that reached
  another worker (a preemption), and every worker saves that step and
  exits so; a SIGTERM from the launcher then would cut a peer's save
  short. Once the launcher has `forwarded` a signal, a worker that died of
  it (one still starting) has stopped too. Any other non-zero status is a
  failure.
  """
  if returncode in _STOP_CODES:
    return True
  return forwarded and -returncode in _FORWARDED


class WorkerProcesses:
  """The started worker processes, their log streams and their fate."""

  def __init__(self, launch_config, ports, start=0):
    """Starts a worker on each of `ports`; `start` numbers the elastic
    job's starts (0 first). Call before any other thread exists: the
    child's pre-exec step is only safe in a one-thread parent."""
    self.config = launch_config
    self.signalled = False  # A signal was passed on: they stop themselves.
    self.killed = set()  # Killed by `kill`, still running then.
    self.processes = []
    elastic = ({tf_config.ELASTIC_START: str(start)}
               if _elastic(launch_config) else {})
    for index in range(len(ports)):
      env = dict(os.environ, TF_CONFIG=tf_config.for_worker(
          [f'localhost:{p}' for p in ports], index),
                 PYTHONUNBUFFERED='1', **elastic)
      self.processes.append(subprocess.Popen(
          [sys.executable, *launch_config.command], env=env,
          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          start_new_session=True,  # Ctrl-C reaches them once, forwarded.
          preexec_fn=_die_with_parent))
    lock = threading.Lock()
    self._streams = [
        threading.Thread(target=_stream, daemon=True, args=(
            pipe, f'[worker {index}] '.encode(), out, lock))
        for index, p in enumerate(self.processes)
        for pipe, out in ((p.stdout, sys.stdout.buffer),
                          (p.stderr, sys.stderr.buffer))]
    for thread in self._streams:
      thread.start()

  def signal_running(self, signum):
    """Sends `signum` to every worker still running."""
    for process in self.processes:
      if process.poll() is None:
        process.send_signal(signum)

  def first_failure(self):
    """(index, exit code) of a worker that failed (`is_stop` says which
    do not), else None."""
    for index, process in enumerate(self.processes):
      if process.poll() not in (None, 0) and not is_stop(process.returncode,
                                                          self.signalled):
        return index, _exit_code(process.returncode)
    return None

  def first_stop(self):
    """The exit code of the first worker that ended non-zero, else None:
    where `first_failure` finds none, one that stopped on a signal."""
    for process in self.processes:
      if process.poll() not in (None, 0):
        return _exit_code(process.returncode)
    return None

  def running(self):
    return any(p.poll() is None for p in self.processes)

  def lost(self):
    """The indices of the workers lost, once one has failed (else []):
    those that failed other than by losing a peer; if every failure is a
    lost peer's, those still running after `grace_s` (they stopped
    answering)."""
    if not self.first_failure():
      return []
    time.sleep(_SETTLE_S)  # Workers lost together are counted together.
    deadline = time.monotonic() + self.config.grace_s
    while True:
      ended = {i: p.poll() for i, p in enumerate(self.processes)}
      failed = [i for i, code in ended.items() if code not in (
          None, 0, errors.PEER_LOST_EXIT) and not is_stop(code, False)]
      if failed:
        return failed
      silent = [i for i, code in ended.items() if code is None]
      if not silent or time.monotonic() >= deadline:
        return silent
      time.sleep(_POLL_S)

  def kill(self):
    """SIGKILL to the running workers (noted in `killed`): the job starts
    again without them."""
    self.killed = {i for i, p in enumerate(self.processes)
                   if p.poll() is None}
    self.signal_running(signal.SIGKILL)
    self.wait()

  def fate(self, index):
    """How worker `index` ended, for a line a user reads."""
    code = self.processes[index].returncode
    if index in self.killed:
      return 'stopped answering'
    if code < 0:
      return f'killed by {signal.Signals(-code).name}'
    return ('lost a peer' if code == errors.PEER_LOST_EXIT
            else f'exited with status {code}')

  def stop(self):
    """SIGTERM to the running workers, SIGKILL after the grace period."""
    self.signal_running(signal.SIGTERM)
    deadline = time.monotonic() + self.config.grace_s
    while self.running() and time.monotonic() < deadline:
      time.sleep(_POLL_S)
    self.signal_running(signal.SIGKILL)
    self.wait()

  def wait(self):
    for process in self.processes:
      process.wait()
    for thread in self._streams:
      thread.join()


class Forwarded:
  """SIGINT and SIGTERM to the launcher, passed on to the workers it runs
  (`watch`), once per signal; installed before any worker starts, so a
  signal that comes while they start reaches them as soon as they exist,
  and one before an elastic restart ends the job instead."""

  def __init__(self):
    self.workers = None
    self.received = None  # The signal, once one came.

  def __enter__(self):
    self._previous = {s: signal.signal(s, self._forward) for s in _FORWARDED}
    return self

  def __exit__(self, *unused):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _forward(self, signum, frame):
    del frame  # Unused.
    logging.warning('%s: passed to every worker', signal.Signals(signum).name)
    self.received = signum
    if self.workers is not None:
      self.workers.signalled = True
      self.workers.signal_running(signum)

  def watch(self, workers):
    """Forwards to `workers` from now on (and the signal that came while
    they started)."""
    self.workers = workers
    if self.received:
      self._forward(self.received, None)


def supervise(workers, elastic=False):
  """Waits for every worker; returns (the launcher's exit code: the failed
  worker's, else that of the first to stop on a signal, else 0; the
  indices of the workers lost, with `elastic`, else []).

  A worker that fails stops the others: SIGTERM, then SIGKILL after the
  grace period; with `elastic`, the lost ones found (`lost`), SIGKILL at
  once. A worker that stops on a signal, forwarded (`Forwarded`) or its
  own, is not a failure (`is_stop`): the others stop by themselves.
  """
  while workers.running():
    failure = workers.first_failure()
    if failure and elastic and not workers.signalled:
      lost = workers.lost()
      workers.kill()
      return _exit_code(workers.processes[lost[0]].returncode), lost
    if failure:
      index, code = failure
      logging.error('worker %d exited with status %d; stopping the others',
                    index, code)
      workers.stop()
      return code, []
    time.sleep(_POLL_S)
  workers.wait()
  failure = workers.first_failure()
  return (failure[1] if failure else workers.first_stop() or 0), []


def main(argv=None):
  """Runs the launcher on `argv` (default: the command line); exits."""
  argv = sys.argv[1:] if argv is None else argv
  flags.FLAGS.mark_as_parsed()  # absl's logging, without absl's flags.
  logging.use_absl_handler()
  logging.set_verbosity(logging.INFO)
  try:
    launch_config = config_from_args(argv)
  except errors.UserError as e:
    sys.exit(f'{PROGRAM}: error: {e}')
  sys.exit(run(launch_config))


def run(launch_config):
  """Starts the job, and again on the workers left after each loss while
  `min_workers` are left (elastic); returns the launcher's exit code."""
  count, start = launch_config.num_workers, 0
  with Forwarded() as forwarded:
    while True:
      code, lost, workers = _start(launch_config, count, start, forwarded)
      if not lost or forwarded.received:
        return code
      count, start = _restart(launch_config, count, start, lost, workers)
      if count is None:
        return code or 1


def _start(launch_config, count, start, forwarded):
  """Starts `count` workers (elastic start `start`) and supervises them:
  (exit code, workers lost, the `WorkerProcesses`)."""
  ports = ([launch_config.port + i for i in range(count)]
           if launch_config.port and not start else free_ports(count))
  logging.info('%d workers on %s', count,
               ', '.join(f'localhost:{p}' for p in ports))
  workers = WorkerProcesses(launch_config, ports, start)
  forwarded.watch(workers)
  return (*supervise(workers, elastic=_elastic(launch_config)), workers)


def _restart(launch_config, count, start, lost, workers):
  """(workers, start) of the next start after losing `lost`; (None, None)
  where fewer than `min_workers` are left (said in one line)."""
  left = count - len(lost)
  what = ', '.join(f'worker {i} ({workers.fate(i)})' for i in lost)
  if left < launch_config.min_workers:
    logging.error('lost %s: %d workers left, fewer than --min_workers=%d; '
                  'the job stops with its checkpoints as they are (run the '
                  'same command to resume)', what, left,
                  launch_config.min_workers)
    return None, None
  logging.warning('lost %s: restart %d goes on with %d workers from the '
                  'latest intact checkpoint, at the same global batch',
                  what, start + 1, left)
  return left, start + 1


if __name__ == '__main__':
  main()
