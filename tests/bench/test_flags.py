"""The benchmarks' command lines: one declaration of each shared flag, and
every documented command parses, each flag landing in its own field.

Only parsers are built here: no benchmark runs.
"""

import ast
import glob
import os
import re

import pytest

from tests.helpers import REPO
from tfmulti.bench import checkpoint_stall
from tfmulti.bench import designs
from tfmulti.bench import e2e
from tfmulti.bench import embedding_transfers
from tfmulti.bench import fit_script
from tfmulti.bench import flags
from tfmulti.bench import flops
from tfmulti.bench import input as bench_input
from tfmulti.bench import pipeline
from tfmulti.bench import plan_calibration
from tfmulti.bench import processes
from tfmulti.bench import schedule_timelines
from tfmulti.bench import sharded
from tfmulti.bench import step_profile
from tfmulti.bench import sync_batch_norm
from tfmulti.bench import table_plan
from tfmulti.bench import tables
from tfmulti.bench import tensor_parallel
from tfmulti.bench import transfers
from tfmulti.bench import unequal_clones

# Each command's module; `python -m tfmulti.bench` runs `designs`.
COMMANDS = {
    'tfmulti.bench': designs,
    'tfmulti.bench.checkpoint_stall': checkpoint_stall,
    'tfmulti.bench.e2e': e2e,
    'tfmulti.bench.embedding_transfers': embedding_transfers,
    'tfmulti.bench.fit_script': fit_script,
    'tfmulti.bench.flops': flops,
    'tfmulti.bench.input': bench_input,
    'tfmulti.bench.pipeline': pipeline,
    'tfmulti.bench.plan_calibration': plan_calibration,
    'tfmulti.bench.processes': processes,
    'tfmulti.bench.schedule_timelines': schedule_timelines,
    'tfmulti.bench.sharded': sharded,
    'tfmulti.bench.step_profile': step_profile,
    'tfmulti.bench.sync_batch_norm': sync_batch_norm,
    'tfmulti.bench.table_plan': table_plan,
    'tfmulti.bench.tables': tables,
    'tfmulti.bench.tensor_parallel': tensor_parallel,
    'tfmulti.bench.transfers': transfers,
    'tfmulti.bench.unequal_clones': unequal_clones,
}
# The shared flags each command takes, with its defaults, as they were
# before they were shared.
SHARED = {
    'tfmulti.bench': dict(model='resnet20', num_clones=2, clone_on_cpu=False,
                          output=None),
    'tfmulti.bench.checkpoint_stall': dict(model='resnet20', output=None),
    'tfmulti.bench.e2e': dict(model='lenet', output=None),
    'tfmulti.bench.embedding_transfers': dict(num_clones=2, output=None),
    'tfmulti.bench.fit_script': dict(model='lenet'),
    'tfmulti.bench.flops': dict(model='resnet20', output=None),
    'tfmulti.bench.input': dict(model='resnet20', num_clones=2,
                                clone_on_cpu=False, output=None),
    'tfmulti.bench.pipeline': dict(model='resnet50', clone_on_cpu=False,
                                   output=None),
    'tfmulti.bench.processes': dict(output=None),
    'tfmulti.bench.schedule_timelines': dict(output=None),
    'tfmulti.bench.sharded': dict(model='resnet50', num_clones=4,
                                  output=None),
    'tfmulti.bench.step_profile': dict(model='lenet', num_clones=2,
                                       clone_on_cpu=False, output=None),
    'tfmulti.bench.sync_batch_norm': dict(model='resnet20', output=None),
    'tfmulti.bench.table_plan': dict(num_clones=4, output=None),
    'tfmulti.bench.tables': dict(num_clones=4, output=None),
    'tfmulti.bench.tensor_parallel': dict(num_clones=4, output=None),
    'tfmulti.bench.transfers': dict(model='resnet50', num_clones=4,
                                    output=None),
    'tfmulti.bench.plan_calibration': dict(model='resnet20', num_clones=4,
                                           output=None),
    'tfmulti.bench.unequal_clones': dict(model='lenet', output=None),
}
# Where argparse refuses a --model outside the registry; the others take
# what their config checks (keras.applications.NAME, MODULE:FUNCTION...).
REGISTERED_ONLY = {'tfmulti.bench', 'tfmulti.bench.pipeline',
                   'tfmulti.bench.step_profile',
                   'tfmulti.bench.unequal_clones'}
