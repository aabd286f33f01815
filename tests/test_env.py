"""`python -m tfmulti.env`: what a bug report needs, read from the
running process."""

import json

import keras
import tensorflow as tf

from tfmulti import env


def test_the_report_names_versions_build_and_devices(capsys):
  env.main(['--json'])
  found = json.loads(capsys.readouterr().out)
  assert found['tensorflow'] == tf.__version__
  assert found['keras'] == keras.__version__
  assert found['tfmulti'] != 'not installed'
  built = tf.sysconfig.get_build_info()
  assert found['cuda'] == str(built.get('cuda_version') or 'none')
  assert found['nccl'] == str(built.get('nccl_version') or 'none')
  assert 'CPU:0' in found['devices']
  env.main([])
  lines = capsys.readouterr().out.splitlines()
  assert f'tensorflow: {tf.__version__}' in lines
  assert any(line.startswith('devices: ') and 'CPU:0' in line
             for line in lines)
