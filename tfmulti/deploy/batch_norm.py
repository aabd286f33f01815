"""BatchNorm's moving statistics after a step of clones or micro-batches.

Clones (and the micro-batches of a pipelined clone) each compute new moving
statistics from their own rows (`model.stateless_call` returns them); the
step assigns them once, under one of these policies.
"""

import tensorflow as tf

from tfmulti import devices
from tfmulti import keras_internals
from tfmulti import step_options


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
