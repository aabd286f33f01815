"""Slim's clone building blocks: the clones and their sum.

`split_batch` cuts a batch into the clones' shards by the step's layout;
`create_clones` runs each clone's forward pass, loss and gradient on its
own device and shard (whatever its runner: whole, in lockstep, in
stages); `optimize_clones` sums them. `deploy.DeployedModel` builds its
step from these; they are also there for writing one's own loop, as in
slim.
"""

import collections
import contextlib

import tensorflow as tf

from tfmulti import devices
from tfmulti import pieces
from tfmulti import slices
from tfmulti.deploy import feeds
from tfmulti.deploy import packs as packs_lib

# A clone's share of one step (slim: Clone(outputs, scope, device)).
# `loss` is the clone's part of the total loss (its mean loss weighted by
# its share of the global batch, plus its part of the regularization);
# `gradients` are d loss / d trainable variable, computed on `device`;
# `non_trainable` is a list of (rows, values): the model's non-trainable
# variables as the forward pass of the clone's shard (or of each of its
# micro-batches) left them.
Clone = collections.namedtuple(
    'Clone', ['outputs', 'loss', 'regularization_loss', 'gradients',
              'non_trainable', 'scope', 'device'])


@contextlib.contextmanager
def on_clone(config, clone_index):
  """Places ops on the clone's device, under its name scope: slim's
  (none for one clone) or 'clone', as a layer named with a leading '_'
  may not open a name scope at the root."""
  scope = config.clone_scope(clone_index) or 'clone'
  with tf.device(config.clone_device(clone_index)), tf.name_scope(scope):
    yield


def split_batch(config, nest, layout, worker=0):
  """The clones' shards of a batch (a nest of `worker`'s rows), cut by
  `layout` on the inputs device: a tuple, one nest a clone, each the
  clone's rows of every accumulation step in order (what the input feed
  prefetches, `feeds.clone_parts`)."""
  with tf.device(config.inputs_device()), tf.name_scope('split_batch'):
    return feeds.clone_parts(nest, layout, worker)


def placed(config, nest, layout, worker):
  """`nest` itself: the shards a feed already cut by `layout` and placed
  on the clones (`split_batch`'s other half)."""
  del config, layout, worker  # The feed applied them.
  return nest


def values_of(variables):
  """The variables' current values, read on the current device."""
  return [tf.convert_to_tensor(v) for v in variables]


def create_clones(config, runner, images, labels, *, layout,
                  accumulation_step=0, terms=None):
  """Runs every clone on its device and its shard of an accumulation step.

  Args:
    config: a `DeploymentConfig`.
    runner: what each clone runs (`runners`: whole clones, lockstep
      clones, or stages), over a model whose variables live on
      `config.variable_devices()`.
    images: a tuple, one nest a clone: its rows of the accumulation step
      (`split_batch` cuts a batch so; a feed prefetches them).
    labels: their targets, as many rows (a tuple of nests).
    layout: the step's `layouts.StepLayout`.
    accumulation_step: whose pieces these rows are, in `layout`.
    terms: the step's `pieces.StepTerms`; None for the layout's rows alone
      (no loss scale, no shift).

  Returns:
    A list of `Clone`, one per clone with rows (an empty clone of a short
    batch runs nothing and adds nothing).
  """
  worker = config.worker_index
  clone_pieces = [layout.of(worker, accumulation_step, c)
                  for c in range(config.num_clones)]
  results = runner.run(clone_pieces, images, labels,
                       terms or pieces.StepTerms(layout.global_rows))
  clones = []
  for i, (result, mine) in enumerate(zip(results, clone_pieces)):
    if result is None:
      continue
    *result, states = result
    part_rows = [p.rows for p in mine if p.rows]
    clones.append(Clone(*result, list(zip(part_rows, states)),
                        scope=config.clone_scope(i),
                        device=config.clone_device(i)))
  return clones


def optimize_clones(clones, variables, owners=None, packs=()):
  """Sums the clones' losses and gradients on the current device.

  Call it under `tf.device(config.optimizer_device())`.

  Args:
    clones: the list `create_clones` returned.
    variables: the trainable variables, in the order of the gradients.
    owners: where each variable's gradients are summed (one device a
      variable: `config.owner_device`); None for the current device.
    packs: groups of variable indices whose gradients travel and are
      summed as one tensor each (`packs.groups`; needs `owners`).

  Returns:
    (total_loss, grads_and_vars), skipping variables that no clone reached.
  """
  with tf.name_scope('optimize_clones'):
    total_loss = tf.add_n([clone.loss for clone in clones], name='total_loss')
    summed = {}
    for group in packs:
      sums = packs_lib.sum_packed([c.gradients for c in clones], group,
                                  owners[group[0]])
      summed.update(zip(group, sums or ()))
    grads_and_vars = []
    for k, variable in enumerate(variables):
      grads = [c.gradients[k] for c in clones if c.gradients[k] is not None]
      if k in summed:
        grads_and_vars.append((summed[k], variable))
      elif grads:
        grads_and_vars.append((devices.on(
            owners[k] if owners else None, slices.add, grads,
            name='sum_gradients'), variable))
  return total_loss, grads_and_vars
