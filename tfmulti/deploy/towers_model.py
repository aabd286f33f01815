"""The towers behind Keras's own `compile` / `fit` / `evaluate` / `predict`.

`TowersModel(model, config, **options)` is a `keras.Model` that wraps a
user's functional model: its `train_step` runs the towers' step
(`deploy()`'s `DeployedModel`, the one implementation of the step the
command line runs too), so clones, stages and micro-batches, clone shares
and accumulation come to `fit`, with Keras's progress bar, callbacks,
validation data and compiled metrics. It follows Keras's guide
"Customizing what happens in fit()": only the steps are overridden.

  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with tf.device(config.variables_device()):
    model = build_my_functional_model()
  towers = deploy.TowersModel(model, config)
  towers.compile(optimizer='adam', loss=..., metrics=['accuracy'])
  towers.fit(train_ds, validation_data=test_ds, epochs=3)

How it differs from a plain Keras model:
  * Keras's step runs eagerly and calls the towers' compiled step, which
    splits each batch by its real rows: `fit`'s last partial batch is split
    as evenly as it goes (each clone's loss weighted by its rows), with one
    more trace for its shape. XLA is the towers' own, per clone:
    `jit_compile=True` is `xla=True` (compiling the whole multi-device step
    would make one cluster on one device); 'auto' leaves it off.
  * The optimizer is made (again, from its config, if it was made
    elsewhere) and built, and every variable's placement checked, in
    `compile`, under the variables device.
  * Sample and class weights are refused in one line (the towers weight
    each clone's loss by its rows only); evaluation takes them as Keras does.
  * `save` (and ModelCheckpoint) writes the wrapped model, which plain Keras
    loads without tfmulti.
"""

import dataclasses

import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import step_options
from tfmulti import trainer
from tfmulti.deploy import towers as towers_lib


