"""Long phases: a bar redrawn in place on a terminal, plain log lines
elsewhere (no carriage return, no escape code); the command line's are
tested in tests/train/test_run_readings.py."""

import io
import re
import time

import pytest

from tfmulti import phases


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_a_counted_phase_draws_a_bar_on_a_terminal(caplog):
  caplog.set_level('INFO', logger='absl')
  terminal = _Terminal()
  with phases.phase('evaluating', 4, stream=terminal) as shown:
    for _ in range(4):
      shown.advance()
  drawn = terminal.getvalue()
  assert drawn.count('\r') == 6  # Its start, 4 parts, its end.
  assert re.search(r'\revaluating: \[=+\] 4/4 \d+\.\d s\n$', drawn)
  assert '\revaluating: [' + ' ' * 30 + '] 0/4' in drawn
  assert 'evaluating' not in caplog.text  # The bar, not log lines.


def test_an_uncounted_phase_shows_its_seconds_as_they_pass(monkeypatch):
  monkeypatch.setattr(phases, '_TICK_S', 0.01)
  terminal = _Terminal()
  with phases.phase('tracing the step', stream=terminal):
    time.sleep(0.2)
  drawn = terminal.getvalue()
  assert drawn.count('\rtracing the step: ') >= 3  # Redrawn as it ran.
  assert drawn.endswith(' s\n')
  ended = len(drawn)
  time.sleep(0.05)
  assert len(terminal.getvalue()) == ended  # Its ticks stop with it.


def test_a_log_file_gets_two_plain_lines(caplog):
  caplog.set_level('INFO', logger='absl')
  log_file = io.StringIO()
  with phases.phase('evaluating', 3, stream=log_file) as shown:
    shown.advance(3)
  assert log_file.getvalue() == ''  # Nothing drawn.
  lines = [r.getMessage() for r in caplog.records]
  assert lines[0] == 'evaluating (3 parts)'
  assert re.fullmatch(r'evaluating: done in \d+\.\d s', lines[1])


def test_a_phase_that_draws_its_own_bar_gets_nothing_more_on_a_terminal(
    caplog):
  caplog.set_level('INFO', logger='absl')
  terminal = _Terminal()
  with phases.phase('preparing', stream=terminal, own_bar=True):
    pass
  assert terminal.getvalue() == '' and 'preparing' not in caplog.text


def test_a_failing_phase_still_ends_its_line():
  terminal = _Terminal()
  with pytest.raises(ValueError):
    with phases.phase('exporting', stream=terminal):
      raise ValueError('disk full')
  assert terminal.getvalue().endswith(' s\n')

