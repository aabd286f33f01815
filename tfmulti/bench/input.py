"""Does the input pipeline keep the clones fed? A folder of real JPEGs
against synthetic data already on the device, side by side.

  python -m tfmulti.bench.input --model=resnet20 --image_size=32

Writes a folder of real JPEGs first (`--images` of `--source_size`
pixels a side: the offline digits upscaled to photographs' sizes, in
`--classes` class folders; `--folder` keeps it, and `--write_only` stops
there, for the command line), then
runs, in one process and in rounds whose order alternates, the same job
(`train.job.train_and_evaluate`: `--steps` global steps of
`--batch_size` rows a clone on `--num_clones` clones) two ways: reading the
folder (`--dataset=folder:PATH --image_size=S,S`: decoding, resizing and
shuffling on the job's private thread pool) and on `--dataset=synthetic`
(one batch made once on the device and repeated: no input at all). The
figure is the ratio of their training rates after the first step (the
job's own `images_per_sec`); at most 1.05 means the clones are fed.
Decoding alone (the folder's pipeline iterated without a step) is timed
too. By default every epoch decodes again, as a dataset too large to keep
in memory would (`--cache` keeps the decoded split when it fits, as the
job does).

On CPU-only machines the clones are logical CPUs sharing the cores with
decoding, so the ratio there says what the cores can do for both, not
whether a GPU would be fed.
"""

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import logging
import numpy as np
import tensorflow as tf

from tfmulti import data
from tfmulti import devices
from tfmulti import errors
from tfmulti.bench import flags
from tfmulti.data import batches
from tfmulti.data import options as options_lib
from tfmulti.deploy import placement
from tfmulti.train import config as config_lib
from tfmulti.train import job

VARIANTS = ('folder', 'synthetic')


@dataclasses.dataclass(frozen=True)
class InputBenchConfig:
  """What to run; see the module's docstring for each field's flag."""
  model: str = 'resnet20'
  image_size: int = 32
  source_size: int = 224
  images: int = 2000
  classes: int = 10
  num_clones: int = 2
  batch_size: int = 64
  steps: int = 40
  rounds: int = 3
  cache: bool = False

  def __post_init__(self):
    for name in ('image_size', 'source_size', 'images', 'num_clones',
                 'batch_size', 'steps', 'rounds'):
      errors.check_count(name, getattr(self, name), 1)
    errors.check_count('classes', self.classes, 2)
    if self.classes > 10:
      raise errors.ConfigError(
          f'classes={self.classes}: the folder holds the digits, 10 classes '
          'at most.')
    if self.steps < 2:
      raise errors.ConfigError(
          f'steps={self.steps}: the first step traces and is not timed; '
          'give at least 2.')


def write_folder(folder, *, images, classes, size, seed=0):
  """`images` JPEGs of `size`x`size` pixels in `classes` class folders: the
  offline digits of the first `classes` labels, upscaled (bicubic) to RGB
  photographs' sizes with a little noise, so the folder decodes as photos
  do and a model can learn it. `classes` is at most 10."""
  from sklearn import datasets  # Only the benchmark's folder needs it.
  digits = datasets.load_digits()
  keep = digits.target < classes
  pixels = digits.images[keep] * (255.0 / 16)
  labels = digits.target[keep]
  rng = np.random.default_rng(seed)
  for index in range(images):
    label = int(labels[index % len(labels)])
    small = pixels[index % len(labels)][None, :, :, None]
    image = tf.image.resize(small, (size, size), 'bicubic')[0]
    image = tf.repeat(image, 3, axis=-1) + rng.normal(0, 4, (size, size, 3))
    jpeg = tf.io.encode_jpeg(tf.cast(tf.clip_by_value(image, 0, 255),
                                     tf.uint8), quality=90)
    os.makedirs(os.path.join(folder, f'class{label:02d}'), exist_ok=True)
    tf.io.write_file(os.path.join(folder, f'class{label:02d}',
                                  f'{index:05d}.jpg'), jpeg)


