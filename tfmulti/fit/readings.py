"""A run you can read under `fit`: each step's time, rows, memory and MFU.

`Readings` is the callback `TowersModel.fit` puts first among the fit's
callbacks: at each train batch's end it puts the `engine.readings`
figures of the steps since the last batch into the logs (`step_time`,
`examples_per_sec`, `tokens_per_sec` where the input is tokens, `mfu`
where the device's peak rate is known, `memory_gib` and
`memory_peak_gib`: the most any device reports), and at an epoch's end
those of the epoch's steps. Keras's progress bar, History and
TensorBoard callback read them there, as they read the loss. A fit's
first step (it traces) and the time between epochs (validation) are not
timed.
"""

import time

import keras

from tfmulti.engine import readings

# The keys it may add to `fit`'s logs (`readings.Reading.logs`).
KEYS = ('step_time', 'examples_per_sec', 'tokens_per_sec', 'mfu',
        'memory_gib', 'memory_peak_gib')


class Readings(keras.callbacks.Callback):
  """Adds the step's readings to `fit`'s logs (see the module).

  Args:
    towers: the `TowersModel` being fit.
    peak: `device_kinds.Kind` of its compute devices, or None.
    device_memory: bytes each GPU holds, or None.
  """

  def __init__(self, towers, *, peak=None, device_memory=None):
    super().__init__()
    self._towers = towers
    self._peak, self._device_memory = peak, device_memory
    self._meter = None
    self._last = None  # (perf_counter, step index) of the last batch end.
    self._epoch = [0.0, 0]  # Timed seconds and steps this epoch.

  def on_train_begin(self, logs=None):
    self._last = None  # The fit's first step traces: untimed.

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = [0.0, 0]
    if self._last is not None:  # A step ran: the next one is timed.
      self._last = (time.perf_counter(), -1)

  def on_train_batch_end(self, batch, logs=None):
    now = time.perf_counter()
    last, self._last = self._last, (now, batch)
    if last is None or logs is None:
      return
    seconds, steps = now - last[0], batch - last[1]
    self._epoch[0] += seconds
    self._epoch[1] += steps
    logs.update(self._meter_now().reading(seconds, steps).logs())

  def on_epoch_end(self, epoch, logs=None):
    seconds, steps = self._epoch
    if steps and logs is not None:
      logs.update(self._meter_now().reading(seconds, steps).logs())

  def _meter_now(self):
    """The meter, made once a step ran (its rows and tokens known)."""
    if self._meter is None:
      towers = self._towers
      self._meter = readings.Meter(
          towers.steps.step_function, towers.batches.rows,
          compute_dtype=towers.model.dtype_policy.compute_dtype,
          peak=self._peak, device_memory=self._device_memory,
          tokens_per_row=towers.batches.tokens_per_row)
    return self._meter
