"""TensorFlow Datasets: mnist, cifar10, ... and tfds:NAME[/CONFIG][:VERSION].

A dataset is read from `data_dir` when prepared there (any name: TFDS reads
a prepared copy without its builder), else downloaded when its servers can
be reached, else a `DatasetUnavailableError` within seconds (TFDS itself
would retry for minutes). Its (image, label) pair is its supervised keys,
or its one `Image` and one `ClassLabel` feature. Evaluation reads its
`test` split, else `validation`, else the train split's last
`validation_fraction` of rows.
"""

import contextlib
import fcntl
import io
import logging as std_logging
import os
import socket
import sys
from urllib import parse

from absl import logging
import tensorflow_datasets as tfds

from tfmulti import errors
from tfmulti import phases
from tfmulti.data import batches

PREFIX = 'tfds:'
_PROBE_TIMEOUT_S = 3.0  # Seconds to wait for a download server to answer.
_EVALUATION_SPLITS = ('test', 'validation')


def _check_reachable(name, builder):
  """Raises `DatasetUnavailableError` if a download server cannot be reached."""
  for url in sorted(builder.url_infos or ()):
    parts = parse.urlparse(url)
    port = parts.port or (443 if parts.scheme == 'https' else 80)
    try:
      socket.create_connection((parts.hostname, port),
                               timeout=_PROBE_TIMEOUT_S).close()
    except OSError as e:
      raise errors.DatasetUnavailableError(
          f'dataset {name!r} is not prepared in {builder.data_dir} and its '
          f'server {parts.hostname}:{port} cannot be reached ({e}). On a '
          f'machine with network run `tfds build {name} --data_dir=DIR`, '
          'copy DIR here and pass --data_dir=DIR (or use --dataset=digits, '
          'which needs no network).') from e


def _builder(name, data_dir):
  """The prepared builder of `name`, preparing it if it can be, quietly
  (`_quiet`)."""
  with _quiet():
    return _prepared_builder(name, data_dir)


def _prepared_builder(name, data_dir):
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise errors.DatasetUnavailableError(
        f'--dataset={PREFIX}{name}: TFDS has no dataset {name!r} in its '
        f'catalogue nor prepared in {data_dir or "~/tensorflow_datasets"}; '
        'check the name (tfds.list_builders()) or pass the --data_dir that '
        'holds it.') from None
  if builder.is_prepared():
    return builder
  _check_reachable(name, builder)
  with _one_preparer(name, data_dir):
    builder = tfds.builder(name, data_dir=data_dir)  # Read again, locked.
    if not builder.is_prepared():  # Else another process just prepared it.
      _prepare(name, data_dir, builder)
  return builder


@contextlib.contextmanager
def _one_preparer(name, data_dir):
  """Holds `data_dir`'s lock for `name`: the workers of a job start
  together on one machine (or one shared disk), and two that prepared the
  same dataset at once would both write it; the others wait, then read
  what the first prepared."""
  root = os.path.expanduser(data_dir or '~/tensorflow_datasets')
  try:
    os.makedirs(root, exist_ok=True)
    lock = open(os.path.join(root, f'.{name.replace("/", "_")}.lock'), 'w')
  except OSError as e:
    raise _cannot_prepare(name, data_dir, e) from e
  with lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
    yield


def _prepare(name, data_dir, builder):
  """Downloads and prepares `name` with `builder`."""
  try:
    with phases.phase(f'preparing dataset {name!r} in {builder.data_dir} '
                      '(once)', own_bar=True):  # TFDS's bar, on a terminal.
      builder.download_and_prepare()
  except OSError as e:  # Disk full, or the directory vanished or is locked.
    raise _cannot_prepare(name, data_dir, e) from e
  except AssertionError as e:  # A manual download TFDS cannot make.
    raise errors.DatasetUnavailableError(
        f'dataset {name!r} cannot be prepared here: '
        f'{errors.first_line(e)}') from e


class _NotAboutItsOwnFolders(std_logging.Filter):
  """Drops TFDS's warnings about a variant folder without its
  `dataset_info.json` (not prepared: `_builder` prepares it, or says
  why it cannot)."""

  def filter(self, record):
    return not str(record.msg).startswith('Variant folder')


@contextlib.contextmanager
def _quiet():
  """Inside, TFDS reads and prepares quietly: its download lines (printed)
  go to the log's debug level, its progress bar shows only on a terminal
  (no escape codes in a log file), and its warnings about a folder not
  prepared yet, which it is about to prepare, are dropped."""
  printed = io.StringIO()
  dropped = _NotAboutItsOwnFolders()
  std_logging.getLogger('absl').addFilter(dropped)
  tfds.display_progress_bar(sys.stderr.isatty())
  try:
    with contextlib.redirect_stdout(printed):
      yield
  finally:
    tfds.display_progress_bar(True)  # TFDS's default.
    std_logging.getLogger('absl').removeFilter(dropped)
    for line in filter(None, printed.getvalue().splitlines()):
      logging.debug('tfds: %s', line)


def _cannot_prepare(name, data_dir, error):
  """The one line for a data_dir that cannot hold `name` (an `OSError`)."""
  return errors.DatasetUnavailableError(
      f'dataset {name!r} cannot be prepared in '
      f'{data_dir or "~/tensorflow_datasets"} ({error.strerror or error}); '
      'free some space or pass another --data_dir.')


def _image_and_label(name, info):
  """The names of the (image, label) features of `info`."""
  features = info.features
  if info.supervised_keys and len(info.supervised_keys) == 2:
    keys = tuple(info.supervised_keys)
  else:
    kinds = {k: type(f).__name__ for k, f in features.items()}
    keys = ([k for k, kind in kinds.items() if kind == 'Image'],
            [k for k, kind in kinds.items() if kind == 'ClassLabel'])
    keys = tuple(found[0] for found in keys if len(found) == 1)
  if len(keys) != 2 or not (
      isinstance(features[keys[0]], tfds.features.Image)
      and isinstance(features[keys[1]], tfds.features.ClassLabel)):
    raise errors.ConfigError(
        f'--dataset={PREFIX}{name}: its features {dict(features)!r:.200} hold '
        'no (image, class label) pair; tfmulti trains image classifiers: '
        'choose a dataset with an Image and a ClassLabel feature.')
  return keys


def read(name, *, data_dir, seed, validation_fraction):
  """`batches.Splits` of TFDS dataset `name` (see the module docstring)."""
  builder = _builder(name, data_dir)
  image, label = _image_and_label(name, builder.info)
  splits = builder.info.splits
  train_rows = splits['train'].num_examples
  evaluation = [s for s in _EVALUATION_SPLITS if s in splits]
  if evaluation:
    names = ('train', evaluation[0])
  else:
    cut = train_rows - max(1, round(train_rows * validation_fraction))
    names = (f'train[:{cut}]', f'train[{cut}:]')
  # The train split's files in an order fixed by the seed, the same every
  # epoch (rows are shuffled again, per epoch, in `batches`).
  read_config = tfds.ReadConfig(shuffle_seed=seed,
                                shuffle_reshuffle_each_iteration=False)
  train, test = [
      builder.as_dataset(split=split, shuffle_files=shuffle,
                         read_config=read_config).map(
                             lambda row: (row[image], row[label]))
      for split, shuffle in zip(names, (True, False))]
  return batches.Splits(
      train, test, builder.info.features[label].num_classes,
      batches.count(train), batches.count(test))
