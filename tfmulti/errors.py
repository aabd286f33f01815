"""The one error type that reaches the user, and the checks that raise it.

Every problem a user can fix (a bad flag or config value, a missing device,
an unavailable dataset, a checkpoint of another model, a strategy that
cannot train the model, a malformed cluster) raises a `UserError` whose
message names the value and the fix, in one line. The command line catches
this one type and prints the message without a traceback. The specific
subclasses say where the problem was found; all are `ValueError`s, as a bad
argument to a library function is in Python.
"""

import re
import sys


class UserError(ValueError):
  """A problem the user can fix; the message names the value and the fix."""


class ConfigError(UserError):
  """A config or flag value, or a combination of them, that cannot work."""


class DeviceError(UserError):
  """A device the deployment needs does not exist in this runtime."""


class DatasetUnavailableError(UserError):
  """A dataset has no prepared copy and cannot be downloaded here."""


class CheckpointMismatchError(UserError):
  """A checkpoint in model_dir does not fit the model being trained."""


class CheckpointDamagedError(UserError):
  """Checkpoints exist in model_dir, and none of them can be read."""


class CheckpointWriteError(UserError):
  """A checkpoint could not be written (disk full, no access)."""


class RunDirError(UserError):
  """model_dir or data_dir cannot be used: not a directory, not writable,
  in use by another run, or holding another job."""


class UnsupportedError(UserError):
  """A strategy cannot train this model in TF 2.21 / Keras 3."""


class ClusterError(UserError):
  """TF_CONFIG is missing, malformed, or disagrees with the flags."""


class PeerLostError(ClusterError):
  """A peer of a multi-worker job stopped answering mid-run: this worker
  is well, and exits with `PEER_LOST_EXIT`, so that a launcher that
  restarts the job (`tfmulti.launch --min_workers`) counts it a survivor."""


# The exit status of a worker that lost a peer (sysexits' EX_TEMPFAIL:
# "a temporary failure; the user is invited to retry").
PEER_LOST_EXIT = 75


def exit_for(error, program=None):
  """The `SystemExit` a `UserError` ends a process with: one line,
  `[program: ]error: <message>`, and status 1; for a lost peer the line
  on stderr and `PEER_LOST_EXIT` (this worker is well: an elastic
  launcher restarts it)."""
  line = f'{program}: error: {error}' if program else f'error: {error}'
  if isinstance(error, PeerLostError):
    sys.stderr.write(line + '\n')
    return SystemExit(PEER_LOST_EXIT)
  return SystemExit(line)


class NonFiniteError(UserError):
  """The loss or the weights became NaN or infinite; training stopped
  without saving them."""


def first_line(error):
  """The first line of `error`'s message (TensorFlow's run to pages), or
  its type's name if it has none."""
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def tf_reason(error):
  """`first_line(error)` without the op names TensorFlow wraps it in
  (`{{function_node ...}}`, `[Op:DecodeImage]`): what a user can act on;
  for a compiled call's error ("Graph execution error:", then where the
  op was built), its last line, which says what failed."""
  text = str(error).strip()
  if text.startswith('Graph execution error'):
    text = text.splitlines()[-1]
  text = re.sub(r'\{\{function_node [^}]*\}\}|\[Op:[^\]]*\]', '',
                first_line(text))
  return ' '.join(text.split()) or type(error).__name__


def check_choice(name, value, choices):
  """Raises `ConfigError` unless `value` is one of `choices`."""
  if value not in choices:
    raise ConfigError(f'{name}={value!r}: choose one of {tuple(choices)}.')


def check_count(name, value, minimum):
  """Raises `ConfigError` unless `value` is an integer >= `minimum`."""
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ConfigError(f'{name}={value!r}: must be an integer >= {minimum}.')


def check_positive(name, value):
  """Raises `ConfigError` unless `value` (if given) is finite and > 0."""
  if value is None:
    return
  if not value > 0 or value == float('inf'):
    raise ConfigError(f'{name}={value!r}: must be a finite number > 0.')
