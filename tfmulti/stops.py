"""Clean stops on signals: the first SIGTERM or Ctrl-C asks, the second
stops at once.

The training loops (the command line's and `TowersModel.fit`'s) read
`StopSignals.received` at each step boundary and stop with a `Stop` after
saving; a multi-worker job first agrees on the step
(`distribute.preemption`).
"""

import collections
import os
import signal
import threading

from absl import logging

# How a run stops: `label` for its message (the signal, and in a
# multi-worker job the worker it reached), `exit_code` the shell's code for
# death by that signal (128 + its number), on every worker.
Stop = collections.namedtuple('Stop', ['label', 'exit_code'])


def exit_code(signal_name):
  """The shell's code for death by signal `signal_name` (128 + number)."""
  return 128 + signal.Signals[signal_name].value


class StopSignals:
  """While entered, SIGTERM and SIGINT ask the training loop to stop.

  The first signal sets `received` (its name); the loop finishes the current
  step, saves a checkpoint and stops. A second signal stops the process at
  once, by that signal, for a user who presses Ctrl-C twice. Outside the main
  thread Python cannot install handlers, and signals keep their defaults.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received = None
    self._previous = {}

  def _handle(self, signum, frame):
    del frame  # Unused.
    if self.received:
      # Stop at once, as the signal's default would: no traceback, and the
      # exit status says which signal (130 for Ctrl-C, 143 for SIGTERM).
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.received = signal.Signals(signum).name
    logging.warning('%s received: stopping after this step with a checkpoint '
                    '(send it again to stop at once)', self.received)

  def stop(self):
    """The `Stop` of this one process, or None before any signal."""
    received = self.received  # Read once: a signal may land at any line.
    return Stop(received, exit_code(received)) if received else None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}
