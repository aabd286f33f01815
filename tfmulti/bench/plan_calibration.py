"""`--plan=auto`'s device model against the steps measured here.

  python -m tfmulti.bench.plan_calibration --model=resnet20 --num_clones=4
  python -m tfmulti.bench.plan_calibration --model=llama --num_clones=4
  python -m tfmulti.bench.plan_calibration --model=dlrm --num_clones=4

Deploys the model under each layout the plan searches on
`--num_clones` logical CPUs (`plan.search.candidates`) and reads each
one's dry run from its traced step (`plan.dry_run.read`); measures this
machine's rates (`plan.measured_rates`: a matmul's FLOP rate, an op's
and a call's cost, the bytes written a second, a copy's bandwidth, each
heavy op of the steps timed alone); predicts each step
(`plan.device_model`) and times `--steps` steps of each in `--rounds`
alternating rounds (the median round). Models: a registered CNN
(`tfmulti.models`, images of `--image_size`), `llama` (keras-hub's
small Llama causal LM, keras-hub needed) and `dlrm` (the recommender of
`bench.table_plan`); momentum SGD.

The targets (#69): the predicted order of the steps matches the measured
order (Spearman's rank correlation at least 0.8), each predicted step is
within 25% of the measured one, and the predicted winner's measured step
is within 10% of the best measured.
"""

import argparse
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import models
from tfmulti import step_options
from tfmulti.bench import designs as bench
from tfmulti.bench import flags
from tfmulti.bench import sharded
from tfmulti.bench import table_plan
from tfmulti.deploy import placement
from tfmulti.deploy import towers as towers_lib
from tfmulti.plan import device_model
from tfmulti.plan import dry_run
from tfmulti.plan import measured_rates
from tfmulti.plan import search

LLAMA, DLRM = 'llama', 'dlrm'
DLRM_SIZES = (100_000, 10_000, 1000, 1000)
SPEARMAN, WITHIN, CHOSEN = 0.8, 0.25, 1.10


def _model(args, scope):
  keras.utils.set_random_seed(0)
  if args.model == LLAMA:
    return sharded.llama(scope)
  with scope:
    if args.model == DLRM:
      return table_plan.dlrm(DLRM_SIZES, args.width)
    return models.get_model(args.model, input_shape=(args.image_size,) * 2 +
                            (3,), num_classes=10)


def _loss(args):
  if args.model == DLRM:
    return keras.losses.BinaryCrossentropy(from_logits=True)
  return keras.losses.SparseCategoricalCrossentropy(
      from_logits=args.model == LLAMA or models.ends_in_logits(args.model))


def _batch(args):
  rows = args.rows_per_clone * args.num_clones
  if args.model == DLRM:
    return table_plan.batch(DLRM_SIZES, rows)
  if args.model == LLAMA:
    ids = np.random.default_rng(0).integers(
        0, 4096, size=(rows, args.sequence_length + 1)).astype(np.int32)
    return ({'token_ids': ids[:, :-1], 'padding_mask': np.ones(
        (rows, args.sequence_length), np.int32)}, ids[:, 1:])
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, args.image_size, args.image_size, 3)
                     ).astype(np.float32),
          rng.integers(0, 10, size=rows).astype(np.int32))


def _deployed(candidate, args):
  config = placement.DeploymentConfig(num_clones=args.num_clones,
                                      clone_on_cpu=True).replaced(
                                          **dict(candidate.deploy))
  model = _model(args, config.variables_scope())
  with tf.device(config.optimizer_variables_device()):
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
  return towers_lib.deploy(config, model, _loss(args), optimizer,
                           step_options.StepOptions(**dict(candidate.options)))


def _timed(deployed, batch, steps):
  """Seconds a step of `steps` steps."""
  start = time.perf_counter()
  for _ in range(steps):
    loss = deployed.train_step_outputs(*batch).total
  float(loss)
  return (time.perf_counter() - start) / steps


def _planned(candidate, batch, args):
  """One candidate's entry (its dry run's counts, or why it was refused),
  its `dry_run.Plan` and its deployed model (None: refused)."""
  try:
    deployed = _deployed(candidate, args)
  except errors.UserError as e:
    return {'name': candidate.name, 'refused': str(e)}, None, None
  found = dry_run.read(deployed, *batch)
  deployed.train_step_outputs(*batch)  # Traced, optimized, run once.
  reports = found.devices.values()
  return {'name': candidate.name, 'ops': sum(r.ops for r in reports),
          'gflop': sum(r.flops for r in reports) / 1e9,
          'written_mb': sum(r.written_bytes for r in reports) / 2**20,
          'kernels': sum(sum(r.kernels.values()) for r in reports)
          }, found, deployed


