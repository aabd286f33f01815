"""Tests for `--dataset=tfrecord:GLOB`: TFRecords in the layout of TF's
image-classification converters, written here from the offline digits."""

import json
import os

import numpy as np
import pytest
from sklearn import datasets
import tensorflow as tf

from tfmulti import data
from tfmulti import errors
from tfmulti.data import tfrecords


def _example(image_bytes, label, keys=(tfrecords.IMAGE_KEY,
                                      tfrecords.LABEL_KEY)):
  feature = {
      keys[0]: tf.train.Feature(bytes_list=tf.train.BytesList(
          value=[image_bytes])),
      keys[1]: tf.train.Feature(int64_list=tf.train.Int64List(
          value=[label]))}
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


def write_records(folder, name, rows, *, files=2, label_offset=0, start=0,
           encode=tf.io.encode_png, **example_kwargs):
  """`rows` digits (from `start`) as PNG records over `files` files
  `name-0000i`; returns their (pixels, labels)."""
  digits = datasets.load_digits()
  pixels = np.round(digits.images[start:start + rows] * 255 / 16).astype(
      np.uint8)[..., None]
  labels = digits.target[start:start + rows]
  os.makedirs(folder, exist_ok=True)
  for f in range(files):
    with tf.io.TFRecordWriter(str(folder / f'{name}-{f:05d}')) as writer:
      for image, label in list(zip(pixels, labels))[f::files]:
        writer.write(_example(encode(image).numpy(),
                              int(label) + label_offset, **example_kwargs))
  return pixels, labels


def test_records_train_with_a_validation_glob_and_a_label_offset(tmp_path):
  _, labels = write_records(tmp_path, 'train', 120, label_offset=1)
  write_records(tmp_path, 'validation', 40, files=1, label_offset=1,
                start=120)
  loaded = data.load(
      f'tfrecord:{tmp_path}/train-*', global_batch_size=16,
      options=data.InputOptions(validation_glob=f'{tmp_path}/validation-*',
                                label_offset=1))
  assert (loaded.num_classes, loaded.input_shape) == (10, (8, 8, 1))
  assert (loaded.train_examples, loaded.test_examples) == (120, 40)
  train_labels = np.concatenate([y for _, y in loaded.train_epoch(0)])
  assert len(train_labels) == 112  # 7 whole batches of 16.
  assert set(train_labels) <= set(labels) and min(train_labels) == 0
  images = np.concatenate([x for x, _ in loaded.test])
  assert images.shape == (40, 8, 8, 1) and images.max() == 255.0


@pytest.mark.slow
def test_without_a_validation_glob_a_seeded_share_is_held_out(tmp_path):
  pixels, _ = write_records(tmp_path, 'train', 200)

  def split(seed):
    loaded = data.load(f'tfrecord:{tmp_path}/train-*', global_batch_size=8,
                       seed=seed,
                       options=data.InputOptions(validation_fraction=0.25))
    test = np.concatenate([x for x, _ in loaded.test])
    train = np.concatenate([x for x, _ in loaded.train_epoch(0)])
    return loaded, {r.tobytes() for r in (test * 255).round().astype(
        np.uint8)}, {r.tobytes() for r in (train * 255).round().astype(
            np.uint8)}
  loaded, test, train = split(0)
  assert loaded.train_examples + loaded.test_examples == 200
  assert 30 <= loaded.test_examples <= 70  # About a quarter.
  assert not test & train  # No row in both.
  assert split(0)[1] == test and split(1)[1] != test


@pytest.mark.slow
@pytest.mark.parametrize('damage, message', [
    ('no_files', 'no file matches; give a glob of TFRecord files'),
    ('keys', r"holds records with keys \['image/bytes', 'label'\]; "
     "tfrecord: reads 'image/encoded'"),
    ('bytes', 'records hold .image/encoded. bytes that are neither PNG nor '
     'JPEG'),
    ('label', r'a label of 9 \(after --label_offset\) is at or past '
     '--num_classes=5'),
    ('offset', 'a label of 0 is below --label_offset=1'),
    ('sizes', r'images of several sizes .*pass --image_size=HEIGHT,WIDTH'),
    # Found by decoding, not by the header: named by file and record.
    ('truncated_png', r"train-00001: record 4 holds 'image/encoded' bytes "
     r'that do not decode \(Invalid PNG data, size \d+\); re-encode'),
    ('jpeg_garbage', r"train-00001: record 4 holds 'image/encoded' bytes "
     r'that do not decode \(Invalid JPEG data, size 42\)'),
    ('not_records', r'train-00002 is not a file of tf.train.Example records '
     r'\(.+\); give --dataset=tfrecord: a glob of TFRecord files only'),
    ('damaged', r'train-00001 is damaged after 9 records \(.+\); write it '
     'again'),
])
def test_bad_records_are_one_line(tmp_path, damage, message):
  options = {'label': dict(num_classes=5),
             'offset': dict(label_offset=1)}.get(damage, {})
  if damage == 'keys':
    write_records(tmp_path, 'train', 20, keys=('image/bytes', 'label'))
  elif damage == 'bytes':
    write_records(tmp_path, 'train', 20,
                  encode=lambda image: tf.constant(b'raw'))
  elif damage == 'sizes':
    write_records(tmp_path, 'train', 20, files=1)
    write_records(tmp_path, 'train', 20, files=1, start=20,
                  encode=lambda image: tf.io.encode_png(
                      tf.image.resize(image, (9, 9), 'nearest')))
    os.rename(tmp_path / 'train-00000', tmp_path / 'train-00001')
    write_records(tmp_path, 'train', 20, files=1)
  elif damage in ('truncated_png', 'jpeg_garbage'):
    written = iter(range(20))  # File 0's 10 records, then file 1's.

    def encode(image):
      good = tf.io.encode_png(image)
      if next(written) != 14:
        return good
      return tf.constant(good.numpy()[:-30] if damage == 'truncated_png'
                         else b'\xff\xd8' + b'junk' * 10)
    write_records(tmp_path, 'train', 20, encode=encode)
  elif damage == 'not_records':
    write_records(tmp_path, 'train', 20)
    (tmp_path / 'train-00002').write_bytes(b'a stray note, not records')
  elif damage == 'damaged':
    write_records(tmp_path, 'train', 20)
    damaged = tmp_path / 'train-00001'
    damaged.write_bytes(damaged.read_bytes()[:-50])
  elif damage != 'no_files':
    write_records(tmp_path, 'train', 20)
  with pytest.raises(errors.UserError, match=message) as refused:
    data.load(f'tfrecord:{tmp_path}/train-*', global_batch_size=4,
              options=data.InputOptions(**options))
  assert '\n' not in str(refused.value)


