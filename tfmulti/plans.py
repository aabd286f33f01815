"""Devices a job is planned for that this machine does not have.

A dry run (`plan.dry_run`) builds a job for GPUs absent here. Inside
`planning()`, a variable made under `tf.device` of an absent device is made
on the host, and its planned device is remembered by its handle:
`devices.device_of` and `devices.GraphPlacement` read it, so every choice
the towers make from where a variable lives (its gradient sum, its update,
its slots' owner) and every count read from the traced graph follow the
plan. Nothing runs on the absent devices; the step is only traced.
"""

import contextlib

import tensorflow as tf

from tfmulti import keras_internals

HOST = '/device:CPU:0'
_PLANNED = {}  # id(a variable's handle) -> (the handle, its device).
_ACTIVE = []  # The absent devices' names while planning.


def active():
  """Whether a plan is being made (`planning`)."""
  return bool(_ACTIVE)


def planned_device(handle):
  """The planned device of the variable whose handle is `handle`, or None
  for one that lives where it was made."""
  entry = _PLANNED.get(id(handle))  # The handle kept: its id not reused.
  return entry[1] if entry and entry[0] is handle else None


def plan(variable, device):
  """Records `device` as where `variable` (a `tf.Variable`) is planned."""
  _PLANNED[id(variable.handle)] = (variable.handle, device)


def plan_slots(optimizer):
  """Each slot of `optimizer` planned beside its variable, where it is
  planned (Keras makes a slot beside the variable as it lives: on the
  host, while planning). Nothing outside a plan."""
  if not active():
    return
  variables = keras_internals.trainable_variables_of(optimizer)
  for slots in keras_internals.slot_lists(optimizer).values():
    for slot, variable in zip(slots, variables):
      handle = keras_internals.storage(variable).handle
      device = planned_device(handle)
      if device is not None:
        plan(keras_internals.storage(slot), device)


def absent(device):
  """Whether `device` names no device of this runtime."""
  wanted = tf.DeviceSpec.from_string(device)
  return not any(
      tf.DeviceSpec.from_string(have.name).device_type == wanted.device_type
      and tf.DeviceSpec.from_string(have.name).device_index ==
      wanted.device_index for have in tf.config.list_logical_devices())


@contextlib.contextmanager
def on_the_host_if_absent():
  """Inside, an op run now on an absent device runs on the host (soft
  placement), for objects that make their own tensors as they are made on
  the devices they are given (a `MirroredStrategy`'s collectives' ordering
  tokens); the step's traced ops keep their planned devices."""
  was = tf.config.get_soft_device_placement()
  tf.config.set_soft_device_placement(True)
  try:
    yield
  finally:
    tf.config.set_soft_device_placement(was)


@contextlib.contextmanager
def planning():
  """Inside, variables made on absent devices are made on the host with
  their device planned (see the module); on exit the plan is forgotten."""
  def creator(next_creator, **kwargs):
    device = keras_internals.current_device()
    if not device or not absent(device):
      return next_creator(**kwargs)
    with tf.device(HOST):
      variable = next_creator(**kwargs)
    plan(variable, device)
    return variable
  _ACTIVE.append(True)
  try:
    with tf.variable_creator_scope(creator):
      yield
  finally:
    _ACTIVE.pop()
    if not _ACTIVE:
      _PLANNED.clear()
