"""Tests for tfmulti.bench.input on tiny settings (no timing is asserted)."""

import os

import pytest
import tensorflow as tf

from tfmulti import deploy
from tfmulti import errors
from tfmulti.bench import input as bench_input


def test_the_folder_holds_real_jpegs_of_the_size_in_class_folders(tmp_path):
  bench_input.write_folder(str(tmp_path), images=12, classes=3, size=20)
  classes = sorted(os.listdir(tmp_path))
  assert classes == ['class00', 'class01', 'class02']
  files = [tmp_path / c / f for c in classes
           for f in os.listdir(tmp_path / c)]
  assert len(files) == 12
  for file in files:
    raw = file.read_bytes()
    assert raw[:2] == b'\xff\xd8'  # A JPEG, decoded by TensorFlow:
    assert tf.io.decode_jpeg(raw).shape == (20, 20, 3)


@pytest.mark.slow
def test_both_variants_run_the_job_and_the_ratio_is_theirs(tmp_path):
  bench = bench_input.InputBenchConfig(
      model='lenet', image_size=28, source_size=32, images=60, classes=3,
      num_clones=2, batch_size=8, steps=3, rounds=1)
  bench_input.write_folder(str(tmp_path), images=60, classes=3, size=32)
  rounds, decoding = bench_input.run(bench, str(tmp_path),
                                     deploy.DeploymentConfig(
                                         num_clones=2, clone_on_cpu=True))
  assert set(rounds) == {'folder', 'synthetic'}
  assert all(len(rates) == 1 and rates[0] > 0 for rates in rounds.values())
  report = bench_input.summarize(rounds, decoding)
  assert report['synthetic_over_folder'] == pytest.approx(
      rounds['synthetic'][0] / rounds['folder'][0])
  assert decoding > 0


def test_a_single_step_is_refused():
  with pytest.raises(errors.ConfigError, match='steps=1: the first step '
                     'traces'):
    bench_input.InputBenchConfig(steps=1)
