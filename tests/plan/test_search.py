"""`--plan=auto`: the layouts of N GPUs, each planned by the dry run and
scored by the device model, ranked; the winning command says the layout
ranked first; bad requests stop in one line."""

import re

from absl.testing import flagsaver
import pytest

from tests.helpers import assert_same_checkpoints
from tfmulti import cli
from tfmulti import device_kinds
from tfmulti import errors
from tfmulti.plan import device_model
from tfmulti.plan import dry_run
from tfmulti.plan import search
from tfmulti.train import planned_job

MIB = 2**20


def test_eight_gpus_have_ten_candidates_each_named_once():
  found = search.candidates(8)
  names = [c.name for c in found]
  assert len(names) == len(set(names)) == 10
  assert names[-3:] == ['split over 2', 'split over 4', 'split over 8']
  assert [c.name for c in search.candidates(1)] == names[:4]


@pytest.mark.parametrize('candidate', search.candidates(4),
                         ids=lambda c: c.name)
def test_each_candidates_flags_make_its_config(candidate, tmp_path,
                                               digits_dir):
  """The command a plan prints says the layout it planned."""
  base = dict(model_dir=str(tmp_path / 'run'), data_dir=digits_dir,
              dry_run=True, num_clones=4, clone_on_cpu=False)
  with flagsaver.flagsaver(**base):
    _, plain, _ = cli.configs_from_flags()
  given = {name: (value.split(',') if name in ('mesh_shape', 'mesh_axes')
                  else int(value) if name == 'gather_ahead'
                  else value == 'true' if name == 'keep_joins' else value)
           for name, value in candidate.flags}
  with flagsaver.flagsaver(**base, **given):
    train_config, deploy_config, _ = cli.configs_from_flags()
  want = plain.replaced(**dict(candidate.deploy))
  assert deploy_config.variable_layouts == want.variable_layouts
  assert deploy_config.variable_devices() == want.variable_devices()
  assert (train_config.step_options.gradient_packs ==
          dict(candidate.options).get('gradient_packs', 0))


def _report(flops=0, ops=0, **moved):
  report = dry_run.DeviceReport(flops=flops, ops=ops)
  for link, (sent, received) in moved.items():
    report.sent_bytes[link] += sent
    report.received_bytes[link] += received
  return report


def test_a_step_is_its_slowest_gpu_or_on_shared_cores_the_sum():
  rates = device_model.Rates(flops=1e12, links={'gpu-gpu': 1e9},
                             op_seconds=1e-6, host_flops=1e11)
  found = dry_run.Plan({
      '/device:GPU:0': _report(2e9, 100, **{'gpu-gpu': (3e6, 1e6)}),
      '/device:GPU:1': _report(1e9, 100, **{'gpu-gpu': (1e6, 1e6)}),
      '/device:CPU:0': _report(1e8)}, [])
  # GPU:0: 2 ms of FLOPs, 3 ms of its link (the more way), 0.1 ms of ops.
  assert device_model.step_seconds(found, rates) == pytest.approx(5.1e-3)
  shared = device_model.Rates(1e12, {'gpu-gpu': 1e9}, 1e-6, shared=True)
  assert device_model.step_seconds(found, shared) == pytest.approx(
      5.1e-3 + 2.1e-3 + 0.1e-3)


def test_the_known_kinds_have_their_links():
  rates = device_model.for_kind(device_kinds.KINDS['h100'], 'tf32')
  assert rates.flops == 494.7e12
  assert rates.links == {'gpu-gpu': 450e9, 'host-gpu': 64e9,
                         'network': 12.5e9}
  assert all(set(kind.links) == {'gpu-gpu', 'host-gpu'}
             for kind in device_kinds.KINDS.values())


def test_the_ranking_drops_what_does_not_fit_and_orders_the_rest():
  a, b, c, d = (search.Candidate(name, ()) for name in 'abcd')
  rows = search.ranked([
      search.Scored(a, 3 * MIB, 0, 3.0), search.Scored(b, MIB, 0, 2.0),
      search.Scored(c, dropped='refused'), search.Scored(d, MIB, 0, 1.0)],
                       2 * MIB)
  assert [r.candidate.name for r in rows] == ['d', 'b', 'a', 'c']
  assert rows[2].dropped == 'needs 3.0 MiB a device, over its 2.0 MiB'
  assert rows[3].dropped == 'refused'


def _plan_flags(tmp_path, digits_dir, **flags):
  return {**dict(model_dir=str(tmp_path / 'run'), data_dir=digits_dir,
                 dry_run=True, num_clones=4, clone_on_cpu=False,
                 plan='auto', device_memory='l4'), **flags}


def test_the_plan_ranks_every_candidate_and_logs_the_winners_command(
    tmp_path, digits_dir, caplog):
  with caplog.at_level('INFO', logger='absl'):
    with flagsaver.flagsaver(**_plan_flags(tmp_path, digits_dir,
                                            batch_size=8)):
      cli.main(['train.py'])
  table = re.findall(r'plan on l4: (\d+)\. (.+?): (dropped: .*|[\d.]+ ms .*)',
                     caplog.text)
  assert [int(rank) for rank, _, _ in table] == list(range(1, 10))
  assert {name for _, name, _ in table} == {
      c.name for c in search.candidates(4)}
  times = [float(m[1]) for _, _, line in table
           if (m := re.match(r'([\d.]+) ms a step predicted', line))]
  assert times == sorted(times) and len(times) >= 8
  winner = table[0][1]
  flags = next(c.flags for c in search.candidates(4) if c.name == winner)
  command = re.search(r'plan: (python train\.py .*)', caplog.text)[1]
  assert command.endswith(' '.join(f'--{k}={v}' for k, v in flags))
  assert '--batch_size=8' in command and '--plan' not in command
  assert '--dry_run' not in command and not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_several_kinds_get_a_plan_each_from_one_dry_run_a_candidate(
    tmp_path, digits_dir, caplog, monkeypatch):
  planned = []
  real = planned_job._planned
  monkeypatch.setattr(planned_job, '_planned', lambda *args: planned.append(
      args[1]) or real(*args))
  with caplog.at_level('INFO', logger='absl'):
    with flagsaver.flagsaver(**_plan_flags(tmp_path, digits_dir,
                                            device_memory='l4,H100')):
      cli.main(['train.py'])
  assert len(planned) == len(search.candidates(4))  # Once, not once a kind.
  for kind in ('l4', 'h100'):
    assert re.search(rf'plan on {kind}: 9\. ', caplog.text), kind
    assert re.search(rf'plan: python train\.py .*--device_memory={kind} '
                     r'--', caplog.text), kind
  assert '--device_memory=l4,H100' not in caplog.text


