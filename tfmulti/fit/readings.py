"""A run you can read under `fit`: each step's time, rows, memory and MFU.

`Readings` is the callback `TowersModel.fit` puts first among the fit's
callbacks: at each train batch's end it puts the `engine.readings`
figures of the steps since the last batch into the logs (`step_time`,
`examples_per_sec`, `tokens_per_sec` where the input is tokens, `mfu`
where the device's peak rate is known, `memory_gib` and
`memory_peak_gib`: the most any device reports), and at an epoch's end
those of the epoch's steps. Keras's progress bar, History and
TensorBoard callback read them there, as they read the loss. A fit's
first step (it traces), the steps a resumed run passes over and the time
between epochs (validation) are not timed.
"""

import math
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
    kind: `device_kinds.Kind` of its compute devices, or None.
    device_memory: bytes each GPU holds, or None.
  """

  def __init__(self, towers, *, kind=None, device_memory=None):
    super().__init__()
    self._towers = towers
    self._kind, self._device_memory = kind, device_memory
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
    if self._towers.passes.passed:  # A resumed run's step, passed over.
      return
    if self._last is None or self._meter is None:  # It traced.
      self._meter_now()  # Its graph read now, before the clock starts.
      self._last = (time.perf_counter(), batch)
      return
    now = time.perf_counter()
    seconds, steps = now - self._last[0], batch - self._last[1]
    self._last = (now, batch)
    self._epoch[0] += seconds
    self._epoch[1] += steps
    if logs is not None:
      logs.update(self._meter.reading(seconds, steps).logs())

  def on_epoch_end(self, epoch, logs=None):
    """The epoch's steps' readings; an epoch whose one step traced has
    them unknown (NaN), so History's lists stay one an epoch."""
    seconds, steps = self._epoch
    if logs is not None and self._meter_now() is not None:
      reading = self._meter.reading(seconds if steps else math.nan,
                                    steps or 1)
      logs.update(reading.logs())

  def _meter_now(self):
    """The meter, made once a step ran (its rows and tokens known), its
    step's cost counted; None before."""
    towers = self._towers
    if self._meter is None and towers.batches.rows:
      self._meter = readings.Meter(
          towers.steps.step_function, towers.batches.rows,
          compute_dtype=towers.model.dtype_policy.compute_dtype,
          kind=self._kind, device_memory=self._device_memory,
          tokens_per_row=towers.batches.tokens_per_row,
          devices=len(towers.config.compute_devices()))
      self._meter.count()
    return self._meter
