"""The model-parallel benchmark: its arithmetic and one tiny run."""

import pytest
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from tfmulti import errors
from tfmulti.bench import pipeline as bench_pipeline


def _space(events):
  """An XSpace of one line holding (op name, start ps, duration ps)."""
  space = xplane_pb2.XSpace()
  plane = space.planes.add()
  line = plane.lines.add()
  line.timestamp_ns = 0
  for i, (name, start, duration) in enumerate(events, start=1):
    plane.event_metadata[i].name = name
    event = line.events.add()
    event.metadata_id, event.offset_ps, event.duration_ps = i, start, duration
  return space


def test_busy_fractions_are_the_union_of_each_stage_over_the_step():
  space = _space([
      ('microbatch_0/stage_0/conv:Conv2D', 0, 40),
      ('microbatch_1/stage_0/conv:Conv2D', 30, 30),  # Overlaps: 0-60 busy.
      ('microbatch_0/stage_1/dense:MatMul', 60, 20),
      ('gradient_tape/microbatch_0/stage_1_backward/x:MatMul', 80, 20),
      ('clone_0/stage_0_sum/AddN', 90, 10),
      ('optimize_clones/sum_gradients', 0, 100),  # No stage: not counted.
  ])
  assert bench_pipeline.busy_fractions(space) == {0: 0.7, 1: 0.4}


@pytest.mark.slow
def test_a_tiny_run_reports_every_design(tmp_path):
  config = bench_pipeline.PipelineBenchConfig(
      model='resnet8_thin', image_size=8, batch_size=8, microbatches=(2,),
      rounds=2, clone_on_cpu=True, pipeline_schedule='gpipe')
  report = bench_pipeline.run(config)
  assert report['config']['pipeline_schedule'] == 'gpipe'
  assert 'peak_bytes_per_device' not in report['rows'][0]  # CPUs: none.
  rows = {row['design']: row for row in report['rows']}
  assert list(rows) == ['one_device', 'model_parallel', 'one_device_2',
                        'pipelined_2']
  # Each design's speed-up is one device's seconds over its own.
  for row in rows.values():
    assert row['x_one_device'] == pytest.approx(
        rows['one_device']['seconds_mean'] / row['seconds_mean'])
  piped = rows['pipelined_2']
  assert piped['busy_predicted'] == pytest.approx(2 / 3)  # M / (M + K - 1).
  assert set(piped['busy_measured']) == {0, 1}
  assert all(0 < b <= 1 for b in piped['busy_measured'].values())
  assert len(report['stages']) == 2
  chart = tmp_path / 'chart.png'
  bench_pipeline.write_chart(report, chart)
  assert chart.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert 'pipelined_2' in bench_pipeline.format_report(report)


@pytest.mark.slow
@pytest.mark.parametrize('schedule', ['interleaved_1f1b', 'zb_v'])
def test_schedules_of_several_chunks_a_device_run_every_design(schedule):
  """The model-parallel design (one micro-batch) runs the plain cut; the
  pipelined one the schedule's 4 chunks, each with its busy fraction."""
  config = bench_pipeline.PipelineBenchConfig(
      model='lenet', image_size=28, batch_size=8, microbatches=(2,),
      rounds=1, clone_on_cpu=True, pipeline_schedule=schedule)
  report = bench_pipeline.run(config)
  rows = {row['design']: row for row in report['rows']}
  assert list(rows) == ['one_device', 'model_parallel', 'one_device_2',
                        'pipelined_2']
  assert set(rows['pipelined_2']['busy_measured']) == {0, 1, 2, 3}


def test_bad_microbatches_stop_with_one_line():
  with pytest.raises(SystemExit, match='--microbatches=a,b: give counts'):
    bench_pipeline.main(['--microbatches=a,b', '--clone_on_cpu'])
  with pytest.raises(errors.ConfigError, match='microbatches=200 is more'):
    bench_pipeline.PipelineBenchConfig(microbatches=(200,))
  with pytest.raises(errors.ConfigError, match="pipeline_schedule='zb'"):
    bench_pipeline.PipelineBenchConfig(pipeline_schedule='zb')
