"""BatchNorm's moving statistics after a step of clones or micro-batches.

Clones (and the micro-batches of a pipelined clone) each compute new moving
statistics from their own rows (`model.stateless_call` returns them); the
step assigns them once, under one of these policies.

A model's own synchronized BatchNorm (Keras's `synchronized=True`) is
honoured: its statistics come from the whole batch, as the clones run in
lockstep (`honoured`).
"""

import dataclasses

from absl import logging
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import step_options


def honoured(model, options):
  """`options`, with `sync_batch_norm=True` where the model's own
  BatchNormalization layers are synchronized (`synchronized=True`, which
  Keras reads in a replica context: the clones then run in lockstep, each
  layer's statistics over the whole batch, as the user asked).

  Raises:
    errors.ConfigError: some layers synchronized and others not; the
      lockstep clones synchronize every one.
  """
  layers = keras_internals.batch_norms(model)
  synchronized = [layer.name for layer in layers if layer.synchronized]
  if not synchronized or options.sync_batch_norm:
    return options
  if len(synchronized) < len(layers):
    others = [layer.name for layer in layers if not layer.synchronized]
    raise errors.ConfigError(
        f'model {model.name!r} synchronizes BatchNormalization '
        f'{", ".join(synchronized)} but not {", ".join(others)}: the '
        'clones synchronize all of them or none; set synchronized=True on '
        'every one (or on none).')
  logging.info('%s: BatchNormalization synchronized=True: the clones run '
               'in lockstep (sync_batch_norm=True).', model.name)
  return dataclasses.replace(options, sync_batch_norm=True)


def check_honoured(model, options):
  """Raises `ConfigError` where the model's own synchronized BatchNorm
  would not be synchronized by these options (`honoured` gives them)."""
  if honoured(model, options) is not options:
    raise errors.ConfigError(
        f'model {model.name!r} has BatchNormalization(synchronized=True): '
        'its statistics need the clones in lockstep; pass '
        'sync_batch_norm=True (--sync_batch_norm).')


def moments_of(model):
  """[(mean index, variance index, momentum)] of the model's BatchNorm
  layers' moving statistics in `model.non_trainable_variables`."""
  where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
  return [(where[id(layer.moving_mean)], where[id(layer.moving_variance)],
           layer.momentum)
          for layer in keras_internals.batch_norms(model)
          if id(layer.moving_mean) in where]


def combine_non_trainable(clones, policy, moments=(), owners=None):
  """The non-trainable values to keep after a step, under `policy`.

  Each clone brings its shard's values, or one set a micro-batch. `clone_0`
  keeps clone 0's first; `mean` the row-weighted mean of them all;
  `full_batch` also adds to each BatchNorm moving variance the spread of
  their batch means, so the update equals one from the whole batch's
  mean and (biased) variance. `moments` is `moments_of(model)`; `owners`,
  where each value is made (its variable's owner; None: here).
  """
  places = owners or [None] * len(clones[0].non_trainable[0][1])
  parts = [part for clone in clones for part in clone.non_trainable]
  if policy == step_options.BN_CLONE_0:
    return list(parts[0][1])
  total = sum(rows for rows, _ in parts)
  weights = [rows / total for rows, _ in parts]
  combined = []
  for values, place in zip(zip(*(values for _, values in parts)), places):
    if values[0].dtype.is_floating:
      combined.append(devices.on(
          place, tf.add_n, [w * v for w, v in zip(weights, values)]))
    else:  # Random-generator state and counters are not averaged.
      combined.append(values[0])
  if policy == step_options.BN_FULL_BATCH:
    for mean_index, variance_index, momentum in moments:
      # A part's new moving mean is m * momentum + mean_p * (1 - momentum),
      # so mean_p - mean = (new_p - new) / (1 - momentum), and the whole
      # batch's variance is the parts' mean variance plus the weighted
      # variance of their means.
      combined[variance_index] = devices.on(
          places[variance_index], _add_spread, combined[variance_index],
          [values[mean_index] for _, values in parts],
          combined[mean_index], weights, momentum)
  return combined


def _add_spread(variance, means, mean, weights, momentum):
  """`variance` plus the weighted spread of the parts' `means` about
  `mean`, in moving-statistic units."""
  spread = tf.add_n([w * tf.square(m - mean) for w, m in zip(weights, means)])
  return variance + spread / (1.0 - momentum)
