"""Keras's distribution API (`keras.distribution`) read as the towers' config.

A Keras 3 user says where a model trains with
`keras.distribution.set_distribution(keras.distribution.DataParallel(
devices=...))`. On TensorFlow, Keras accepts it and trains on one device
(only JAX's variables and steps consult it). The towers honour it:
`config_for` turns Keras's `DataParallel` (a one-axis mesh) into a
`DeploymentConfig` with one clone a device of the mesh, in the mesh's
order, and a `ModelParallel` into the same clones with its layout map's
variable layouts (`mesh_layouts`): each variable a layout splits is stored
as its shards over the mesh (`sharding`). Every device of the mesh is a
clone with its own rows: the same update, to round-off. Each clone
gathers the shards it computes with; a Dense or convolution kernel split
over an axis other than the batch axis is computed where its blocks live
instead, each block gathered there over the batch axis alone
(`tensor_parallel`), and then a mesh row is one clone spanning its
devices: its leader takes the row's rows, as JAX feeds the rows over the
batch axis alone; a table is looked up where its rows live (`lookups`).
Tensor layouts (a layer's outputs) name how JAX computes, not what is
trained: the towers ignore them, logged (Keras's TensorFlow backend,
which crashed on them, is lent a `distribute_tensor` that returns the
tensor as it is: `keras_internals`).
"""

import keras

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti.deploy.placement import DeploymentConfig
from tfmulti.mesh import mesh_layouts


def config_for(config, workers=None):
  """The `DeploymentConfig` that `config` says: itself; a Keras
  `DataParallel` or `ModelParallel` read (`clones_of`,
  `from_model_parallel`); None, the distribution
  `keras.distribution.set_distribution` set. Across `workers` (a
  `distribute.workers.Workers`), a distribution's mesh is each worker's
  devices, and the config takes this worker's place in the job.

  Raises:
    errors.UserError: no config and no distribution, or one the towers do
      not honour.
  """
  if isinstance(config, DeploymentConfig):
    return config
  distribution = config or keras.distribution.distribution()
  if distribution is None:
    raise errors.ConfigError(
        'no DeploymentConfig and no Keras distribution set: pass '
        'config=deploy.DeploymentConfig(...) or the distribution '
        '(TowersModel(model, distribution)), call keras.distribution.'
        'set_distribution(distribution) first, or make the TowersModel '
        'inside `with distribution.scope():` (a scope ends with its block); '
        'a distribution is a DataParallel or a ModelParallel.')
  keras_internals.lend_distribute_tensor()  # Its output layouts, ignored.
  place = ({} if workers is None or workers.strategy is None else
           dict(replica_id=workers.index, num_replicas=workers.num_workers))
  if isinstance(distribution, keras.distribution.ModelParallel):
    return from_model_parallel(distribution, **place)
  if not isinstance(distribution, keras.distribution.DataParallel):
    raise errors.ConfigError(
        f'config={distribution!r}: pass a DeploymentConfig, a '
        'keras.distribution.DataParallel or a ModelParallel.')
  return DeploymentConfig(**clones_of(distribution), **place)


def from_model_parallel(distribution, plan_tables=False,
                        strict_layout_map=False, keep_joins=False,
                        gather_ahead=mesh_layouts.GATHER_AHEAD, **place):
  """One clone a device of `distribution`'s mesh (`clones_of`), its
  variables laid out by its layout map; with `plan_tables`, each plain
  Embedding table it does not name laid out by `table_plan`; with
  `strict_layout_map`, a key matching no variable an error; with
  `keep_joins`, each variable joined for the pass kept through the step,
  else gathered `gather_ahead` layers early (`mesh_layouts.
  VariableLayouts`). `place`: the worker's (`replica_id`,
  `num_replicas`) across workers."""
  return DeploymentConfig(
      **clones_of(distribution), **place,
      variable_layouts=mesh_layouts.from_keras(
          distribution, plan_tables=plan_tables,
          strict_layout_map=strict_layout_map, keep_joins=keep_joins,
          gather_ahead=gather_ahead))


def clones_of(distribution):
  """One clone a device of `distribution`'s mesh: devices 'cpu:0' to
  'cpu:N-1' (logical CPUs, `clone_on_cpu`) or 'gpu:0' to 'gpu:N-1', in
  the mesh's row-major order, as clone i runs on device i."""
  names = [str(d) for d in distribution.device_mesh.devices.flatten()]
  kinds = {name.split(':')[-2].split('/')[-1].lower() if ':' in name
           else None for name in names}
  kind = kinds.pop() if len(kinds) == 1 else None
  if kind not in ('cpu', 'gpu') or [
      name.split(':')[-1] for name in names] != [
          str(i) for i in range(len(names))]:
    raise errors.ConfigError(
        f'{type(distribution).__name__}(devices={names}): the towers run '
        'clone i on device '
        f"i; give one kind's devices from 0 in order: cpu:0, cpu:1, ... or "
        'gpu:0, gpu:1, ...')
  return dict(num_clones=len(names), clone_on_cpu=kind == 'cpu')
