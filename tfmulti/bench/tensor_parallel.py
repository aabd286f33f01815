"""Tensor-parallel feed-forward blocks: each device's activations, and
what crosses devices a block, read from the traced step.

  python -m tfmulti.bench.tensor_parallel --num_clones=4
  python -m tfmulti.bench.tensor_parallel --num_clones=8

Deploys `--blocks` transformer feed-forward blocks (keras.io's
TransformerBlock's: LayerNorm, Dense(--hidden, gelu), Dense(--width), a
residual add) over `--num_clones` clones of logical CPUs on a mesh
(2, N/2) of axes ('batch', 'model') with keras-hub Llama's feed-forward
map: each block's first kernel split by output features over 'model'
(column-parallel), its second by input features (row-parallel), each
stored split over 'batch' too (`mesh.tensor_parallel`). From its
traced step, and from one device's on the whole batch, it counts:

* activations: the bytes of the hidden activations the forward pass
  makes (each tensor of a clone's rows by the hidden width or a part of
  it). What tensor parallelism saves: the most any device holds of one
  clone's, against one device's for that clone's rows / M (M: the model
  axis's devices, a block's span); the target: at most 1.1x (computed
  whole, M). And each device's for all its clones, against one device's
  for the whole batch / N (1.0 computed whole too: each clone's rows are
  1/N of the batch);
* crossings: each clone's tensors of its rows by the width that cross
  devices a block (forward: its input to the model axis's other M - 1
  devices, their partial sums back; backward: the output's gradient out,
  the input gradient's parts back), in all-reduces: bytes over a ring
  all-reduce's of the block's output over M devices (2 (M-1) x rows x
  width x 4 bytes, Megatron's one forward and one backward a block).
"""

import argparse
import collections
import re

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
from tfmulti.plan import peaks
from tfmulti.plan import traffic

TARGET = 1.1  # A clone's activations a device, over one device's / M.
FEATURES = 16  # The inputs' width: not the blocks' (`--width`).
RULES = (('block_.*_up/kernel', ('batch', 'model')),
         ('block_.*_down/kernel', ('model', 'batch')))


def _blocks(args):
  keras.utils.set_random_seed(0)
  inputs = keras.Input((FEATURES,))
  x = keras.layers.Dense(args.width, name='embed')(inputs)
  for i in range(args.blocks):
    y = keras.layers.LayerNormalization(name=f'block_{i}_norm')(x)
    y = keras.layers.Dense(args.hidden, activation='gelu',
                           name=f'block_{i}_up')(y)
    x = x + keras.layers.Dense(args.width, name=f'block_{i}_down')(y)
  return keras.Model(inputs, keras.layers.Dense(10, name='head')(x))


def _graph(args, num_clones, layouts, rows):
  config = placement.DeploymentConfig(num_clones=num_clones,
                                      clone_on_cpu=True,
                                      variable_layouts=layouts)
  deployed = towers_lib.deploy(
      config, _blocks(args),
      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      keras.optimizers.Adam())
  rng = np.random.default_rng(0)
  images = tf.constant(rng.normal(size=(rows, FEATURES)), tf.float32)
  labels = tf.constant(rng.integers(0, 10, rows), tf.int32)
  return deployed.traced_step(images, labels).graph


def activations(graph, rows, widths, row=1):
  """{(device, clone scope): bytes of the blocks' forward buffers of
  `rows` rows whose last dimension is one of `widths`} among the ops the
  step runs (a buffer once, whatever views of it there are:
  `peaks.buffer_of`); a buffer of a mesh row's `row` clones' rows (a
  block's one product for them, `tensor_parallel`) under 'row'."""
  placement_of, runs = devices.GraphPlacement(), peaks.reachable(graph)
  held = collections.Counter()
  for op in graph.get_operations():
    if (op.name not in runs or 'gradient_tape' in op.name
        or not re.search(r'(^|/)block_', op.name)
        or op.type == 'SplitV'):  # A row's product cut by rows: views.
      continue
    for t in op.outputs:
      if (t.shape.rank and t.shape.rank > 1
          and t.shape[0] in (rows, rows * row)
          and t.shape[-1] in widths and peaks.buffer_of(t) is t):
        whose = (op.name.split('/')[0] if t.shape[0] == rows or row == 1
                 else 'row')
        held[placement_of.of_op(op), whose] += t.shape.num_elements() * 4
  return held


