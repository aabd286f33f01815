"""`train.py --dry_run`: the job planned for its GPUs, on any machine.

Builds the model and the towers the flags describe for GPU:0 to GPU:N-1
(`plan.dry_run`: none of them need exist), traces one step on a batch
of the data's shapes (zeros: nothing is read beyond the data's shapes and
counts), and logs each device's report. With `--strategy=multi_worker`
and `--num_workers=W` (no cluster needed) it plans one worker, whose
towers every worker runs on its part of the global batch (the largest
part), and counts the workers' all-reduce over the network. It ends with
one line and a non-zero exit where an op placed on a GPU has no GPU
kernel for its dtypes, or where `--device_memory` cannot hold a device's
variables, slots and the step's tensors at their peak.
"""

from absl import logging
import numpy as np
import tensorflow as tf

from tfmulti import device_kinds
from tfmulti import devices
from tfmulti import errors
from tfmulti import layouts
from tfmulti import plans
from tfmulti.engine import readings
from tfmulti.engine import registry
from tfmulti.plan import device_model
from tfmulti.plan import dry_run
from tfmulti.plan import measured_rates
from tfmulti.plan import search as search_lib
from tfmulti.train import build
from tfmulti.train import job


def run(config, deploy_config, device_memory=None):
  """Plans the job (see the module); returns the `dry_run.Plan`.

  Raises:
    errors.UserError: a strategy the dry run does not plan, a job the
      strategy would refuse (`registry.check`), an op without a GPU
      kernel, or a device over `device_memory` (bytes).
  """
  found = _planned(config, deploy_config, _checked(config, deploy_config,
                                                  device_memory))
  _log(found)
  _check(found, device_memory)
  return found


def _planned(config, deploy_config, options):
  """The `dry_run.Plan` of the job's step on `deploy_config`'s GPUs."""
  workers = deploy_config.num_workers
  dataset = job.load_shapes(config, deploy_config)
  # The largest worker's rows: each worker runs the same towers.
  global_rows = job.global_batch_size(config, deploy_config)
  rows = max(layouts.worker_span(global_rows, i, workers,
                                 config.step_options.worker_parts)[1]
             for i in range(workers))
  images = np.zeros((rows, *dataset.input_shape), np.float32)
  labels = np.zeros((rows,), np.int32)
  with plans.planning():
    # A GPU variables device: the optimizer's constants are made on it.
    with tf.device(deploy_config.optimizer_variables_device()), (
        plans.on_the_host_if_absent()):
      model, optimizer = build.model_and_optimizer(
          config, deploy_config, input_shape=dataset.input_shape,
          num_classes=dataset.num_classes,
          learning_rate=config.learning_rate)(
              deploy_config.variables_scope())
    return dry_run.plan(deploy_config, model, build.make_loss(), optimizer,
                        images, labels, options)


def plan_kinds(device_memory):
  """The GPU kinds a `--device_memory` of a plan names, in its order:
  'h100,l4' -> ['h100', 'l4'] (one plan each)."""
  return [kind.strip().lower() for kind in (device_memory or '').split(',')
          if kind.strip()]


def check_plan(layout_flags, clone_on_cpu, device_memory, dry=True):
  """Raises `ConfigError` for a `--plan=auto` it cannot make, before
  anything is placed or built: `layout_flags` given (the plan chooses
  them), a memory size instead of GPU kinds, kinds with `clone_on_cpu`
  (logical CPUs are measured here), or several kinds to train (`dry`:
  `--dry_run`, which only plans)."""
  if layout_flags:
    raise errors.ConfigError(
        f'--plan=auto with {", ".join(f"--{n}" for n in layout_flags)}: '
        'the plan chooses the layout flags itself; drop them.')
  if clone_on_cpu and device_memory:
    raise errors.ConfigError(
        f'--plan=auto with --clone_on_cpu and --device_memory='
        f'{device_memory}: on logical CPUs the plan measures this machine; '
        'drop --device_memory, or --clone_on_cpu to plan GPUs.')
  kinds = plan_kinds(device_memory)
  if not clone_on_cpu and (not kinds or any(
      kind not in device_kinds.KINDS for kind in kinds)):
    raise errors.ConfigError(
        f'--plan=auto with --device_memory={device_memory}: the plan needs '
        'device kinds of GPUs (--device_memory='
        f'{"|".join(sorted(device_kinds.KINDS))}, or several: h100,l4), or '
        '--clone_on_cpu.')
  if len(kinds) > 1 and not dry:
    raise errors.ConfigError(
        f'--plan=auto with --device_memory={device_memory} without '
        '--dry_run: several kinds get a plan each, and one job trains; add '
        '--dry_run, or name one kind.')


