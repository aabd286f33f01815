"""The documents say what the code does: the flags table is the CLI's."""

import os
import re

from absl import flags

from tests.helpers import REPO
from tfmulti import cli
from tfmulti import step_options
from tfmulti.train import registry

RUNNING = os.path.join(REPO, 'docs', 'running.md')
ROW = re.compile(r'^\| `--(\w+)` \| ([^|]+) \|', re.M)


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
    if honours.strip() == 'all':
      names = set(registry.get(registry.TOWERS).honours)
    elif 'clone_shares' in names and '`auto`' not in honours:
      names.add(f'clone_shares={step_options.AUTO}')
    names.discard(step_options.AUTO)
    for strategy in re.findall(r'`(\w+)`', strategies):
      documented[strategy] = names
  assert documented == {name: set(builder.honours)
                        for name, builder in registry.BUILDERS.items()}
