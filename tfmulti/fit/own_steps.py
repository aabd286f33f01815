"""A model's own steps across the towers' clones: run once, split by rows.

A Keras model may bring its own `train_step` (keras.io's trainer pattern,
the TensorFlow guide "Customizing what happens in fit()", a GAN or a VAE
with two optimizers), its own `test_step`, or its own `compute_loss` under
Keras's steps. `TowersModel` then runs the model's step once a batch, on
the whole batch, as one device runs it, and computes the layers the step
calls by rows on the clones (`rows_split`):

* `compile` is the model's own (a GAN's takes its two optimizers): the
  model is compiled with the arguments `TowersModel.compile` got, its
  optimizers made beside the variables.
* The step's Python, its losses and its metrics see the whole batch; each
  update it makes (through any optimizer, wherever the model holds it,
  inside any `tf.function` helper) is made once, from gradients each
  clone computed for its rows on its device and summed beside each
  variable. Clone shares give each clone its share of every call's rows.

Exact to plain `fit` to round-off where the layers' rows are independent
(no random draws, no BatchNorm in training: each clone's batch
statistics would be its rows'). What cannot be honoured is refused in
one line: when `TowersModel` is built (`check`), at `compile`, or when a
layer's call cannot be split by rows (`rows_split`).
"""

import functools

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import step_options
from tfmulti.fit import rows_split

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
  several workers (`workers`, what `workers.start()` gave), stages,
  layouts, or a step option that needs the towers' own step: its
  accumulation steps, atoms, lockstep clones or measured shares."""
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
  trained = [layer.name for layer in keras_internals.batch_norms(model)
             if layer.trainable]
  if trained and config.num_clones > 1:
    raise errors.UnsupportedError(
        f'model {model.name!r} has its own {mine} and a BatchNormalization '
        f'in training ({trained[0]!r}): each clone would normalize its own '
        'rows; freeze it (trainable=False), or use num_clones=1.')
  if workers is not None and workers.strategy is not None:
    raise errors.UnsupportedError(
        f'model {model.name!r} has its own {mine}: across workers it is '
        'not run yet; fit it in one process (workers=None).')
  defaults = step_options.StepOptions()
  others = {name: getattr(options, name) for name in (
      'num_microbatches', 'accumulation_steps', 'reproducible_rows',
      'sync_batch_norm')
            if getattr(options, name) != getattr(defaults, name)}
  if options.auto_shares:
    others['clone_shares'] = options.clone_shares
  if others or options.xla is True:
    named = ', '.join(f'{k}={v}' for k, v in others.items()) or 'xla=True'
    raise errors.UnsupportedError(
        f'{named}: model {model.name!r} has its own {mine}, which applies '
        'its updates itself, once a batch; drop the option, or train with '
        'Keras\'s own steps.')


class OwnSteps:
  """The steps of `towers` (a `TowersModel`) whose model brings its own
  (see the module): the part `TowersModel` runs in place of Keras's."""

  def __init__(self, towers):
    self.towers = towers
    self.model = towers.model
    self.split = rows_split.RowsSplit(towers.model, towers.config,
                                      towers.options.fixed_shares)
    self._train = tf.function(functools.partial(
        self._split, 'train_step'), autograph=False)
    self._test = tf.function(functools.partial(
        self._split, 'test_step'), autograph=False)

  def compile(self, *args, jit_compile='auto', **kwargs):
    """The model's own `compile` with these arguments (a GAN's takes its
    optimizers), its optimizers made beside the variables; then Keras's
    around the steps."""
    if jit_compile is True:
      raise errors.UnsupportedError(
          'jit_compile=True: a model with its own steps runs them whole, '
          'uncompiled; drop it.')
    with tf.device(self.towers.config.optimizer_variables_device()):
      self.model.compile(*args, **kwargs)
    keras.Model.compile(  # Keras's loop of N steps a call runs each.
        self.towers, optimizer=self.model.optimizer, jit_compile=False,
        run_eagerly=True,
        steps_per_execution=kwargs.get('steps_per_execution', 1))

  @property
  def metrics(self):
    return self.model.metrics

  def train_step(self, data):
    inputs = keras.utils.unpack_x_y_sample_weight(data)[0]
    self.towers.batches.partial(int(tf.shape(tf.nest.flatten(inputs)[0])[0]))
    self.towers.batches.note(inputs)
    return self._train(data)

  @property
  def step_function(self):
    """The compiled step a train step runs (the model's own, split)."""
    return self._train

  @staticmethod
  def train_function(keras_function):
    """Keras's own train function: its N steps a call, each this step."""
    return keras_function

  def test_step(self, data):
    return self._test(data)

  def check_fit(self, callbacks):
    """Raises `UnsupportedError` for a BackupAndRestore: its backup would
    not hold every optimizer a model's own step may update."""
    if any(isinstance(c, keras.callbacks.BackupAndRestore)
           for c in callbacks or ()):
      raise errors.UnsupportedError(
          f'BackupAndRestore: model {self.model.name!r} has its own steps, '
          'whose optimizers its backup would not hold; save with '
          'ModelCheckpoint instead.')

  def _split(self, name, data):
    """The model's step `name` on `data`, once, its layers computed by
    rows on the clones; its logs."""
    # A step the user compiled runs as its Python: traced here.
    step = getattr(self.model, name)
    step = getattr(step, 'python_function', step)
    with self.split.splitting():
      return step(data)
