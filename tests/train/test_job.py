"""Tests for the training loop: resume, summaries, NaN stop, precision."""

import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from tests.helpers import checkpoint_tensors
from tests.helpers import scalars
from tfmulti import deploy
from tfmulti import errors
from tfmulti import step_options
from tfmulti.engine import checkpoints
from tfmulti.engine import registry
from tfmulti.train import config as config_lib
from tfmulti.train import job
from tfmulti.train import run_dir
from tfmulti.train import summaries


@pytest.mark.slow
def test_the_same_command_resumes_where_it_stopped(run_train, tmp_path):
  model_dir = str(tmp_path / 'resume')
  first = run_train(model_dir=model_dir, train_steps=3, checkpoint_steps=2,
                    keep_checkpoints=1)
  assert first['resumed_from_step'] is None and first['steps'] == 3
  assert sorted(os.listdir(model_dir)).count('ckpt-3.index') == 1
  assert not os.path.exists(os.path.join(model_dir, 'ckpt-2.index'))
  second = run_train(model_dir=model_dir, train_steps=5, checkpoint_steps=2,
                     keep_checkpoints=1)
  assert second['resumed_from_step'] == 3 and second['steps'] == 5
  assert second['checkpoint'] == os.path.join(model_dir, 'ckpt-5')
  # Steps 4 and 5 were trained here, not again from 1.
  assert sorted(scalars(model_dir)[summaries.TOTAL_LOSS]) == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.parametrize('strategy', ['towers', 'mirrored'])
def test_tensorboard_tags_are_the_same_on_every_path(run_train, tmp_path,
                                                     strategy):
  model_dir = str(tmp_path / strategy)
  run_train(model_dir=model_dir, strategy=strategy, model='resnet8_thin',
            num_clones=2, train_steps=4, log_every_steps=2,
            optimizer='momentum', learning_rate=0.1, lr_schedule='step')
  found = scalars(model_dir)
  assert {summaries.TOTAL_LOSS, 'losses/clone_0', 'losses/clone_1',
          summaries.REGULARIZATION_LOSS, summaries.LEARNING_RATE,
          summaries.IMAGES_PER_SEC, summaries.EVAL_ACCURACY,
          summaries.EVAL_LOSS} <= set(found)
  for step in (2, 4):
    np.testing.assert_allclose(
        found[summaries.TOTAL_LOSS][step],
        found['losses/clone_0'][step] + found['losses/clone_1'][step],
        rtol=1e-5)
    assert 0 < found[summaries.REGULARIZATION_LOSS][step] < (
        found[summaries.TOTAL_LOSS][step])
  # The step schedule drops x0.1 at 50% and 75% of 4 steps: step 2 used
  # rate(1) = 0.1, step 4 used rate(3) = 0.001.
  np.testing.assert_allclose(found[summaries.LEARNING_RATE][2], 0.1, rtol=1e-6)
  np.testing.assert_allclose(found[summaries.LEARNING_RATE][4], 0.001,
                             rtol=1e-5)
  assert found[summaries.IMAGES_PER_SEC][4] > 0
  assert 0 <= found[summaries.EVAL_ACCURACY][4] <= 1
  assert found[summaries.EVAL_LOSS][4] > 0


@pytest.mark.slow
@pytest.mark.parametrize('strategy', ['towers', 'mirrored'])
def test_gradient_summaries(run_train, tmp_path, strategy):
  model_dir = str(tmp_path / strategy)
  run_train(model_dir=model_dir, strategy=strategy, num_clones=2,
            train_steps=1, summarize_gradients=True)
  found = scalars(model_dir)
  histograms = [t for t in found if t.startswith('gradients/')]
  norms = [t for t in found if t.startswith('gradient_norms/')]
  assert len(histograms) == 10  # lenet: 5 layers, kernel and bias each.
  assert any(t.endswith('logits/kernel') for t in histograms)
  assert len(norms) == 11  # And the global norm.
  assert found[summaries.GLOBAL_GRADIENT_NORM][1] > 0


