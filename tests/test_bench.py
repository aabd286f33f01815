"""Tests for tfmulti.bench: every variant runs and is reported; no timing."""

import json

import pytest

from tfmulti import bench

TINY = bench.BenchConfig(model='lenet', batch_size=2, num_clones=2,
                         clone_on_cpu=True, rounds=2, steps_per_round=1,
                         warmup_steps=1)
CPU_VARIANTS = {'single', 'towers', 'towers_one_device', 'independent',
                'mirrored_reduce_to_one_device', 'central_storage'}


def test_every_cpu_variant_is_timed_and_compared():
  comparison = bench.compare(TINY)
  variants = comparison['variants']
  assert set(variants) == CPU_VARIANTS
  assert comparison['skipped'] == {}
  assert variants['single']['ratio_to_single'] == pytest.approx(1.0)
  for name, entry in variants.items():
    assert entry['images_per_sec_min'] <= entry['images_per_sec_median'] <= (
        entry['images_per_sec_max']), name
    assert entry['ratio_to_single'] > 0 and entry['xla'] is False, name
  assert 0.0 <= comparison['gradient_combination_share'] < 1.0
  assert set(comparison['towers_over_mirrored']) == {
      'mirrored_reduce_to_one_device'}


def test_central_storage_is_skipped_with_its_reason_for_batch_norm():
  config = bench.BenchConfig(model='resnet8_thin', batch_size=2,
                             clone_on_cpu=True, rounds=1, steps_per_round=1,
                             warmup_steps=1)
  comparison = bench.compare(config)
  assert 'central_storage' not in comparison['variants']
  assert 'BatchNormalization' in comparison['skipped']['central_storage']


def test_xla_is_set_explicitly_in_every_variant():
  config = bench.BenchConfig(model='lenet', batch_size=2, clone_on_cpu=True,
                             xla=True, rounds=1, steps_per_round=1,
                             warmup_steps=1)
  variants = bench.compare(config)['variants']
  assert {n for n, e in variants.items() if e['xla']} == {
      'single', 'towers', 'towers_one_device', 'independent'}


def test_a_retracing_variant_fails_the_benchmark():
  traces = iter(range(100))  # A new trace count at every look.
  variant = bench.Variant('retraces', step=lambda: 0.0,
                          trace_count=lambda: next(traces), xla=False)
  with pytest.raises(RuntimeError, match=r"\['retraces'\] retraced"):
    bench.time_variants([variant], TINY)


def test_cli_writes_json_sweep_and_chart(tmp_path, capsys):
  output, chart = tmp_path / 'report.json', tmp_path / 'sweep.png'
  bench.main(['--model=lenet', '--clone_on_cpu', '--batch_size=2',
              '--rounds=1', '--steps_per_round=1', '--warmup_steps=1',
              f'--output={output}'])
  report = json.loads(output.read_text())
  assert set(report['comparison']['variants']) == CPU_VARIANTS
  assert report['environment']['tensorflow'].startswith('2.21')
  assert 'x single' in capsys.readouterr().out
  rows = bench.sweep(bench.BenchConfig(
      model='lenet', batch_size=2, clone_on_cpu=True, rounds=1,
      steps_per_round=1, warmup_steps=1, sweep_clones=(1, 2, 4)))
  assert [r['num_clones'] for r in rows] == [1, 2, 4]
  assert [r['global_batch'] for r in rows] == [2, 4, 8]
  assert rows[0]['per_image_cost_vs_1_clone'] == 1.0
  bench.write_chart(rows, str(chart))
  assert chart.read_bytes().startswith(b'\x89PNG')


@pytest.mark.parametrize('argv, message', [
    (['--num_clones=0', '--clone_on_cpu'], 'num_clones=0: must be >= 1'),
    (['--chart=x.png', '--clone_on_cpu'], '--chart draws the sweep'),
    (['--num_clones=2'], 'do not exist'),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)
