"""TFRecords of image classification (`--dataset=tfrecord:GLOB`).

Each record is a `tf.train.Example` holding `image/encoded` (JPEG or PNG
bytes) and `image/class/label` (int64): the layout TF's own ImageNet and
Model Garden converters write. `--validation_glob` names the evaluation
files; without it a seeded `validation_fraction` of the records is held
out. `--label_offset` is subtracted from every label (TF's ImageNet
converter writes 1..1000).

Rows, classes and image sizes are not in the files' headers: the first run
reads every record once and decodes its image (so a truncated or corrupt
image stops the run now, naming its file and record, and not mid-epoch),
checks them all (the keys, PNG or JPEG bytes that decode, labels in range,
one size unless `--image_size` is given) and logs what it read; the job
records the counts in `job.json`, and a resumed run takes them from there
(`known`).
"""

from absl import logging
from google.protobuf import message
import numpy as np
import tensorflow as tf

from tfmulti import errors
from tfmulti.data import batches
from tfmulti.data import images

PREFIX = 'tfrecord:'
IMAGE_KEY = 'image/encoded'
LABEL_KEY = 'image/class/label'
_FEATURES = {IMAGE_KEY: tf.io.FixedLenFeature([], tf.string),
             LABEL_KEY: tf.io.FixedLenFeature([], tf.int64)}
_SCAN_BATCH = 4096  # Records summarised a read.
_UNREADABLE = (tf.errors.InvalidArgumentError, tf.errors.DataLossError)


def _files(pattern, flag):
  """The sorted files matching `pattern`, or one line naming `flag`."""
  files = sorted(tf.io.gfile.glob(pattern))
  if not files:
    raise errors.DatasetUnavailableError(
        f'{flag}{pattern}: no file matches; give a glob of TFRecord files, '
        'e.g. /data/imagenet/train-*.')
  for file in files:  # The first record of each file holds both keys.
    try:
      first = [raw.numpy() for raw in tf.data.TFRecordDataset(file).take(1)]
      keys = {key for raw in first
              for key in tf.train.Example.FromString(raw).features.feature}
    except (tf.errors.DataLossError, message.DecodeError) as e:
      raise errors.ConfigError(
          f'{file} is not a file of tf.train.Example records '
          f'({errors.tf_reason(e)}); give {flag} a glob of TFRecord files '
          'only.') from None
    if first and not {IMAGE_KEY, LABEL_KEY} <= keys:
      raise errors.ConfigError(
          f'{file} holds records with keys {sorted(keys)}; tfrecord: reads '
          f'{IMAGE_KEY!r} (PNG or JPEG bytes) and {LABEL_KEY!r} (int64), '
          "the layout of TF's image-classification converters.")
  return files


def _records(files):
  return tf.data.TFRecordDataset(files, num_parallel_reads=tf.data.AUTOTUNE)


def _parsed(raw):
  example = tf.io.parse_single_example(raw, _FEATURES)
  return example[IMAGE_KEY], example[LABEL_KEY]


def _held_out(seed, fraction):
  """Whether record `position` is held out: a draw seeded by it."""
  def held(position):
    draw = tf.random.stateless_uniform([], seed=tf.stack(
        [tf.constant(seed, tf.int64), position]))
    return draw < fraction
  return held


def _scan(records, label_offset):
  """(labels, (height, width, channels) of each record) of `records`, each
  image decoded once.

  Raises:
    tf.errors.InvalidArgumentError: a record without the keys, or an image
      that does not decode (`_bad_record` says which).
    tf.errors.DataLossError: a damaged file.
  """
  summaries = records.map(lambda raw: (lambda image, label: (
      label - label_offset, images.shape(image)))(*_parsed(raw)),
                          tf.data.AUTOTUNE).batch(_SCAN_BATCH)
  labels, shapes = [], []
  for label, shape in summaries:
    labels.append(label.numpy())
    shapes.append(shape.numpy())
  if not labels:
    return np.zeros([0], np.int64), np.zeros([0, 3], np.int32)
  return np.concatenate(labels), np.concatenate(shapes)


def _check(where, labels, shapes, options):
  """Raises `ConfigError` for bad bytes, labels out of range or mixed sizes;
  returns (num_classes, channels, (height, width) of one image)."""
  if not len(labels):
    raise errors.ConfigError(f'{where}: no records; give files with images.')
  bad = int(np.sum(shapes[:, 2] == 0))
  if bad:
    raise errors.ConfigError(
        f'{where}: {bad} of {len(labels)} records hold {IMAGE_KEY!r} bytes '
        'that are neither PNG nor JPEG; re-encode them.')
  if labels.min() < 0:
    raise errors.ConfigError(
        f'{where}: a label of {labels.min() + options.label_offset} is '
        f'below --label_offset={options.label_offset}; lower the offset '
        '(TF\'s ImageNet converter writes 1..1000: give 1).')
  num_classes = options.num_classes or int(labels.max()) + 1
  if labels.max() >= num_classes:
    raise errors.ConfigError(
        f'{where}: a label of {labels.max()} (after --label_offset) is at '
        f'or past --num_classes={num_classes}; raise --num_classes or set '
        '--label_offset.')
  channels = set(shapes[:, 2].tolist())
  sizes = {tuple(s) for s in shapes[:, :2].tolist()}
  if len(channels) > 1:
    raise errors.ConfigError(
        f'{where}: images of {sorted(channels)} channels; give images of one '
        'kind.')
  if options.image_size is None and len(sizes) > 1:
    raise errors.ConfigError(
        f'{where}: images of several sizes ({sorted(sizes)[:3]}, ...); pass '
        '--image_size=HEIGHT,WIDTH to resize them all.')
  return num_classes, channels.pop(), sizes.pop()


