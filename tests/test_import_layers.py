"""The folders are the layers: every import points down, never across.

  bench/         the benchmarks, which run both front doors
  cli, launch    the command line
  train/ | fit/  the command line's job | Keras's door: never each other
  engine/        what both doors run: the registry, N steps a call,
                 checkpoints
  plan/          a built step read before it runs: dry run, peaks, traffic
  deploy/ | distribute/   the towers | the tf.distribute paths
  mesh/          a mesh's storage and split compute, from Keras's layouts
  pipeline/ | data/ | models/   stages | input pipelines | models
  the ground floor (tfmulti/*.py)

Read from the source with `ast`, so a new import that points up (or joins
deploy and distribute) fails here before it tangles the graph.
"""

import ast
import os

from tests.helpers import REPO

PACKAGE = os.path.join(REPO, 'tfmulti')
# The floor of each folder (and of the command line); a module may import
# its own folder and any lower floor.
FLOORS = {'': 0, 'models': 1, 'pipeline': 1, 'data': 1, 'mesh': 2,
          'deploy': 3, 'distribute': 3, 'plan': 4, 'engine': 5, 'train': 6,
          'fit': 6, 'cli': 7, 'launch': 7, 'compare': 7, 'bench': 8}


def _part(module):
  """The folder (or 'cli') of a dotted module under tfmulti."""
  parts = module.split('.')[1:]
  return parts[0] if parts and parts[0] in FLOORS else ''


def _modules():
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        relative = os.path.relpath(path, REPO)[:-3].replace(os.sep, '.')
        yield relative.removesuffix('.__init__'), path


def _imports(path):
  """The tfmulti modules `path` imports (`from tfmulti.x import y` names
  tfmulti.x.y when y is a module)."""
  tree = ast.parse(open(path).read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [f'{node.module}.{alias.name}' for alias in node.names]
      names = [n if _is_module(n) else node.module for n in names]
    else:
      continue
    yield from (n for n in names if n.split('.')[0] == 'tfmulti')


def _is_module(dotted):
  path = os.path.join(REPO, *dotted.split('.'))
  return os.path.isdir(path) or os.path.exists(path + '.py')


def test_every_import_points_down_or_within_its_folder():
  upward = []
  for module, path in _modules():
    mine = _part(module)
    for imported in _imports(path):
      theirs = _part(imported)
      if theirs != mine and FLOORS[theirs] >= FLOORS[mine]:
        upward.append(f'{module} imports {imported}')
  assert not upward, upward


def test_deploy_and_distribute_never_import_each_other():
  crossing = [
      f'{module} imports {imported}'
      for module, path in _modules() if _part(module) in ('deploy',
                                                          'distribute')
      for imported in _imports(path)
      if {_part(module), _part(imported)} == {'deploy', 'distribute'}]
  assert not crossing, crossing


def test_the_layers_are_read_from_the_real_imports():
  # The reader above must see the imports it judges, or it proves nothing.
  job = dict(_modules())['tfmulti.train.job']
  assert 'tfmulti.engine.registry' in set(_imports(job))
  assert _part('tfmulti.deploy.towers') == _part('tfmulti.deploy') == 'deploy'
  assert _part('tfmulti.errors') == '' and _part('tfmulti.cli') == 'cli'


# The ground floor's own order: the errors, the moved names' table and
# the one reader of Keras's and TensorFlow's private names, then the
# layout (pure: no TensorFlow) and the devices a dry run plans, then the
# step options, the device strings and the sparse gradients' rules, then
# what cuts tensors, then the trainer contract, then the piece body every
# path runs.
GROUND = {'errors': 0, 'moved': 0, 'keras_internals': 0, 'env': 0,
          'layouts': 1,
          'native_logs': 1, 'stops': 1, 'digits': 1, 'tf_config': 1,
          'plans': 1, 'device_kinds': 1, 'phases': 1, 'step_options': 2,
          'devices': 2, 'slices': 2,
          'rows': 3, 'trainer': 4, 'pieces': 5}


def test_the_ground_floor_imports_in_its_order():
  ground = {module: path for module, path in _modules()
            if module.count('.') == 1 and _part(module) == ''
            and module.split('.')[1] not in FLOORS}
  assert set(m.split('.')[1] for m in ground) == set(GROUND)
  sideways = [
      f'{module} imports {imported}'
      for module, path in ground.items() for imported in _imports(path)
      if GROUND[imported.split('.')[1]] >= GROUND[module.split('.')[1]]]
  assert not sideways, sideways


def test_each_package_map_lists_every_module_of_its_folder():
  """The maps in the folders' __init__ docstrings name what is there."""
  unlisted = []
  for folder in ('deploy', 'mesh', 'plan', 'bench', 'pipeline', 'fit',
                 'train', 'distribute', 'engine'):
    path = os.path.join(PACKAGE, folder)
    doc = ast.get_docstring(ast.parse(open(os.path.join(
        path, '__init__.py')).read()))
    unlisted += [f'{folder}/{name}' for name in os.listdir(path)
                 if name.endswith('.py') and name != '__init__.py'
                 and name[:-3] not in doc and name != '__main__.py']
  assert not unlisted, unlisted
