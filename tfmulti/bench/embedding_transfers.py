"""The bytes an Embedding's gradient moves a towers step: slices, not a table.

  python -m tfmulti.bench.embedding_transfers --vocab=1000000 --width=64

Deploys a text model (token ids -> Embedding(vocab, width) -> the mean over
the tokens -> 10 logits) over `--num_clones` clones of logical CPUs with
its variables on a device of their own (CPU:N, the host beside N GPUs),
traces one step on `--rows_per_clone` rows of `--tokens` random ids a
clone (nothing runs: the placement is the graph's, `plan.traffic`), and
counts the gradient bytes each clone sends the variables device, against
what the rows it touched hold (a value row and an int32 index a looked-up
id, and the dense head's gradients) and against the dense gradient
`tf.add_n` would have made of the table (vocab x width floats). The
target: at most 1.1 x the touched rows' bytes a clone a step.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf

from tfmulti import devices
from tfmulti.bench import designs as bench
from tfmulti.bench import flags
from tfmulti.deploy import placement
from tfmulti.deploy import towers as towers_lib
from tfmulti.plan import traffic

MB = 2**20
CLASSES = 10
TARGET = 1.1  # Gradient bytes a clone sends, over its touched rows' bytes.


def _text_model(vocab, width, tokens):
  inputs = keras.Input((tokens,), dtype='int32')
  x = keras.layers.Embedding(vocab, width)(inputs)
  x = keras.layers.GlobalAveragePooling1D()(x)
  return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def run(args):
  """The report: per clone, the gradient bytes sent, and the targets."""
  n = args.num_clones
  config = placement.DeploymentConfig(num_clones=n, clone_on_cpu=True,
                                      variables_device=f'/device:CPU:{n}')
  keras.utils.set_random_seed(0)
  with tf.device(config.optimizer_variables_device()):
    model = _text_model(args.vocab, args.width, args.tokens)
    optimizer = keras.optimizers.Adam(0.001)
  deployed = towers_lib.deploy(
      config, model, keras.losses.SparseCategoricalCrossentropy(
          from_logits=True), optimizer)
  rng = np.random.default_rng(0)
  rows = args.rows_per_clone * n
  ids = rng.integers(0, args.vocab, size=(rows, args.tokens)).astype(
      np.int32)
  labels = rng.integers(0, CLASSES, size=rows).astype(np.int32)
  table = traffic.step_traffic(deployed, ids, labels)
  head = (args.width * CLASSES + CLASSES) * 4
  touched = args.rows_per_clone * args.tokens * (args.width * 4 + 4) + head
  sent = {device: table[device].sent['gradients']
          for device in config.compute_devices()}
  return {'environment': bench.environment(), 'emulated': 'logical CPUs',
          'vocab': args.vocab, 'width': args.width, 'tokens': args.tokens,
          'num_clones': n, 'rows_per_clone': args.rows_per_clone,
          'table_mb': devices.variable_bytes(model.layers[1].embeddings) / MB,
          'dense_gradient_mb': args.vocab * args.width * 4 / MB,
          'touched_mb_per_clone': touched / MB,
          'sent_mb_per_clone': {d: s / MB for d, s in sent.items()},
          'max_sent_of_touched': max(sent.values()) / touched,
          'target_of_touched': TARGET}


def format_report(report):
  lines = [f"Embedding({report['vocab']:,}, {report['width']}): "
           f"{report['table_mb']:.1f} MB table; {report['num_clones']} clones "
           f"of {report['rows_per_clone']} rows x {report['tokens']} tokens "
           '(graph read on logical CPUs)']
  for device, mb in report['sent_mb_per_clone'].items():
    lines.append(f'{device}: sends {mb:.3f} MB of gradients a step '
                 f"(the rows it touched: {report['touched_mb_per_clone']:.3f}"
                 f" MB; a dense gradient: {report['dense_gradient_mb']:.1f} "
                 'MB)')
  lines.append(f"busiest clone: {report['max_sent_of_touched']:.3f} x its "
               f"touched rows' bytes (target {report['target_of_touched']})")
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.embedding_transfers',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(num_clones=2)])
  p.add_argument('--vocab', type=int, default=1_000_000)
  p.add_argument('--width', type=int, default=64)
  p.add_argument('--tokens', type=int, default=20)
  p.add_argument('--rows_per_clone', type=int, default=64)
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  flags.on_logical_cpus(
      'python -m tfmulti.bench.embedding_transfers', args,
      ('vocab', 'width', 'tokens', 'num_clones', 'rows_per_clone'),
      args.num_clones + 1)  # And the host.
  report = run(args)
  bench.emit(report, format_report(report), args.output)


if __name__ == '__main__':
  main()