def read(pattern, *, options, seed, known=None, shard=None):
  """`batches.Splits` of the TFRecords `pattern` (see the module's
  docstring); `known` is the counts a previous run of this job recorded,
  or None to read them; `shard`, (worker, workers) with `shard_files`:
  this worker reads files worker, worker + workers, ..."""
  train_files = _files(pattern, f'--dataset={PREFIX}')
  test_files = (_files(options.validation_glob, '--validation_glob=')
                if options.validation_glob else None)
  if shard:
    return _sharded(pattern, train_files, test_files, options, shard)
  train = _records(train_files)
  if test_files:
    test = _records(test_files)
  else:  # A seeded share of the records, fixed by their positions.
    held = _held_out(seed, options.validation_fraction)
    test = train.enumerate().filter(lambda i, _: held(i)).map(
        lambda _, raw: raw)
    train = train.enumerate().filter(lambda i, _: ~held(i)).map(
        lambda _, raw: raw)
  if known is None:
    classes, shape, (train_rows,), test_rows = _counted(
        pattern, [train], test, options, train_files + (test_files or []))
    known = classes, shape, train_rows, test_rows
  return _decoded(train, test, known, options)


def _decoded(train, test, known, options, worker_rows=None):
  """`batches.Splits` of the record streams, decoded."""
  num_classes, shape, train_rows, test_rows = known
  # Resized later when an image size is given; else all of `shape`.
  decoded_shape = (None, None, shape[2]) if options.image_size else shape

  def decode(raw):
    image, label = _parsed(raw)
    image = tf.io.decode_image(image, channels=shape[2],
                               expand_animations=False)
    image.set_shape(decoded_shape)
    return image, label - options.label_offset
  return batches.Splits(train.map(decode, tf.data.AUTOTUNE),
                         test.map(decode, tf.data.AUTOTUNE), num_classes,
                         train_rows, test_rows, worker_rows)


def _sharded(pattern, train_files, test_files, options, shard):
  """This worker's share of the training files (`shard_files`): every file
  is counted (each worker must know the others' rows to train as many
  steps), this worker's read."""
  worker, workers = shard
  if not test_files:
    raise errors.ConfigError(
        f'--shard_files with --dataset={PREFIX}{pattern} needs '
        '--validation_glob: a held-out share of records would differ from '
        'worker to worker.')
  if len(train_files) < workers:
    raise errors.ConfigError(
        f'--dataset={PREFIX}{pattern} matches {len(train_files)} file(s) '
        f'for {workers} workers; --shard_files needs a file a worker at '
        'least: drop it, or split the records into more files.')
  classes, shape, per_file, test_rows = _counted(
      pattern, [_records([f]) for f in train_files], _records(test_files),
      options, train_files + test_files)
  worker_rows = tuple(sum(per_file[w::workers]) for w in range(workers))
  return _decoded(_records(train_files[worker::workers]),
                  _records(test_files),
                  (classes, shape, worker_rows[worker], test_rows), options,
                  worker_rows)


def _counted(pattern, train_parts, test, options, files):
  """(num_classes, image shape, [rows of each train part], test rows),
  read from every record of `files` (the parts' and the test's) and
  checked."""
  logging.info('Reading every record of %s once (its label, its image '
               'decoded) to count its rows and classes and check them.',
               pattern)
  try:
    found = [_scan(records, options.label_offset)
             for records in [*train_parts, test]]
  except _UNREADABLE as e:
    raise _bad_record(files, e) from None
  labels = np.concatenate([labels for labels, _ in found])
  shapes = np.concatenate([shapes for _, shapes in found])
  classes, channels, size = _check(f'--dataset={PREFIX}{pattern}', labels,
                                   shapes, options)
  if not len(found[-1][0]):
    raise errors.ConfigError(
        f'--dataset={PREFIX}{pattern}: no records held out for evaluation; '
        'raise --validation_fraction or give --validation_glob.')
  return (classes, (*size, channels), [len(labels) for labels, _ in
                                       found[:-1]], len(found[-1][0]))


def _bad_record(files, error):
  """The one-line `ConfigError` naming the first record of `files` that
  cannot be read, parsed or decoded (`error`, the scan's, says what when
  none is found): each file is scanned alone until one fails, then its
  records one by one."""
  for file in files:
    try:
      _scan(_records([file]), 0)
    except _UNREADABLE:
      found = _bad_in_file(file)
      if found:
        return found
  return errors.ConfigError(
      f'a record cannot be read as {IMAGE_KEY!r} bytes and an int64 '
      f'{LABEL_KEY!r} ({errors.tf_reason(error)}); convert every record to '
      'that layout.')


def _bad_in_file(file):
  """The `ConfigError` naming `file`'s first bad record, or None."""
  read = 0
  try:
    for raw in tf.data.TFRecordDataset(file):
      try:
        image, _ = _parsed(raw)
      except tf.errors.InvalidArgumentError as e:
        return errors.ConfigError(
            f'{file}: record {read} does not hold {IMAGE_KEY!r} bytes and an '
            f'int64 {LABEL_KEY!r} ({errors.tf_reason(e)}); convert every '
            'record to that layout.')
      try:
        images.shape(image)  # Zeros, not an error, for other bytes.
      except tf.errors.InvalidArgumentError as e:
        return errors.ConfigError(
            f'{file}: record {read} holds {IMAGE_KEY!r} bytes that do not '
            f'decode ({images.why_not_decoded(image) or errors.tf_reason(e)})'
            '; re-encode its image, or drop the record.')
      read += 1
  except tf.errors.DataLossError as e:
    return errors.ConfigError(
        f'{file} is damaged after {read} records ({errors.tf_reason(e)}); '
        'write it again.')
  return None
