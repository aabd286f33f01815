"""The documents say what the code does: the flags table is the CLI's, the
Kubernetes manifest runs the installed command line the tests run, and the
front doors stay short and current.

README.md is a front door, at most 200 lines; BENCHMARKS.md gives one
current table a question, at most 400 lines, each dated: earlier rounds
live in git and in the dated JSON reports under docs/, not in prose, and a
word of the day ("tonight", "this morning") is wrong the day after, so
BENCHMARKS.md has none. Every dotted `tfmulti.` name that README.md,
BENCHMARKS.md or docs/*.md gives (a module, as in `python -m
tfmulti.bench.e2e`, or a class, function or attribute, as
`tfmulti.fit.TowersModel`) must resolve: the longest prefix that imports as
a module, then attributes, and not through an old place that only warns
(`tfmulti.moved`). A rename that leaves a document behind fails here,
naming the document and the name, instead of sending a reader to
something that is not there. Names relative to a module
(`deploy.StepOptions`) are not checked.
"""

import configparser
import glob
import importlib
import importlib.util
import inspect
import os
import re

from absl import flags
import pytest

from tests.helpers import indexed_job_flags
from tests.helpers import INDEXED_JOB_MANIFEST
from tests.helpers import manifest_command
from tests.helpers import REPO
from tfmulti import cli
from tfmulti import moved
from tfmulti import step_options
from tfmulti.engine import registry

RUNNING = os.path.join(REPO, 'docs', 'running.md')
ROW = re.compile(r'^\| `--(\w+)` \| ([^|]+) \|', re.M)
# The documents whose `tfmulti.` names must exist, as globs under REPO.
DOCUMENTS = ('README.md', 'BENCHMARKS.md', os.path.join('docs', '*.md'))
MOST_LINES = {'README.md': 200, 'BENCHMARKS.md': 400}
# A day, or a part of it, named relative to the writing ("this evening",
# "(night)"): a date says it for good.
WORDS_OF_THE_DAY = re.compile(
    r'\b(?:tonight|today|yesterday|last\s+night|morning|afternoon|evening)\b'
    r'|\(night\)', re.I)
# `tfmulti.` and identifiers: a trailing full stop, a call's `(...)` or a
# `[.NAME]` placeholder ends the name.
DOTTED_NAME = re.compile(r'(?<![\w.])tfmulti(?:\.[A-Za-z_]\w*)+')


def _table():
  """{flag name: its default as written} from docs/running.md."""
  with open(RUNNING) as f:
    return {name: default.strip() for name, default in ROW.findall(f.read())}


def test_the_flags_table_lists_every_flag_of_the_cli_with_its_default():
  defined = {flag.name: flag
             for flag in flags.FLAGS.get_flags_for_module(cli.__name__)}
  table = _table()
  assert set(table) == set(defined)
  for name, flag in defined.items():
    assert table[name] == repr(flag.default), name


def test_the_honours_table_is_the_registry():
  with open(os.path.join(REPO, 'docs', 'design.md')) as f:
    text = f.read()
  table = text[text.index('| strategy | honours |'):].split('\n\n')[0]
  rows = [line.split('|')[1:3] for line in table.splitlines()[2:]]
  documented = {}
  for strategies, honours in rows:
    names = set(re.findall(r'`(\w+)`', honours))
    if honours.strip() in ('all', 'all but `worker_parts`'):
      names = set(registry.get(registry.TOWERS).honours)
    elif 'clone_shares' in names and '`auto`' not in honours:
      names.add(f'clone_shares={step_options.AUTO}')
    names.discard(step_options.AUTO)
    for strategy in re.findall(r'`(\w+)`', strategies):
      documented[strategy] = names
  assert documented == {name: set(builder.honours)
                        for name, builder in registry.BUILDERS.items()}


def test_the_indexed_job_manifest_runs_the_installed_command_line():
  """docs/indexed_job.yaml runs what `pip install tfmulti` installs, with
  flags of the CLI, one port and as many workers as completions; the
  indexed-job test (tests/distribute/test_cluster.py) runs its flags,
  and docs/running.md shows its command."""
  program, *manifest_flags = manifest_command()
  setup = configparser.ConfigParser()
  setup.read(os.path.join(REPO, 'setup.cfg'))
  scripts = dict(line.split(' = ') for line in setup['options.entry_points'][
      'console_scripts'].strip().splitlines())
  assert scripts[program] == f'{cli.__name__}:{cli.run.__name__}'
  given = dict(flag[2:].split('=', 1) for flag in manifest_flags)
  defined = {flag.name
             for flag in flags.FLAGS.get_flags_for_module(cli.__name__)}
  assert set(given) <= defined and given['cluster'] == 'indexed_job'
  with open(INDEXED_JOB_MANIFEST) as f:
    manifest = f.read()
  assert given['num_workers'] in re.findall(r'completions: (\d+)', manifest)
  port = given['worker_hosts'].rsplit(':', 1)[1]
  assert re.findall(r'(?:containerPort|port): (\d+)', manifest) == [port] * 2
  # The test's run: the manifest's flags, its pods' addresses on loopback.
  assert indexed_job_flags('localhost:2{index}') == [
      '--worker_hosts=localhost:2{index}' if flag.startswith('--worker_hosts')
      else flag for flag in manifest_flags
      if not flag.startswith('--model_dir')]
  with open(RUNNING) as f:
    running = ' '.join(f.read().replace('\\\n', ' ').split())
  assert ' '.join(manifest_command()) in running


