"""Tests for tfmulti.run_dir: usable paths, one writer, one job."""

import errno
import os
import signal
import subprocess
import sys
import tempfile

from absl import flags
from absl.testing import flagsaver
import pytest

from tests.helpers import assert_same_checkpoints
from tests.helpers import REPO
from tfmulti import cli
from tfmulti import errors
from tfmulti.train import run_dir


class TestCheckDirectory:

  def test_creates_a_missing_directory(self, tmp_path):
    run_dir.check_directory('model_dir', str(tmp_path / 'a' / 'b'))
    assert (tmp_path / 'a' / 'b').is_dir()

  def test_a_regular_file(self, tmp_path):
    path = tmp_path / 'file'
    path.write_text('x')
    with pytest.raises(errors.RunDirError,
                       match=f'--model_dir={path} is a file, not a '
                       'directory; pass a directory'):
      run_dir.check_directory('model_dir', str(path))

  def test_a_path_under_a_regular_file(self, tmp_path):
    (tmp_path / 'file').write_text('x')
    with pytest.raises(errors.RunDirError,
                       match=r'--data_dir=.*file/sub cannot be used \(Not a '
                       'directory\\); pass a directory this user can write'):
      run_dir.check_directory('data_dir', str(tmp_path / 'file' / 'sub'))

  def test_a_read_only_file_system(self, tmp_path, monkeypatch):
    def read_only(**kwargs):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(tempfile, 'NamedTemporaryFile', read_only)
    with pytest.raises(errors.RunDirError,
                       match=r'cannot be used \(Read-only file system\)'):
      run_dir.check_directory('model_dir', str(tmp_path))


def test_one_writer_per_model_dir_and_no_stuck_lock(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, '-c',
       'import sys, time\nfrom tfmulti.train import run_dir\n'
       f'lock = run_dir.Lock({str(tmp_path)!r})\nlock.__enter__()\n'
       'print("locked", flush=True)\ntime.sleep(60)\n'],
      cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    with pytest.raises(errors.RunDirError,
                       match=f'is in use by another run \\(pid {holder.pid} '
                       'on .*\\); wait for it to finish, or pass another'):
      with run_dir.Lock(str(tmp_path)):
        pass
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
  with run_dir.Lock(str(tmp_path)):  # A killed holder leaves nothing stuck.
    assert (tmp_path / run_dir.LOCK_FILE).read_text().startswith(
        f'pid {os.getpid()} ')


JOB = {'model': 'lenet', 'optimizer': 'adam', 'global_batch_size': 128}
SETTINGS = {'learning_rate': 0.001, 'total_steps': 100}


class TestCheckJob:

  def test_a_resume_that_changes_the_job_is_refused(self, tmp_path):
    run_dir.check_job(str(tmp_path), JOB, SETTINGS, resuming=False)
    changed = dict(JOB, optimizer='sgd', global_batch_size=64)
    with pytest.raises(errors.RunDirError,
                       match="holds another job \\(optimizer='adam' there, "
                       "'sgd' here; global_batch_size=128 there, 64 here\\); "
                       'resume with the flags that started it'):
      run_dir.check_job(str(tmp_path), changed, SETTINGS, resuming=True)

  def test_settings_may_change_and_are_logged(self, tmp_path, caplog):
    run_dir.check_job(str(tmp_path), JOB, SETTINGS, resuming=False)
    with caplog.at_level('INFO', logger='absl'):
      run_dir.check_job(str(tmp_path), JOB,
                        dict(SETTINGS, learning_rate=0.01), resuming=True)
    assert 'resuming with changed settings: learning_rate 0.001 -> 0.01' in (
        caplog.text)

  def test_a_fresh_start_records_the_new_job(self, tmp_path):
    run_dir.check_job(str(tmp_path), JOB, SETTINGS, resuming=False)
    other = dict(JOB, model='resnet20')
    run_dir.check_job(str(tmp_path), other, SETTINGS, resuming=False)
    with pytest.raises(errors.RunDirError, match="model='resnet20' there"):
      run_dir.check_job(str(tmp_path), JOB, SETTINGS, resuming=True)


class TestClaimed:

  @pytest.mark.parametrize('error', [
      errors.ConfigError('refused'), RuntimeError('a bug in my model'),
      KeyboardInterrupt()])
  def test_a_run_that_never_trained_leaves_nothing(self, tmp_path, error):
    model_dir = tmp_path / 'new' / 'run'
    with pytest.raises(type(error)) as raised:
      with run_dir.claimed(str(model_dir)):
        (model_dir / run_dir.JOB_FILE).write_text('{}')
        raise error
    assert raised.value is error  # The user's own, traceback and all.
    assert not (tmp_path / 'new').exists()

  def test_what_a_run_wrote_and_what_it_found_are_kept(self, tmp_path):
    model_dir = tmp_path / 'run'
    with pytest.raises(RuntimeError):
      with run_dir.claimed(str(model_dir)):
        (model_dir / 'ckpt-1.index').write_text('')
        raise RuntimeError('after a checkpoint')
    assert (model_dir / 'ckpt-1.index').exists()
    found = tmp_path / 'made_by_the_user'
    found.mkdir()
    with pytest.raises(RuntimeError):
      with run_dir.claimed(str(found)):
        raise RuntimeError('a bug in my model')
    assert found.is_dir()


@pytest.mark.slow
def test_a_run_reruns_from_its_flagfile_to_the_same_weights(run_train,
                                                            tmp_path):
  """Each run writes its resolved flags as `flags.txt`; `train.py
  --flagfile=` with another `--model_dir` trains the same job again, to
  the same bits."""
  first, again = str(tmp_path / 'first'), str(tmp_path / 'again')
  run_train(model_dir=first, num_clones=2, optimizer='sgd',
            learning_rate=0.05)
  path = os.path.join(first, run_dir.FLAGS_FILE)
  with open(path) as f:
    lines = f.read().splitlines()
  for line in (f'--model_dir={first}', '--num_clones=2', '--optimizer=sgd',
               '--learning_rate=0.05', '--train_steps=2', '--noexport'):
    assert line in lines
  with flagsaver.flagsaver():
    flags.FLAGS(['train.py', f'--flagfile={path}', f'--model_dir={again}'])
    cli.main(['train.py'])
  assert_same_checkpoints(os.path.join(again, 'ckpt-2'),
                          os.path.join(first, 'ckpt-2'), exact=True)
