"""Helpers of the tests of split layers computed as blocks
(`tensor_parallel`): a Keras `ModelParallel` over logical CPUs, plain
`fit`, and the clone whose rows a traced product takes."""

import re

import keras
import numpy as np
import tensorflow as tf

from tfmulti import plans
from tfmulti.deploy import placement
from tfmulti.plan import dry_run


def parallel(layouts, shape=(2, 2), names=('batch', 'model')):
  """Keras's `ModelParallel` of `layouts` ({key: axes}) on a mesh of
  `shape` with axes `names` (the first the batch's) of logical CPUs."""
  mesh = keras.distribution.DeviceMesh(
      shape, list(names), keras.distribution.list_devices()[:int(
          np.prod(shape))])
  layout_map = keras.distribution.LayoutMap(mesh)
  for key, axes in layouts.items():
    layout_map[key] = axes
  return keras.distribution.ModelParallel(layout_map=layout_map,
                                          batch_dim_name=names[0])


OPTIMIZERS = {'adam': lambda: keras.optimizers.Adam(0.01),
              'sgd': lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              'adagrad': lambda: keras.optimizers.Adagrad(0.1)}


def fit_model(model, data, epochs=2, optimizer='adam', **options):
  """`model`'s losses of plain `fit` on `data` in batches of 16, rows
  in order, with the optimizer named."""
  model.compile(optimizer=OPTIMIZERS[optimizer](),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model.fit(*data, batch_size=16, epochs=epochs, shuffle=False,
                   verbose=0, **options).history['loss']


def clone_of(rows):
  """The clone whose ops made `rows` (a tensor): the clone named in the
  op's scope, or else in its consumers'."""
  names = [rows.op.name] + [op.name for op in rows.consumers()]
  return next(int(m[1]) for name in names
              if (m := re.search(r'(?:^|/)clone_(\d+)/', name)))


def planned_on_gpus(layouts, make_model, data, make_optimizer=None):
  """{GPU: its `dry_run.DeviceReport`} of the step of `make_model()` under
  `layouts` (a `VariableLayouts`) on `data`, traced for as many GPUs as
  the mesh has devices (none here: `plans.planning`), with Adam (or
  `make_optimizer()`) made where the config puts optimizer variables."""
  config = placement.DeploymentConfig(num_clones=layouts.num_devices,
                                      variable_layouts=layouts)
  with plans.planning():
    model = make_model()
    with tf.device(config.optimizer_variables_device()):
      optimizer = (make_optimizer or keras.optimizers.Adam)()
    found = dry_run.plan(config, model, keras.losses.
                         SparseCategoricalCrossentropy(from_logits=True),
                         optimizer, *data)
  return {d: r for d, r in found.devices.items() if 'GPU' in d}