def _job(bench, dataset, deploy_config):
  """The job's training rate (images/sec after the first step)."""
  model_dir = tempfile.mkdtemp(prefix='tfmulti-input-')
  try:
    metrics = job.train_and_evaluate(
        config_lib.TrainConfig(
            model=bench.model, dataset=dataset,
            input_options=options_lib.InputOptions(
                image_size=(bench.image_size, bench.image_size)),
            model_dir=model_dir, batch_size=bench.batch_size,
            train_steps=bench.steps, log_every_steps=bench.steps,
            checkpoint_steps=bench.steps, export=False),
        deploy_config)
  finally:
    shutil.rmtree(model_dir, ignore_errors=True)
  return metrics['images_per_sec']


def decode_rate(folder, bench):
  """Images/sec of the folder's training pipeline alone, one epoch."""
  loaded = data.load(f'folder:{folder}',
                     global_batch_size=bench.batch_size * bench.num_clones,
                     options=options_lib.InputOptions(
                         image_size=(bench.image_size, bench.image_size)))
  start, rows = time.perf_counter(), 0
  for images, _ in loaded.train_epoch(0):
    rows += int(images.shape[0])
  return rows / (time.perf_counter() - start)


def run(bench, folder, deploy_config):
  """{variant: [images/sec a round]}, and the decoding rate."""
  rounds = {name: [] for name in VARIANTS}
  datasets = {'folder': f'folder:{folder}', 'synthetic': 'synthetic'}
  for k in range(bench.rounds):
    for name in VARIANTS if k % 2 == 0 else VARIANTS[::-1]:
      rounds[name].append(_job(bench, datasets[name], deploy_config))
      logging.info('round %d %s: %.0f images/sec', k + 1, name,
                   rounds[name][-1])
  return rounds, decode_rate(folder, bench)


def summarize(rounds, decoding):
  """Medians, and the synthetic rate over the folder's (the figure)."""
  medians = {name: statistics.median(rates) for name, rates in rounds.items()}
  return {'images_per_sec': medians,
          'synthetic_over_folder': medians['synthetic'] / medians['folder'],
          'decoding_images_per_sec': decoding}


def parser():
  """The command line: the shared flags, a flag an InputBenchConfig field,
  and this benchmark's own."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.input',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model=InputBenchConfig.model,
                            model_names=flags.TRAINABLE,
                            num_clones=InputBenchConfig.num_clones,
                            clone_on_cpu=True)])
  for field in dataclasses.fields(InputBenchConfig):
    if field.name in flags.NAMES:
      continue
    if isinstance(field.default, bool):
      p.add_argument(f'--{field.name}', action='store_true')
    else:
      p.add_argument(f'--{field.name}', type=type(field.default),
                     default=field.default)
  p.add_argument('--folder', help='where to write the JPEGs (default: '
                 'a temporary folder, removed after)')
  p.add_argument('--write_only', action='store_true',
                 help='write the folder (--folder) and stop')
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  if args.write_only and not args.folder:
    sys.exit('tfmulti.bench.input: error: --write_only writes --folder: '
             'name one.')
  try:
    bench = InputBenchConfig(**{f.name: getattr(args, f.name)
                                for f in dataclasses.fields(InputBenchConfig)})
    clone_on_cpu = devices.place_clones(
        bench.num_clones, clone_on_cpu=args.clone_on_cpu or not (
            tf.config.list_physical_devices('GPU')))
  except errors.UserError as e:
    sys.exit(f'tfmulti.bench.input: error: {e}')
  if not bench.cache:
    batches.CACHE_BYTES = 0  # Decode every epoch, as large datasets do.
  folder = args.folder or tempfile.mkdtemp(prefix='tfmulti-jpegs-')
  try:
    write_folder(folder, images=bench.images, classes=bench.classes,
                 size=bench.source_size)
    if args.write_only:
      return
    rounds, decoding = run(bench, folder, placement.DeploymentConfig(
        num_clones=bench.num_clones, clone_on_cpu=clone_on_cpu))
  finally:
    if not args.folder:
      shutil.rmtree(folder, ignore_errors=True)
  report = summarize(rounds, decoding)
  print(json.dumps(report, indent=2))
  if args.output:
    with open(args.output, 'w') as f:
      json.dump({'config': dataclasses.asdict(bench),
                 'clone_on_cpu': clone_on_cpu, 'rounds': rounds, **report},
                f, indent=2)


if __name__ == '__main__':
  main()
