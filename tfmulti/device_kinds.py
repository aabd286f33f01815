"""Known devices: their memory and their peak rates, one table.

The dry run checks a plan against a device's memory (`--device_memory`);
a run's MFU divides its FLOPs a second by the device's peak rate for the
step's compute dtype (`--device_peak_flops`, or the GPU's own name). Each
figure is the vendor's datasheet figure, dense (no structured sparsity),
for the SXM part where there are several (docs/running.md names the
datasheets). float32 matmuls on a GPU that has TF32 run as TF32 where
TensorFlow allows it (its default, `tf.config.experimental.
enable_tensor_float_32_execution`), so their peak is TF32's.
"""

import dataclasses
import re
from typing import Optional

from tfmulti import errors

GIB = 2**30
TERA = 1e12


@dataclasses.dataclass(frozen=True)
class Kind:
  """A device kind: its memory in GiB (None: not known), its peak FLOP/s
  for each compute dtype ('float32', 'tf32', 'bfloat16', 'float16'), and
  its links' bytes a second each way ('gpu-gpu': NVLink, or PCIe where
  it has none; 'host-gpu': PCIe; the dry run's link names)."""
  memory_gib: Optional[int]
  rates: dict
  links: dict = dataclasses.field(default_factory=dict)

  def rate(self, dtype):
    """The peak FLOP/s of `dtype`; one the kind lacks (bfloat16 on a T4)
    runs at its float32 rate."""
    return self.rates.get(dtype, self.rates['float32'])


def _kind(memory_gib, links, float32, tf32=None, bfloat16=None,
          float16=None):
  rates = {'float32': float32, 'tf32': tf32, 'bfloat16': bfloat16,
           'float16': float16}
  return Kind(memory_gib, {k: v * TERA for k, v in rates.items() if v},
              {'gpu-gpu': links[0] * 1e9, 'host-gpu': links[1] * 1e9})


# Datasheet figures: TFLOP/s, dense; links in GB/s each way, half the
# datasheet's both-ways figure (NVLink: H100 and H200 900, A100 600, V100
# 300; PCIe Gen5 x16 128, Gen4 64, Gen3 32).
KINDS = {
    'h100': _kind(80, (450, 64), 67, 494.7, 989.4, 989.4),
    'h200': _kind(141, (450, 64), 67, 494.7, 989.4, 989.4),
    'a100': _kind(80, (300, 32), 19.5, 156, 312, 312),
    'a100_40gb': _kind(40, (300, 32), 19.5, 156, 312, 312),
    'l40s': _kind(48, (32, 32), 91.6, 183, 362, 362),
    'l4': _kind(24, (32, 32), 30.3, 60, 121, 121),
    'a10g': _kind(24, (32, 32), 31.2, 62.5, 125, 125),
    'v100': _kind(32, (150, 16), 15.7, float16=125),
    'v100_16gb': _kind(16, (150, 16), 15.7, float16=125),
    't4': _kind(16, (16, 16), 8.1, float16=65),
}
# Memory of one device of a known kind, GiB (the largest of its kind).
KNOWN_MEMORY = {name: kind.memory_gib for name, kind in KINDS.items()}
_SCALES = {'': 1, 'G': 1e9, 'T': TERA, 'P': 1e15}


# A GPU's own name ('NVIDIA A100-SXM4-40GB') to its kind: the first match.
_NAMES = (('h200', r'h200'), ('h100', r'h100'),
          ('a100_40gb', r'a100.*40\s*gb'), ('a100', r'a100'),
          ('l40s', r'l40s'), ('l4', r'\bl4\b'), ('a10g', r'a10g'),
          ('v100_16gb', r'v100.*16\s*gb'), ('v100', r'v100'),
          ('t4', r'\bt4\b'))


def kind_of(device_name):
  """The `KINDS` name of a GPU's own name ('NVIDIA A100-SXM4-40GB' ->
  'a100_40gb'), or None for one not in the table."""
  return next((kind for kind, pattern in _NAMES
               if re.search(pattern, device_name.lower())), None)


def peak_rate(value):
  """The `Kind` `--device_peak_flops` names: a known one ('h100'), or one
  rate for every dtype ('312T', '1.5e14', '900G'); None without it.

  Raises:
    errors.ConfigError: neither a rate nor a known name.
  """
  if not value:
    return None
  if value.lower() in KINDS:
    return KINDS[value.lower()]
  match = re.fullmatch(r'(\d+(?:\.\d*)?(?:e\d+)?)\s*([GTP]?)',
                       value.strip(), re.IGNORECASE)
  rate = match and float(match.group(1)) * _SCALES[match.group(2).upper()]
  if not rate:
    raise errors.ConfigError(
        f'device_peak_flops={value}: give a rate a device (312T, 1.5e14) '
        f'or a device name ({", ".join(sorted(KINDS))}).')
  return Kind(None, {'float32': rate})


def memory_bytes(value):
  """The bytes `--device_memory` names ('80GB', '40GiB', '16384MB', or a
  name of `KNOWN_MEMORY`), or None without it.

  Raises:
    errors.ConfigError: neither a size nor a known name.
  """
  if not value:
    return None
  if value.lower() in KNOWN_MEMORY:
    return KNOWN_MEMORY[value.lower()] * GIB
  match = re.fullmatch(r'(\d+(?:\.\d+)?)\s*(GB|GIB|MB|MIB)', value.upper())
  if not match:
    raise errors.ConfigError(
        f'device_memory={value}: give a size (80GB, 16384MB) or a device '
        f'name ({", ".join(sorted(KNOWN_MEMORY))}).')
  scale = GIB if match.group(2).startswith('G') else 2**20
  size = int(float(match.group(1)) * scale)
  if size <= 0:
    raise errors.ConfigError(
        f'device_memory={value}: a device holds more than nothing; give '
        'its size, e.g. 80GB.')
  return size


def size_text(size):
  """Bytes as a person reads them: GiB to two places from a tenth of one,
  else MiB to one (a small device's memory is not '0 GiB')."""
  return f'{size / GIB:.2f} GiB' if size >= GIB / 10 else (
      f'{size / 2**20:.1f} MiB')
