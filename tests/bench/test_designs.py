"""Tests for tfmulti.bench: the variants train alike and are reported."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import weights
from tfmulti.bench import designs as bench
from tfmulti.bench import variants as bench_variants

TINY = bench.BenchConfig(model='lenet', batch_size=2, num_clones=2,
                         clone_on_cpu=True, rounds=2, steps_per_round=1,
                         untimed_steps=1, reproducible_rows=1)
CPU_VARIANTS = {'single', 'towers', 'towers_one_device', 'independent',
                'towers_reproducible', 'towers_spread', 'towers_spread_packs',
                'mirrored_reduce_to_one_device', 'central_storage'}
# They run the same computation on the same global batch (the atoms' sum
# rounds differently: equal to 1e-5 too).
SAME_COMPUTATION = ('towers', 'towers_one_device', 'towers_reproducible',
                    'towers_spread', 'towers_spread_packs',
                    'mirrored_reduce_to_one_device', 'central_storage')


@pytest.mark.slow
def test_the_variants_time_the_same_training():
  variants, skipped = bench_variants.build_variants(TINY)
  assert {v.name for v in variants} == CPU_VARIANTS and skipped == {}
  bench._warm_up(variants, TINY)
  rates = bench.time_variants(variants, TINY)
  assert {name: len(r) for name, r in rates.items()} == {
      name: TINY.rounds for name in CPU_VARIANTS}
  models = {v.name: v.model for v in variants}
  # 1 + untimed_steps + rounds * steps_per_round steps each, from one seed:
  # every path ends with the weights of the real single path.
  reference = weights(models['single'])
  for name in SAME_COMPUTATION:
    for got, want in zip(weights(models[name]), reference):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                 err_msg=name)
  assert models['single'].count_params() == 83_126  # lenet on 32x32x3.


def test_the_report_is_computed_from_the_rates():
  rates = {'single': [100.0, 300.0, 200.0], 'towers': [400.0, 390.0, 410.0],
           'independent': [500.0] * 3, 'mirrored_x': [100.0, 100.0, 50.0]}
  report = bench.summarize(rates, dict.fromkeys(rates, 1.5),
                           dict.fromkeys(rates, False), {'central': 'why'})
  towers = report['variants']['towers']
  assert (towers['images_per_sec_median'], towers['images_per_sec_min'],
          towers['images_per_sec_max']) == (400.0, 390.0, 410.0)
  assert towers['ratio_to_single'] == pytest.approx(2.0)  # 400 / 200.
  assert report['variants']['single']['ratio_to_single'] == 1.0
  assert report['gradient_combination_share'] == pytest.approx(0.2)
  assert report['towers_over_mirrored'] == {'mirrored_x': 4.0}
  assert report['skipped'] == {'central': 'why'}
  assert 'towers / mirrored_x: 4.000' in bench.format_report(
      {'comparison': report})


@pytest.mark.slow
def test_central_storage_is_skipped_with_its_reason_for_batch_norm():
  config = bench.BenchConfig(model='resnet8_thin', batch_size=2,
                             clone_on_cpu=True, reproducible_rows=2)
  variants, skipped = bench_variants.build_variants(config)
  assert 'central_storage' not in {v.name for v in variants}
  assert 'BatchNormalization' in skipped['central_storage']


def test_xla_is_set_explicitly_in_every_variant():
  config = bench.BenchConfig(model='lenet', batch_size=2, clone_on_cpu=True,
                             xla=True, reproducible_rows=1)
  variants, _ = bench_variants.build_variants(config)
  # The tf.distribute paths, the single reference among them, cannot XLA.
  assert {v.name for v in variants if v.xla} == {
      'towers', 'towers_one_device', 'towers_reproducible', 'towers_spread',
      'towers_spread_packs', 'independent'}


def test_a_retracing_variant_fails_the_benchmark():
  traces = iter(range(100))  # A new trace count at every look.
  variant = bench_variants.Variant('retraces', step=lambda: 0.0,
                                   trace_count=lambda: next(traces),
                                   xla=False)
  with pytest.raises(RuntimeError, match=r"\['retraces'\] retraced"):
    bench.time_variants([variant], TINY)


def test_peak_memory_counts_each_variants_steps_above_the_resident(
    monkeypatch):
  """Each variant's peaks are read after its own steps, from statistics
  reset before them, less what was resident then (100 bytes on each
  device: every variant's variables). The allocator is faked: CPUs report
  none."""
  resident = 100
  peak = {'GPU:0': 0, 'GPU:1': 0}
  held = {'GPU:0': resident, 'GPU:1': resident}
  memory = tf.config.experimental
  monkeypatch.setattr(memory, 'reset_memory_stats',
                      lambda device: peak.__setitem__(device, held[device]))
  monkeypatch.setattr(memory, 'get_memory_info', lambda device: {
      'peak': max(peak[device], held[device]), 'current': held[device]})

  def stepping(name, grows):
    def step():
      for device, extra in grows.items():
        held[device] += extra  # Activations of this step...
        peak[device] = max(peak[device], held[device])
        held[device] -= extra  # ...freed after it.
      return 0.0
    return bench_variants.Variant(name, step=step, trace_count=lambda: 1,
                                  xla=False)
  variants = [stepping('central', {'GPU:0': 30}),
              stepping('spread', {'GPU:0': 10, 'GPU:1': 10})]
  assert bench.peak_memory(variants, ['GPU:0', 'GPU:1']) == {
      'central': {'GPU:0': 30, 'GPU:1': 0},
      'spread': {'GPU:0': 10, 'GPU:1': 10}}
  assert bench.peak_memory(variants, []) == {}

@pytest.mark.slow
def test_cli_writes_json_sweep_and_chart(tmp_path, capsys, monkeypatch):
  output, chart = tmp_path / 'report.json', tmp_path / 'sweep.png'
  shared = []
  monkeypatch.setattr(bench.devices, 'share_cores', shared.append)
  bench.main(['--model=lenet', '--clone_on_cpu', '--batch_size=2',
              '--reproducible_rows=2', '--rounds=1', '--steps_per_round=1',
              '--untimed_steps=1', '--share_cores',
              f'--output={output}'])
  assert shared == [2]  # The pool of --num_clones' share, before the run.
  report = json.loads(output.read_text())
  assert set(report['comparison']['variants']) == CPU_VARIANTS
  assert report['environment']['tensorflow'].startswith('2.21')
  assert report['environment']['intra_op_threads'] == (
      tf.config.threading.get_intra_op_parallelism_threads())
  assert 'x single' in capsys.readouterr().out
  rows = bench.sweep(bench.BenchConfig(
      model='lenet', batch_size=2, clone_on_cpu=True, rounds=1,
      steps_per_round=1, untimed_steps=1, sweep_clones=(1, 2, 4),
      reproducible_rows=2))
  assert [r['num_clones'] for r in rows] == [1, 2, 4]
  assert [r['global_batch'] for r in rows] == [2, 4, 8]
  for row in rows:  # Each clone count's cost a row over one clone's.
    assert row['per_image_cost_vs_1_clone'] == pytest.approx(
        row['ms_per_image'] / rows[0]['ms_per_image'])
    assert row['ms_per_image'] == pytest.approx(
        1000 / row['images_per_sec_median'])
  bench.write_chart(rows, str(chart))
  assert chart.read_bytes().startswith(b'\x89PNG')


@pytest.mark.parametrize('argv, message', [
    (['--num_clones=0', '--clone_on_cpu'],
     'num_clones=0: must be an integer >= 1'),
    (['--chart=x.png', '--clone_on_cpu'], '--chart draws the sweep'),
    (['--share_cores'], '--share_cores shares the cores among clones on '
     'logical CPUs: add --clone_on_cpu'),
    (['--batch_size=48', '--clone_on_cpu'],
     'reproducible_rows=32: each clone.s batch_size=48 must be whole atoms'),
    (['--num_clones=2'], 'do not exist'),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)
