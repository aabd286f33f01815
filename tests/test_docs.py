"""The documents say what the code does: the flags table is the CLI's, the
Kubernetes manifest runs the installed command line the tests run."""

import configparser
import os
import re

from absl import flags

from tests.helpers import indexed_job_flags
from tests.helpers import INDEXED_JOB_MANIFEST
from tests.helpers import manifest_command
from tests.helpers import REPO
from tfmulti import cli
from tfmulti import step_options
from tfmulti.engine import registry

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