@pytest.mark.parametrize('checkpoint_steps', [1, 4])
def test_a_diverging_run_stops_and_names_a_finite_checkpoint(
    run_train, tmp_path, checkpoint_steps):
  """Huge steps: the weights or the loss go non-finite; nothing non-finite
  is saved, and the checkpoint the message names is finite."""
  model_dir = str(tmp_path / 'diverges')
  with pytest.raises(SystemExit) as stop:
    run_train(model_dir=model_dir, optimizer='sgd', learning_rate=1e6,
              train_steps=30, checkpoint_steps=checkpoint_steps)
  found = re.search(r'(the loss is (nan|inf) at|the weights are not finite '
                    r'after) step (\d+); training stopped without saving',
                    str(stop.value))
  assert found, stop.value
  assert 1 < int(found.group(3)) < 30
  latest = tf.train.latest_checkpoint(model_dir) or 'none yet'
  assert f'latest checkpoint ({latest}' in str(stop.value)
  for _, path in checkpoints.numbered_checkpoints(model_dir):
    checkpoints.check_intact(path)  # Every tensor of every one is finite.
  assert not os.path.exists(os.path.join(model_dir, 'metrics.json'))


@pytest.mark.slow
def test_nothing_left_to_train_keeps_the_figures_of_the_run_that_trained(
    run_train, tmp_path):
  model_dir = str(tmp_path / 'done')
  trained = run_train(model_dir=model_dir)
  again = run_train(model_dir=model_dir)  # The same command: nothing to do.
  assert again == trained
  assert trained['resumed_from_step'] is None and trained['steps'] == 2
  assert trained['images_per_sec'] > 0 and trained['train_loss'] > 0


@pytest.mark.slow
def test_nothing_left_to_train_without_a_record_writes_strict_json(
    run_train, tmp_path):
  model_dir = str(tmp_path / 'done')
  run_train(model_dir=model_dir)
  os.remove(os.path.join(model_dir, 'metrics.json'))
  run_train(model_dir=model_dir)

  def refuse(constant):
    raise ValueError(f'{constant} is not JSON')
  with open(os.path.join(model_dir, 'metrics.json')) as f:
    metrics = json.load(f, parse_constant=refuse)
  assert (metrics['resumed_from_step'], metrics['steps']) == (2, 2)
  assert metrics['images_per_sec'] is None and metrics['train_loss'] is None
  assert metrics['nulls']['images_per_sec'].startswith('no step ran')


@pytest.mark.slow
def test_a_resume_that_changes_the_job_stops_with_one_line(run_train,
                                                           tmp_path):
  model_dir = str(tmp_path / 'adam')
  run_train(model_dir=model_dir, optimizer='adam')
  with pytest.raises(SystemExit,
                     match="holds another job \\(optimizer='adam' there, "
                     "'sgd' here\\); resume with the flags that started it"):
    run_train(model_dir=model_dir, optimizer='sgd', train_steps=4)
  # The rate and the length may change: the run continues from step 2.
  metrics = run_train(model_dir=model_dir, learning_rate=0.01, train_steps=4)
  assert (metrics['resumed_from_step'], metrics['steps']) == (2, 4)


@pytest.mark.slow
def test_mixed_precision_trains_in_bfloat16_on_cpus(run_train, tmp_path):
  model_dir = str(tmp_path / 'mixed')
  metrics = run_train(model_dir=model_dir, mixed_precision=True,
                      num_clones=2, batch_size=32, train_steps=30,
                      log_every_steps=1)
  assert metrics['mixed_precision'] == 'mixed_bfloat16'
  losses = scalars(model_dir)[summaries.TOTAL_LOSS]
  assert losses[30] < 0.6 * losses[1], (losses[1], losses[30])


@pytest.mark.slow
def test_xla_trains(run_train, tmp_path):
  model_dir = str(tmp_path / 'xla')
  run_train(model_dir=model_dir, xla=True, num_clones=2, batch_size=32,
            train_steps=30, log_every_steps=1)
  losses = scalars(model_dir)[summaries.TOTAL_LOSS]
  assert losses[30] < 0.6 * losses[1], (losses[1], losses[30])


