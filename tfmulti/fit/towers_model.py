"""The towers behind Keras's own `compile` / `fit` / `evaluate` / `predict`.

`TowersModel(model, config, **options)` is a `keras.Model` that wraps a
user's Keras model: `compile` builds its trainer from the strategy
registry the command line uses (`engine.registry`: the towers, or the
towers on every worker), and its steps drive that trainer through the one
trainer contract (`trainer.Trainer`), so clones, stages and micro-batches,
clone shares and accumulation come to `fit`, with Keras's progress bar,
callbacks, validation data and compiled metrics. It follows Keras's guide
"Customizing what happens in fit()": only the steps are overridden.

  config = deploy.DeploymentConfig(num_clones=2, clone_on_cpu=True)
  with config.variables_scope():
    model = build_my_model()  # functional, Sequential or subclassed; built
  towers = fit.TowersModel(model, config)
  towers.compile(optimizer='adam', loss=..., metrics=['accuracy'])
  towers.fit(train_ds, validation_data=test_ds, epochs=3)

How it differs from a plain Keras model:
  * Keras's step runs eagerly: the trainer's compiled step, then Keras's
    metrics of its outputs (`compiled`). The step splits each batch by its
    real rows: `fit`'s last partial batch is split
    as evenly as it goes (each clone's loss weighted by its rows), with one
    more trace for its shape. XLA is the towers' own, per clone:
    `jit_compile` is the step option `xla` (compiling the whole
    multi-device step would make one cluster on one device): 'auto', the
    default, compiles each clone where `xla_rule` says (GPUs).
  * The optimizer is the user's own object (its schedule, exclusions and
    state as given): its iteration count and learning rate are made again
    beside the variables, and it is built and every variable's placement
    checked, in `compile`, under `config.optimizer_variables_device()`.
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
(`fit.backup`, `fit.runs`), in one process or across workers.
"""

import dataclasses

import keras
import tensorflow as tf

from tfmulti import device_kinds
from tfmulti import errors
from tfmulti import step_options
from tfmulti.deploy import keras_distribution
from tfmulti.deploy import towers as towers_lib
from tfmulti.engine import exported
from tfmulti.engine import registry
from tfmulti.fit import across_workers
from tfmulti.fit import backup as backup_lib
from tfmulti.fit import compiled
from tfmulti.fit import keras_steps
from tfmulti.fit import own_steps
from tfmulti.fit import runs
from tfmulti.mesh import shard_views


