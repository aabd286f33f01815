"""The trained model, for serving and notebooks: `export/<step>/`.

  python -m tfmulti.train.export --model_dir=runs/lenet-digits-towers-2clones

At the end of training (and on demand, from a model_dir's latest intact
checkpoint) the model is written twice into `<model_dir>/export/<step>/`:

* a SavedModel whose `serving_default` signature takes float `images`
  `[batch, H, W, C]` in the training input's range (pixels in [0, 255],
  `models.pixels`) and returns
  `logits` and class `probabilities`;
* `model.keras`, the Keras model file.

Both hold the model both doors export (`engine.exported`: a copy for one
device, its weights whole), so they load and run on one device whatever
path trained them, in a process that never imports tfmulti. The
export is written under a temporary name and renamed, so a half-written
export never sits under its final name.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

from absl import logging
import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import models
from tfmulti.engine import checkpoints
from tfmulti.engine import exported
from tfmulti.train import run_dir

EXPORT_DIR = 'export'
KERAS_FILE = 'model.keras'
SIGNATURE = 'serving_default'


def _write(model, directory, input_shape):
  """The SavedModel and the Keras file of the model both doors export
  (`engine.exported`)."""
  with exported.one_device_model(model, input_shape) as served:
    archive = keras.export.ExportArchive()
    archive.track(served)

    def serve(images):
      logits = tf.cast(served(images, training=False), tf.float32)
      return {'logits': logits, 'probabilities': tf.nn.softmax(logits)}
    archive.add_endpoint(SIGNATURE, serve, input_signature=[tf.TensorSpec(
        (None, *input_shape), tf.float32, name='images')])
    archive.write_out(directory, verbose=False)
    served.save(os.path.join(directory, KERAS_FILE))


def export(model, model_dir, step, input_shape):
  """Writes `<model_dir>/export/<step>/` atomically (the model takes
  images of `input_shape`); returns its path.

  Raises:
    errors.RunDirError: it cannot be written.
  """
  final = os.path.join(model_dir, EXPORT_DIR, str(step))
  try:
    os.makedirs(os.path.dirname(final), exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f'.{step}-', dir=os.path.dirname(final))
  except OSError as e:
    raise errors.RunDirError(f'cannot write {final} ({e.strerror or e}); '
                             'free some space or fix the directory.') from e
  try:
    _write(model, partial, tuple(input_shape))
    if os.path.isdir(final):  # An earlier export of the same step.
      shutil.rmtree(final)
    os.replace(partial, final)
  except OSError as e:
    raise errors.RunDirError(f'cannot write {final} ({e.strerror or e}); '
                             'free some space or fix the directory.') from e
  finally:
    shutil.rmtree(partial, ignore_errors=True)
  logging.info('exported %s (SavedModel, signature %r; and %s)', final,
               SIGNATURE, KERAS_FILE)
  return final


def export_latest(model_dir):
  """Exports the latest intact checkpoint of `model_dir`; returns the path.

  Raises:
    errors.UserError: no job record or no checkpoint to export.
  """
  try:
    with open(os.path.join(model_dir, run_dir.JOB_FILE)) as f:
      job = json.load(f)['job']
  except (OSError, ValueError, KeyError) as e:
    raise errors.RunDirError(
        f'--model_dir={model_dir} holds no readable {run_dir.JOB_FILE} '
        f'({e}); pass the model_dir of a tfmulti run.') from e
  latest = checkpoints.latest_intact(model_dir)
  if latest is None:
    raise errors.RunDirError(f'--model_dir={model_dir} holds no checkpoint '
                             'to export; train first.')
  model = models.get_model(job['model'], input_shape=job['input_shape'],
                           num_classes=job['num_classes'],
                           dtype_policy=job['dtype_policy'])
  tf.train.Checkpoint(model=model).restore(
      latest[1]).expect_partial().assert_existing_objects_matched()
  return export(model, model_dir, latest[0], job['input_shape'])


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog='python -m tfmulti.train.export', description=__doc__.split('\n')[0])
  parser.add_argument('--model_dir', required=True,
                      help='a tfmulti run directory')
  args = parser.parse_args(argv)
  try:
    print(export_latest(os.path.expanduser(args.model_dir)))
  except errors.UserError as e:
    sys.exit(f'tfmulti.train.export: error: {e}')


if __name__ == '__main__':
  main()
