"""Emulated devices: passes that take time without taking the CPU.

Logical CPUs share the machine's cores, so stages on them cannot run at
once and a schedule's overlap cannot be seen. An emulated device instead
spends a fixed time per row in each pass, waiting (a `tf.py_function`
sleep, on the device that would run the pass): K waits on K devices run
at once given enough inter-op threads (`use_threads`), so the executor's
real order and overlap are what the timings show. For benchmarks only;
every figure that comes from it is labelled emulated.
"""

import threading
import time

from absl import logging
import keras
import numpy as np
import tensorflow as tf


def use_threads(count):
  """Enough inter-op threads for `count` waits at once; call it before
  TensorFlow initialises its runtime (after, it says so and keeps the
  runtime's threads: more waits than threads then queue)."""
  try:
    tf.config.threading.set_inter_op_parallelism_threads(count)
  except RuntimeError:
    logging.warning(
        'the runtime already runs with %d inter-op threads; emulated '
        'waits beyond that many run one after another.',
        tf.config.threading.get_inter_op_parallelism_threads())


class PassLog:
  """The waits that ran: (stage, kind 'F', 'B' or 'W', start, end),
  seconds on `time.perf_counter`'s clock."""

  def __init__(self):
    self._lock = threading.Lock()
    self.records = []

  def add(self, record):
    with self._lock:
      self.records.append(record)

  def clear(self):
    with self._lock:
      self.records = []


class EmulatedPass(keras.layers.Layer):
  """Identity with one (unused) weight whose forward pass waits
  `forward_s_per_row` a row, and whose gradient waits `backward_s_per_row`
  a row for its input's half (B) and `weights_s_per_row` for its weight's
  (W), logged as stage `stage`'s. Put one in each stage of a model cut
  into stages. The two halves are separate ops, so a schedule that splits
  them (ZB-H1, ZB-V) runs each in its own pass; one fused backward pass
  runs both, one after the other, as one device would: the waits of one
  layer hold a lock."""

  def __init__(self, stage, forward_s_per_row, backward_s_per_row, log,
               weights_s_per_row=0.0, **kwargs):
    super().__init__(**kwargs)
    self.stage = stage
    self.seconds = {'F': forward_s_per_row, 'B': backward_s_per_row,
                    'W': weights_s_per_row}
    self.log = log
    self._device = threading.Lock()

  def build(self, input_shape):
    self.delay_weight = self.add_weight(shape=(), initializer='zeros',
                                  name='emulated_weight')

  def _wait(self, kind, values):
    with self._device:
      start = time.perf_counter()
      time.sleep(len(values) * self.seconds[kind])
      self.log.add((self.stage, kind, start, time.perf_counter()))
    return np.float32(0.0)

  def _zero_after_wait(self, kind, tensor):
    """A float32 zero that exists once the wait of `tensor`'s rows is done.

    The wait is declared stateless: a stateful op would be chained to every
    other one in the step by tf.function's automatic control dependencies,
    and the stages' waits would run one after another (and a W wait could
    not be held back from B to W). It reads the tensor itself, so nothing
    folds it away before the step runs.
    """
    zero = tf.numpy_function(lambda values: self._wait(kind, values),
                             [tensor], tf.float32, stateful=False)
    zero.set_shape([])
    return zero

  def _waited(self, kind, tensor):
    """`tensor`, after the wait (a zero added: a data dependency)."""
    return tensor + tf.cast(self._zero_after_wait(kind, tensor),
                            tensor.dtype)

  def call(self, inputs):
    @tf.custom_gradient
    def emulated(x, weight):
      def grad(dy):
        return (self._waited('B', dy), tf.cast(
            self._zero_after_wait('W', dy), weight.dtype))
      return self._waited('F', x), grad
    return emulated(inputs, self.delay_weight)

  def compute_output_shape(self, input_shape):
    return input_shape


class DeviceWaits(keras.layers.Layer):
  """Identity that, on each device it runs on, waits that device's
  `seconds_per_row` a row in its forward pass: devices of set speeds.

  `seconds_per_row` maps 'CPU:1' (a device's type and index) to seconds;
  the device is read when the step is traced, the seconds when it runs, so
  a device can slow down mid-run without a retrace.
  """

  def __init__(self, seconds_per_row, **kwargs):
    super().__init__(**kwargs)
    self.seconds_per_row = seconds_per_row

  def call(self, inputs):
    spec = tf.DeviceSpec.from_string(tf.identity(inputs).device)
    device = f'{spec.device_type}:{spec.device_index}'

    def wait(values):
      time.sleep(len(values) * self.seconds_per_row.get(device, 0.0))
      return np.float32(0.0)
    # Stateless, so waits on two devices are not chained (see
    # `EmulatedPass`).
    zero = tf.numpy_function(wait, [inputs], tf.float32, stateful=False)
    zero.set_shape([])
    return inputs + tf.cast(zero, inputs.dtype)

  def compute_output_shape(self, input_shape):
    return input_shape