def test_counts_a_run_recorded_are_not_read_again(tmp_path, monkeypatch):
  write_records(tmp_path, 'train', 60)

  def scan(*args):
    raise AssertionError('the records were read whole again')
  monkeypatch.setattr(tfrecords, '_scan', scan)
  loaded = data.load(f'tfrecord:{tmp_path}/train-*', global_batch_size=8,
                     known=(10, (8, 8, 1), 47, 13))
  assert (loaded.num_classes, loaded.train_examples) == (10, 47)
  assert loaded.input_shape == (8, 8, 1)


@pytest.mark.slow
def test_the_command_line_trains_records_and_resumes_on_their_counts(
    run_train, tmp_path, monkeypatch):
  write_records(tmp_path / 'records', 'train', 400)
  dataset = f'tfrecord:{tmp_path / "records"}/train-*'
  model_dir = str(tmp_path / 'run')
  run_train(dataset=dataset, image_size=['28', '28'], num_clones=2,
            model_dir=model_dir, train_steps=2)
  with open(os.path.join(model_dir, 'job.json')) as f:
    job = json.load(f)['job']
  assert job['num_classes'] == 10 and job['input_shape'] == [28, 28, 1]
  assert job['train_examples'] + job['test_examples'] == 400

  def scan(*args):
    raise AssertionError('the resumed run read the records whole again')
  monkeypatch.setattr(tfrecords, '_scan', scan)
  metrics = run_train(dataset=dataset, image_size=['28', '28'],
                      num_clones=2, model_dir=model_dir, train_steps=4)
  assert (metrics['resumed_from_step'], metrics['steps']) == (2, 4)


def _rows(dataset):
  return [x.numpy().tobytes() for batch, _ in dataset for x in batch]


@pytest.mark.slow
def test_shard_files_gives_each_worker_its_files_and_equal_steps(tmp_path):
  write_records(tmp_path, 'train', 150, files=3)  # 50 rows a file.
  write_records(tmp_path, 'validation', 20, files=1, start=150)
  options = data.InputOptions(validation_glob=f'{tmp_path}/validation-*',
                              shard_files=True)
  workers = [data.load(f'tfrecord:{tmp_path}/train-*', global_batch_size=16,
                       options=options, worker=(w, 2)) for w in range(2)]
  # Worker 0 reads files 0 and 2 (100 rows), worker 1 file 1 (50): both
  # train the 6 steps of 8 rows that 50 rows make.
  for loaded in workers:
    assert loaded.per_worker and loaded.train_examples == 6 * 16
    batches = list(loaded.train_epoch(0))
    assert len(batches) == 6 and {b[0].shape[0] for b in batches} == {8}
    assert len(list(loaded.train_epoch(0, skip_batches=4))) == 2
  mine = [set(_rows(loaded.train_epoch(e))) for loaded in workers
          for e in range(3)]
  assert not (mine[0] | mine[1] | mine[2]) & (mine[3] | mine[4] | mine[5])
  # Evaluation reads every validation file on every worker.
  assert [loaded.test_examples for loaded in workers] == [20, 20]


@pytest.mark.parametrize('setup, options, message', [
    ('no_validation', {}, '--shard_files with --dataset=tfrecord:.* needs '
     '--validation_glob'),
    ('one_file', {'validation': True}, r'matches 1 file\(s\) for 2 workers'),
])
def test_records_that_cannot_be_shared_out_are_one_line(tmp_path, setup,
                                                        options, message):
  write_records(tmp_path, 'train', 40,
                files=2 if setup == 'no_validation' else 1)
  write_records(tmp_path, 'validation', 10, files=1, start=40)
  glob = f'{tmp_path}/validation-*' if options else None
  with pytest.raises(errors.ConfigError, match=message):
    data.load(f'tfrecord:{tmp_path}/train-*', global_batch_size=8,
              options=data.InputOptions(validation_glob=glob,
                                        shard_files=True),
              worker=(0, 2))
