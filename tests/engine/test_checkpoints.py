"""Tests for tfmulti.checkpoints: round trips, portability, stop signals."""

import errno
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import checkpoint_tensors
from tests.helpers import make_batch
from tests.helpers import make_deployed
from tests.helpers import mlp
from tests.helpers import weights
from tfmulti import deploy
from tfmulti import errors
from tfmulti.engine import checkpoints

ONE = deploy.DeploymentConfig(num_clones=1, clone_on_cpu=True)


def _checkpointer(directory, deployed, max_to_keep=2, in_background=False):
  return checkpoints.Checkpointer(
      str(directory), model=deployed.model, optimizer=deployed.optimizer,
      max_to_keep=max_to_keep, device=ONE.summaries_device(),
      in_background=in_background)


def test_round_trip_restores_weights_slots_and_position(tmp_path):
  trained = make_deployed(ONE)
  trained.train_step(*make_batch(8))
  path = _checkpointer(tmp_path, trained).save(checkpoints.Position(7, 2, 40))
  assert os.path.basename(path) == 'ckpt-7'
  fresh = make_deployed(ONE, model_fn=lambda: mlp(seed=5))
  position = _checkpointer(tmp_path, fresh).restore_latest()
  assert position == checkpoints.Position(7, 2, 40)
  for got, want in zip(weights(fresh.model), weights(trained.model)):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(fresh.optimizer.variables, trained.optimizer.variables):
    np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.slow
def test_a_resumed_run_draws_what_the_uninterrupted_run_drew(tmp_path):
  def dropout():
    return mlp(dropout=True)
  run = make_deployed(ONE, model_fn=dropout)
  run.train_step(*make_batch(8))
  _checkpointer(tmp_path, run).save(checkpoints.Position(1, 0, 8))
  resumed = make_deployed(ONE, model_fn=dropout)
  _checkpointer(tmp_path, resumed).restore_latest()
  images, labels = make_batch(8, seed=1)
  np.testing.assert_array_equal(
      resumed.train_step_outputs(images, labels, with_outputs=True).outputs,
      run.train_step_outputs(images, labels, with_outputs=True).outputs)


@pytest.mark.parametrize('in_background', [False, True])
def test_keeps_the_newest_and_saves_a_step_once(tmp_path, in_background):
  deployed = make_deployed(ONE)
  checkpointer = _checkpointer(tmp_path, deployed, max_to_keep=2,
                               in_background=in_background)
  for step in (1, 2, 3):
    checkpointer.save(checkpoints.Position(step, 0, step))
  checkpointer.wait()
  state = tf.train.get_checkpoint_state(str(tmp_path))
  assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
      'ckpt-2', 'ckpt-3']
  assert checkpointer.latest == state.model_checkpoint_path == str(
      tmp_path / 'ckpt-3')
  assert sorted(p.name for p in tmp_path.glob('ckpt-*')) == [
      'ckpt-2.data-00000-of-00001', 'ckpt-2.index',
      'ckpt-3.data-00000-of-00001', 'ckpt-3.index']
  saved = checkpoint_tensors(str(tmp_path / 'ckpt-3'))
  kernel = deployed.model.trainable_variables[0]
  kernel.assign(kernel + 1.0)  # Changed, but step 3 is already saved.
  path = checkpointer.save(checkpoints.Position(3, 0, 3))
  assert path == str(tmp_path / 'ckpt-3')
  again = checkpoint_tensors(path)
  assert again.keys() == saved.keys()
  for key, value in saved.items():
    np.testing.assert_array_equal(again[key], value, err_msg=key)


def test_an_empty_directory_restores_nothing(tmp_path):
  assert _checkpointer(tmp_path, make_deployed(ONE)).restore_latest() is None


def test_another_model_is_refused_with_the_fix(tmp_path):
  _checkpointer(tmp_path, make_deployed(ONE)).save(
      checkpoints.Position(1, 0, 8))
  def wider():
    inputs = keras.Input((6,))
    return keras.Model(inputs, keras.layers.Dense(3)(
        keras.layers.Dense(32)(inputs)))
  other = make_deployed(ONE, model_fn=wider)
  with pytest.raises(errors.CheckpointMismatchError,
                     match='ckpt-1 does not fit.*new --model_dir'):
    _checkpointer(tmp_path, other).restore_latest()


