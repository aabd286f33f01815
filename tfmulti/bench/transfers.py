"""Each device's bytes held and moved in one towers step, read from its graph.

  python -m tfmulti.bench.transfers --model=resnet50 --num_clones=4

Deploys the model (224x224x3 images, 1000 classes by default; momentum SGD,
one slot a variable) over `--num_clones` clones of logical CPUs with its
variables

* `central`: all on a device of their own (CPU:N, standing for the host
  CPU beside N GPUs, slim's and tfmulti's default there);
* `spread`: each on one of the clones' devices (`--variables_device=spread`);
* `spread_packs`: spread, with `--gradient_packs=auto`;

traces one step of each (nothing runs: the placement is the graph's, the
same on logical CPUs as on GPUs) and counts per device, with
`plan.traffic`, the variable and slot bytes it holds and the bytes it
sends and receives across devices, variable reads and gradients apart
from the rest (input shards, losses, BatchNorm statistics), with the
transfers. MirroredStrategy's all-reduce is given by theory, as a ring
all-reduce moves it on GPUs: a reduce-scatter and an all-gather of
(N-1)/N x P each, so 2 (N-1)/N x P each way a device, and a full copy of
the variables and slots held on each (its graph on logical CPUs reduces
onto CPU:0, which is not the GPU one).

Spread variables cannot move less: a device that computes a clone and owns
1/N of the variables receives the (N-1)/N x P of variables it does not own
and (N-1) x P/N of gradients for those it owns, 2 (N-1)/N x P, and sends
as much. The targets are 1.15 times that, and 1.15 / N of the bytes held. The
report also gives what largest-first placement reaches on the sizes alone
(spread placement is that rule), as a check.
"""

import argparse
import sys

import keras
import numpy as np
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import models
from tfmulti.bench import designs as bench
from tfmulti.bench import flags
from tfmulti.deploy import placement
from tfmulti.deploy import towers as towers_lib
from tfmulti.plan import traffic

MB = 2**20
VARIANTS = ('central', 'spread', 'spread_packs')
# The targets of the design (tf_cnn_benchmarks' balance), at N devices.
HELD_SLACK = 1.15  # Each device holds at most 1.15 / N of the bytes.
SENT_SLACK = 1.15  # ... and sends and receives at most 1.15 x 2(N-1)/N P.


def _deployed(variant, args):
  """The model deployed as `variant` says (see the module's docstring)."""
  n = args.num_clones
  variables = (f'/device:CPU:{n}' if variant == 'central'
               else placement.SPREAD)
  config = placement.DeploymentConfig(num_clones=n, clone_on_cpu=True,
                                      variables_device=variables)
  keras.utils.set_random_seed(0)
  with tf.device(config.optimizer_variables_device()):
    with config.variables_scope():
      model = models.get_any_model(
          args.model, input_shape=(args.image_size, args.image_size, 3),
          num_classes=args.num_classes)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  loss = keras.losses.SparseCategoricalCrossentropy(
      from_logits=models.ends_in_logits(args.model))
  return towers_lib.deploy(
      config, model, loss, optimizer,
      gradient_packs='auto' if variant == 'spread_packs' else 0)


def _per_device(table, parameter_bytes):
  """The table's figures per device (bytes to MB, shares of P)."""
  rows = {}
  for device, counts in table.items():
    moved = {way: sum(getattr(counts, way)[kind]
                      for kind in ('variables', 'gradients'))
             for way in ('sent', 'received')}
    rows[device] = {
        'held_mb': counts.held / MB,
        'sent_mb': moved['sent'] / MB, 'received_mb': moved['received'] / MB,
        'sent_of_p': moved['sent'] / parameter_bytes,
        'received_of_p': moved['received'] / parameter_bytes,
        'other_sent_mb': counts.sent['other'] / MB,
        'other_received_mb': counts.received['other'] / MB,
        'gradient_transfers_sent': counts.transfers_sent['gradients'],
        'variable_transfers_received': counts.transfers_received['variables'],
    }
  return rows


