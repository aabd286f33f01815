"""Tests for tfmulti.native_logs: C++ chatter held back, errors shown."""

import os

import pytest

from tfmulti import native_logs


@pytest.mark.parametrize('argv, wanted', [
    (['train.py'], False), (['train.py', '--verbosity=1'], True),
    (['train.py', '-v', '2'], True), (['train.py', '--verbosity=0'], False),
    (['train.py', '--v=-1'], False), (['train.py', '--verbosity=x'], False),
])
def test_verbose_reads_absl_verbosity(argv, wanted):
  assert native_logs.verbose(argv) is wanted


def test_held_output_is_dropped_when_the_block_succeeds(capfd):
  with native_logs.held():
    os.write(2, b'I0000 cudart_stub.cc: Could not find cuda drivers\n')
  os.write(2, b'after\n')
  assert capfd.readouterr().err == 'after\n'


def test_held_output_is_shown_when_the_block_fails(capfd):
  with pytest.raises(ImportError):
    with native_logs.held():
      os.write(2, b'why the import failed\n')
      raise ImportError('no module')
  assert 'why the import failed' in capfd.readouterr().err


def test_not_held_when_verbose(capfd):
  with native_logs.held(enabled=False):
    os.write(2, b'everything\n')
  assert capfd.readouterr().err == 'everything\n'