@pytest.mark.slow
def test_central_storage_trains_a_model_without_batch_norm(run_train):
  metrics = run_train(strategy='central_storage', num_clones=2)
  assert metrics['strategy'] == 'central_storage' and metrics['steps'] == 2


@pytest.mark.slow
@pytest.mark.parametrize('strategy', ['towers', 'mirrored'])
def test_synchronized_batch_norm_flag_trains_on_both_paths(run_train,
                                                           strategy):
  metrics = run_train(strategy=strategy, model='resnet8_thin', num_clones=2,
                      sync_batch_norm=True)
  assert metrics['steps'] == 2 and metrics['strategy'] == strategy
  assert np.isfinite(metrics['train_loss'])


@pytest.mark.slow
def test_profile_steps_trace_every_clone(run_train, tmp_path):
  model_dir = tmp_path / 'profiled'
  run_train(model_dir=str(model_dir), num_clones=2, train_steps=3,
            profile_steps=['1', '2'])
  traces = list(model_dir.glob('plugins/profile/*/*.xplane.pb'))
  assert len(traces) == 1
  space = xplane_pb2.XSpace()
  space.ParseFromString(traces[0].read_bytes())
  ops = {metadata.name for plane in space.planes
         for metadata in plane.event_metadata.values()}
  # Names as the step scopes them, under the loop's call of the step
  # (`StatefulPartitionedCall/`) where a call runs many (--steps_per_loop).
  scopes = [name.split('/') for name in ops]
  for clone in ('clone_0', 'clone_1'):  # Each clone's forward ops.
    assert any(clone in scope and 'MatMul' in scope[-1] for scope in scopes)
  assert any('optimize_clones' in scope for scope in scopes)


@pytest.mark.parametrize('steps, message', [
    (['2', '1'], 'profile_steps=2,1: the last step must be >= the first'),
    (['0', '3'], 'profile_steps=0: must be an integer >= 1'),
    (['x'], '--profile_steps=x: give two global steps'),
])
def test_bad_profile_steps(run_train, steps, message):
  with pytest.raises(SystemExit, match=message):
    run_train(profile_steps=steps)


@pytest.mark.slow
def test_the_run_that_prepares_the_data_starts_from_the_same_weights(
    run_train, tmp_path):
  # Preparing a data set draws from the global random generators; the seed
  # must still give the same weights as a run that finds it prepared.
  data_dir = str(tmp_path / 'fresh_tfds')
  first, again = (run_train(model_dir=str(tmp_path / name), data_dir=data_dir,
                            num_clones=2, optimizer='momentum')
                  for name in ('prepares', 'finds_prepared'))
  got, want = (checkpoint_tensors(m['checkpoint']) for m in (first, again))
  assert got.keys() == want.keys()
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)


@pytest.mark.slow
def test_a_resume_with_other_settings_records_each_stretch(run_train,
                                                           tmp_path):
  model_dir = str(tmp_path / 'run')
  common = dict(model_dir=model_dir, num_clones=2, optimizer='momentum')
  run_train(train_steps=2, **common)
  run_train(train_steps=4, num_stages=2, num_microbatches=2, **common)
  metrics = run_train(train_steps=4, **common)  # Nothing left: kept.
  stretches = metrics['stretches']
  assert [s['from_step'] for s in stretches] == [0, 2]
  first, second = (s['settings'] for s in stretches)
  assert (first['num_stages'], first['step_options']['num_microbatches'],
          first['total_steps']) == (1, 1, 2)
  assert (second['num_stages'], second['step_options']['num_microbatches'],
          second['total_steps']) == (2, 2, 4)
  with open(os.path.join(model_dir, 'job.json')) as f:
    assert json.load(f)['stretches'] == stretches
  # A resume from an older checkpoint drops what it no longer holds.
  metrics = run_train(model_dir=str(tmp_path / 'other'), train_steps=2,
                      num_clones=2)
  assert [s['from_step'] for s in metrics['stretches']] == [0]


