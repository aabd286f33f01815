"""Where a worker stands, from TF_CONFIG, a Slurm step or an Indexed Job."""

import json

import pytest

from tfmulti import errors
from tfmulti.distribute import resolvers

STEP = {'SLURM_PROCID': '2', 'SLURM_STEP_NUM_TASKS': '4',
        'SLURM_STEP_NODELIST': 'n[9-10]',
        'SLURM_STEP_TASKS_PER_NODE': '2(x2)'}


@pytest.mark.parametrize('text, hosts', [
    ('n[9-10]', ['n9', 'n10']),  # Slurm's order, not the strings' (n10 < n9).
    ('n9,n10', ['n9', 'n10']),
    ('gpu[01,03-04],solo', ['gpu01', 'gpu03', 'gpu04', 'solo']),
    ('rack[1-2]-n[1-2]', ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']),
])
def test_node_lists_expand_in_order(text, hosts):
  assert resolvers.expand_nodelist(text) == hosts


def test_tasks_per_node_expand():
  assert resolvers.expand_tasks_per_node('2(x3),1') == [2, 2, 2, 1]


def test_a_slurm_step_places_ranks_node_by_node():
  cluster = resolvers.resolve('auto', STEP, port=7000)
  assert cluster.workers == ('n9:7000', 'n9:7001', 'n10:7000', 'n10:7001')
  assert (cluster.index, cluster.is_chief) == (2, False)
  config = json.loads(resolvers.tf_config(cluster))
  assert config == {'cluster': {'worker': list(cluster.workers)},
                    'task': {'type': 'worker', 'index': 2}}


def test_an_indexed_job_places_its_pods():
  cluster = resolvers.resolve(
      'indexed_job', {'JOB_COMPLETION_INDEX': '0'},
      worker_hosts='train-{index}.train:2222', num_workers=3)
  assert cluster.workers == ('train-0.train:2222', 'train-1.train:2222',
                             'train-2.train:2222')
  assert cluster.is_chief


@pytest.mark.parametrize('environ, source', [
    ({'TF_CONFIG': '{}', **STEP}, 'tf_config'), (STEP, 'slurm'),
    ({**STEP, 'SLURM_STEP_NUM_TASKS': '1'}, 'none'), ({}, 'none')])
def test_auto_reads_the_environment(environ, source):
  assert resolvers.source_of('auto', environ) == source


@pytest.mark.parametrize('kind, environ, kwargs, message', [
    ('slurm', {k: v for k, v in STEP.items() if k != 'SLURM_PROCID'}, {},
     'SLURM_PROCID is not set: --cluster=slurm reads it'),
    ('slurm', {**STEP, 'SLURM_PROCID': '4'}, {},
     'SLURM_PROCID=4 is not a task of SLURM_STEP_NUM_TASKS=4'),
    ('slurm', {**STEP, 'SLURM_STEP_NODELIST': 'n[9-'}, {},
     "SLURM_STEP_NODELIST='n\\[9-' does not expand"),
    ('slurm', {**STEP, 'SLURM_STEP_NODELIST': 'n[10-9]'}, {},
     "'10-9' is not a number or a rising range"),
    ('slurm', {**STEP, 'SLURM_STEP_TASKS_PER_NODE': '2(x3)'}, {},
     r'gives \[2, 2, 2\] tasks on the 2 nodes'),
    ('slurm', {**STEP, 'SLURM_STEP_TASKS_PER_NODE': 'two'}, {},
     "SLURM_STEP_TASKS_PER_NODE='two' does not expand"),
    ('slurm', STEP, dict(port=0), '--port=0: give the first port'),
    ('indexed_job', {}, dict(worker_hosts='h-{index}:1', num_workers=2),
     'JOB_COMPLETION_INDEX is not set'),
    ('indexed_job', {'JOB_COMPLETION_INDEX': '2'},
     dict(worker_hosts='h-{index}:1', num_workers=2),
     'JOB_COMPLETION_INDEX=2 is not a pod of --num_workers=2'),
    ('indexed_job', {'JOB_COMPLETION_INDEX': '0'},
     dict(worker_hosts='h-0:1', num_workers=2),
     "--worker_hosts='h-0:1': --cluster=indexed_job needs"),
    ('indexed_job', {'JOB_COMPLETION_INDEX': '0'},
     dict(worker_hosts='h-{index}:1'), '--num_workers=None'),
])
def test_a_malformed_environment_is_one_line(kind, environ, kwargs, message):
  kwargs = {'port': 7000, **kwargs}
  with pytest.raises(errors.ClusterError, match=message) as refused:
    resolvers.resolve(kind, environ, **kwargs)
  assert '\n' not in str(refused.value) and len(str(refused.value)) < 300
