"""Sharded variables: each device's bytes held and moved a step, and the step.

  python -m tfmulti.bench.sharded --model=resnet50 --num_clones=4
  python -m tfmulti.bench.sharded --model=llama --num_clones=8

Deploys the model over `--num_clones` clones of logical CPUs twice, with
momentum SGD (one slot a variable):

* `sharded`: its variables laid out over a mesh (`mesh.sharding`): for
  `--model=llama`, keras-hub's `LlamaBackbone` built small from its
  configuration (its word embeddings tied: the map names the one table),
  with its own `get_layout_map` on a mesh (2, N/2) of axes ('batch',
  'model') (keras-hub needed); for any other model, every kernel
  whose last dimension the mesh divides split on it over 'model' of a
  mesh (1, N) of axes ('batch', 'model'): computed where its blocks live
  (`mesh.tensor_parallel`: its output channels or features), or with
  `--joined`, over a one-axis mesh ('model',) of N that is also the
  batch's, so that each clone joins every kernel for its pass (FSDP:
  each layer's in its call, again for its gradient, `mesh.releases`;
  with `--keep_joins`, once, kept through the step);
  with `--layout_map=auto`, the map derived from the model on the same
  mesh (`mesh.auto_layout`);
* `spread`: each variable whole on one device (`--variables_device=spread`).

From one traced step of each (`plan.traffic`) it counts per device the
variable and slot bytes held and the variable and gradient bytes sent and
received. A clone gathers each shard it does not own and sends each
shard's gradient piece to its owner, so a device that owns 1/N receives
(N-1)/N x P of shards and (N-1) x P/N of pieces, 2 (N-1)/N x P, and sends
as much: a ring all-gather and reduce-scatter's bytes; 3 (N-1)/N x P
where each layer gathers its shards again for its gradient, as
FSDP's and ZeRO-3's do (kernels split
over 'model' are computed where their blocks live: joined over 'batch'
alone, they move less, and the rows, outputs and partial sums that cross
instead are activations, counted apart). The targets: the
busiest device holds at most 1.1 / N of the bytes and moves at most
1.1 x 2 (or 3) (N-1)/N x P each way. Then it times `--steps` steps of each in
alternating `--rounds` (the target: sharded at most 1.15x spread's
median); logical CPUs share the cores, so the time shows the gathers'
and cuts' own cost, not their overlap. First it times each variant's
first step on a fresh deployment (trace, graph optimization, run), and
plain Keras `train_on_batch` of the model on one device.
"""

import argparse
import contextlib
import re
import statistics
import sys
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
from tfmulti.deploy import placement
from tfmulti.deploy import towers as towers_lib
from tfmulti.mesh import mesh_layouts
from tfmulti.plan import traffic

MB = 2**20
HELD_SLACK, MOVED_SLACK, STEP_SLACK = 1.1, 1.1, 1.15
LLAMA = 'llama'


def llama(scope):
  """The small Llama causal LM, its backbone's variables made in `scope`
  (the task compiles an optimizer as it is made: outside it)."""
  import keras_hub  # pylint: disable=import-outside-toplevel
  with scope:
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=4096, num_layers=2, num_query_heads=8,
        num_key_value_heads=2, hidden_dim=128, intermediate_dim=512,
        tie_word_embeddings=True)  # Its map names one table, not two.
  return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _model(args, scope=None):
  keras.utils.set_random_seed(0)
  scope = scope or contextlib.nullcontext()
  if args.model == LLAMA:
    return llama(scope)
  with scope:
    return models.get_any_model(
        args.model, input_shape=(args.image_size, args.image_size, 3),
        num_classes=args.num_classes)


