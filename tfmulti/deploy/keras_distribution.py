"""Keras's distribution API (`keras.distribution`) read as the towers' config.

A Keras 3 user says where a model trains with
`keras.distribution.set_distribution(keras.distribution.DataParallel(
devices=...))`. On TensorFlow, Keras accepts it and trains on one device
(only JAX's variables and steps consult it). The towers honour it:
`config_for` turns Keras's `DataParallel` (a one-axis mesh) into a
`DeploymentConfig` with one clone a device of the mesh, in the mesh's
order. `ModelParallel`'s layouts (variables sharded over a mesh) are not
honoured yet: refused in one line, never trained as something else.
"""

import keras

from tfmulti import errors
from tfmulti.deploy.placement import DeploymentConfig


def config_for(config):
  """The `DeploymentConfig` that `config` says: itself; a Keras
  `DataParallel` read (`from_data_parallel`); None, the distribution
  `keras.distribution.set_distribution` set.

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
        'config=deploy.DeploymentConfig(...), or call keras.distribution.'
        'set_distribution(keras.distribution.DataParallel(devices=...)) '
        'first.')
  if isinstance(distribution, keras.distribution.ModelParallel):
    raise errors.UnsupportedError(
        f'{distribution}: the towers do not shard variables by a layout '
        'map yet; use keras.distribution.DataParallel, or a '
        'DeploymentConfig with spread variables.')
  if not isinstance(distribution, keras.distribution.DataParallel):
    raise errors.ConfigError(
        f'config={distribution!r}: pass a DeploymentConfig or a '
        'keras.distribution.DataParallel.')
  return from_data_parallel(distribution)


def from_data_parallel(distribution):
  """One clone a device of `distribution`'s mesh: devices 'cpu:0' to
  'cpu:N-1' (logical CPUs, `clone_on_cpu`) or 'gpu:0' to 'gpu:N-1', in
  that order, as clone i runs on device i."""
  names = [str(d) for d in distribution.device_mesh.devices.flatten()]
  kinds = {name.split(':')[-2].split('/')[-1].lower() for name in names}
  kind = kinds.pop() if len(kinds) == 1 else None
  if kind not in ('cpu', 'gpu') or [
      name.split(':')[-1] for name in names] != [
          str(i) for i in range(len(names))]:
    raise errors.ConfigError(
        f'DataParallel(devices={names}): the towers run clone i on device '
        f"i; give one kind's devices from 0 in order: cpu:0, cpu:1, ... or "
        'gpu:0, gpu:1, ...')
  return DeploymentConfig(num_clones=len(names), clone_on_cpu=kind == 'cpu')
