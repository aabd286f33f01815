"""The towers behind Keras's own `compile` / `fit` / `evaluate` / `predict`.

`TowersModel(model, config, **options)` is a `keras.Model` that wraps a
user's Keras model: its `train_step` runs the towers' step
(`deploy()`'s `DeployedModel`, the one implementation of the step the
command line runs too), so clones, stages and micro-batches, clone shares
and accumulation come to `fit`, with Keras's progress bar, callbacks,
validation data and compiled metrics. It follows Keras's guide
"Customizing what happens in fit()": only the steps are overridden.

  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = build_my_model()  # functional, Sequential or subclassed; built
  towers = fit.TowersModel(model, config)
  towers.compile(optimizer='adam', loss=..., metrics=['accuracy'])
  towers.fit(train_ds, validation_data=test_ds, epochs=3)

How it differs from a plain Keras model:
  * Keras's step runs eagerly and calls the towers' compiled step, which
    splits each batch by its real rows: `fit`'s last partial batch is split
    as evenly as it goes (each clone's loss weighted by its rows), with one
    more trace for its shape. XLA is the towers' own, per clone:
    `jit_compile` is the step option `xla` (compiling the whole
    multi-device step would make one cluster on one device): 'auto', the
    default, compiles each clone where `xla_rule` says (GPUs).
  * The optimizer is made (again, from its config, if it was made
    elsewhere) and built, and every variable's placement checked, in
    `compile`, under `config.optimizer_variables_device()`.
  * `compile(steps_per_execution=N)` runs N steps in one compiled call
    (`step_loop`), as Keras's own loop.
  * Several inputs and outputs (lists or dicts), several losses with
    `loss_weights`, and sample or class weights are Keras's own: each is a
    mean over rows, split with the batch and weighted by each piece's rows,
    which is exact. A loss over a Keras mask is refused in one line.
  * `save` (and ModelCheckpoint) writes the wrapped model with the
    optimizer's state, which plain Keras loads without tfmulti; `export`
    exports it; `predict` before `compile` runs it on one device.

Across workers (`workers=`, from `tfmulti.distribute.workers.start()`,
the same script on every worker; `across_workers`): every worker reads
the same global batches (the same data, the same seed; checked each step,
one line if not) and trains on its rows of each (`rows.worker_part`); the
workers' gradients meet in the strategy's all-reduce, one update. It runs
the step options the command line's `--strategy=multi_worker` runs, and
refuses the others in one line (`engine.registry`). The metrics
`fit` logs are computed on every
worker from the whole batch's outputs (gathered), so they equal one
process's and every worker's; validation and `evaluate` split each batch
over the workers (parts that differ by a row at most) and gather the
outputs the same way (collectives: call `evaluate` on every worker, as
`fit`). Only
the chief (worker 0) shows the progress bar and keeps the callbacks that
write files (ModelCheckpoint, TensorBoard, CSVLogger): the others drop
them, so nothing is written twice. An input of unknown length needs
`steps_per_epoch` (every worker must take as many steps). A peer lost
mid-step ends `fit` on the others with one line naming it (`SystemExit`,
status `errors.PEER_LOST_EXIT`, as the command line's), not TensorFlow's
traceback.

A `keras.callbacks.BackupAndRestore` among `fit`'s callbacks makes the run
preemptible, exactly: a signal saves the step, the next run resumes at it
(`fit.backup`), in one process or across workers.
"""

import dataclasses
import inspect
import sys

from absl import logging
import keras
import tensorflow as tf

from tfmulti import errors
from tfmulti import keras_internals
from tfmulti import rows
from tfmulti import step_options
from tfmulti import trainer
from tfmulti.deploy import towers as towers_lib
from tfmulti.engine import registry
from tfmulti.engine import step_calls
from tfmulti.fit import across_workers
from tfmulti.fit import backup as backup_lib
from tfmulti.fit import step_loop


