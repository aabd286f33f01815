"""The model_dir as a trusted place: usable paths, one writer, one job.

* `check_directory`: a directory that can be created and written, or one
  line naming the flag and the fix (a regular file, a path under a file, a
  read-only file system).
* `Lock`: one run writes to a model_dir at a time. The lock is the kernel's
  (`flock` on `<model_dir>/.lock`), so a killed run never leaves it stuck.
* `check_job`: `<model_dir>/job.json` records what the checkpoints are of
  (model, data, optimizer, global batch, precision). A resume that would
  change the job is refused with one line naming what differs; settings that
  may change on resume (learning rate, steps, clones, path, step options)
  take effect, the log says which changed, and `record_stretch` keeps, for
  each stretch of steps, the settings that trained it.
* `claimed`: the directory checked and locked for the run; a run that
  stops before it trained (refused, or failing in the user's own model
  function) leaves no trace of itself.
"""

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile

from absl import logging

from tfmulti import errors

LOCK_FILE = '.lock'
JOB_FILE = 'job.json'
FLAGS_FILE = 'flags.txt'  # The command line's, for --flagfile.


def check_directory(flag, path):
  """Creates directory `path` if needed and checks that it is writable.

  Raises:
    errors.RunDirError: naming `--<flag>`, the reason and the fix.
  """
  if os.path.exists(path) and not os.path.isdir(path):
    raise errors.RunDirError(f'--{flag}={path} is a file, not a directory; '
                             'pass a directory.')
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix='.write-test-'):
      pass
  except OSError as e:
    raise errors.RunDirError(
        f'--{flag}={path} cannot be used ({e.strerror or e}); pass a '
        'directory this user can write.') from e


class Lock:
  """While entered, this process is the only writer of `directory`."""

  def __init__(self, directory):
    self._path = os.path.join(directory, LOCK_FILE)
    self._file = None

  def __enter__(self):
    handle = open(self._path, 'a+')
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      handle.seek(0)
      holder = handle.read().strip() or 'another process'
      handle.close()
      raise errors.RunDirError(
          f'--model_dir={os.path.dirname(self._path)} is in use by another '
          f'run ({holder}); wait for it to finish, or pass another '
          '--model_dir.') from None
    handle.seek(0)
    handle.truncate()
    handle.write(f'pid {os.getpid()} on {socket.gethostname()}\n')
    handle.flush()
    self._file = handle
    return self

  def __exit__(self, *exc_info):
    fcntl.flock(self._file, fcntl.LOCK_UN)
    self._file.close()


def check_job(directory, job, settings, *, resuming):
  """Records `job` in `directory`, or checks a resume against the record.

  Args:
    directory: the model_dir.
    job: {name: value} that a resume must keep (what the checkpoints are).
    settings: {name: value} that may change on resume (logged if they do).
    resuming: whether `directory` holds checkpoints to resume from.

  Raises:
    errors.RunDirError: the resume would change the job (naming what and
      how), or the record is unreadable.
  """
  path = os.path.join(directory, JOB_FILE)
  job = as_json(job)
  if resuming and os.path.exists(path):
    try:
      with open(path) as f:
        saved = json.load(f)
      saved_job, saved_settings = saved['job'], saved['settings']
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise errors.RunDirError(
          f'{path} cannot be read ({e}); restore it, or pass a new '
          '--model_dir.') from e
    differs = [f'{name}={saved_job.get(name)!r} there, {value!r} here'
               for name, value in job.items() if saved_job.get(name) != value]
    if differs:
      raise errors.RunDirError(
          f'--model_dir={directory} holds another job ({"; ".join(differs)})'
          '; resume with the flags that started it, or pass a new '
          '--model_dir.')
    settings = as_json(settings)
    changed = [f'{name} {saved_settings.get(name)!r} -> {value!r}'
               for name, value in settings.items()
               if saved_settings.get(name) != value]
    if changed:
      logging.info('resuming with changed settings: %s', ', '.join(changed))
    # A record from before stretches were kept: one stretch from step 0.
    stretches = saved.get('stretches') or [
        {'from_step': 0, 'settings': saved_settings}]
  else:
    stretches = []
  _write(path, {'job': job, 'settings': settings, 'stretches': stretches})


def recorded_job(directory):
  """The job `directory`'s job.json records, or None when it has none or
  it cannot be read (`check_job` says so, later)."""
  try:
    with open(os.path.join(directory, JOB_FILE)) as f:
      return json.load(f)['job']
  except (OSError, ValueError, KeyError, TypeError):
    return None


def record_stretch(directory, from_step, settings):
  """Records in job.json that steps from `from_step` on are trained with
  `settings` (a stretch begins only where the settings change); returns
  the stretches, [{'from_step': step, 'settings': {...}}], oldest first.

  A stretch that began at or after `from_step` (a resume from an older
  checkpoint) no longer describes the weights and is dropped.
  """
  path = os.path.join(directory, JOB_FILE)
  with open(path) as f:
    saved = json.load(f)
  settings = as_json(settings)
  stretches = [stretch for stretch in saved.get('stretches', [])
               if stretch['from_step'] < from_step]
  if not stretches or stretches[-1]['settings'] != settings:
    stretches.append({'from_step': from_step, 'settings': settings})
  saved['stretches'] = stretches
  _write(path, saved)
  return stretches


def write_flags(directory, command):
  """Writes `command` (the resolved flags, one a line) as `directory`'s
  flagfile: `train.py --flagfile=<directory>/flags.txt` runs the job
  again, a later flag (`--model_dir=...`) replacing the file's."""
  path = os.path.join(directory, FLAGS_FILE)
  with open(path + '.tmp', 'w') as f:
    f.write(''.join(f'{line}\n' for line in command))
  os.replace(path + '.tmp', path)


def as_json(value):
  """`value` as it reads back from JSON (tuples become lists)."""
  return json.loads(json.dumps(value))


def _write(path, record):
  with open(path + '.tmp', 'w') as f:
    json.dump(record, f, indent=2, sort_keys=True)
  os.replace(path + '.tmp', path)


# What a run leaves before it trains: a directory holding only these
# describes nothing that happened.
_BEFORE_TRAINING = {LOCK_FILE, JOB_FILE, FLAGS_FILE}


@contextlib.contextmanager
def claimed(directory, *, lock=True):
  """`directory` checked (created if needed) and, with `lock`, locked.

  Any exception raised inside (a `UserError`, or one from the user's own
  model function, whose traceback it keeps), while a directory this call
  created holds nothing but the lock and the job record, removes what it
  created (its missing parents too): a run that never trained leaves the
  filesystem as it was.
  """
  created = _first_missing(directory)
  check_directory('model_dir', directory)
  try:
    with Lock(directory) if lock else contextlib.nullcontext():
      yield
  except BaseException:  # Ctrl-C during the build, too: nothing trained.
    if created and _holds_only(created, _BEFORE_TRAINING):
      shutil.rmtree(created)
    raise


def _first_missing(path):
  """The outermost directory of `path` that does not exist yet, or None."""
  path, missing = os.path.abspath(path), None
  while not os.path.exists(path):
    path, missing = os.path.dirname(path), path
  return missing


def _holds_only(top, names):
  return all(set(files) <= names for _, _, files in os.walk(top))