def _layouts(model, args):
  """The `sharded` variant's layouts (see the module)."""
  n = args.num_clones
  if args.model == LLAMA or args.layout_map == mesh_layouts.AUTO:
    shape, names = (((2, n // 2), ('batch', 'model')) if args.model == LLAMA
                    else ((n,), ('model',)) if args.joined
                    else ((1, n), ('batch', 'model')))
    mesh = mesh_layouts.VariableLayouts(
        shape, names, args.layout_map or mesh_layouts.MODEL_OWN,
        keep_joins=args.keep_joins)
    return mesh_layouts.resolved(mesh, model)
  rules = tuple(
      (re.escape(v.path), (None,) * (len(v.shape) - 1) + ('model',))
      for v in model.trainable_variables
      if v.path.endswith('kernel') and v.shape[-1] % n == 0)
  if args.joined:
    return mesh_layouts.VariableLayouts((n,), ('model',), rules,
                                        keep_joins=args.keep_joins)
  return mesh_layouts.VariableLayouts((1, n), ('batch', 'model'), rules)


def _deployed(variant, args):
  model = _model(args)
  config = placement.DeploymentConfig(
      num_clones=args.num_clones, clone_on_cpu=True,
      **({'variable_layouts': _layouts(model, args)} if variant == 'sharded'
         else {'variables_device': placement.SPREAD}))
  if variant == 'spread':  # Spread variables are placed as they are made.
    model = _model(args, config.variables_scope())
  return towers_lib.deploy(config, model, _loss(args), _optimizer(),
                           gradient_packs=args.gradient_packs)


def _loss(args):
  return keras.losses.SparseCategoricalCrossentropy(
      from_logits=args.model == LLAMA or models.ends_in_logits(args.model))


def _optimizer():
  return keras.optimizers.SGD(0.1, momentum=0.9)


def first_step_seconds(variant, args):
  """Seconds of a fresh deployment's first step, its trace, graph
  optimization and run: `variant` (`_deployed`'s), or 'plain': Keras's
  own `train_on_batch` of the model on one device, on the whole batch."""
  images, labels = _batch(args)
  if variant == 'plain':
    model = _model(args)
    model.compile(optimizer=_optimizer(), loss=_loss(args))

    def step():
      return model.train_on_batch(images, labels, return_dict=True)['loss']
  else:
    deployed = _deployed(variant, args)

    def step():
      return float(deployed.train_step_outputs(images, labels).total)
  start = time.perf_counter()
  step()
  return time.perf_counter() - start


def _batch(args):
  rng = np.random.default_rng(0)
  rows = args.rows_per_clone * args.num_clones
  if args.model == LLAMA:
    tokens = args.sequence_length
    ids = rng.integers(0, 4096, size=(rows, tokens + 1)).astype(np.int32)
    return ({'token_ids': ids[:, :-1],
             'padding_mask': np.ones((rows, tokens), np.int32)}, ids[:, 1:])
  return (rng.normal(size=(rows, args.image_size, args.image_size,
                           3)).astype(np.float32),
          rng.integers(0, args.num_classes, size=rows).astype(np.int32))


def measure(variant, args):
  """One variant's bytes per device (shares of P) and its deployed model."""
  deployed = _deployed(variant, args)
  parameter_bytes = sum(devices.variable_bytes(v)
                        for v in deployed.model.trainable_variables)
  table = traffic.step_traffic(deployed, *_batch(args))
  held = sum(counts.held for counts in table.values())
  rows = {}
  for device, counts in table.items():
    rows[device] = {'held_of_total': counts.held / held}
    for way in ('sent', 'received'):
      rows[device][f'{way}_of_p'] = sum(
          getattr(counts, way)[kind] for kind in ('variables', 'gradients')
      ) / parameter_bytes
      rows[device][f'activations_{way}_of_p'] = (
          getattr(counts, way)['activations'] / parameter_bytes)
  return deployed, {
      'parameter_mb': parameter_bytes / MB, 'held_mb': held / MB,
      'devices': rows,
      'max_held_of_total': max(r['held_of_total'] for r in rows.values()),
      'max_moved_of_p': max(max(r['sent_of_p'], r['received_of_p'])
                            for r in rows.values()),
      'max_activations_of_p': max(
          max(r['activations_sent_of_p'], r['activations_received_of_p'])
          for r in rows.values())}


def time_steps(deployed, args):
  """Seconds a step, of `args.steps` steps after one to trace."""
  images, labels = _batch(args)
  deployed.train_step_outputs(images, labels)
  start = time.perf_counter()
  for _ in range(args.steps):
    loss = deployed.train_step_outputs(images, labels).total
  float(loss)
  return (time.perf_counter() - start) / args.steps


def _gathers(args):
  """How often a step moves each shard's bytes: gathered for the pass
  (twice where its layer gathers it again for its gradient) and its
  gradient's piece sent back."""
  return 3 if args.joined and not args.keep_joins else 2


def run(args):
  n = args.num_clones
  report = {'environment': bench.environment(), 'model': args.model,
            'num_clones': n, 'rows_per_clone': args.rows_per_clone,
            'image_size': args.image_size,
            'sequence_length': args.sequence_length,
            'gradient_packs': args.gradient_packs, 'joined': args.joined,
            'keep_joins': args.keep_joins, 'variants': {},
            'targets': {'held_of_total': HELD_SLACK / n,
                        'moved_of_p': MOVED_SLACK * _gathers(args) * (n - 1)
                                      / n,
                        'step_vs_spread': STEP_SLACK}}
  report['first_step_s'] = {variant: first_step_seconds(variant, args)
                            for variant in ('sharded', 'spread', 'plain')}
  deployed = {}
  for variant in ('sharded', 'spread'):
    deployed[variant], report['variants'][variant] = measure(variant, args)
  seconds = {variant: [] for variant in deployed}
  for _ in range(args.rounds):
    for variant, model in deployed.items():
      seconds[variant].append(time_steps(model, args))
  for variant, times in seconds.items():
    report['variants'][variant]['step_s'] = times
  report['step_vs_spread'] = (statistics.median(seconds['sharded']) /
                              statistics.median(seconds['spread']))
  return report


def format_report(report):
  n, targets = report['num_clones'], report['targets']
  lines = [f"{report['model']}, {n} clones (graph read on logical CPUs)"]
  for variant, result in report['variants'].items():
    lines.append(
        f"{variant}: P = {result['parameter_mb']:.1f} MB; busiest device "
        f"holds {result['max_held_of_total']:.3f} of the "
        f"{result['held_mb']:.1f} MB held (target "
        f"{targets['held_of_total']:.3f}), moves "
        f"{result['max_moved_of_p']:.2f} P each way at most (target "
        f"{targets['moved_of_p']:.2f}) and activations of "
        f"{result['max_activations_of_p']:.2f} P; step median "
        f"{statistics.median(result['step_s']) * 1e3:.1f} ms")
  lines.append(f"sharded / spread step: {report['step_vs_spread']:.3f} "
               f"(target at most {targets['step_vs_spread']})")
  first = report['first_step_s']
  lines.append('first step (trace and run) s: ' + ', '.join(
      f'{variant} {seconds:.1f}' for variant, seconds in first.items()))
  return '\n'.join(lines)


def parser():
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.sharded',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model='resnet50', model_names=flags.APPLICATIONS,
                            num_clones=4)])
  p.add_argument('--image_size', type=int, default=64)
  p.add_argument('--num_classes', type=int, default=1000)
  p.add_argument('--rows_per_clone', type=int, default=2)
  p.add_argument('--sequence_length', type=int, default=16,
                 help="--model=llama's tokens a row (default: %(default)s)")
  p.add_argument('--gradient_packs', default='0',
                 help="both variants' StepOptions.gradient_packs: 'auto' or "
                 'a count (default: %(default)s, none)')
  p.add_argument('--joined', action='store_true',
                 help='not --model=llama: shard every kernel over a one-axis '
                 'mesh that is also the batch\'s, each joined for its pass '
                 '(FSDP), not computed as blocks on a mesh (1, N)')
  p.add_argument('--keep_joins', action='store_true',
                 help='with --joined: each kernel joined once before the '
                 'pass and kept through the step, not joined in its '
                 "layer's call and again for its gradient")
  p.add_argument('--layout_map', choices=(mesh_layouts.AUTO,),
                 help="'auto': the sharded variant's map derived from the "
                 "model (layout_map='auto') on the same mesh, not "
                 "keras-hub's own (llama) or every kernel's last dimension")
  p.add_argument('--steps', type=int, default=5)
  p.add_argument('--rounds', type=int, default=3)
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  try:
    for name in ('num_clones', 'image_size', 'num_classes',
                 'rows_per_clone', 'sequence_length', 'steps', 'rounds'):
      errors.check_count(name, getattr(args, name), 1)
    if args.model == LLAMA and args.num_clones % 2:
      raise errors.ConfigError(
          f'--num_clones={args.num_clones} with --model=llama: its mesh is '
          '(2, N/2); use an even count.')
    if args.model != LLAMA:
      models.check_any(args.model)
    elif args.joined:
      raise errors.ConfigError(
          '--joined with --model=llama: its own map says which kernels '
          'compute as blocks; drop --joined.')
    if args.keep_joins and not args.joined:
      raise errors.ConfigError(
          '--keep_joins without --joined: only joined kernels are kept; '
          'add --joined.')
    args.gradient_packs = step_options.StepOptions(
        gradient_packs=args.gradient_packs).gradient_packs
    devices.create_logical_cpus(args.num_clones)
    tf.config.set_soft_device_placement(False)
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.sharded: error: {e}')
  report = run(args)
  bench.emit(report, format_report(report), args.output)


if __name__ == '__main__':
  main()
