"""A table split by rows over the devices: each device's bytes held, and
moved a step against the rows its clones' ids touch.

  python -m tfmulti.bench.tables --vocab=1000000 --width=64 --num_clones=4

Deploys a recommender's tower (ids -> Embedding(vocab, width) -> the mean
over the ids -> a click's logit, Adagrad) over `--num_clones` clones of
logical CPUs, its table laid out by rows over a mesh (N,) ('model'), so
each device holds 1/N of it and its Adagrad slot, and each clone looks its
ids up where their rows live (`mesh.lookups`). From one step on
`--rows_per_clone` rows of `--tokens` random ids a clone it counts, device
by device:

* held: the bytes of the variables and slots on it (`traffic.held_bytes`),
  against (table + slot) / N; the target: at most 1.1x;
* moved: the bytes it sends and receives of variables, gradients and
  lookups (`traffic` kinds: the batch's split and the loss aside), those
  whose size the ids decide (the ids, the rows, their gradient's slices)
  evaluated on this batch (`traffic.measured_transfers`), against what
  the ids touch: for each id of a clone's rows whose row lives on another
  device, the id (4 bytes) there and its row back, and its gradient row
  and index there; the target: at most 1.1x each way. Ids are counted as
  they come (a row touched twice is sent twice). A clone that joined the
  table instead would receive (N-1)/N of it each step (`table_mb`).
"""

import argparse
import collections

import keras
import numpy as np
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti.bench import designs as bench
from tfmulti.bench import flags
from tfmulti.deploy import placement
from tfmulti.deploy import towers as towers_lib
from tfmulti.mesh import mesh_layouts
from tfmulti.plan import traffic

MB = 2**20
TARGET = 1.1  # Held over (table + slot) / N; moved over the touched bytes.
ID_BYTES = 4


def _tower(vocab, width, tokens):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((tokens,), dtype='int32')
  x = keras.layers.Embedding(vocab, width, name='table')(inputs)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(1, name='click')(x))


def _touched(ids, n, vocab, width):
  """{device index: (bytes out, bytes in)} the ids touch (see the
  module): clone c's ids, counted by the device their row lives on."""
  rows_per_shard = vocab // n
  counts = np.zeros((n, n), np.int64)  # [clone, owner]
  for c, mine in enumerate(np.split(ids, n)):
    counts[c] += np.bincount((mine // rows_per_shard).ravel(), minlength=n)
  np.fill_diagonal(counts, 0)
  row, gradient = width * 4, width * 4 + ID_BYTES
  asked, answered = counts.sum(axis=1), counts.sum(axis=0)
  return {d: (asked[d] * (ID_BYTES + gradient) + answered[d] * row,
              asked[d] * row + answered[d] * (ID_BYTES + gradient))
          for d in range(n)}


def run(args):
  """The report: per device, bytes held and moved, and their targets."""
  n = args.num_clones
  layouts = mesh_layouts.VariableLayouts(
      (n,), ('model',), (('table/embeddings', ('model', None)),))
  config = placement.DeploymentConfig(num_clones=n, clone_on_cpu=True,
                                      variable_layouts=layouts)
  model = _tower(args.vocab, args.width, args.tokens)
  deployed = towers_lib.deploy(
      config, model, keras.losses.BinaryCrossentropy(from_logits=True),
      keras.optimizers.Adagrad(0.05))
  rng = np.random.default_rng(0)
  rows = args.rows_per_clone * n
  ids = rng.integers(0, args.vocab, (rows, args.tokens)).astype(np.int32)
  labels = rng.integers(0, 2, rows).astype(np.float32)
  moved = collections.defaultdict(lambda: [0, 0])
  for source, reader, kind, size in traffic.measured_transfers(
      deployed, tf.constant(ids), tf.constant(labels)):
    if kind != 'other':  # The batch's split, its loss: not the table's.
      moved[source][0] += size
      moved[reader][1] += size
  table = args.vocab * args.width * 4
  held = traffic.held_bytes(deployed.parts.storage.variables +
                            deployed.optimizer.variables)
  report = {'environment': bench.environment(), 'emulated': 'logical CPUs',
            'vocab': args.vocab, 'width': args.width, 'tokens': args.tokens,
            'num_clones': n, 'rows_per_clone': args.rows_per_clone,
            'table_mb': table / MB, 'devices': {}}
  touched = _touched(ids, n, args.vocab, args.width)
  for d in range(n):
    device = devices.canonical(config.clone_device(d))
    out, into = moved[device]
    report['devices'][device] = {
        'held_of_share': held[device] / (2 * table / n),
        'sent_mb': out / MB, 'received_mb': into / MB,
        'sent_of_touched': out / touched[d][0],
        'received_of_touched': into / touched[d][1]}
  rows_of = report['devices'].values()
  report['max_held_of_share'] = max(r['held_of_share'] for r in rows_of)
  report['max_moved_of_touched'] = max(
      max(r['sent_of_touched'], r['received_of_touched']) for r in rows_of)
  report['target'] = TARGET
  return report


def format_report(report):
  lines = [f"Embedding({report['vocab']:,}, {report['width']}) by rows over "
           f"{report['num_clones']} clones of {report['rows_per_clone']} rows "
           f"x {report['tokens']} ids ({report['table_mb']:.1f} MB table; "
           'graph read on logical CPUs)']
  for device, r in report['devices'].items():
    lines.append(
        f"{device}: holds {r['held_of_share']:.3f} x (table + slot) / N; "
        f"sends {r['sent_mb']:.3f} MB ({r['sent_of_touched']:.3f} x touched),"
        f" receives {r['received_mb']:.3f} MB "
        f"({r['received_of_touched']:.3f} x)")
  lines.append(f"busiest: holds {report['max_held_of_share']:.3f}, moves "
               f"{report['max_moved_of_touched']:.3f} x touched (target "
               f"{report['target']} each)")
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.tables',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(num_clones=4)])
  p.add_argument('--vocab', type=int, default=1_000_000)
  p.add_argument('--width', type=int, default=64)
  p.add_argument('--tokens', type=int, default=8)
  p.add_argument('--rows_per_clone', type=int, default=256)
  return p


def _check(args):
  if args.num_clones < 2:
    raise errors.ConfigError(
        f'--num_clones={args.num_clones}: a table split over one device '
        'moves nothing; give 2 or more.')
  if args.vocab % args.num_clones:
    raise errors.ConfigError(
        f'--vocab={args.vocab} does not split into --num_clones='
        f'{args.num_clones} equal shards; give a multiple of it.')


def main(argv=None):
  args = parser().parse_args(argv)
  flags.on_logical_cpus(
      'python -m tfmulti.bench.tables', args,
      ('vocab', 'width', 'tokens', 'num_clones', 'rows_per_clone'),
      args.num_clones, _check)
  report = run(args)
  bench.emit(report, format_report(report), args.output)


if __name__ == '__main__':
  main()