@pytest.mark.slow
def test_a_pipelined_checkpoint_continues_on_the_towers(run_train, tmp_path):
  """2 stages x 2 micro-batches for 3 steps, then plain towers to step 5,
  ends where 2 plain clones trained for 5 steps end."""
  common = dict(batch_size=4, optimizer='momentum', learning_rate=0.05,
                num_clones=2)
  model_dir = str(tmp_path / 'pipelined')
  run_train(model_dir=model_dir, train_steps=3, num_stages=2,
            num_microbatches=2, **common)
  metrics = run_train(model_dir=model_dir, train_steps=5, **common)
  assert (metrics['resumed_from_step'], metrics['steps']) == (3, 5)
  whole = run_train(model_dir=str(tmp_path / 'whole'), train_steps=5,
                    **common)
  got = checkpoint_tensors(metrics['checkpoint'])
  for key, value in checkpoint_tensors(whole['checkpoint']).items():
    np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6,
                               err_msg=key)


@pytest.mark.slow
def test_a_two_clone_checkpoint_continues_on_every_path(run_train, tmp_path):
  """2 clones -> mirrored, one device, 4 clones and 2 clones of 2 stages,
  at the same step.

  The global batch stays 8 rows; lenet has no BatchNorm, so every path
  continues to the weights of one uninterrupted 2-clone run: the resume
  restored the weights, the momentum slots and the input position.
  """
  common = dict(batch_size=4, optimizer='momentum', learning_rate=0.05)
  start = str(tmp_path / 'two_clones')
  run_train(model_dir=start, num_clones=2, train_steps=3, **common)
  whole = run_train(model_dir=str(tmp_path / 'whole'), num_clones=2,
                    train_steps=5, **common)
  reference = checkpoint_tensors(whole['checkpoint'])
  layouts = {'towers_2': dict(num_clones=2),
             'mirrored_2': dict(strategy='mirrored', num_clones=2),
             'single': dict(strategy='single', num_clones=1, batch_size=8),
             'towers_4': dict(num_clones=4, batch_size=2),
             'pipelined_2x2': dict(num_clones=2, num_stages=2,
                                   num_microbatches=2)}
  finals = {}
  for name, flag_values in layouts.items():
    model_dir = str(tmp_path / name)
    shutil.copytree(start, model_dir)
    values = dict(common, train_steps=5)
    values.update(flag_values)
    metrics = run_train(model_dir=model_dir, **values)
    assert (metrics['resumed_from_step'], metrics['steps']) == (3, 5), name
    assert metrics['checkpoint'].endswith('ckpt-5')
    finals[name] = checkpoint_tensors(metrics['checkpoint'])
  for name, tensors in finals.items():
    # Saved once, in one layout: the same keys whichever path wrote them.
    assert tensors.keys() == reference.keys(), name
    for key, value in tensors.items():
      np.testing.assert_allclose(value, reference[key], rtol=1e-5, atol=1e-6,
                                 err_msg=f'{name}: {key}')


@pytest.mark.slow
@pytest.mark.parametrize('first, then', [
    (dict(num_clones=4, variables_device='spread', batch_size=2),
     dict(num_clones=1, batch_size=8)),
    (dict(num_clones=1, batch_size=8),
     dict(num_clones=4, variables_device='spread', batch_size=2))])
def test_spread_variables_and_one_clone_continue_each_other(
    run_train, tmp_path, first, then):
  """4 clones with each variable and slot on one of their devices, and 1
  clone with all of them on the CPU, write one layout: each continues
  the other's checkpoint to the weights of an uninterrupted run (8 rows a
  step, momentum slots)."""
  common = dict(optimizer='momentum', learning_rate=0.05)
  model_dir = str(tmp_path / 'job')
  run_train(model_dir=model_dir, train_steps=3, **common, **first)
  metrics = run_train(model_dir=model_dir, train_steps=5, **common, **then)
  assert (metrics['resumed_from_step'], metrics['steps']) == (3, 5)
  whole = run_train(model_dir=str(tmp_path / 'whole'), train_steps=5,
                    **common, **first)
  got = checkpoint_tensors(metrics['checkpoint'])
  reference = checkpoint_tensors(whole['checkpoint'])
  assert got.keys() == reference.keys()
  for key, value in reference.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6,
                               err_msg=key)


