"""Tests for tfmulti.bench.step_profile: each op's part, and what the
profile reads from the towers' and MirroredStrategy's traced steps."""

import pytest

from tfmulti.bench import designs
from tfmulti.bench import step_profile


@pytest.mark.parametrize('op_name, op_type, part', [
    ('clone_0/conv2d/Conv2D', '_MklNativeConv2DWithBias', 'forward_backward'),
    ('gradient_tape/clone_1/conv2d/Conv2DBackpropInput', '_MklMatMul',
     'forward_backward'),
    ('gradient_tape/clone_1/strided_slice', 'StridedSlice',
     'forward_backward'),
    ('replica_1/dense/MatMul', '_MklMatMul', 'forward_backward'),
    ('split_batch/strided_slice_1', 'StridedSlice', 'split'),
    ('split_batch/strided_slice_1/_3', '_Send', 'copies'),
    ('clone_1/ReadVariableOp', '_Recv', 'copies'),
    ('optimize_clones/sum_gradients_4', 'AddN', 'sum'),
    ('sgd_8/update_1_4/Mul', 'Mul', 'update'),
    ('EagerLocalExecute/', 'Shape', 'host'),
    ('EagerLocalExecute/', '__inference_step_graph_3106', None),
])
def test_each_op_has_its_part(op_name, op_type, part):
  assert step_profile.part_of(op_name, op_type) == part


def test_a_summary_sums_each_part_per_step():
  events = [('clone_0/a', 'Conv2D', 0.004), ('clone_1/a', 'Conv2D', 0.002),
            ('x/_1', '_Send', 0.001), ('EagerLocalExecute/', '__inference_f',
                                       0.01)] * 2
  summary = step_profile.summarize(events, steps=2)
  assert summary['step_ms'] == pytest.approx(10)
  assert summary['parts_ms']['forward_backward'] == pytest.approx(6)
  assert summary['parts_ms']['copies'] == pytest.approx(1)
  assert summary['ops'] == {'forward_backward': 2, 'split': 0, 'copies': 1,
                            'sum': 0, 'update': 0, 'host': 0}


@pytest.mark.slow
def test_the_towers_update_once_and_mirrored_updates_each_replica():
  """Read from the profiled steps of LeNet on 2 logical CPUs: the towers
  split, copy and sum inside their compiled step and update each variable
  once; MirroredStrategy updates each replica's copy (about twice the
  ops) and runs ops eagerly around its step; one device copies nothing."""
  bench = designs.BenchConfig(model='lenet', batch_size=4, num_clones=2,
                              clone_on_cpu=True, reproducible_rows=4)
  report = step_profile.run(bench, steps=2)
  assert set(report) == set(step_profile.VARIANTS)
  towers = report['towers']['ops']
  mirrored = report['mirrored_reduce_to_one_device']['ops']
  assert towers['split'] > 0 and towers['copies'] > 0 and towers['sum'] > 0
  assert towers['host'] == 0 < mirrored['host']
  assert mirrored['update'] > 1.5 * towers['update']
  assert report['single']['ops']['copies'] == 0
  assert '| towers |' in step_profile.format_table(report)
