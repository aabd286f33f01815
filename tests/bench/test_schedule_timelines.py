"""tfmulti.bench.schedule_timelines: emulated stages run the schedule's
order, and activation memory is counted from the traced graph."""

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


def _peak_bytes(schedule, recompute=False, k=2, m=8):
  log = emulated.PassLog()
  deployed = bench.deploy_stages(k, m, schedule, log, NO_WAITS, recompute)
  images, labels = bench.batch(64)
  graph = deployed.traced_step(images, labels).graph
  counted = bench.activation_bytes(graph, k)
  return [bench.peak_bytes(device, counted)
          for device in schedules.device_orders(schedule, k, m)], counted


@pytest.mark.slow
def test_activation_memory_counted_from_the_graph():
  gpipe, counted = _peak_bytes('gpipe')
  one_f_one_b, _ = _peak_bytes('1f1b')
  recomputed, _ = _peak_bytes('1f1b', recompute=True)
  zero_bubble, split = _peak_bytes('zb_h1')
  # Stage 0 keeps its input and its 6 Dense layers' outputs a micro-batch:
  # 7 tensors of 8 rows x 64 float32 features, until its backward pass.
  tensor = 8 * bench.WIDTH * 4
  assert counted[0] == (7 * tensor, 0)
  assert one_f_one_b[0] == gpipe[0] // 4  # 2 micro-batches held, not 8.
  assert recomputed[0] <= one_f_one_b[0] // 2
  # ZB-H1's stage 0 has no input gradient to give: its B is empty, and W
  # takes the whole backward pass from the 7 tensors and the gradient it
  # was handed. F0 F1 B0 W0 ...: 2 micro-batches and that gradient at most.
  assert split[0] == (7 * tensor, 8 * tensor)
  assert zero_bubble[0] == 15 * tensor
  # The last stage's W reads, of each of its 6 Dense layers, the input and
  # the gradient before the activation (B took the activation's), the
  # emulated layer's output gradient, and the logits' input and gradient:
  # a deferred micro-batch holds more than its forward pass did here.
  assert split[1][1] == 14 * tensor + 8 * 10 * 4
  assert split[1][1] > split[1][0]
  assert max(zero_bubble) > max(one_f_one_b)


@pytest.mark.slow
def test_attention_stages_hold_what_w_reads_and_no_more_than_1f1b():
  """Where the forward pass keeps more than W reads (the attention's
  probabilities), a deferred micro-batch holds less than a whole one, and
  ZB-H1 holds at most 1.1x 1F1B's busiest stage."""
  def peaks(schedule):
    log = emulated.PassLog()
    deployed = bench.deploy_stages(2, 4, schedule, log, NO_WAITS,
                                   block='attention')
    graph = deployed.traced_step(*bench.batch(16, block='attention')).graph
    held = bench.activation_bytes(graph, 2)
    return held, [bench.peak_bytes(device, held) for device in
                  schedules.device_orders(schedule, 2, 4)]
  _, one_f_one_b = peaks('1f1b')
  held, zero_bubble = peaks('zb_h1')
  assert held[1][1] < held[1][0]
  assert max(zero_bubble) <= 1.1 * max(one_f_one_b)


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
