"""A run you can read, through the command line: every progress line and
TensorBoard carry the step's time, examples a second, memory and MFU, and
the MFU is the layers' FLOPs (counted apart, from the Keras model) over
the step time (measured apart) and the devices' peak; its long phases are
plain lines in a log."""

import os
import re

from absl.testing import flagsaver
import numpy as np
import pytest

from tests.helpers import scalars
from tfmulti import cli
from tfmulti import models
from tfmulti.bench import flops as flops_lib

PEAK = 1e9  # --device_peak_flops=1G: a logical CPU's made-up peak.


@pytest.mark.parametrize('strategy', [
    'towers', pytest.param('mirrored', marks=pytest.mark.slow)])
def test_each_line_and_tensorboard_carry_the_steps_readings(
    run_train, tmp_path, caplog, strategy):
  model_dir = str(tmp_path / strategy)
  with caplog.at_level('INFO', logger='absl'):
    run_train(model_dir=model_dir, strategy=strategy, num_clones=2,
              train_steps=4, log_every_steps=2, batch_size=8,
              steps_per_loop='1', device_peak_flops='1G')
  found = scalars(model_dir)
  rows = 16  # 8 a clone.
  model = models.get_model('lenet', input_shape=(28, 28, 1),
                           num_classes=10)
  want_flops = flops_lib.step_flops(model, rows)
  for step in (2, 4):
    step_time = float(found['step_time'][step])
    assert float(found['examples_per_sec'][step]) * step_time == (
        pytest.approx(rows))
    # The MFU is the model's FLOPs a second over 2 devices' peak.
    np.testing.assert_allclose(
        float(found['mfu'][step]) * step_time * 2 * PEAK, want_flops,
        rtol=1e-5)
    assert 0 < found['memory/process/in_use_gib'][step] <= (
        found['memory/process/peak_gib'][step])
    planned = [found[f'memory/{device}/planned_peak_gib'][step]
               for device in ('CPU:0', 'CPU:1')]
    if strategy == 'towers':  # Each clone's pass, planned on its device.
      assert min(planned) > 0
    else:  # The plan reads the towers; a replica's ops may fall on one.
      assert sum(planned) > 0
  lines = re.findall(r'step [24]/4 \(epoch 1\) loss [\d.]+ \| (.*) \| ETA',
                     caplog.text)
  assert len(lines) == 2
  for line in lines:
    assert re.fullmatch(
        r'[\d.]+ s/step, [\d,]+ examples/s, MFU [\d.]+% \| memory process '
        r'[\d.]+ [MG]iB in use, [\d.]+ [MG]iB peak \([\d.]+%\), CPU:0 '
        r'[\d.]+ [MG]iB planned peak, CPU:1 [\d.]+ [MG]iB planned peak',
        line), line
  # The long phases: two plain lines each in a log, no bar's codes.
  assert '\r' not in caplog.text and '\x1b[' not in caplog.text
  for name in ('tracing the step (its first call builds the graph)',
               'evaluating'):
    assert re.search(rf'{re.escape(name)}: done in \d+\.\d s',
                     caplog.text), name
  assert re.search(r'evaluating \(\d+ parts\)', caplog.text)


@pytest.mark.parametrize('flag, value, message', [
    ('device_peak_flops', 'fast', r'device_peak_flops=fast: give a rate a '
     r'device \(312T, 1.5e14\) or a device name \(a100, '),
    ('device_memory', 'lots', r'device_memory=lots: give a size')])
def test_a_bad_device_figure_stops_the_run_before_anything(
    tmp_path, digits_dir, flag, value, message):
  model_dir = tmp_path / 'run'
  with flagsaver.flagsaver(model_dir=str(model_dir), data_dir=digits_dir,
                           clone_on_cpu=True, **{flag: value}):
    with pytest.raises(SystemExit, match=message):
      cli.main(['train.py'])
  assert not os.path.exists(model_dir)
