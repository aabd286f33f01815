"""What a bug report needs, in one command.

  python -m tfmulti.env
  python -m tfmulti.env --json

Prints one `name: value` line each: tfmulti's version, Python's,
TensorFlow's, Keras's and those of the packages tfmulti reads (NumPy,
TensorFlow Datasets, keras-hub where installed); what TensorFlow was built
with (CUDA, cuDNN, NCCL: 'none' in a CPU build); the machine; and its
devices, each GPU with its name and compute capability. `--json` prints
the same as one JSON object (what the benchmarks record: `report`).
"""

import argparse
import importlib.metadata
import json
import os
import platform
import sys

# The packages whose versions a report names, as their distributions are
# named; those not installed say so.
PACKAGES = ('tfmulti', 'tensorflow', 'keras', 'numpy', 'tensorflow-datasets',
            'keras-hub')
# TensorFlow's build information: its key for each library a GPU build
# links.
BUILT_WITH = {'cuda': 'cuda_version', 'cudnn': 'cudnn_version',
              'nccl': 'nccl_version'}


def _version(package):
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return 'not installed'


def report():
  """{name: value} of the versions, TensorFlow's build, the machine and
  its devices (see the module)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  built = tf.sysconfig.get_build_info()
  found = {'python': platform.python_version()}
  found.update((package, _version(package)) for package in PACKAGES)
  found.update((name, str(built.get(key) or 'none'))
               for name, key in BUILT_WITH.items())
  found.update(platform=platform.platform(), cpu_count=os.cpu_count(),
               devices=_devices(tf))
  return found


def _devices(tf):
  """Each physical device: its kind and index, a GPU with its name and
  compute capability."""
  found = []
  for device in tf.config.list_physical_devices():
    line = device.name.replace('/physical_device:', '')
    if device.device_type == 'GPU':
      details = tf.config.experimental.get_device_details(device)
      capability = '.'.join(map(str, details.get('compute_capability') or ()))
      line += f" ({details.get('device_name', '?')}, compute {capability})"
    found.append(line)
  return found


def format_report(found):
  """`report()` as `name: value` lines, the devices comma-separated."""
  return '\n'.join(
      f"{name}: {', '.join(value) if isinstance(value, list) else value}"
      for name, value in found.items())


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m tfmulti.env',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--json', action='store_true',
                      help='one JSON object instead of lines')
  args = parser.parse_args(argv)
  found = report()
  sys.stdout.write((json.dumps(found, indent=2) if args.json
                    else format_report(found)) + '\n')


if __name__ == '__main__':
  main()
