"""Tests for tfmulti.stops: the first signal asks, the second stops."""

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tfmulti import stops


class TestStopSignals:

  @pytest.mark.parametrize('signum, name, code', [
      (signal.SIGTERM, 'SIGTERM', 143), (signal.SIGINT, 'SIGINT', 130)])
  def test_first_signal_asks_to_stop(self, signum, name, code):
    before = signal.getsignal(signum)
    with stops.StopSignals() as signals:
      os.kill(os.getpid(), signum)
      assert signals.received == name
      assert signals.stop() == stops.Stop(name, code)
    assert signal.getsignal(signum) is before

  @pytest.mark.slow
  @pytest.mark.parametrize('second', [signal.SIGINT, signal.SIGTERM])
  def test_second_signal_stops_at_once_by_that_signal(self, second):
    script = ('import os, signal, time\n'
              'from tfmulti import stops\n'
              'with stops.StopSignals():\n'
              '  os.kill(os.getpid(), signal.SIGINT)\n'
              f'  os.kill(os.getpid(), {int(second)})\n'
              '  time.sleep(30)\n')
    result = subprocess.run([sys.executable, '-c', script], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -second  # The shell shows 128 + signal.
    assert 'Traceback' not in result.stderr
