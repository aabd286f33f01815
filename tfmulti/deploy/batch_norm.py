"""BatchNorm's moving statistics after a step of several clones or pieces.

Clones (and the micro-batches of a pipelined clone) each compute new moving
statistics from their own rows (`model.stateless_call` returns them); the
step assigns them once, under one of these policies.
"""

import keras
import tensorflow as tf

# Batch-norm moving statistics: which clones' values are kept each step.
BN_CLONE_0 = 'clone_0'  # slim's rule, and what MirroredStrategy reads back.
BN_MEAN = 'mean'  # The mean over clones, weighted by rows (non-float
# state: clone 0's).
# The mean, with each BatchNorm moving variance corrected by the spread of
# the pieces' means: exactly one update from the whole batch's statistics.
BN_FULL_BATCH = 'full_batch'
BATCH_NORM_POLICIES = (BN_CLONE_0, BN_MEAN, BN_FULL_BATCH)


def moments_of(model):
  """[(mean index, variance index, momentum)] of the model's BatchNorm
  layers' moving statistics in `model.non_trainable_variables`."""
  where = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
  return [(where[id(layer.moving_mean)], where[id(layer.moving_variance)],
           layer.momentum)
          for layer in model._flatten_layers()
          if isinstance(layer, keras.layers.BatchNormalization)
          and id(layer.moving_mean) in where]


def combine_non_trainable(clones, policy, moments=()):
  """The non-trainable values to keep after a step, under `policy`.

  Each clone brings one piece of rows, or one a micro-batch. `clone_0`
  keeps clone 0's first piece; `mean` the row-weighted mean of the pieces;
  `full_batch` also adds to each BatchNorm moving variance the spread of
  the pieces' batch means, so the update equals one from the whole batch's
  mean and (biased) variance. `moments` is `moments_of(model)`.
  """
  pieces = [piece for clone in clones for piece in clone.non_trainable]
  if policy == BN_CLONE_0:
    return list(pieces[0][1])
  total = sum(rows for rows, _ in pieces)
  weights = [rows / total for rows, _ in pieces]
  combined = []
  for values in zip(*(values for _, values in pieces)):
    if values[0].dtype.is_floating:
      combined.append(tf.add_n([w * v for w, v in zip(weights, values)]))
    else:  # Random-generator state and counters are not averaged.
      combined.append(values[0])
  if policy == BN_FULL_BATCH:
    for mean_index, variance_index, momentum in moments:
      # A piece's new moving mean is m * momentum + mean_p * (1 - momentum),
      # so mean_p - mean = (new_p - new) / (1 - momentum), and the whole
      # batch's variance is the pieces' mean variance plus the weighted
      # variance of their means.
      spread = tf.add_n([
          w * tf.square(values[mean_index] - combined[mean_index])
          for w, (_, values) in zip(weights, pieces)])
      combined[variance_index] += spread / (1.0 - momentum)
  return combined