def search(config, deploy_config, device_memory=None, kind=None):
  """`--plan=auto`: each layout of `search.candidates` planned for the
  job's GPUs of `kind` (a `device_kinds.KINDS` name), or with
  `--clone_on_cpu` on this machine's logical CPUs; a candidate the towers
  refuse or `device_memory` cannot hold dropped with why, the rest ranked
  by the step `device_model` predicts: from the kind's datasheet, or from
  rates measured here with each candidate's heavy ops timed alone
  (`measured_rates.with_kernels`). Logs the table and returns its
  `search.Scored` rows, the winner first.

  Raises:
    errors.DeviceError: no candidate fits, naming what the least needy
      one needs.
    errors.ConfigError: the towers refuse every candidate (the first's
      refusal).
  """
  return _ranked(_candidates_planned(config, deploy_config, device_memory),
                 config, deploy_config, device_memory, kind)


def search_kinds(config, deploy_config, kinds):
  """`search` for each of `kinds`, the candidates planned once (a dry run
  does not depend on the kind): {kind: its rows}. A kind no candidate
  fits is logged with why and left out.

  Raises:
    errors.UserError: no kind can run the job (the first kind's reason).
  """
  planned = _candidates_planned(config, deploy_config, None)
  found, refused = {}, []
  for kind in kinds:
    try:
      found[kind] = _ranked(planned, config, deploy_config,
                            device_kinds.memory_bytes(kind), kind)
    except errors.UserError as e:
      logging.warning('plan on %s: %s', kind, e)
      refused.append(e)
  if not found:
    raise refused[0]
  return found


def _candidates_planned(config, deploy_config, device_memory):
  """(candidate, its `dry_run.Plan` or why the towers refuse it) of each
  layout of `search.candidates`."""
  planned = []
  for candidate in search_lib.candidates(deploy_config.num_clones,
                                         deploy_config.clone_on_cpu):
    try:
      candidate_config, candidate_deploy = candidate.applied(
          config, deploy_config)
      found = _planned(config, candidate_deploy, _checked(
          candidate_config, candidate_deploy, device_memory))
      _check(found, None)
    except errors.UserError as e:
      planned.append((candidate, str(e)))
      continue
    planned.append((candidate, found))
  return planned


def _ranked(planned, config, deploy_config, device_memory, kind):
  """`search`'s rows of `planned` (`_candidates_planned`) on `kind`."""
  rates = _rates(config, deploy_config, kind, [
      found for _, found in planned if isinstance(found, dry_run.Plan)])
  rows = search_lib.ranked([
      search_lib.Scored(candidate, dropped=found) if isinstance(found, str)
      else search_lib.scored(candidate, found, device_model.step_seconds(
          found, rates)) for candidate, found in planned], device_memory)
  where = kind or 'logical CPU'
  _log_ranked(rows, where)
  if rows[0].dropped is not None:
    _refuse(rows, deploy_config.num_clones, where)
  return rows


def _rates(config, deploy_config, kind, plans):
  """The device model's `Rates`: `kind`'s, or on logical CPUs measured
  here, `plans`' kernels timed."""
  if deploy_config.clone_on_cpu:
    return measured_rates.with_kernels(
        [devices.canonical(d) for d in deploy_config.compute_devices()],
        plans)
  return device_model.for_kind(device_kinds.KINDS[kind], readings.rate_dtype(
      'float16' if config.mixed_precision else 'float32', 'GPU:0'))