@pytest.mark.parametrize('document', sorted(MOST_LINES))
def test_the_front_doors_stay_short(document):
  with open(os.path.join(REPO, document)) as f:
    lines = len(f.read().splitlines())
  assert lines <= MOST_LINES[document], (
      f'{document} has {lines} lines, at most {MOST_LINES[document]}: '
      'history goes to git and the dated docs/*.json reports')


def test_the_benchmarks_name_no_day_by_a_word_of_the_day():
  with open(os.path.join(REPO, 'BENCHMARKS.md')) as f:
    text = f.read()
  found = [f'line {text.count(chr(10), 0, match.start()) + 1}: '
           f'{match.group(0)!r}' for match in WORDS_OF_THE_DAY.finditer(text)]
  assert not found, f'BENCHMARKS.md: write the date instead: {found}'


def test_words_of_the_day_are_found_and_dates_are_not():
  found = [m.group(0) for m in WORDS_OF_THE_DAY.finditer(
      'Measured tonight, this evening and Today; 2026-11-26 (night); '
      'the morning run; last\nnight; todays, overnight, `--yesterdays`')]
  assert found == ['tonight', 'evening', 'Today', '(night)', 'morning',
                   'last\nnight']


def _resolve(dotted):
  """The object a dotted name gives: the longest prefix that imports as a
  module, then its attributes (a class's annotated fields count). Raises
  ImportError or AttributeError for a name that does not exist."""
  parts = dotted.split('.')
  for end in range(len(parts), 0, -1):
    name = '.'.join(parts[:end])
    if parts[end - 1] == '__main__':  # Importing it would run the command.
      if importlib.util.find_spec(name) is None:
        continue
      return name
    try:
      found = importlib.import_module(name)
    except ModuleNotFoundError as error:
      # Only this name's own absence: a module that fails to import
      # something else is an error of its own.
      if error.name is None or not (name + '.').startswith(error.name + '.'):
        raise
      continue
    break
  for attribute in parts[end:]:
    if not hasattr(found, attribute) and inspect.isclass(found) and any(
        attribute in vars(klass).get('__annotations__', {})
        for klass in found.__mro__):
      found = attribute  # A field each instance sets.
    else:
      found = getattr(found, attribute)
  return found


def _moved(dotted):
  """Where `dotted` lives now if it, or a prefix of it, moved and its old
  place only warns (`tfmulti.moved.MOVED`); None if it did not move."""
  parts = dotted.split('.')
  for end in range(len(parts), 1, -1):
    old = '.'.join(parts[:end])
    if old in moved.MOVED:
      return '.'.join([moved.MOVED[old]] + parts[end:])
  return None


def _names(text):
  """The dotted `tfmulti.` names in `text`, in order, each once."""
  return list(dict.fromkeys(DOTTED_NAME.findall(text)))


def test_names_are_read_as_written():
  assert _names(
      'Run `python -m tfmulti.bench.e2e --model=lenet`, or\n'
      'tfmulti.fit.TowersModel(model, config). See tfmulti.fit. '
      '`python -m tfmulti.bench[.NAME]`; tfmulti/bench/e2e.py and '
      'x.tfmulti.y are not names.') == [
          'tfmulti.bench.e2e', 'tfmulti.fit.TowersModel', 'tfmulti.fit',
          'tfmulti.bench']


def test_a_name_resolves_to_what_it_names_and_a_stale_one_does_not():
  from tfmulti.deploy import balance
  from tfmulti.fit import TowersModel
  assert _resolve('tfmulti.fit.TowersModel') is TowersModel
  assert _resolve('tfmulti.deploy.balance.Balancer') is balance.Balancer
  assert _resolve('tfmulti.deploy.balance') is balance
  assert _resolve('tfmulti.bench.__main__') == 'tfmulti.bench.__main__'
  for stale in ('tfmulti.deploy.balance.Balanced', 'tfmulti.costs',
                'tfmulti.fit.TowersModel.no_such_method'):
    with pytest.raises((ImportError, AttributeError)):
      _resolve(stale)
  old, new = next(iter(moved.MOVED.items()))
  assert _moved(old + '.anything') == new + '.anything'
  assert _moved('tfmulti.fit.TowersModel') is None


def test_every_tfmulti_name_the_documents_give_exists():
  missing = []
  for pattern in DOCUMENTS:
    for path in sorted(glob.glob(os.path.join(REPO, pattern))):
      with open(path) as f:
        names = _names(f.read())
      for name in names:
        document = os.path.relpath(path, REPO)
        if _moved(name):
          missing.append(f'{document}: {name} (moved to {_moved(name)})')
          continue
        try:
          _resolve(name)
        except (ImportError, AttributeError) as error:
          missing.append(f'{document}: {name} ({error})')
  assert not missing, missing