@pytest.mark.slow
def test_a_kind_no_layout_fits_is_logged_and_the_others_planned(
    tmp_path, digits_dir, caplog, monkeypatch):
  with flagsaver.flagsaver(**_plan_flags(tmp_path, digits_dir)):
    train_config, deploy_config, _ = cli.configs_from_flags()
  monkeypatch.setitem(device_kinds.KNOWN_MEMORY, 't4', 0)
  with caplog.at_level('INFO', logger='absl'):
    found = planned_job.search_kinds(train_config, deploy_config,
                                     ['t4', 'h100'])
  assert list(found) == ['h100'] and found['h100'][0].dropped is None
  assert re.search(r'plan on t4: no layout of 4 t4 devices fits: the least '
                   r'needy, [^,]+, needs [\d.]+ MiB a device', caplog.text)
  monkeypatch.setitem(device_kinds.KNOWN_MEMORY, 'h100', 0)
  with pytest.raises(errors.DeviceError, match='no layout of 4 t4 devices'):
    planned_job.search_kinds(train_config, deploy_config, ['t4', 'h100'])


@pytest.mark.parametrize('flags, message', [
    (dict(device_memory='80GB'), r'--plan=auto with --device_memory=80GB: '
     r'the plan needs device kinds of GPUs \(--device_memory=a100\|.*, or '
     r'several: h100,l4\), or --clone_on_cpu'),
    (dict(device_memory='h100,80GB'), r'--device_memory=h100,80GB: the '
     r'plan needs device kinds of GPUs'),
    (dict(device_memory='h100,l4', dry_run=False), r'--device_memory='
     r'h100,l4 without --dry_run: several kinds get a plan each, and one job '
     r'trains; add --dry_run, or name one kind'),
    (dict(variables_device='spread', mesh_shape=['4'], mesh_axes=['batch'],
          layout_map='auto'),
     r'--plan=auto with --variables_device, --mesh_shape, --mesh_axes, '
     r'--layout_map: the plan chooses the layout flags itself; drop them'),
    (dict(clone_on_cpu=True), r'--plan=auto with --clone_on_cpu and '
     r'--device_memory=l4: on logical CPUs the plan measures this machine; '
     r'drop --device_memory'),
    (dict(strategy='mirrored'), r'no layout of 4 l4 devices can run this '
     r'job: variables on the host: --dry_run with --strategy=mirrored'),
])
def test_a_plan_it_cannot_make_stops_in_one_line(tmp_path, digits_dir,
                                                 flags, message):
  with flagsaver.flagsaver(**dict(_plan_flags(tmp_path, digits_dir),
                                  **flags)):
    with pytest.raises(SystemExit, match=message):
      cli.main(['train.py'])
  assert not (tmp_path / 'run').exists()


def test_a_model_no_layout_fits_names_what_the_least_needy_needs(
    tmp_path, digits_dir):
  with flagsaver.flagsaver(**_plan_flags(tmp_path, digits_dir)):
    train_config, deploy_config, _ = cli.configs_from_flags()
  with pytest.raises(errors.DeviceError, match=(
      r'no layout of 4 l4 devices fits: the least needy, [^,]+, needs '
      r'[\d.]+ MiB a device, over its 0.5 MiB; lower --batch_size')):
    planned_job.search(train_config, deploy_config, MIB // 2, 'l4')


@pytest.mark.slow
def test_on_logical_cpus_the_plan_times_each_layout_here(
    tmp_path, digits_dir, caplog):
  with caplog.at_level('INFO', logger='absl'):
    with flagsaver.flagsaver(**_plan_flags(
        tmp_path, digits_dir, clone_on_cpu=True, device_memory=None,
        num_clones=2, batch_size=4)):
      cli.main(['train.py'])
  table = re.findall(r'plan on logical CPU: (\d+)\. (.+?): ([\d.]+) ms a '
                     r'step predicted', caplog.text)
  assert sorted(name for _, name, _ in table) == sorted(
      c.name for c in search.candidates(2, on_cpus=True))
  times = [float(ms) for _, _, ms in table]
  assert times == sorted(times) and times[0] > 0
  assert 'plan: training' not in caplog.text
  assert not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_without_dry_run_the_plan_trains_its_winner_as_plain_towers(
    run_train, tmp_path, caplog):
  with caplog.at_level('INFO', logger='absl'):
    planned = run_train(plan='auto', num_clones=2,
                        model_dir=str(tmp_path / 'planned'))
  winner = re.search(r'plan on logical CPU: 1\. (.+?):', caplog.text)[1]
  assert f'plan: training {winner}' in caplog.text
  plain = run_train(num_clones=2, model_dir=str(tmp_path / 'plain'))
  assert_same_checkpoints(planned['checkpoint'], plain['checkpoint'])
