"""How close a training step comes to the device's matmul rate.

  python -m tfmulti.bench.flops --model=resnet20 --image_size=32

Times, in one process and in alternating rounds, a large float32 matmul
(`--matmul_size` square: 2 n^3 FLOPs, the device's practical peak) and one
clone's training step of `--model` on `--batch_size` synthetic rows,
without and with XLA (`xla=False` / `xla=True`). A step's FLOPs are three
times its forward multiply-adds, twice (a multiply and an add): the
forward pass, and the backward pass's input and weight gradients, each as
large, counted from the layers' kernels (convolutions and dense layers;
elementwise ops, BatchNorm and pooling are left out, so the fraction is a
little low). The figure is each step's FLOP rate over the matmul's.
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import models
from tfmulti.bench import flags
from tfmulti.deploy import placement
from tfmulti.deploy import towers as towers_lib
from tfmulti.pipeline import costs

VARIANTS = ('step', 'step_xla')


@dataclasses.dataclass(frozen=True)
class FlopsConfig:
  """What to run; see the module's docstring for each field's flag."""
  model: str = 'resnet20'
  image_size: int = 32
  channels: int = 3
  batch_size: int = 64
  steps: int = 20
  rounds: int = 3
  matmul_size: int = 2048

  def __post_init__(self):
    for name in ('image_size', 'channels', 'batch_size', 'steps', 'rounds',
                 'matmul_size'):
      errors.check_count(name, getattr(self, name), 1)
    models.check(self.model)


def step_flops(model, rows):
  """FLOPs of one training step on `rows` rows: 3 x 2 x the kernels'
  forward multiply-adds."""
  multiply_adds = 0
  for operation, node in costs.operations(model):
    kernel = getattr(operation, 'kernel', None)
    if isinstance(kernel, keras.Variable):
      shape = node.output_tensors[0].shape
      outputs = math.prod(d for d in shape[1:] if d is not None)
      multiply_adds += outputs * math.prod(kernel.shape) / shape[-1]
  return 3 * 2 * multiply_adds * rows


def matmul_rate(size, device):
  """FLOP/s of a `size` square float32 matmul on `device` (median of 5)."""
  with tf.device(device):
    a = tf.random.normal((size, size))
    b = tf.random.normal((size, size))
    matmul = tf.function(lambda: tf.reduce_sum(tf.matmul(a, b)))
    matmul().numpy()
    seconds = []
    for _ in range(5):
      start = time.perf_counter()
      matmul().numpy()
      seconds.append(time.perf_counter() - start)
  return 2 * size**3 / statistics.median(seconds)


def step_seconds(bench, xla, config):
  """Median seconds of a training step of one clone (after warm-up)."""
  shape = (bench.image_size, bench.image_size, bench.channels)
  with tf.device(config.variables_device()):
    model = models.get_model(bench.model, input_shape=shape, num_classes=10)
    optimizer = keras.optimizers.SGD(0.01)
  deployed = towers_lib.deploy(
      config, model, keras.losses.SparseCategoricalCrossentropy(
          from_logits=True), optimizer, xla=xla)
  rng = np.random.default_rng(0)
  images = tf.constant(rng.normal(size=(bench.batch_size, *shape)),
                       tf.float32)
  labels = tf.constant(rng.integers(0, 10, bench.batch_size), tf.int32)
  for _ in range(2):  # Traces, then warms.
    float(deployed.train_step(images, labels))
  start = time.perf_counter()
  for _ in range(bench.steps):
    loss = deployed.train_step(images, labels)
  float(loss)
  return (time.perf_counter() - start) / bench.steps, model


def run(bench, config):
  """{'matmul': [FLOP/s], 'step': [s], 'step_xla': [s]} a round, and the
  step's FLOPs."""
  rounds = {'matmul': [], **{name: [] for name in VARIANTS}}
  flops = None
  for k in range(bench.rounds):
    rounds['matmul'].append(matmul_rate(bench.matmul_size,
                                        config.compute_devices()[0]))
    for name in VARIANTS if k % 2 == 0 else VARIANTS[::-1]:
      seconds, model = step_seconds(bench, name == 'step_xla', config)
      rounds[name].append(seconds)
      flops = step_flops(model, bench.batch_size)
  return rounds, flops


def summarize(rounds, flops):
  """Medians, and each step's FLOP rate over the matmul's."""
  matmul = statistics.median(rounds['matmul'])
  report = {'step_flops': flops, 'matmul_flops_per_sec': matmul}
  for name in VARIANTS:
    seconds = statistics.median(rounds[name])
    report[name] = {'seconds': seconds, 'flops_per_sec': flops / seconds,
                    'of_matmul_rate': flops / seconds / matmul}
  return report


def parser():
  """The command line: the shared flags, then a flag a FlopsConfig field."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.flops',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model=FlopsConfig.model,
                            model_names=flags.TRAINABLE)])
  for field in dataclasses.fields(FlopsConfig):
    if field.name not in flags.NAMES:
      p.add_argument(f'--{field.name}', type=type(field.default),
                     default=field.default)
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  try:
    bench = FlopsConfig(**{f.name: getattr(args, f.name)
                           for f in dataclasses.fields(FlopsConfig)})
    on_cpu = not tf.config.list_physical_devices('GPU')
    devices.place_clones(1, clone_on_cpu=on_cpu)
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.flops: error: {e}')
  config = placement.DeploymentConfig(num_clones=1, clone_on_cpu=on_cpu)
  rounds, flops = run(bench, config)
  report = summarize(rounds, flops)
  print(json.dumps(report, indent=2))
  if args.output:
    with open(args.output, 'w') as f:
      json.dump({'config': dataclasses.asdict(bench), 'rounds': rounds,
                 **report}, f, indent=2)


if __name__ == '__main__':
  main()
