"""The plain Keras script that the command line is measured against.

  python -m tfmulti.bench.fit_script --model_dir=/tmp/fit --epochs=40

What a Keras user writes to do the main command's work on one device:
the digits data set (TFDS, offline), LeNet, Adam 1e-3, a global batch of
128, `fit` with the test split evaluated after every epoch, then the model
saved (`.keras`) and exported (a SavedModel), as `train.py` ends. The data
pipeline and the model are the ones `train.py` builds, so the two differ
only in how they train. `bench.processes` times both as whole processes.
"""

import argparse
import os

from tfmulti import devices
from tfmulti.bench import flags

BATCH = 128


def parser():
  """The command line: the shared --model and this script's own flags."""
  p = argparse.ArgumentParser(
      prog='python -m tfmulti.bench.fit_script',
      description=__doc__.split('\n')[0],
      parents=[flags.shared(model='lenet', model_names=flags.TRAINABLE,
                            output=False)])
  p.add_argument('--model_dir', required=True)
  p.add_argument('--epochs', type=int, default=40)
  p.add_argument('--data_dir')
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  devices.create_logical_cpus(2)  # As train.py's --clone_on_cpu machine.
  import keras  # pylint: disable=g-import-not-at-top

  from tfmulti import data  # pylint: disable=g-import-not-at-top
  from tfmulti.deploy import placement  # pylint: disable=g-import-not-at-top
  from tfmulti.train import build  # pylint: disable=g-import-not-at-top
  from tfmulti.train import config  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  loaded = data.load('digits', global_batch_size=BATCH,
                     data_dir=args.data_dir)
  model, optimizer = build.model_and_optimizer(
      config.TrainConfig(model=args.model), placement.DeploymentConfig(),
      input_shape=loaded.input_shape, num_classes=loaded.num_classes,
      learning_rate=1e-3)()
  model.compile(optimizer=optimizer, loss=build.make_loss(),
                metrics=['accuracy'])
  model.fit(loaded.train_epoch(0), epochs=args.epochs,
            validation_data=loaded.test, verbose=0)
  os.makedirs(args.model_dir, exist_ok=True)
  model.save(os.path.join(args.model_dir, 'model.keras'))
  model.export(os.path.join(args.model_dir, 'saved_model'), verbose=False)


if __name__ == '__main__':
  main()
