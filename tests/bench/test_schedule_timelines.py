"""tfmulti.bench.schedule_timelines: emulated stages run the schedule's
order; the report and its charts."""

import json

import pytest

from tfmulti.bench import emulated
from tfmulti.bench import schedule_timelines as bench
from tfmulti.pipeline import schedules

ROWS = 16


NO_WAITS = {'F': 0.0, 'B': 0.0, 'W': 0.0}


@pytest.mark.parametrize('schedule', [
    pytest.param(name, marks=pytest.mark.slow)
    for name in schedules.SCHEDULES])
def test_each_emulated_stage_runs_its_passes_in_the_schedules_order(
    schedule):
  """Read from the passes as they ran (no timing): each stage's F, B and W
  waits came in the order the schedule gives that stage (a fused backward
  pass runs its B and W waits together, in either order; so does the
  first chunk's split one, whose B has no input gradient to give and
  leaves the whole backward pass to its W, right after it)."""
  log = emulated.PassLog()
  deployed = bench.deploy_stages(3, 6, schedule, log, NO_WAITS,
                                 virtual_stages=2)
  deployed.train_step(*bench.batch(ROWS - 4))
  split = schedules.splits_backward(schedule)
  device_of = schedules.chunk_devices(schedule, 3, 2)
  for d, passes in enumerate(schedules.device_orders(schedule, 3, 6, 2)):
    ran = [(stage, kind) for stage, kind, _, _ in sorted(
        log.records, key=lambda r: r[2]) if device_of[stage] == d]
    want = [(stage, kind) for stage, kind, _ in passes]
    if split:
      want = [p for p in want if p != (0, 'W')]
    assert _fused(ran, {0} if split else None) == want


def _fused(ran, chunks=None):
  """Logged (stage, kind) waits with each fused backward pass's two (B
  and W of one stage, in either order; of `chunks`' stages, or of all) as
  one B."""
  out, i = [], 0
  while i < len(ran):
    if ran[i][1] == 'F' or (chunks is not None and ran[i][0] not in chunks):
      out.append(ran[i])
      i += 1
    else:
      assert sorted(ran[i:i + 2]) == [(ran[i][0], 'B'), (ran[i][0], 'W')]
      out.append((ran[i][0], 'B'))
      i += 2
  return out


def test_idle_fractions_of_logged_waits():
  # Stage 0 busy 0-1 and 2-3, stage 1 busy 1-2 and 3-4: span 4, idle half.
  records = [(0, 'F', 0.0, 1.0), (1, 'F', 1.0, 2.0), (0, 'B', 2.0, 3.0),
             (1, 'B', 3.0, 4.0)]
  assert bench.idle_fractions(records, [0, 1]) == (4.0, [0.5, 0.5])
  with pytest.raises(RuntimeError, match='device 0 ran two passes at once'):
    bench.idle_fractions(records + [(0, 'F', 0.5, 1.5)], [0, 1])


@pytest.mark.parametrize('argv, message', [
    (['--stages=2,x'], '--stages=2,x: give counts'),
    (['--rows=12'], 'rows=12: each of microbatches=8 must get as many rows'),
])
def test_bad_arguments_stop_with_one_line(argv, message):
  with pytest.raises(SystemExit, match=message):
    bench.main(argv)


@pytest.mark.slow
def test_the_report_and_its_charts(tmp_path):
  output = tmp_path / 'report.json'
  bench.main(['--stages=2', '--microbatches=2', '--rows=8',
              '--forward_ms_per_row=1', '--steps=1', f'--output={output}',
              f'--chart_dir={tmp_path}'])
  report = json.loads(output.read_text())
  assert report['emulated'] is True
  assert {r['schedule'] for r in report['results']} == set(
      schedules.SCHEDULES)
  for r in report['results']:
    # F = B = W: 1 of 3 units a step idle under 1F1B, 1 of 7 under ZB-H1
    # and under ZB-V with M = 2 (< 2K - 1), (K - 1) / (v M) = 1/4 of the
    # ideal 6 interleaved: 1.5 of 7.5.
    want = {'zb_h1': 1 / 7, 'zb_v': 1 / 7,
            'interleaved_1f1b': 1.5 / 7.5}.get(
        r['schedule'], 1 / 3)
    assert r['idle_theory'] == pytest.approx([want, want])
    assert len(r['idle_measured']) == 2
    # F, B and W of 2 micro-batches on each of 2 stages (4 chunks).
    assert len(r['passes']) == 2 * 2 * 3 * r['virtual_stages']
  for name in schedules.SCHEDULES:
    assert (tmp_path / f'schedule_{name}.png').read_bytes().startswith(
        b'\x89PNG')
