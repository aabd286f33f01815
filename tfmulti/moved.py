"""Public names that moved, and the one way their old places keep working.

A name a user imported keeps importing from where it was, with a
`DeprecationWarning` naming its new place (as TensorFlow and Keras keep
theirs), so a move never breaks a user's script on the day it lands.
`MOVED` is the list (old dotted name -> new dotted name); a package whose
old attribute moved answers through `attribute(package, name)` in its
`__getattr__`, and a moved module's old file is `module(__name__)`. The new
place is imported only when the old name is used, so an alias may point
up the layers without the package importing it.
"""

import importlib
import sys
import warnings

MOVED = {
    'tfmulti.deploy.TowersModel': 'tfmulti.fit.TowersModel',
    'tfmulti.train.registry': 'tfmulti.engine.registry',
    'tfmulti.train.step_calls': 'tfmulti.engine.step_calls',
    'tfmulti.train.checkpoints': 'tfmulti.engine.checkpoints',
    'tfmulti.deploy.sharding': 'tfmulti.mesh.sharding',
    'tfmulti.deploy.shard_views': 'tfmulti.mesh.shard_views',
    'tfmulti.deploy.tensor_parallel': 'tfmulti.mesh.tensor_parallel',
    'tfmulti.deploy.mesh_layouts': 'tfmulti.mesh.mesh_layouts',
    'tfmulti.deploy.lookups': 'tfmulti.mesh.lookups',
    'tfmulti.deploy.table_plan': 'tfmulti.mesh.table_plan',
    'tfmulti.deploy.dry_run': 'tfmulti.plan.dry_run',
    'tfmulti.deploy.peaks': 'tfmulti.plan.peaks',
    'tfmulti.deploy.traffic': 'tfmulti.plan.traffic',
}


def _warn(old, new):
  warnings.warn(f'{old} moved to {new}; import it from there (the old '
                'name will be removed).', DeprecationWarning, stacklevel=3)


def resolve(dotted):
  """The object at `dotted` (a module, or a module's attribute)."""
  try:
    return importlib.import_module(dotted)
  except ModuleNotFoundError:
    parent, _, name = dotted.rpartition('.')
    return getattr(importlib.import_module(parent), name)


def attribute(package, name):
  """`package`'s moved attribute `name`, with the warning; raises
  `AttributeError` for a name that never was there (a module's
  `__getattr__` contract)."""
  old = f'{package}.{name}'
  if old not in MOVED:
    raise AttributeError(f'module {package!r} has no attribute {name!r}')
  _warn(old, MOVED[old])
  return resolve(MOVED[old])


def module(old):
  """Makes the module `old` (a moved module's former file, importing this)
  its new module, with the warning: `sys.modules` then hands the new one
  to every import of the old name."""
  _warn(old, MOVED[old])
  sys.modules[old] = importlib.import_module(MOVED[old])