def measure(variant, args):
  """One variant's report: per device, and its checks against the
  targets."""
  deployed = _deployed(variant, args)
  n = args.num_clones
  variables = deployed.model.trainable_variables
  sizes = [devices.variable_bytes(v) for v in variables]
  parameter_bytes = sum(sizes)
  rng = np.random.default_rng(0)
  rows = args.rows_per_clone * n
  images = rng.normal(size=(rows, args.image_size, args.image_size,
                            3)).astype(np.float32)
  labels = rng.integers(0, args.num_classes, size=rows).astype(np.int32)
  per_device = _per_device(traffic.step_traffic(deployed, images, labels),
                           parameter_bytes)
  clones = deployed.config.compute_devices()
  held = sum(row['held_mb'] for row in per_device.values())
  return {
      'parameter_mb': parameter_bytes / MB,
      'largest_variable_of_p': max(sizes) / parameter_bytes,
      'devices': per_device,
      'max_held_of_total': max(r['held_mb'] for r in per_device.values())
                           / held,
      'max_sent_of_p': max(r['sent_of_p'] for r in per_device.values()),
      'max_received_of_p': max(r['received_of_p']
                               for r in per_device.values()),
      'max_gradient_transfers_per_clone': max(
          per_device[c]['gradient_transfers_sent'] for c in clones),
      'largest_first_max_held_of_p': _largest_first(sizes, n) /
                                     parameter_bytes,
      'targets': {'held_of_total': HELD_SLACK / n,
                  'moved_of_p': SENT_SLACK * 2 * (n - 1) / n,
                  'gradient_transfers_per_clone': n - 1},
  }


def _largest_first(sizes, n):
  """The most bytes a device holds when `sizes` go largest first to the
  least loaded of n devices."""
  held = [0] * n
  for size in sorted(sizes, reverse=True):
    held[held.index(min(held))] += size
  return max(held)


def mirrored_theory(n, parameter_mb):
  """A ring all-reduce over n replicas, per device (bytes each way)."""
  moved = 2 * (n - 1) / n
  return {'sent_of_p': moved, 'received_of_p': moved, 'held_of_total': 1.0,
          'sent_mb': moved * parameter_mb}


def run(args):
  report = {'environment': bench.environment(), 'model': args.model,
            'image_size': args.image_size, 'num_classes': args.num_classes,
            'num_clones': args.num_clones,
            'rows_per_clone': args.rows_per_clone, 'emulated': 'logical CPUs',
            'variants': {}}
  for variant in VARIANTS:
    report['variants'][variant] = measure(variant, args)
  parameter_mb = report['variants']['central']['parameter_mb']
  report['mirrored_theory'] = mirrored_theory(args.num_clones, parameter_mb)
  return report


def format_report(report):
  n = report['num_clones']
  first = report['variants']['central']
  lines = [f"{report['model']} at {report['image_size']}x"
           f"{report['image_size']}, {report['num_classes']} classes: "
           f"P = {first['parameter_mb']:.1f} MB of trainable variables, the "
           f"largest {first['largest_variable_of_p']:.1%} of P; {n} clones "
           '(graph read on logical CPUs)',
           f"{'variant':<14}{'device':<16}{'held MB':>9}{'sent MB':>9}"
           f"{'recv MB':>9}{'sent/P':>8}{'recv/P':>8}{'grad tx':>8}"
           f"{'other MB':>10}"]
  for variant, result in report['variants'].items():
    for device, row in result['devices'].items():
      lines.append(
          f"{variant:<14}{device:<16}{row['held_mb']:>9.1f}"
          f"{row['sent_mb']:>9.1f}{row['received_mb']:>9.1f}"
          f"{row['sent_of_p']:>8.2f}{row['received_of_p']:>8.2f}"
          f"{row['gradient_transfers_sent']:>8d}"
          f"{row['other_sent_mb'] + row['other_received_mb']:>10.1f}")
  theory = report['mirrored_theory']
  lines.append(f"{'mirrored':<14}{'each (theory)':<16}{'all':>9}"
               f"{theory['sent_mb']:>9.1f}{theory['sent_mb']:>9.1f}"
               f"{theory['sent_of_p']:>8.2f}{theory['received_of_p']:>8.2f}")
  lines.append('')
  for variant, result in report['variants'].items():
    targets = result['targets']
    lines.append(
        f"{variant}: busiest device holds {result['max_held_of_total']:.3f} "
        f"of the bytes (target {targets['held_of_total']:.3f}; largest first "
        f"would reach {result['largest_first_max_held_of_p']:.3f}), sends "
        f"{result['max_sent_of_p']:.2f} P and receives "
        f"{result['max_received_of_p']:.2f} P (target "
        f"{targets['moved_of_p']:.2f}); at most "
        f"{result['max_gradient_transfers_per_clone']} gradient transfers a "
        f"clone (target with packs {targets['gradient_transfers_per_clone']})")
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.transfers',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model='resnet50', model_names=flags.APPLICATIONS,
                            num_clones=4)])
  p.add_argument('--image_size', type=int, default=224)
  p.add_argument('--num_classes', type=int, default=1000)
  p.add_argument('--rows_per_clone', type=int, default=2)
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  try:
    for name in ('num_clones', 'image_size', 'num_classes',
                 'rows_per_clone'):
      errors.check_count(name, getattr(args, name), 1)
    models.check_any(args.model)
    devices.create_logical_cpus(args.num_clones + 1)  # And the host.
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.transfers: error: {e}')
  report = run(args)
  bench.emit(report, format_report(report), args.output)


if __name__ == '__main__':
  main()