@pytest.mark.slow
def test_spread_variables_and_packs_train_the_central_bits(run_train,
                                                          caplog):
  """The command line with --variables_device=spread and packs: the same
  checkpoint, bit for bit, as central variables; an export for one
  device."""
  caplog.set_level('INFO', logger='absl')
  runs = [run_train(num_clones=2, reproducible_rows=2, model='resnet8_thin',
                    export=export, **flags)
          for flags, export in ((dict(), False), (dict(
              variables_device='spread', gradient_packs='auto'), True))]
  spread = runs[1]
  assert spread['variables_device'] == 'spread'
  assert "variables spread over ['/device:CPU:0', '/device:CPU:1']" in (
      caplog.text)
  got, want = (checkpoint_tensors(run['checkpoint']) for run in runs)
  assert got.keys() == want.keys()
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  serve = tf.saved_model.load(spread['export']).signatures['serving_default']
  assert {op.device for op in serve.graph.get_operations()} == {''}


class TestElasticStart:
  """A start of an elastic launch keeps the job's recorded global batch."""

  def _configs(self, model_dir, workers, start, **values):
    train = config_lib.TrainConfig(model_dir=str(model_dir), batch_size=16,
                                   strategy='multi_worker',
                                   elastic_start=start, **values)
    return train, deploy.DeploymentConfig(
        num_clones=1, clone_on_cpu=True, replica_id=0, num_replicas=workers)

  def _record(self, model_dir, rows):
    run_dir.check_job(str(model_dir), {'global_batch_size': rows}, {},
                      resuming=False)

  @pytest.mark.parametrize('workers, rows_a_clone', [(2, 24), (3, 16),
                                                     (4, 12)])
  def test_the_recorded_batch_is_split_over_the_workers_left(
      self, tmp_path, workers, rows_a_clone):
    self._record(tmp_path, 48)
    train, deployed = self._configs(tmp_path, workers, start=1)
    kept = job.keep_global_batch(train, deployed)
    assert kept.batch_size == rows_a_clone
    assert job.global_batch_size(kept, deployed) == 48

  def test_outside_an_elastic_launch_nothing_changes(self, tmp_path):
    self._record(tmp_path, 48)
    train, deployed = self._configs(tmp_path, 2, start=None)
    assert job.keep_global_batch(train, deployed) is train  # check_job refuses.
    fresh, deployed = self._configs(tmp_path / 'new', 2, start=0)
    assert job.keep_global_batch(fresh, deployed) is fresh  # No record yet.

  @pytest.mark.parametrize('atoms, parts', [(0, (10, 10, 10, 9, 9)),
                                             (4, (12, 12, 8, 8, 8))])
  def test_a_batch_that_does_not_split_takes_parts_of_whole_atoms(
      self, tmp_path, atoms, parts):
    self._record(tmp_path, 48)
    train, deployed = self._configs(
        tmp_path, 5, start=2,
        step_options=step_options.StepOptions(reproducible_rows=atoms))
    kept = job.keep_global_batch(train, deployed)
    assert kept.step_options.worker_parts == parts
    assert job.global_batch_size(kept, deployed) == 48
    registry.check(kept, deployed.__class__(
        num_clones=1, clone_on_cpu=True, replica_id=0, num_replicas=5))

  def test_fewer_atoms_than_workers_is_one_line(self, tmp_path):
    self._record(tmp_path, 48)
    train, deployed = self._configs(
        tmp_path, 13, start=1,
        step_options=step_options.StepOptions(reproducible_rows=4))
    with pytest.raises(errors.ConfigError, match=(
        'a global batch of 48 rows is not 13 or more whole parts of 4 rows')):
      job.keep_global_batch(train, deployed)

  def test_linear_scaling_is_refused(self, tmp_path):
    with pytest.raises(errors.ConfigError,
                       match='--lr_scaling=linear under an elastic launch'):
      self._configs(tmp_path, 2, start=0, lr_scaling='linear')