def _refuse(rows, num_clones, where):
  """Raises for a search where no candidate runs (see `search`)."""
  planned = [r for r in rows if r.need_bytes]
  if not planned:
    raise errors.ConfigError(
        f'no layout of {num_clones} {where} devices can run this job: '
        f'{rows[0].candidate.name}: {rows[0].dropped}')
  least = min(planned, key=lambda r: r.need_bytes)
  raise errors.DeviceError(
      f'no layout of {num_clones} {where} devices fits: the least needy, '
      f'{least.candidate.name}, {least.dropped}; lower --batch_size '
      '(raising --accumulation_steps keeps the global batch) or plan more '
      'devices, or a kind of more memory.')


def _log_ranked(rows, kind):
  text = device_kinds.size_text
  for rank, row in enumerate(rows, 1):
    logging.info(
        'plan on %s: %d. %s: %s', kind, rank, row.candidate.name,
        f'dropped: {row.dropped}' if row.dropped else
        f'{1e3 * row.seconds:.2f} ms a step predicted, needs '
        f'{text(row.need_bytes)} a device, moves {text(row.moved_bytes)}')


def _checked(config, deploy_config, device_memory):
  """The step options as the strategy runs them, after the real run's
  gate (`registry.check`: its options, workers, layouts) and the dry
  run's own rules."""
  if device_memory is not None and deploy_config.clone_on_cpu:
    raise errors.ConfigError(
        '--device_memory with --clone_on_cpu: the dry run checks GPUs; '
        'leave --clone_on_cpu out to plan GPU:0 to GPU:N-1.')
  if config.strategy not in (registry.TOWERS, registry.MULTI_WORKER):
    raise errors.ConfigError(
        f'--dry_run with --strategy={config.strategy}: the dry run plans '
        f'the towers, in one process or on each worker; use --strategy='
        f'{registry.TOWERS} or {registry.MULTI_WORKER}.')
  if (config.strategy == registry.MULTI_WORKER and
      deploy_config.num_workers < 2):
    raise errors.ConfigError(
        f'--dry_run with --strategy={registry.MULTI_WORKER} plans a worker '
        'of --num_workers: give --num_workers=W, 2 or more.')
  return registry.check(config, deploy_config)


def _log(found):
  for device, report in found.devices.items():
    moved = ', '.join(f'{link} {report.sent_bytes[link] / 2**20:.1f} MiB out '
                      f'{report.received_bytes[link] / 2**20:.1f} MiB in'
                      for link in sorted(set(report.sent_bytes) |
                                         set(report.received_bytes)))
    logging.info(
        '%s: holds %.1f MiB of variables and slots, its tensors peak at '
        '%.1f MiB; moves %s; %.2f GFLOP a step in %d ops; %d without a '
        'GPU kernel', device, report.held_bytes / 2**20,
        report.peak_bytes / 2**20, moved or 'nothing',
        report.flops / 1e9, report.ops, len(report.missing_kernels))
  for size, path, device in found.holders[:5]:
    logging.info('biggest: %s, %.1f MiB on %s', path, size / 2**20, device)


def _check(found, device_memory):
  missing = [line for report in found.devices.values()
             for line in report.missing_kernels]
  if missing:
    raise errors.DeviceError(
        f'{len(missing)} op(s) placed on a GPU have no GPU kernel for their '
        f'dtypes; the first: {missing[0]}. Move it to the input pipeline or '
        'cast it to a type a GPU computes.')
  over = (dry_run.over_memory(found, device_memory)
          if device_memory is not None else [])
  if over:
    raise errors.DeviceError(
        f'{len(over)} device(s) do not fit: {over[0]}.')
  if any(dry_run.device_type(d) == 'GPU' for d in found.devices):
    logging.info('dry run: every op placed on a GPU has a GPU kernel%s.',
                 _fits(found, device_memory))


def _fits(found, device_memory):
  """', and every device fits ...' naming the busiest GPU and its spare
  memory; '' without a memory given."""
  if device_memory is None:
    return ''
  gpus = {device: report for device, report in found.devices.items()
          if dry_run.device_type(device) == 'GPU'}
  busiest, report = max(gpus.items(), key=lambda item: (
      item[1].held_bytes + item[1].peak_bytes))
  need = report.held_bytes + report.peak_bytes
  text = device_kinds.size_text
  return (f', and every device fits in {text(device_memory)} (the '
          f'busiest, {busiest}, needs {text(need)}: '
          f'{text(device_memory - need)} spare)')
