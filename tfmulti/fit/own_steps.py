"""A model's own steps across the towers' clones, as tf.distribute runs them.

A Keras model may bring its own `train_step` (keras.io's trainer pattern,
the TensorFlow guide "Customizing what happens in fit()", a GAN or a VAE
with two optimizers), its own `test_step`, or its own `compute_loss` under
Keras's steps. `TowersModel` then runs the model's step itself on every
clone's shard of a batch, in turn on threads (`in_turn`), as tf.distribute
runs it in each replica:

* `compile` is the model's own (a GAN's takes its two optimizers): the
  model is compiled with the arguments `TowersModel.compile` got.
* Every update the step makes meets the other clones' same update: each
  variable's gradients summed beside it, each clone's weighted by its
  share of the batch's rows (the step differentiates a mean over its rows,
  as Keras's losses and `ops.mean` give), slices joined (a fixed lookup's
  summed, `slices.collapsed`), then one `apply`; the clones go on reading
  the updated variables.
* The metrics the step updates see every clone's rows (each clone updates
  them in turn); the logs are the last clone's, after every clone's
  updates.

Exact to plain `fit` where the step is (no random draws, no BatchNorm in
training, a loss that is a mean over rows). What cannot be honoured is
refused in one line when `TowersModel` is built (`check`).
"""

import functools

import keras
import tensorflow as tf

from tfmulti import devices
from tfmulti import errors
from tfmulti import layouts
from tfmulti import rows
from tfmulti import slices
from tfmulti import step_options
from tfmulti.fit import in_turn

_STEPS = ('train_step', 'test_step', 'compute_loss')


def own_steps(model):
  """The names of the steps `model`'s class brings of its own (none for
  what is no Keras model: `TowersModel` refuses it in one line)."""
  if not isinstance(model, keras.Model):
    return []
  return [name for name in _STEPS
          if getattr(type(model), name) is not getattr(keras.Model, name)]


def check(model, config, options, workers):
  """Raises `UserError` for what a model's own step cannot run with:
  several workers (`workers`, what `workers.start()` gave), stages, or a
  step option that cuts a clone or its rows unevenly."""
  mine = ', '.join(own_steps(model))
  if config.num_stages > 1:
    raise errors.UnsupportedError(
        f'num_stages={config.num_stages}: model {model.name!r} has its own '
        f'{mine}, which runs whole on each clone; use num_stages=1.')
  if config.variable_layouts is not None:
    raise errors.UnsupportedError(
        f'model {model.name!r} has its own {mine}, which reads and updates '
        'whole variables: variable layouts are not honoured there; leave '
        'them unset (keras.distribution.DataParallel).')
  if workers is not None and workers.strategy is not None:
    raise errors.UnsupportedError(
        f'model {model.name!r} has its own {mine}: across workers it is '
        'not run yet; fit it in one process (workers=None).')
  defaults = step_options.StepOptions()
  others = {name: getattr(options, name) for name in (
      'num_microbatches', 'accumulation_steps', 'reproducible_rows',
      'sync_batch_norm', 'clone_shares')
            if getattr(options, name) != getattr(defaults, name)}
  if others or options.xla is True:
    named = ', '.join(f'{k}={v}' for k, v in others.items()) or 'xla=True'
    raise errors.UnsupportedError(
        f'{named}: model {model.name!r} has its own {mine}, which runs '
        'whole on equal clones; drop the option, or train with Keras\'s '
        'own steps.')


def check_callbacks(model, callbacks):
  """Raises `UnsupportedError` for a BackupAndRestore: its backup would
  not hold every optimizer a model's own step may update."""
  if any(isinstance(c, keras.callbacks.BackupAndRestore)
         for c in callbacks or ()):
    raise errors.UnsupportedError(
        f'BackupAndRestore: model {model.name!r} has its own steps, whose '
        'optimizers its backup would not hold; save with ModelCheckpoint '
        'instead.')


class OwnSteps:
  """The model's own steps on `config`'s clones (see the module)."""

  def __init__(self, model, config):
    self.model = model
    self.config = config
    self._train = tf.function(functools.partial(
        self._in_turn, 'train_step'), autograph=False)
    self._test = tf.function(functools.partial(
        self._in_turn, 'test_step'), autograph=False)

  def compile(self, args, kwargs):
    """The model's own `compile`, with `TowersModel.compile`'s
    arguments, its optimizers made beside the variables."""
    if kwargs.get('steps_per_execution', 1) != 1:
      raise errors.UnsupportedError(
          f'steps_per_execution={kwargs["steps_per_execution"]}: model '
          f'{self.model.name!r} has its own steps, one a call; drop it.')
    with tf.device(self.config.optimizer_variables_device()):
      self.model.compile(*args, **kwargs)

  @property
  def metrics(self):
    return self.model.metrics

  def train_step(self, data):
    return self._train(data)

  def test_step(self, data):
    return self._test(data)

  def _in_turn(self, name, data):
    """The model's step `name` on each clone's rows of `data`, in turn:
    the last clone's logs."""
    total = rows.batch_rows(data, None)
    sizes = layouts.even_parts(total, self.config.num_clones)
    with tf.device(self.config.inputs_device()):
      shards = rows.split(data, sizes)
    live = [i for i, size in enumerate(sizes) if size]
    # A step the user compiled runs as its Python: traced here, per clone.
    step = getattr(self.model, name)
    step = getattr(step, 'python_function', step)
    weights = [sizes[i] / total for i in live]
    optimizers = in_turn.optimizers_of(self.model)
    with in_turn.meetings(optimizers):
      results = in_turn.run(
          [functools.partial(step, shards[i]) for i in live],
          [self.config.clone_device(i) for i in live],
          [self.config.clone_scope(i) or 'clone' for i in live],
          functools.partial(self._meet, weights))
    return results[-1]

  def _meet(self, weights, optimizer, requests):
    """One update of `optimizer` from every clone's (grads, variables):
    each variable's gradients weighted by the clones' shares and summed
    beside it, then applied once."""
    variables = requests[0][1]
    summed = []
    for k, variable in enumerate(variables):
      parts = [(w, grads[k]) for w, (grads, _) in zip(weights, requests)
               if grads[k] is not None]
      owner = self.config.owner_device(devices.device_of(variable))
      summed.append(devices.on(owner, _weighted_sum, parts) if parts
                    else None)
    with tf.device(self.config.optimizer_variables_device()):
      return in_turn.apply(optimizer, summed, variables)


def _weighted_sum(parts):
  """Σ weight x gradient over the clones' (weight, gradient) `parts`:
  slices joined with their values weighted (a fixed lookup's copies of a
  row summed, as one device gives one), dense ones added."""
  if all(slices.is_sparse(g) for _, g in parts):
    joined = slices.concat([tf.IndexedSlices(
        g.values * tf.cast(w, g.values.dtype), g.indices, g.dense_shape)
                            for w, g in parts])
    fixed = slices.fixed_rows(parts[0][1].indices)
    return slices.collapsed(joined) if fixed else joined
  return tf.add_n([tf.convert_to_tensor(g) * tf.cast(w, g.dtype)
                   for w, g in parts])

