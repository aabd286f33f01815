"""Where a step's time goes: the towers against MirroredStrategy, by part.

  python -m tfmulti.bench.step_profile --model=lenet --clone_on_cpu \
      --num_clones=2 --output=step_profile.json

Runs each variant's step (`bench.variants`: `single`, `towers`,
`mirrored_reduce_to_one_device`, built by the training code on the same
model and global batch) under TensorFlow's profiler, one variant after
the other, and sums the time of the ops it ran, per step, by part:

  forward_backward  the clones' (replicas') forward and backward ops
  split             the batch cut into shards (slices)
  copies            tensors sent between devices (_Send, _Recv)
  sum               the gradients summed (AddN)
  update            the optimizer's ops and the rest of the step
  host              ops run eagerly outside the compiled step

With the op counts of each part, so what one design runs and another does
not shows as ops, not only as time. Op time is summed over the threads
that ran the ops (on 2 logical CPUs, two at once), so it exceeds the step's
wall; `step_ms` is the compiled step's own span. It reads the host's CPU
plane of the profile: on CPUs the ops themselves; on GPUs it would time
their launches, not their kernels, so it is a CPU benchmark.
"""

import argparse
import collections
import glob
import json
import statistics
import sys
import tempfile

from absl import logging
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti.bench import designs
from tfmulti.bench import flags
from tfmulti.bench import variants as variants_lib

VARIANTS = ('single', 'towers', 'mirrored_reduce_to_one_device')
PARTS = ('forward_backward', 'split', 'copies', 'sum', 'update', 'host')
_CLONE_SCOPES = ('clone_', 'replica', 'gradient_tape')
_SPLITS = ('StridedSlice', 'Split', 'SplitV', 'Slice')
_COPIES = ('_Send', '_Recv', '_HostSend', '_HostRecv')
_FUNCTION = '__inference'  # A compiled function's call: the step's span.


def part_of(op_name, op_type):
  """The part (one of `PARTS`) an op of the step belongs to, from its name
  scope and type; None for the compiled step's own call."""
  if op_type.startswith(_FUNCTION):
    return None
  top = op_name.split('/')[0]
  if top.startswith('EagerLocalExecute'):
    return 'host'
  if op_type in _COPIES:
    return 'copies'
  if op_type == 'AddN':
    return 'sum'
  if op_type in _SPLITS and not top.startswith('gradient_tape'):
    return 'split'
  if top.startswith(_CLONE_SCOPES):
    return 'forward_backward'
  return 'update'


def op_events(space):
  """(op name, op type, duration in seconds, is the step's call) of every
  op event on the host's CPU plane of an `XSpace`."""
  for plane in space.planes:
    if not plane.name.startswith('/host:CPU'):
      continue
    names = {key: meta.name for key, meta in plane.event_metadata.items()}
    for line in plane.lines:
      for event in line.events:
        name = names.get(event.metadata_id, '')
        if ':' not in name or '::' in name:  # Executor events, not ops.
          continue
        op_name, op_type = name.rsplit(':', 1)
        op_type = op_type.strip()
        yield op_name, op_type, event.duration_ps * 1e-12


def summarize(events, steps):
  """{'step_ms', 'parts_ms': {part: ms a step}, 'ops': {part: ops a step}}
  of `events` (`op_events`) over `steps` steps."""
  times, counts, spans = collections.Counter(), collections.Counter(), []
  for op_name, op_type, seconds in events:
    part = part_of(op_name, op_type)
    if part is None:
      spans.append(seconds)
      continue
    times[part] += seconds
    counts[part] += 1
  return {'step_ms': 1e3 * statistics.median(spans) if spans else None,
          'parts_ms': {p: 1e3 * times[p] / steps for p in PARTS},
          'ops': {p: counts[p] / steps for p in PARTS}}


def profile(variant, steps, directory):
  """`summarize` of `steps` steps of `variant` under the profiler, after 3
  untimed ones (the trace)."""
  for _ in range(3):
    loss = variant.step()
  float(loss)
  tf.profiler.experimental.start(directory)
  try:
    for _ in range(steps):
      loss = variant.step()
    float(loss)  # The last step's ops end inside the profile.
  finally:
    tf.profiler.experimental.stop()
  (path,) = glob.glob(f'{directory}/**/*.xplane.pb', recursive=True)
  space = keras_internals.xplane_proto().XSpace()
  with open(path, 'rb') as f:
    space.ParseFromString(f.read())
  return summarize(op_events(space), steps)


def run(bench, steps, names=VARIANTS):
  """{variant: `summarize`} of each of `names`, built from `bench`."""
  built, _ = variants_lib.build_variants(bench, names)
  report = {}
  for variant in built:
    with tempfile.TemporaryDirectory() as directory:
      report[variant.name] = profile(variant, steps, directory)
  return report


def format_table(report):
  """The report as a Markdown table: ms a step (ops a step) by part."""
  lines = ['| variant | step ms | ' + ' | '.join(PARTS) + ' |',
           '|---' * (len(PARTS) + 2) + '|']
  for name, entry in report.items():
    cells = [f"{entry['parts_ms'][p]:.2f} ({entry['ops'][p]:.0f})"
             for p in PARTS]
    lines.append(f"| {name} | {entry['step_ms']:.2f} | "
                 + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def parser():
  """The command line: the shared flags and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.step_profile', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      parents=[flags.shared(model='lenet', num_clones=2, clone_on_cpu=True)])
  p.add_argument('--batch_size', type=int, default=64, help='rows a clone')
  p.add_argument('--steps', type=int, default=30)
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  try:
    errors.check_count('steps', args.steps, 1)
    bench = designs.BenchConfig(model=args.model, batch_size=args.batch_size,
                                num_clones=args.num_clones,
                                clone_on_cpu=args.clone_on_cpu,
                                # No reproducible variant is profiled.
                                reproducible_rows=args.batch_size)
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.step_profile: error: {e}')
  if args.clone_on_cpu:
    devices.create_logical_cpus(args.num_clones)
  report = run(bench, args.steps)
  logging.info('step profile, ms a step (ops a step):\n%s',
               format_table(report))
  if args.output:
    with open(args.output, 'w') as f:
      json.dump({'config': vars(args), 'variants': report}, f, indent=2)


if __name__ == '__main__':
  logging.set_verbosity(logging.INFO)
  main()
