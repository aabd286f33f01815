"""Tests for tfmulti.train.export: a served model, loaded without tfmulti."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti import models
from tfmulti.train import export

# Loads each export in a process that imports only TensorFlow, Keras and
# TFDS (for the prepared digits files), and prints each one's accuracy on the
# test split, as the training run evaluated it: float pixels in [0, 255].
_LOAD_AND_EVALUATE = '''
import json, sys
import keras, numpy as np, tensorflow as tf, tensorflow_datasets as tfds
digits_dir, export_dirs = sys.argv[1], sys.argv[2:]
assert not any(name.startswith('tfmulti') for name in sys.modules)
builder = tfds.builder_from_directory(digits_dir)
images, labels = [], []
for image, label in builder.as_dataset(split='test', as_supervised=True):
  images.append(image.numpy()); labels.append(label.numpy())
images = np.stack(images).astype(np.float32)
labels = np.array(labels)
accuracies = []
for export_dir in export_dirs:
  serve = tf.saved_model.load(export_dir).signatures['serving_default']
  outputs = serve(images=tf.constant(images))
  probabilities = np.sum(outputs['probabilities'], axis=-1)
  assert np.allclose(probabilities, 1.0, atol=1e-5)
  model = keras.models.load_model(export_dir + '/model.keras')
  predicted = np.argmax(model.predict(images, verbose=0), -1)
  accuracies.append({
      'saved_model': float(np.mean(np.argmax(outputs['logits'], -1)
                                   == labels)),
      'keras': float(np.mean(predicted == labels))})
print(json.dumps(accuracies))
'''


@pytest.mark.slow
def test_runs_export_models_that_load_without_tfmulti(run_train,
                                                      digits_dir):
  """A 2-clone towers run and a 2-replica mirrored (BatchNorm) run."""
  runs = [run_train(model=model, num_clones=2, strategy=strategy,
                    batch_size=32, train_steps=6, optimizer='adam',
                    learning_rate=0.003, export=True)
          for model, strategy in (('lenet', 'towers'),
                                  ('resnet8_thin', 'mirrored'))]
  for metrics in runs:
    path = metrics['export']
    assert path.endswith(os.path.join('export', '6'))
    assert metrics['phases_seconds']['export'] > 0  # Its own phase.
    assert sorted(os.listdir(os.path.dirname(path))) == ['6']  # Nothing
    # else: no partial export is left.
    # Placed for one device: no op of the served graph names a device.
    serve = tf.saved_model.load(path).signatures[export.SIGNATURE]
    assert {op.device for op in serve.graph.get_operations()} == {''}
  result = subprocess.run(
      [sys.executable, '-c', _LOAD_AND_EVALUATE,
       os.path.join(digits_dir, 'digits', '1.0.0')] +
      [metrics['export'] for metrics in runs],
      cwd='/', capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  accuracies = json.loads(result.stdout.strip().splitlines()[-1])
  for metrics, accuracy in zip(runs, accuracies):
    assert accuracy == {'saved_model': metrics['eval_accuracy'],
                        'keras': metrics['eval_accuracy']}


@pytest.mark.slow
def test_export_an_existing_model_dir(run_train, tmp_path):
  model_dir = str(tmp_path / 'run')
  run_train(model_dir=model_dir, num_clones=2, train_steps=3)
  assert not os.path.exists(os.path.join(model_dir, export.EXPORT_DIR))
  export.main([f'--model_dir={model_dir}'])
  path = os.path.join(model_dir, export.EXPORT_DIR, '3')
  serve = tf.saved_model.load(path).signatures[export.SIGNATURE]
  images = np.random.default_rng(0).random((5, 28, 28, 1), np.float32)
  logits = serve(images=tf.constant(images))['logits'].numpy()
  trained = models.get_model('lenet', input_shape=(28, 28, 1),
                             num_classes=10)
  tf.train.Checkpoint(model=trained).restore(
      os.path.join(model_dir, 'ckpt-3')).expect_partial()
  loaded = keras.models.load_model(os.path.join(path, export.KERAS_FILE))
  for got, want in zip(loaded.get_weights(), trained.get_weights()):
    np.testing.assert_array_equal(got, want)  # The checkpoint's weights.
  np.testing.assert_allclose(loaded.predict(images, verbose=0), logits,
                             rtol=1e-5, atol=1e-6)


def test_export_without_a_run_says_what_to_do(tmp_path):
  with pytest.raises(SystemExit, match='holds no readable job.json'):
    export.main([f'--model_dir={tmp_path}'])