@pytest.mark.slow
def test_a_resume_at_another_global_batch_is_one_line(run_train, tmp_path):
  """Clones and workers may change on resume; the global batch may not."""
  model_dir = str(tmp_path / 'job')
  run_train(model_dir=model_dir, num_clones=2, batch_size=4, train_steps=1)
  with pytest.raises(SystemExit, match=(
      'holds another job \\(global_batch_size=8 there, 16 here\\); resume '
      'with the flags that started it')):
    run_train(model_dir=model_dir, num_clones=4, batch_size=4,
              train_steps=2)
  assert checkpoints.numbered_checkpoints(model_dir)[0][0] == 1


class TestScan:
  """The latest intact checkpoint is found whatever else is damaged."""

  def _three_saved(self, directory):
    """Checkpoints 1, 2 and 3 of a model whose kernel is the step number."""
    deployed = make_deployed(ONE)
    checkpointer = _checkpointer(directory, deployed, max_to_keep=5)
    for step in (1, 2, 3):
      deployed.model.trainable_variables[0].assign(
          tf.fill(deployed.model.trainable_variables[0].shape, float(step)))
      checkpointer.save(checkpoints.Position(step, 0, 8 * step))
    return deployed

  def _restored_step(self, directory):
    fresh = make_deployed(ONE, model_fn=lambda: mlp(seed=5))
    position = _checkpointer(directory, fresh).restore_latest()
    kernel = fresh.model.trainable_variables[0].numpy()
    assert (kernel == position.step).all()  # The weights of that step.
    return position.step

  def test_an_empty_index_file(self, tmp_path):
    self._three_saved(tmp_path)
    (tmp_path / 'checkpoint').write_text('')
    assert self._restored_step(tmp_path) == 3
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith('ckpt-3')

  def test_an_index_naming_a_missing_checkpoint(self, tmp_path):
    self._three_saved(tmp_path)
    for path in tmp_path.glob('ckpt-3.*'):
      path.unlink()
    assert self._restored_step(tmp_path) == 2

  @pytest.mark.parametrize('damage', ['truncated data', 'garbled index',
                                      'missing data'])
  def test_a_damaged_newest_is_skipped_and_kept(self, tmp_path, caplog,
                                                damage):
    self._three_saved(tmp_path)
    data = tmp_path / 'ckpt-3.data-00000-of-00001'
    if damage == 'truncated data':
      data.write_bytes(data.read_bytes()[:50])
    elif damage == 'garbled index':
      (tmp_path / 'ckpt-3.index').write_bytes(b'not an sstable')
    else:
      data.unlink()
    with caplog.at_level('WARNING', logger='absl'):
      assert self._restored_step(tmp_path) == 2
    assert 'skipping damaged checkpoint' in caplog.text
    assert 'ckpt-3' in caplog.text
    assert (tmp_path / 'ckpt-3.index').exists()  # Never deleted.

  def test_only_damaged_checkpoints_stop_the_run(self, tmp_path):
    self._three_saved(tmp_path)
    for step in (1, 2, 3):
      (tmp_path / f'ckpt-{step}.index').write_bytes(b'')
    with pytest.raises(errors.CheckpointDamagedError,
                       match='no checkpoint in .* can be read.*ckpt-3.*'
                       'new --model_dir'):
      _checkpointer(tmp_path, make_deployed(ONE))

  def test_partial_writes_are_removed(self, tmp_path):
    self._three_saved(tmp_path)
    partial = tmp_path / 'ckpt-4_temp'
    partial.mkdir()
    (partial / 'part-00000-of-00001.data-00000-of-00001').write_bytes(b'x')
    written = tmp_path / 'ckpt-4.data-00000-of-00001.tempstate123'
    written.write_bytes(b'x')  # A background write's, cut short.
    assert self._restored_step(tmp_path) == 3
    assert not partial.exists() and not written.exists()


@pytest.mark.parametrize('in_background', [False, True])
def test_non_finite_weights_are_never_saved(tmp_path, in_background):
  deployed = make_deployed(ONE)
  checkpointer = _checkpointer(tmp_path, deployed,
                               in_background=in_background)
  checkpointer.save(checkpoints.Position(1, 0, 8))
  kernel = deployed.model.trainable_variables[0]
  kernel.assign(tf.fill(kernel.shape, float('nan')))
  with pytest.raises(errors.NonFiniteError,
                     match=r'weights are not finite after step 2.*ckpt-1\)'):
    checkpointer.save(checkpoints.Position(2, 0, 16))
  assert not (tmp_path / 'ckpt-2.index').exists()
  checkpoints.check_intact(checkpointer.latest)  # Named, and finite.


