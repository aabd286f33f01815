"""The model_dir as a trusted place: usable paths, one writer, one job.

* `check_directory`: a directory that can be created and written, or one
  line naming the flag and the fix (a regular file, a path under a file, a
  read-only file system).
* `Lock`: one run writes to a model_dir at a time. The lock is the kernel's
  (`flock` on `<model_dir>/.lock`), so a killed run never leaves it stuck.
* `check_job`: `<model_dir>/job.json` records what the checkpoints are of
  (model, data, optimizer, global batch, precision). A resume that would
  change the job is refused with one line naming what differs; settings that
  may change on resume (learning rate, steps, clones, path) take effect, and
  the log says which changed.
"""

import fcntl
import json
import os
import socket
import tempfile

from absl import logging

from tfmulti import errors

LOCK_FILE = '.lock'
JOB_FILE = 'job.json'


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
    changed = [f'{name} {saved_settings.get(name)!r} -> {value!r}'
               for name, value in settings.items()
               if saved_settings.get(name) != value]
    if changed:
      logging.info('resuming with changed settings: %s', ', '.join(changed))
  with open(path + '.tmp', 'w') as f:
    json.dump({'job': job, 'settings': settings}, f, indent=2,
              sort_keys=True)
  os.replace(path + '.tmp', path)
