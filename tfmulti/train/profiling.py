"""TensorBoard profiles of chosen global steps (`--profile_steps=A,B`).

The trace goes to `<model_dir>/plugins/profile/<run>/`, where TensorBoard's
Profile tab finds it (`pip install -e '.[profile]'` installs the plugin,
then `tensorboard --logdir <model_dir>`). The trace viewer shows each op of
the step under its clone's name scope (`clone_0/...`, `clone_1/...`) and,
on GPUs, one lane per device; the step's gradient sum and update appear
under `optimize_clones/` on the optimizer device. Where a call runs many
steps (`--steps_per_loop`), the names sit under the loop's call of the
step (`StatefulPartitionedCall/clone_0/...`).
"""

import importlib.util

from absl import logging
import tensorflow as tf

PLUGIN = 'tensorboard_plugin_profile'


class StepProfiler:
  """Traces global steps [first, last] (1-based) into `logdir`."""

  def __init__(self, steps, logdir):
    self._steps = steps
    self._logdir = logdir
    self._active = False

  def before(self, step):
    """Call before global step `step` runs."""
    if self._steps is None or self._active or step != self._steps[0]:
      return
    if importlib.util.find_spec(PLUGIN) is None:
      logging.warning("profiling steps %d-%d into %s; to view the trace, "
                      "pip install -e '.[profile]' (TensorBoard's profile "
                      'plugin)', *self._steps, self._logdir)
    else:
      logging.info('profiling steps %d-%d into %s (TensorBoard, Profile tab)',
                   *self._steps, self._logdir)
    tf.profiler.experimental.start(self._logdir)
    self._active = True

  def after(self, step, outputs):
    """Call after global step `step` was dispatched, with its outputs."""
    if self._active and step >= self._steps[1]:
      float(outputs.total)  # Waits for the step to finish on its devices.
      self.close()

  def close(self):
    """Ends a trace in progress (at the end, or when training stops)."""
    if self._active:
      tf.profiler.experimental.stop()
      self._active = False