class TowersModel(keras.Model):
  """A user's functional model trained by the towers through Keras's `fit`.

  Attributes:
    model: the wrapped functional `keras.Model` (its weights are this
      model's; save or export it as any Keras model).
    config: the `DeploymentConfig`.
    options: the `StepOptions`.
    towers: the `DeployedModel` (or `balance.Balanced`) that `compile`
      builds.
  """

  def __init__(self, model, config, options=None, **fields):
    """Wraps `model`, built under `config.variables_device()`.

    Args:
      model: a built functional `keras.Model`, one input and one output.
      config: a `DeploymentConfig`.
      options: a `StepOptions`; None for the defaults.
      **fields: `StepOptions` fields that replace those of `options`.

    Raises:
      errors.UserError: a model or option the towers cannot run, or a
        tf.distribute strategy scope around it.
    """
    _check_no_strategy()
    towers_lib.check_model(model)
    options = dataclasses.replace(options or step_options.StepOptions(),
                                  **fields)
    towers_lib.check_options(config, options)
    super().__init__(name=f'towers_{model.name}')
    self.model = model
    self.config = config
    self.options = options
    self.towers = None
    self.built = True  # Its weights are the built model's.

  def call(self, inputs, training=False):
    return self.model(inputs, training=training)

  def compile(self, optimizer='rmsprop', loss=None, metrics=None, *,
              jit_compile='auto', **kwargs):
    """Keras's `compile`, then the towers: the optimizer built and every
    variable checked on the variables device. `jit_compile=True` compiles
    each clone with XLA (`xla=True`)."""
    if kwargs.get('loss_weights') is not None:
      raise errors.ConfigError(
          'loss_weights: TowersModel trains one output with one loss; drop '
          'loss_weights.')
    if kwargs.pop('run_eagerly', None) is False:
      raise errors.ConfigError(
          'run_eagerly=False: TowersModel runs Keras\'s step eagerly around '
          "the towers' compiled step; leave run_eagerly unset.")
    if jit_compile is True:
      self.options = dataclasses.replace(self.options, xla=True)
    with tf.device(self.config.variables_device()):
      super().compile(optimizer=_beside_the_variables(optimizer), loss=loss,
                      metrics=metrics, jit_compile=False, run_eagerly=True,
                      **kwargs)
    self.towers = towers_lib.deploy(self.config, self.model,
                                    _one_loss(self.loss), self.optimizer,
                                    self.options)

  def train_step(self, data):
    _check_no_strategy()
    images, labels, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if sample_weight is not None:
      raise errors.ConfigError(
          'sample_weight (or class_weight) given to fit: the towers weight '
          "each clone's loss by its rows only; drop the weights.")
    _check_rows(images, self.config.num_clones,
                self.options.accumulation_steps)
    # The compiled metrics' variables, made once, before the step is traced:
    # made in its first trace, they would make tf.function trace it twice
    # (what Keras's own fit does under a strategy).
    if self._compile_metrics is not None and not self._compile_metrics.built:
      self._symbolic_build(data_batch=(images, labels, None))
    if isinstance(self.towers, towers_lib.DeployedModel):
      sizes = self.towers.clone_rows(images, labels, uneven=True)
      return self._train_function(images, labels, sizes)
    result = self.towers.train_step_outputs(  # Balanced: measures first.
        images, labels, uneven=True, with_outputs=True)
    return self._update_metrics(images, labels, result.outputs, result.total)

  @tf.function
  def _train_function(self, images, labels, sizes):
    """The towers' step and the metrics, one compiled call a step (eager,
    the metrics cost more than a small model's step). `sizes` are Python
    ints: one trace per split, as the towers' own step."""
    result = self.towers.step_graph(images, labels, sizes, with_outputs=True)
    return self._update_metrics(images, labels, result.outputs, result.total)

  def _update_metrics(self, images, labels, outputs, total):
    """The loss tracker and the compiled metrics, as Keras updates them."""
    self._loss_tracker.update_state(total, sample_weight=tf.shape(images)[0])
    return self.compute_metrics(images, labels, outputs)

  def test_step(self, data):
    images, labels, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    return self._test_function(images, labels, sample_weight)

  @tf.function
  def _test_function(self, images, labels, sample_weight):
    """The towers' inference and Keras's evaluation loss and metrics of it,
    one compiled call a batch."""
    outputs = self.towers.predict(images)
    loss = self._compute_loss(x=images, y=labels, y_pred=outputs,
                              sample_weight=sample_weight, training=False)
    self._loss_tracker.update_state(loss, sample_weight=tf.shape(images)[0])
    return self.compute_metrics(images, labels, outputs,
                                sample_weight=sample_weight)

  def predict_step(self, data):
    images, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    return self.towers.predict(images)

  def save(self, filepath, *args, **kwargs):
    """Saves the wrapped model, so plain Keras loads the file without
    tfmulti (what ModelCheckpoint writes too). `save_weights` keeps this
    model's own, the optimizer's state included (BackupAndRestore's)."""
    return self.model.save(filepath, *args, **kwargs)


def _check_no_strategy():
  if tf.distribute.has_strategy():
    raise errors.ConfigError(
        'TowersModel places its clones itself; build and fit it outside '
        'any tf.distribute strategy scope.')


def _beside_the_variables(optimizer):
  """`optimizer` made again from its config in the current device scope:
  one made elsewhere keeps its iteration count and learning rate there."""
  if not isinstance(optimizer, keras.optimizers.Optimizer):
    return optimizer  # A name: Keras makes it here.
  if optimizer.built:
    raise errors.ConfigError(
        f'optimizer {optimizer.name!r} is already built (it has slots for '
        'other variables); pass a new optimizer to compile.')
  return type(optimizer).from_config(optimizer.get_config())


def _one_loss(loss):
  """The one loss `compile` was given, as a callable the towers take."""
  if isinstance(loss, (list, tuple, dict)) or loss is None:
    raise errors.ConfigError(
        f'loss={loss!r}: TowersModel trains one output; compile with one '
        'loss, e.g. loss=keras.losses.SparseCategoricalCrossentropy().')
  loss = keras.losses.get(loss) if isinstance(loss, str) else loss
  trainer.check_loss(loss)
  return loss


def _check_rows(images, num_clones, accumulation_steps):
  """Refuses a batch the towers cannot split, naming drop_remainder."""
  rows = images.shape[0]
  if rows < num_clones or rows % accumulation_steps:
    raise errors.ConfigError(
        f'a batch of {rows} rows cannot be split over num_clones='
        f'{num_clones} in accumulation_steps={accumulation_steps} equal '
        "parts (fit's last partial batch); batch the dataset with "
        'drop_remainder=True.')