REQUIRED = {'tfmulti.bench.fit_script': ['--model_dir=/tmp/fit']}
DOCUMENTS = ['README.md', 'BENCHMARKS.md', 'docs/*.md', 'tfmulti/bench/*.py']
# A command and its flags, `\`-continued lines joined first; a bare mention
# (no flag) is prose, not a command.
COMMAND = re.compile(r'python -m (tfmulti\.bench(?:\.\w+)?)'
                     r'((?:[ \t]+--\w+(?:=[^\s`;]+)?)+)')
LOOP = re.compile(r'for (\w+) in ([^;]+); do')


def _expand(argv, loops):
  """`argv` once for each value of the shell loops' variables it reads."""
  argvs = [argv]
  for var, values in loops:
    if any(f'${var}' in arg for arg in argv):
      argvs = [[arg.replace(f'${var}', value) for arg in argv]
               for argv in argvs for value in values.split()]
  return argvs


def _documented():
  """(command, argv) of every command the documents give."""
  found = []
  for pattern in DOCUMENTS:
    for path in sorted(glob.glob(os.path.join(REPO, pattern))):
      with open(path) as f:
        text = re.sub(r'\\\n\s*', ' ', f.read())
      for line in text.splitlines():
        for name, flags_text in COMMAND.findall(line):
          found += [(name, argv) for argv in _expand(flags_text.split(),
                                                      LOOP.findall(line))]
  return found


def _declarations():
  """{flag: [file of each add_argument('--flag', ...)]} in tfmulti/bench."""
  declared = {}
  for path in sorted(glob.glob(os.path.join(REPO, 'tfmulti', 'bench',
                                            '*.py'))):
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if (isinstance(node, ast.Call)
          and getattr(node.func, 'attr', None) == 'add_argument'
          and isinstance(node.args[0], ast.Constant)):
        declared.setdefault(node.args[0].value, []).append(
            os.path.basename(path))
  return declared


def test_each_shared_flag_is_declared_once_in_flags():
  declared = _declarations()
  for name in flags.NAMES:
    assert declared[f'--{name}'] == ['flags.py'], name


def test_every_command_takes_its_shared_flags_from_flags():
  helps = {}
  for names in (flags.REGISTERED, flags.TRAINABLE, flags.APPLICATIONS):
    parent = flags.shared(model='lenet', model_names=names, num_clones=1,
                          clone_on_cpu=True)
    for action in parent._actions:
      helps.setdefault(action.dest, set()).add(action.help)
  for name, module in COMMANDS.items():
    for action in module.parser()._actions:
      if action.dest in flags.NAMES:
        assert action.help in helps[action.dest], (name, action.dest)


@pytest.mark.parametrize('name', sorted(COMMANDS))
def test_shared_flags_keep_each_commands_defaults(name):
  args = COMMANDS[name].parser().parse_args(REQUIRED.get(name, []))
  assert {f: getattr(args, f) for f in flags.NAMES if hasattr(args, f)
          } == SHARED[name]


@pytest.mark.parametrize('name', sorted(
    name for name, shared in SHARED.items() if 'model' in shared))
def test_model_outside_the_registry_is_refused_where_it_was(name):
  argv = REQUIRED.get(name, []) + ['--model=keras.applications.ResNet50']
  if name in REGISTERED_ONLY:
    with pytest.raises(SystemExit):
      COMMANDS[name].parser().parse_args(argv)
  else:
    args = COMMANDS[name].parser().parse_args(argv)
    assert args.model == 'keras.applications.ResNet50'


def test_the_documents_give_a_command_for_every_benchmark():
  assert {name for name, _ in _documented()} == set(COMMANDS)


@pytest.mark.parametrize('name, argv', _documented(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_each_documented_command_parses_into_its_flags(name, argv):
  args = COMMANDS[name].parser().parse_args(REQUIRED.get(name, []) + argv)
  for flag in argv:
    field, _, value = flag[2:].partition('=')
    parsed = getattr(args, field)
    assert parsed == (type(parsed)(value) if value else True), flag