def crossings(graph, shape):
  """(forward, backward) bytes of the tensors of `shape` that cross
  devices in the step (a tensor once a reading device): backward, those
  made of a gradient (under the tape's 'gradient_tape' scope, or what
  reads one: the tape's sums of a tensor's gradients)."""
  backward = set()
  for op in graph.get_operations():  # Inputs first: the order made.
    if 'gradient_tape' in op.name or any(t.op.name in backward
                                         for t in op.inputs):
      backward.add(op.name)
  moved = [0, 0]
  for tensor, *_ in traffic.crossings(graph):
    if tuple(tensor.shape) == shape:
      moved[tensor.op.name in backward] += (
          tensor.shape.num_elements() * tensor.dtype.size)
  return moved


def run(args):
  """The report: per device, activations against one device's / N; a
  block's crossings in all-reduces."""
  n, rows = args.num_clones, args.rows_per_clone
  m = n // 2  # The model axis.
  layouts = mesh_layouts.VariableLayouts((2, m), ('batch', 'model'), RULES)
  split = _graph(args, n, layouts, rows * n)
  mine = activations(split, rows, {args.hidden, args.hidden // m}, m)
  one = sum(activations(_graph(args, 1, None, rows * n), rows * n,
                        {args.hidden}).values())
  held, joint = collections.Counter(), collections.Counter()
  for (device, whose), size in mine.items():
    held[device] += size
    joint[device] += size if whose == 'row' else 0
  # A clone's on a device: its own, and its 1 / M of its mesh row's.
  clone_parts = [size + joint[device] / m if whose != 'row' else size / m
                 for (device, whose), size in mine.items()]
  forward, backward = crossings(split, (rows, args.width))
  all_reduce = 2 * (m - 1) * rows * args.width * 4
  per_block = n * args.blocks * all_reduce
  report = {'environment': bench.environment(), 'emulated': 'logical CPUs',
            'num_clones': n, 'mesh': [2, m], 'blocks': args.blocks,
            'width': args.width, 'hidden': args.hidden,
            'rows_per_clone': rows, 'one_device_mb': one / 2**20,
            'devices': {device: size / (one / n)
                        for device, size in sorted(held.items())},
            'max_clone_part': max(clone_parts) / (one / n / m),
            'forward_all_reduces_a_block': forward / per_block,
            'backward_all_reduces_a_block': backward / per_block}
  report['target'] = TARGET
  return report


def format_report(report):
  lines = [f"{report['blocks']} feed-forward blocks ({report['width']} -> "
           f"{report['hidden']} -> {report['width']}) on a mesh "
           f"{tuple(report['mesh'])} of {report['num_clones']} clones of "
           f"{report['rows_per_clone']} rows (graph read on logical CPUs); "
           f"one device's hidden activations: "
           f"{report['one_device_mb']:.3f} MB"]
  for device, share in report['devices'].items():
    lines.append(f'{device}: hidden activations {share:.3f} x one '
                 "device's / N")
  lines.append(
      f"most of one clone's on a device: {report['max_clone_part']:.3f} x "
      f"its rows' on one device / M (target {report['target']}; whole: M)"
      "; a block's crossings a clone: "
      f"{report['forward_all_reduces_a_block']:.3f} all-reduce forward, "
      f"{report['backward_all_reduces_a_block']:.3f} backward")
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.tensor_parallel',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(num_clones=4)])
  p.add_argument('--blocks', type=int, default=2)
  p.add_argument('--width', type=int, default=48)
  p.add_argument('--hidden', type=int, default=256)
  p.add_argument('--rows_per_clone', type=int, default=24)
  return p


def _check(args):
  if args.num_clones < 4 or args.num_clones % 2:
    raise errors.ConfigError(
        f'--num_clones={args.num_clones}: the mesh is (2, N/2); give an '
        'even count of 4 or more.')
  if args.hidden % (args.num_clones // 2) or args.width % 2:
    raise errors.ConfigError(
        f'--hidden={args.hidden} --width={args.width}: the hidden width '
        'splits over N/2 devices and the width over 2; give multiples.')
  part = args.hidden // (args.num_clones // 2)
  if len({args.width, args.rows_per_clone, FEATURES, part}) < 4:
    raise errors.ConfigError(
        f'--rows_per_clone={args.rows_per_clone} --width={args.width} '
        f'--hidden={args.hidden}: the report tells tensors by their '
        'shape; give rows, a width and a hidden part (hidden / (N/2)) '
        f'other than each other and {FEATURES}.')


def main(argv=None):
  args = parser().parse_args(argv)
  flags.on_logical_cpus(
      'python -m tfmulti.bench.tensor_parallel', args,
      ('blocks', 'width', 'hidden', 'rows_per_clone'), args.num_clones,
      _check)
  report = run(args)
  bench.emit(report, format_report(report), args.output)


if __name__ == '__main__':
  main()
