"""Long phases shown as they go: a bar in a terminal, plain lines in a log.

A run's long phases (preparing a dataset, tracing the step, evaluating,
exporting) run inside `phase(name, total)`. Where the log goes to a
terminal (stderr is one), a line is redrawn in place: a bar of `total`
parts advanced by `Phase.advance`, or, where the parts are not counted
(tracing), the seconds so far, redrawn twice a second; it ends with the
phase's time. Elsewhere (a log file, a job's output) no escape code or
carriage return is written: one log line when the phase starts and one
with its time when it ends.
"""

import contextlib
import sys
import threading
import time

from absl import logging

_WIDTH = 30  # Characters of a bar.
_TICK_S = 0.5  # Seconds between redraws of an uncounted phase.


class Phase:
  """A phase under way: `advance(parts)` as its parts finish."""

  def __init__(self, name, total, stream):
    self.name, self.total, self._stream = name, total, stream
    self.done = 0
    self.started = time.perf_counter()
    self._lock = threading.Lock()

  def advance(self, parts=1):
    self.done += parts
    if self._stream is not None and self.total:
      self.draw()

  def draw(self, end=''):
    """Redraws the phase's line in place (`end`: '\n' when it ends)."""
    seconds = time.perf_counter() - self.started
    if self.total:
      filled = _WIDTH * min(self.done, self.total) // self.total
      shown = (f'[{"=" * filled}{" " * (_WIDTH - filled)}] '
               f'{self.done}/{self.total} ')
    else:
      shown = ''
    with self._lock:
      self._stream.write(f'\r{self.name}: {shown}{seconds:.1f} s{end}')
      self._stream.flush()


@contextlib.contextmanager
def phase(name, total=None, *, stream=None, own_bar=False):
  """Shows the phase `name` of `total` parts (None: not counted) while the
  body runs (see the module); yields its `Phase`.

  Args:
    stream: where a terminal's bar goes (stderr); a stream that is no
      terminal gets log lines instead.
    own_bar: the phase draws its own bar in a terminal (TFDS's
      preparation): only the log lines are this one's.
  """
  stream = sys.stderr if stream is None else stream
  drawn = stream.isatty() and not own_bar
  if not stream.isatty():
    logging.info('%s%s', name, f' ({total} parts)' if total else '')
  shown = Phase(name, total, stream if drawn else None)
  ticking, ticker = threading.Event(), None
  if drawn:
    shown.advance(0)
    if not total:
      ticker = threading.Thread(target=_tick, args=(shown, ticking),
                                daemon=True)
      ticker.start()
  try:
    yield shown
  finally:
    ticking.set()
    if ticker is not None:
      ticker.join()  # Its last redraw before the phase's last line.
    if drawn:
      shown.draw(end='\n')
    elif not stream.isatty():
      logging.info('%s: done in %.1f s', name,
                   time.perf_counter() - shown.started)


def _tick(shown, stopped):
  """Redraws an uncounted phase's seconds until it ends."""
  while not stopped.wait(_TICK_S):
    shown.draw()
