"""A recommender's tables planned over the devices, against each table
whole and each split by rows: the bytes each device holds and looks up.

  python -m tfmulti.bench.table_plan --num_clones=4
  python -m tfmulti.bench.table_plan --num_clones=8

Deploys a DLRM (dense features through a bottom MLP, one Embedding of
`--width` a categorical feature of one id, with `--vocab_sizes` rows
each, a dot interaction and a top MLP; Adagrad) over `--num_clones`
clones of logical CPUs on a mesh (N,) ('model'), its tables laid out
three ways in one run:

* planned: `VariableLayouts(plan_tables=True)` (`mesh.table_plan`);
* whole: each table whole on one device, spread by bytes (no layout);
* rows: each table split by rows over every device.

For each, from the deployed variables and one traced step on
`--rows_per_clone` rows of uniform random ids a clone:

* held: the most bytes of the tables any device holds, over an even
  share (the tables / N; each table's Adagrad slot follows it);
* looked up: the most bytes any device's lookups gather (their ops'
  outputs, evaluated on the batch: `traffic.measured_lookups`), over an
  even share (all of them / N);
* gathers: the lookup ops a step runs, over all clones (a split table
  gathers once a shard a clone, a whole one once a clone).

The planner's target: at most 1.1x an even share of each, with fewer
gathers than rows, which splits every table.
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
from tfmulti.mesh import table_plan
from tfmulti.plan import traffic

DESIGNS = ('planned', 'whole', 'rows')
DENSE = 4  # Dense features an example.


def dlrm(sizes, width=16):
  """A DLRM as users write it: dense features through a bottom MLP, one
  Embedding a categorical feature (`sizes`: their rows), every pair of
  them dotted, and a top MLP to a click's logit."""
  keras.utils.set_random_seed(0)
  dense = keras.Input((DENSE,), name='dense')
  ids = [keras.Input((1,), dtype='int32', name=f'c{i}')
         for i in range(len(sizes))]
  bottom = keras.layers.Dense(width, activation='relu', name='bottom')(dense)
  features = [bottom] + [
      keras.layers.Flatten()(keras.layers.Embedding(
          rows, width, name=f'table_{i}')(x))
      for i, (rows, x) in enumerate(zip(sizes, ids))]
  stacked = keras.ops.stack(features, axis=1)
  dots = keras.layers.Flatten()(
      keras.ops.matmul(stacked, keras.ops.transpose(stacked, (0, 2, 1))))
  x = keras.layers.Dense(16, activation='relu', name='top')(
      keras.layers.Concatenate()([bottom, dots]))
  return keras.Model([dense, *ids], keras.layers.Dense(1, name='click')(x))


def _layouts(design, n):
  rules = ((('table_.*/embeddings', ('model', None)),) if design == 'rows'
           else ())
  return mesh_layouts.VariableLayouts((n,), ('model',), rules,
                                      plan_tables=design == 'planned')


def batch(vocab_sizes, rows):
  """A DLRM's batch of `rows`: normal dense features, uniform ids of each
  table of `vocab_sizes`, clicks of 0 or 1."""
  rng = np.random.default_rng(0)
  features = {'dense': tf.constant(rng.normal(size=(rows, DENSE)),
                                   tf.float32)}
  for i, size in enumerate(vocab_sizes):
    features[f'c{i}'] = tf.constant(rng.integers(0, size, (rows, 1)),
                                    tf.int32)
  return features, tf.constant(rng.integers(0, 2, rows), tf.float32)


def _design(args, design):
  """The report's entry of one design."""
  n = args.num_clones
  config = placement.DeploymentConfig(num_clones=n, clone_on_cpu=True,
                                      variable_layouts=_layouts(design, n))
  deployed = towers_lib.deploy(
      config, dlrm(args.vocab_sizes, args.width),
      keras.losses.BinaryCrossentropy(from_logits=True),
      keras.optimizers.Adagrad(0.05))
  tables = [v for v in deployed.parts.storage.variables
            if v.path.startswith('table_')]
  held = traffic.held_bytes(tables)
  gathers = traffic.measured_lookups(
      deployed, *batch(args.vocab_sizes, args.rows_per_clone * n))
  looked = collections.Counter()
  for device, size in gathers:
    looked[device] += size
  names = [devices.canonical(config.clone_device(d)) for d in range(n)]
  even_held = sum(held.values()) / n
  even_looked = sum(looked.values()) / n
  return {
      'held_of_share': [held.get(d, 0) / even_held for d in names],
      'looked_of_share': [looked.get(d, 0) / even_looked for d in names],
      'gathers': len(gathers),
      'max_held_of_share': max(held.values()) / even_held,
      'max_looked_of_share': max(looked.values()) / even_looked}


def run(args):
  """The report: each design's busiest device, held and looked up."""
  report = {'environment': bench.environment(), 'emulated': 'logical CPUs',
            'vocab_sizes': list(args.vocab_sizes), 'width': args.width,
            'num_clones': args.num_clones,
            'rows_per_clone': args.rows_per_clone,
            'target': table_plan.TARGET,
            'designs': {d: _design(args, d) for d in DESIGNS}}
  return report


def format_report(report):
  lines = [f"{len(report['vocab_sizes'])} tables of "
           f"{sum(report['vocab_sizes']):,} rows x {report['width']} over "
           f"{report['num_clones']} clones of {report['rows_per_clone']} "
           'rows (graph read on logical CPUs); busiest device over an even '
           'share:']
  for name, r in report['designs'].items():
    lines.append(f"{name:8s} holds {r['max_held_of_share']:.3f}, looks up "
                 f"{r['max_looked_of_share']:.3f}; {r['gathers']} gathers "
                 'a step')
  lines.append(f"target: {report['target']} each (planned)")
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.table_plan',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(num_clones=4)])
  p.add_argument('--vocab_sizes', type=_sizes,
                 default=(1_000_000, 100_000, 10_000, 10_000, 1000, 1000,
                          200, 200, 104, 48, 24, 16))
  p.add_argument('--width', type=int, default=16)
  p.add_argument('--rows_per_clone', type=int, default=256)
  return p


def _sizes(value):
  return tuple(int(v) for v in value.split(','))


def _check(args):
  if args.num_clones < 2:
    raise errors.ConfigError(
        f'--num_clones={args.num_clones}: tables over one device are not '
        'planned; give 2 or more.')
  if min(args.vocab_sizes) < 1:
    raise errors.ConfigError(
        f'--vocab_sizes={",".join(map(str, args.vocab_sizes))}: give each '
        'table 1 row or more.')
  odd = [v for v in args.vocab_sizes if v % args.num_clones]
  if odd:
    raise errors.ConfigError(
        f'--vocab_sizes: {odd} do not split into --num_clones='
        f'{args.num_clones} equal shards by rows; give multiples of it.')


def main(argv=None):
  args = parser().parse_args(argv)
  flags.on_logical_cpus(
      'python -m tfmulti.bench.table_plan', args,
      ('width', 'num_clones', 'rows_per_clone'), args.num_clones, _check)
  report = run(args)
  bench.emit(report, format_report(report), args.output)


if __name__ == '__main__':
  main()