class TowersModel(keras.Model):
  """A user's Keras model trained by the towers through Keras's `fit`.

  Attributes:
    model: the wrapped `keras.Model` (its weights are this
      model's; save or export it as any Keras model).
    config: the `DeploymentConfig`.
    options: the `StepOptions`, as the registry checked them.
    towers: the trainer `compile` builds (a `trainer.Trainer`).
    door: how `fit` runs (`across_workers.Local` or `AcrossWorkers`).
  """

  def __init__(self, model, config=None, options=None, *, workers=None,
               shuffle_seed=0, device_peak_flops=None, device_memory=None,
               **fields):
    """Wraps `model`, built in `config.variables_scope()`.

    Args:
      model: a built `keras.Model`: functional, Sequential or subclassed
        (any inputs and outputs; stages need a functional one).
      config: a `DeploymentConfig`, or Keras's `DataParallel` or
        `ModelParallel`; None: the one `set_distribution` set.
      options: a `StepOptions`; None for the defaults.
      workers: across workers, what `workers.start()` gave (the model
        built in its scope); None in one process.
      shuffle_seed: with BackupAndRestore, or with `reproducible_rows` in
        a process Keras's seed was not set in, the seed of each epoch's
        order of array inputs (the same on every worker, every restart and
        every layout). Else Keras shuffles arrays by each process's own
        generators: across workers, seed them alike
        (`keras.utils.set_random_seed`) on every worker; workers fed other
        batches stop at the step with one line.
      device_peak_flops: the peak rate of each compute device for the
        MFU in `fit`'s logs (`device_kinds.peak_rate`: '312T', 'a100');
        None: a GPU's own kind's (no MFU on a CPU).
      device_memory: each GPU's memory ('80GB', 'h100'), for its share in
        use; None: a GPU's own kind's.
      **fields: `StepOptions` fields that replace those of `options`.

    Raises:
      errors.UserError: a model or option the towers cannot run, or a
        tf.distribute strategy scope around it.
    """
    _check_no_strategy()
    towers_lib.check_model(model)
    figures = dict(kind=device_kinds.peak_rate(device_peak_flops),
                   device_memory=device_kinds.memory_bytes(device_memory))
    config = keras_distribution.config_for(config, workers)
    door = across_workers.door_for(workers, config)  # Chosen once.
    door.check(model)
    options = dataclasses.replace(options or step_options.StepOptions(),
                                  **fields)
    options = compiled.checked_options(model, options)
    super().__init__(name=f'towers_{model.name}')
    self.model = model
    # Keras names the losses and metrics of a list of outputs by these, as
    # on the model itself (`dense_1_loss`); others are named by position.
    if hasattr(model, 'output_names'):
      self.output_names = model.output_names
    self.config, self.door, self.shuffle_seed = config, door, shuffle_seed
    self.device_figures = figures  # For `fit.readings.Readings`.
    self.options = registry.check_options(door.gate, options, config)
    self.passes = backup_lib.Passes()  # A resumed fit's passed steps.
    self.towers = None
    self.compile_args = {}
    self.batches = runs.FullRows()  # Fewer rows than its full: a last one.
    self.steps = _steps_for(self, workers)  # Keras's, or the model's own.
    self.built = True  # Its weights are the built model's.

  def call(self, inputs, training=False):
    return self.model(inputs, training=training)

  def compile(self, *args, **kwargs):
    """Keras's `compile` of the steps the model runs (`steps`): the
    trainer built from the registry, the user's optimizer beside the
    variables (`keras_steps`); or the model's own `compile`
    (`own_steps`). `jit_compile` is the step option `xla`."""
    self.steps.compile(*args, **kwargs)

  @property
  def metrics(self):
    own = getattr(self, 'steps', None) and self.steps.metrics
    return super().metrics if own is None else own

  def make_train_function(self, force=False):
    """Keras's train function, as the steps run it (Keras's: N steps a
    compiled call, `step_loop`)."""
    if self.train_function is None or force:
      super().make_train_function(force)
      self.train_function = self.steps.train_function(self.train_function)
    return self.train_function

  def full_rows(self):
    """The rows of this fit's full global batches, once one trained; None
    while a resumed run passes over steps."""
    rows_ = self.batches.rows
    return rows_ if self.passes.none_left() and rows_ else None

  def train_step(self, data):
    _check_no_strategy()
    return self.steps.train_step(data)

  def test_step(self, data):
    return self.steps.test_step(data)

  def predict_step(self, data):
    images, _, _ = compiled.unpack(data)
    if self.towers is None:  # Before compile: the model on one device.
      return self.model(images, training=False)
    return self.towers.predict(images)

  def save(self, filepath, *args, **kwargs):
    """Saves the wrapped model with this model's optimizer state and
    compile config, as Keras saves a compiled model, so plain Keras loads
    it (ModelCheckpoint's); `save_weights` keeps this model's own."""
    if self.towers is not None and not self.model.compiled:
      self.model.compile(optimizer=self.optimizer, **self.compile_args)
    with shard_views.whole_state(self.optimizer):  # Sharded: as one device.
      return self.model.save(filepath, *args, **kwargs)

  def export(self, filepath, *args, **kwargs):
    """Exports the wrapped model for one device (a SavedModel for serving,
    Keras's export), as the command line does (`engine.exported`)."""
    with exported.one_device_model(self.model) as served:
      return served.export(filepath, *args, **kwargs)

  def fit(self, *args, **kwargs):
    """Keras's `fit` (`runs`): across workers, as many steps on each, the
    chief alone showing progress and writing files; with a BackupAndRestore,
    a signal saves the step and exits, and the next run resumes there."""
    self.steps.check_fit(runs.fit_arguments(self, args, kwargs).get(
        'callbacks'))
    return runs.run(self, super().fit, args, kwargs)


def _steps_for(towers, workers):
  """The steps `towers` runs, chosen once: the model's own (`own_steps`,
  checked against the towers' config, options and `workers`), or
  Keras's through the trainer (`keras_steps`)."""
  if own_steps.own_steps(towers.model):
    own_steps.check(towers.model, towers.config, towers.options, workers)
    return own_steps.OwnSteps(towers)
  return keras_steps.KerasSteps(towers)


def _check_no_strategy():
  if tf.distribute.has_strategy():
    raise errors.ConfigError(
        'TowersModel places its clones itself; build and fit it outside '
        'any tf.distribute strategy scope.')