def spearman(xs, ys):
  """Spearman's rank correlation of two equal-length sequences (ties
  ranked by their order)."""
  def ranks(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    return [order.index(i) for i in range(len(values))]
  rx, ry = ranks(xs), ranks(ys)
  n = len(xs)
  return 1 - 6 * sum((a - b)**2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def _measure(ran, batch, args):
  """Each deployed model's median round, into its row: `ran` is (row,
  deployed) pairs, timed in turn each round (drift is shared)."""
  rounds = [[_timed(deployed, batch, args.steps) for _, deployed in ran]
            for _ in range(args.rounds)]
  for index, (row, _) in enumerate(ran):
    row['measured_ms'] = 1e3 * statistics.median(r[index] for r in rounds)


def _rates_entry(rates):
  copy = rates.links[measured_rates.LINK]
  return {'gflops': rates.flops / 1e9, 'op_us': 1e6 * rates.op_seconds,
          'copy_gbs': copy / 1e9 if copy != float('inf') else None,
          'written_gbs': rates.written_bytes / 1e9,
          'call_us': 1e6 * rates.call_seconds,
          'kernels_timed': len(rates.kernel_seconds)}


def run(args):
  """The report: the rates, each candidate's row, and the scores."""
  names = [devices.canonical(d.name)
           for d in tf.config.list_logical_devices('CPU')][:args.num_clones]
  batch = _batch(args)
  planned = [_planned(c, batch, args)
             for c in search.candidates(args.num_clones, on_cpus=True)]
  rates = measured_rates.with_kernels(
      names, [found for _, found, deployed in planned if deployed])
  for row, found, deployed in planned:
    if deployed:
      row['predicted_ms'] = 1e3 * device_model.step_seconds(found, rates)
  _measure([(row, deployed) for row, _, deployed in planned if deployed],
           batch, args)
  ran = [row for row, _, deployed in planned if deployed]
  predicted = [r['predicted_ms'] for r in ran]
  measured = [r['measured_ms'] for r in ran]
  return {
      'model': args.model, 'num_clones': args.num_clones,
      'rows_per_clone': args.rows_per_clone, 'rates': _rates_entry(rates),
      'rows': [row for row, _, _ in planned],
      'spearman': spearman(predicted, measured) if len(ran) > 1 else 1.0,
      'worst_ratio': max((p / m for p, m in zip(predicted, measured)),
                         key=lambda x: abs(x - 1)),
      'chosen_of_best': ran[predicted.index(min(predicted))][
          'measured_ms'] / min(measured)}


def format_report(report):
  """The report as a text table (what the command prints)."""
  rates = report['rates']
  lines = [f"{report['model']} on {report['num_clones']} logical CPUs, "
           f"{report['rows_per_clone']} rows a clone; rates: "
           f"{rates['gflops']:.0f} GFLOP/s, {rates['op_us']:.2f} us an op, "
           f"{rates['written_gbs']:.0f} GB/s written, "
           f"{rates['call_us']:.0f} us a call",
           f"{'layout':<32}{'predicted ms':>14}{'measured ms':>13}"
           f"{'ratio':>7}{'ops':>7}{'GFLOP':>8}{'written MiB':>13}"]
  for row in report['rows']:
    if 'refused' in row:
      lines.append(f"{row['name']:<32}refused: {row['refused']}")
      continue
    lines.append(f"{row['name']:<32}{row['predicted_ms']:>14.2f}"
                 f"{row['measured_ms']:>13.2f}"
                 f"{row['predicted_ms'] / row['measured_ms']:>7.2f}"
                 f"{row['ops']:>7}{row['gflop']:>8.3f}"
                 f"{row['written_mb']:>13.1f}")
  lines.append(f"Spearman {report['spearman']:.2f} (target {SPEARMAN}); "
               f"worst predicted/measured {report['worst_ratio']:.2f} "
               f"(target within {WITHIN:.0%}); chosen's measured step "
               f"{report['chosen_of_best']:.2f}x the best (target "
               f"{CHOSEN:.2f})")
  return '\n'.join(lines)


def parser():
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.plan_calibration',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model='resnet20', model_names=flags.TRAINABLE,
                            num_clones=4)])
  p.add_argument('--rows_per_clone', type=int, default=8)
  p.add_argument('--image_size', type=int, default=32)
  p.add_argument('--sequence_length', type=int, default=32)
  p.add_argument('--width', type=int, default=16,
                 help="--model=dlrm's table width (default: %(default)s)")
  p.add_argument('--steps', type=int, default=10)
  p.add_argument("--rounds", type=int, default=5)
  return p


def _check(args):
  if args.model not in models.names() + [LLAMA, DLRM]:
    raise errors.ConfigError(
        f'--model={args.model}: give a registered CNN '
        f'({", ".join(models.names())}), {LLAMA} or {DLRM}.')


def main(argv=None):
  args = parser().parse_args(argv)
  flags.on_logical_cpus(
      'python -m tfmulti.bench.plan_calibration', args,
      ('num_clones', 'rows_per_clone', 'image_size', 'sequence_length',
       'width', 'steps', 'rounds'), args.num_clones, _check)
  report = run(args)
  bench.emit(report, format_report(report), args.output)


if __name__ == '__main__':
  main()