class TowersModel(keras.Model):
  """A user's Keras model trained by the towers through Keras's `fit`.

  Attributes:
    model: the wrapped `keras.Model` (its weights are this
      model's; save or export it as any Keras model).
    config: the `DeploymentConfig`.
    options: the `StepOptions`.
    towers: the `DeployedModel` that `compile` builds.
  """

  def __init__(self, model, config, options=None, *, workers=None,
               shuffle_seed=0, **fields):
    """Wraps `model`, built in `config.variables_scope()`.

    Args:
      model: a built `keras.Model`: functional, Sequential or subclassed
        (any inputs and outputs; stages need a functional one).
      config: a `DeploymentConfig`.
      options: a `StepOptions`; None for the defaults.
      workers: across workers, what `workers.start()` gave (the model
        built in its scope); None in one process.
      shuffle_seed: with BackupAndRestore, the seed of each epoch's order
        of array inputs (the same on every worker and every restart). Without
        one, Keras shuffles arrays by each process's own generators: across
        workers, seed them alike (`keras.utils.set_random_seed`) on every
        worker; workers fed other batches stop at the step with one line
        (`across_workers.step_on_workers`).
      **fields: `StepOptions` fields that replace those of `options`.

    Raises:
      errors.UserError: a model or option the towers cannot run, or a
        tf.distribute strategy scope around it.
    """
    _check_no_strategy()
    towers_lib.check_model(model)
    # How the steps run, chosen once: in one process, or across workers.
    steps = across_workers.steps_for(workers, config)
    steps.check(model)
    options = dataclasses.replace(options or step_options.StepOptions(),
                                  **fields)
    # The command line's gate: what its towers (on every worker) run.
    registry.check_options(steps.gate, options, config)
    if options.summarize_gradients:  # The step's gradients reach no file.
      raise errors.UnsupportedError(
          'summarize_gradients=True: fit writes no gradient summaries (the '
          "command line's --summarize_gradients does); drop it, or log the "
          'weights with keras.callbacks.TensorBoard(histogram_freq=1).')
    super().__init__(name=f'towers_{model.name}')
    self.model = model
    # Keras names the losses and metrics of a list of outputs by these, as
    # on the model itself (`dense_1_loss`, not the loss's name); a
    # Sequential or subclassed model has none, and Keras names by position.
    if hasattr(model, 'output_names'):
      self.output_names = model.output_names
    self.config = config
    self.options = options
    self.workers = workers
    self.shuffle_seed = shuffle_seed
    self._backup = None  # A `backup.Backup` while a fit runs with one.
    self._to_pass = 0  # Steps of a resumed epoch to pass over.
    self._passed = False  # Whether the last step was passed over.
    self.towers = None
    self._steps = steps
    self._compile_args = {}
    self.built = True  # Its weights are the built model's.

  def call(self, inputs, training=False):
    return self.model(inputs, training=training)

  def compile(self, optimizer='rmsprop', loss=None, metrics=None, *,
              jit_compile='auto', **kwargs):
    """Keras's `compile`, then the towers: the optimizer built and every
    variable checked on the variables device. Several losses,
    `loss_weights` and weighted metrics are Keras's own; `jit_compile` is
    the step option `xla`: True compiles each clone with XLA, 'auto' (the
    default) follows `xla_rule`."""
    if kwargs.pop('run_eagerly', None) is False:
      raise errors.ConfigError(
          'run_eagerly=False: TowersModel runs Keras\'s step eagerly around '
          "the towers' compiled step; leave run_eagerly unset.")
    for each in tf.nest.flatten(loss):
      if isinstance(each, keras.losses.Loss):
        trainer.check_loss(each)
    step_calls.check_shares('steps_per_execution',
                            kwargs.get('steps_per_execution', 1), self.options)
    if jit_compile in (True, False):  # 'auto' leaves the rule to decide.
      self.options = dataclasses.replace(self.options, xla=jit_compile)
    with tf.device(self.config.optimizer_variables_device()):
      with self._steps.scope():  # Its variables, the workers' too.
        optimizer = _beside_the_variables(optimizer)
      super().compile(optimizer=optimizer, loss=loss, metrics=metrics,
                      jit_compile=False, run_eagerly=True, **kwargs)
    self._compile_args = dict(loss=loss, metrics=metrics, **kwargs)
    with self._steps.scope():
      self.towers = towers_lib.deploy(self.config, self.model,
                                      _CompiledLoss(self), self.optimizer,
                                      self.options)
    self._steps.bind(self.towers)
    self._full_rows = 0  # The most rows a batch had: fewer is a last one.
    self._full_layout = None  # The layout of the fit's full batches.

  def make_train_function(self, force=False):
    """Keras's train function, or N steps a compiled call (`step_loop`)."""
    if self.train_function is None or force:
      super().make_train_function(force)
      self.train_function = step_loop.wrap(self, self.train_function)
    return self.train_function

  def full_batch(self):
    """(rows, layout) of this fit's full global batches, once one trained;
    None while a resumed run passes over steps. A loop's steps train."""
    self._passed = False
    full = self._full_layout is not None and not self._to_pass
    return (self._full_rows, self._full_layout) if full else None

  def loop_step(self, data, layout):
    """One step of `data` (a full global batch, in a compiled loop): this
    worker's rows of it trained; the logs."""
    images, labels, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    targets = _targets(labels, sample_weight)
    mine = self._steps.mine((images, targets))
    return self._train_function(*mine, layout, (images, targets))

  def train_step(self, data):
    _check_no_strategy()
    images, labels, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    # The compiled loss and metrics, built once before the step is traced:
    # built in its first trace, they would make tf.function trace it twice
    # (what Keras's own fit does under a strategy).
    keras_internals.build_compiled(self, (images, labels, sample_weight))
    if self._backup is not None:
      self._to_pass += self._backup.steps_to_pass()
    self._passed = self._to_pass > 0
    if self._passed:  # Trained before the restart: read, not trained.
      self._to_pass -= 1
      return self.get_metrics_result()
    targets = _targets(labels, sample_weight)
    rows_ = rows.batch_rows(images, targets)
    self._full_rows = max(self._full_rows, rows_)
    mine = self._steps.mine((images, targets))  # This worker's rows.
    self.towers.measure_shares(*mine)
    layout = self.towers.layout_for(*mine, partial=rows_ < self._full_rows)
    if rows_ == self._full_rows:
      self._full_layout = layout
    return self._train_function(*mine, layout, (images, targets))

  @tf.function(autograph=False)  # As Keras traces its own steps.
  def _train_function(self, images, targets, layout, whole):
    """The towers' step and the metrics, one compiled call a step (eager,
    the metrics cost more than a small model's step). `layout` is a frozen
    record of Python ints: one trace per layout, as the towers' own step.
    `whole`: the whole global batch (images, targets), which the workers
    check they share, and whose targets the metrics read."""
    total, outputs = self._steps.train(images, targets, layout, whole)
    all_targets = whole[1]
    labels, sample_weight = (*all_targets, None)[:2]
    keras_internals.loss_tracker(self).update_state(
        total, sample_weight=layout.global_rows)
    # Each output's loss (`logits_loss`, ...) of the whole batch, as Keras
    # computes it: the pieces' calls above leave those metrics alone.
    _, output_losses = _CompiledLoss(self).with_output_losses(all_targets,
                                                              outputs)
    keras_internals.track_output_losses(self, output_losses)
    return self.compute_metrics(images, labels, outputs,
                                sample_weight=sample_weight)

  def test_step(self, data):
    images, labels, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    keras_internals.build_compiled(self, (images, labels, sample_weight))
    return self._test_function(images, labels, sample_weight)

  @tf.function(autograph=False)  # As Keras traces its own steps.
  def _test_function(self, images, labels, sample_weight):
    """The towers' inference and Keras's evaluation loss and metrics of it,
    one compiled call a batch. Across workers each runs its rows and the
    outputs are gathered, so every worker's metrics are the batch's."""
    outputs, regularization = self._steps.evaluate(images)
    loss, output_losses = _CompiledLoss(self).with_output_losses(
        _targets(labels, sample_weight), outputs)
    keras_internals.track_output_losses(self, output_losses)
    loss += tf.cast(regularization, loss.dtype)
    rows_ = tf.shape(tf.nest.flatten(images)[0])[0]
    keras_internals.loss_tracker(self).update_state(loss,
                                                    sample_weight=rows_)
    return self.compute_metrics(images, labels, outputs,
                                sample_weight=sample_weight)

  def predict_step(self, data):
    images, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    if self.towers is None:  # Before compile: the model on one device.
      return self.model(images, training=False)
    return self.towers.predict(images)

  def save(self, filepath, *args, **kwargs):
    """Saves the wrapped model with this model's optimizer state and
    compile config, as Keras would save a compiled model, so plain Keras
    loads the file without tfmulti (what ModelCheckpoint writes too).
    `save_weights` keeps this model's own (BackupAndRestore's)."""
    if self.towers is not None and not self.model.compiled:
      self.model.compile(optimizer=self.optimizer, **self._compile_args)
    return self.model.save(filepath, *args, **kwargs)

  def export(self, filepath, *args, **kwargs):
    """Exports the wrapped model (a SavedModel for serving)."""
    return self.model.export(filepath, *args, **kwargs)

  def fit(self, *args, **kwargs):
    """Keras's `fit`. Across workers, every worker takes as many steps and
    only the chief shows progress and writes files; with a
    BackupAndRestore, a signal saves the step and exits, and the next run
    resumes there (see the module)."""
    arguments = _FIT.bind(self, *args, **kwargs).arguments
    del arguments['self']
    arguments.update(arguments.pop('kwargs', {}))
    self._steps.check_input(arguments)
    _check_batches(self, arguments)
    callbacks = list(arguments.get('callbacks') or ())
    originals = [c for c in callbacks
                 if isinstance(c, keras.callbacks.BackupAndRestore)]
    if originals:
      self._backup = backup_lib.Backup(
          originals[0], **backup_lib.fed(arguments, originals[0].backup_dir,
                                         seed=self.shuffle_seed),
          is_chief=self.config.worker_index == 0,
          agreed_stop=self._steps.agreed_stop())
      callbacks = [self._backup if c is originals[0] else c
                   for c in callbacks]
    arguments['callbacks'] = callbacks
    self._full_layout = None  # Its first step fixes it again.
    try:
      with self._steps.guard(
          lambda: int(self.optimizer.iterations.value.numpy()) + 1):
        return super().fit(**self._steps.for_this_worker(arguments))
    except backup_lib.Preempted as e:
      logging.warning('%s: the job saved it in %s; run the same script '
                      'again to resume.', e, self._backup.directory)
      sys.exit(e.stop.exit_code)
    except errors.ClusterError as e:
      # A peer lost mid-step, or one that missed the agreed stop: one
      # line, not TensorFlow's pages of traceback.
      raise errors.exit_for(e) from e
    finally:
      if self._backup is not None:
        self._backup.close()
      self._backup, self._to_pass = None, 0

  def passing_steps(self):
    """Whether the last step was one a resumed run passed over."""
    return self._passed