def test_a_full_disk_stops_with_one_line_and_keeps_the_last(tmp_path,
                                                            monkeypatch):
  deployed = make_deployed(ONE)
  checkpointer = _checkpointer(tmp_path, deployed)
  checkpointer.save(checkpoints.Position(1, 0, 8))

  def disk_full(**kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(checkpointer.manager, 'save', disk_full)
  with pytest.raises(errors.CheckpointWriteError,
                     match='cannot write checkpoint ckpt-2 .*No space left.*'
                     'latest good checkpoint is .*ckpt-1'):
    checkpointer.save(checkpoints.Position(2, 0, 16))
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith('ckpt-1')


class TestInTheBackground:
  """Checkpoints written by a thread while the steps go on."""

  def test_each_holds_the_values_of_its_step(self, tmp_path):
    """Each save copies that step's weights and slots; the steps after it
    (run before its write ends) do not reach the files."""
    trained = make_deployed(ONE)
    checkpointer = _checkpointer(tmp_path, trained, in_background=True)
    assert checkpointer.in_background
    for step in (1, 2):
      trained.train_step(*make_batch(8, seed=step))
      saved = (weights(trained.model),
               [v.numpy() for v in trained.optimizer.variables])
      checkpointer.save(checkpoints.Position(step, 0, 8 * step))
      trained.train_step(*make_batch(8, seed=10 + step))
    checkpointer.wait()
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith('ckpt-2')
    fresh = make_deployed(ONE, model_fn=lambda: mlp(seed=5))
    assert _checkpointer(tmp_path, fresh).restore_latest() == (
        checkpoints.Position(2, 0, 16))
    for got, want in zip(weights(fresh.model), saved[0]):
      np.testing.assert_array_equal(got, want)
    for got, want in zip(fresh.optimizer.variables, saved[1]):
      np.testing.assert_array_equal(got.numpy(), want)

  def test_a_failed_write_stops_with_one_line_and_keeps_the_last(
      self, tmp_path, monkeypatch):
    deployed = make_deployed(ONE)
    checkpointer = _checkpointer(tmp_path, deployed, in_background=True)
    checkpointer.save(checkpoints.Position(1, 0, 8))
    checkpointer.wait()
    thread = checkpointer._writer._background  # pylint: disable=protected-access
    written = thread._write  # pylint: disable=protected-access

    class DiskFull:
      """The compiled write, failing as a full disk does when it runs."""
      get_concrete_function = written.get_concrete_function

      def __call__(self, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(thread, '_write', DiskFull())
    checkpointer.save(checkpoints.Position(2, 0, 16))  # Returns at once.
    with pytest.raises(errors.CheckpointWriteError,
                       match='cannot write checkpoint ckpt-2 .*No space '
                       'left.*latest good checkpoint is .*ckpt-1'):
      checkpointer.wait()
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith('ckpt-1')
    assert [step for step, _ in checkpoints.numbered_checkpoints(
        str(tmp_path))] == [1]

  def test_tf_distribute_variables_are_written_too(self, tmp_path):
    """A MirroredStrategy's variables (one copy a replica): the snapshot
    holds their values, and a fresh model restores them."""
    strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
    with strategy.scope():
      model = mlp()
      optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
      optimizer.build(model.trainable_variables)
    checkpointer = checkpoints.Checkpointer(
        str(tmp_path), model=model, optimizer=optimizer, max_to_keep=2,
        device=ONE.summaries_device(), in_background=True)
    for variable in model.trainable_variables:
      variable.assign(variable + 1.0)
    saved = weights(model)
    checkpointer.save(checkpoints.Position(1, 0, 8))
    checkpointer.wait()
    fresh = make_deployed(ONE, model_fn=lambda: mlp(seed=5))
    assert _checkpointer(tmp_path, fresh).restore_latest().step == 1
    for got, want in zip(weights(fresh.model), saved):
      np.testing.assert_array_equal(got, want)
