"""A quiet start: TensorFlow's C++ start-up chatter held back.

Importing TensorFlow and probing for CUDA on a machine without a GPU prints
lines from C++ straight to file descriptor 2 ("All log messages before
absl::InitializeLog() ...", "Could not find cuda drivers", "failed call to
cuInit"), which `TF_CPP_MIN_LOG_LEVEL` does not reach. `quiet_start`
runs those two steps inside `held()`, which sends descriptor 2 to a
temporary file and shows what it caught only if the step fails;
`--verbosity=1` (or `-v 1`) shows everything. The command line starts so,
and so does every `python -m tfmulti.<module>` command (the package does it
when run as one). Only `quiet_start` imports TensorFlow.
"""

import contextlib
import os
import sys
import tempfile

_VERBOSE = ('--verbosity', '-v', '--v')


def verbose(argv):
  """Whether `argv` asks for debug logging (absl's --verbosity >= 1)."""
  for k, arg in enumerate(argv):
    name, _, value = arg.partition('=')
    if name in _VERBOSE:
      if not value and k + 1 < len(argv):
        value = argv[k + 1]
      try:
        return int(value) >= 1
      except ValueError:
        return False
  return False


@contextlib.contextmanager
def held(enabled=True):
  """Holds what is written to descriptor 2 inside; replays it on failure."""
  if not enabled:
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      caught.seek(0)
      sys.stderr.write(caught.read().decode(errors='replace'))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)


def quiet_start(argv):
  """Imports TensorFlow and probes for CUDA with the C++ start-up lines
  held back, unless `argv` asks for --verbosity; returns whether it did."""
  loud = verbose(argv)
  if not loud:
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  with held(enabled=not loud):
    import tensorflow as tf  # Here, inside held(): its start-up lines.
    tf.config.list_physical_devices('GPU')  # Probes CUDA now, quietly.
  return loud