_FIT = inspect.signature(keras.Model.fit)


def _check_batches(model, arguments):
  """Cuts the full and the last batch of array inputs before the first
  step: a last batch the layout refuses (not whole atoms, clones in
  lockstep) would otherwise stop `fit` after a whole epoch."""
  x = arguments.get('x')
  if model.towers is None or not backup_lib.are_arrays(x):
    return
  _, full, last = across_workers.fit_batches(arguments)
  for batch, partial in ((full, False), (last, 0 < last < full)):
    if batch:
      model.towers.layout_for_rows(batch // model.config.num_workers,
                                   partial)


class _CompiledLoss:
  """Keras's compiled loss as the towers' `loss_fn(targets, outputs)`, with
  targets = `_targets(labels, sample_weight)`: several outputs, their losses,
  `loss_weights` and sample (or class) weights, each a mean over the rows
  that the towers weight by a piece's rows, which is exact. A call leaves
  the per-output loss metrics alone: the step adds the whole batch's."""

  def __init__(self, model):
    self.model = model

  def __call__(self, targets, outputs):
    return self.with_output_losses(targets, outputs)[0]

  def with_output_losses(self, targets, outputs):
    """(The loss, each output's unweighted loss for its metric)."""
    labels, sample_weight = (*targets, None)[:2]
    loss, output_losses = keras_internals.compiled_loss(
        self.model, labels, outputs, sample_weight)
    if loss is None:  # The model's own add_loss terms alone.
      return tf.zeros([]), output_losses
    # A mean-reduced Keras loss divides by the replica count in the
    # clones' lockstep; the towers weight by rows themselves.
    return keras_internals.unscale_for_replicas(loss), output_losses


def _targets(labels, sample_weight):
  """What the towers split with the inputs: (labels,) or (labels,
  sample_weight), a nest of tensors (None is no row-major tensor)."""
  return (labels,) if sample_weight is None else (labels, sample_weight)


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
