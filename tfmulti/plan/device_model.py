"""A step's time predicted from its dry run (`dry_run.Plan`).

Each device's time is its FLOPs at its peak rate, the bytes it moves on
each link (the more of what it sends and receives there) at the link's
bandwidth, a cost an op (an executor's dispatch and a kernel's launch)
and the bytes its ops write at a rate where one is known; a kernel timed
alone (`kernels`) counts its time instead of its estimate. Compute and
transfers are added, not overlapped: a bound that FSDP's prefetch and
NCCL's overlap beat, the same for every candidate. Devices run at once,
so a step is its slowest device's time, and a call's own cost; on
logical CPUs (`Rates.shared`) they share the cores, so a step is their
sum. The GPU figures are datasheets' (`device_kinds.KINDS`), the host's
and an op's cost estimates; on logical CPUs every rate is measured here
(`measured_rates`).
"""

import dataclasses

from tfmulti.plan import dry_run

# A host's float32 FLOP/s: a server's CPU cores' vector units, an estimate
# (its optimizer updates and input ops are memory-bound besides).
HOST_FLOPS = 1e12
# A cost an op on a GPU: TensorFlow's dispatch and a CUDA launch, a few
# microseconds each (an estimate).
GPU_OP_SECONDS = 5e-6
# The workers' network, bytes a second each way: 100 Gb/s.
NETWORK_BYTES = 12.5e9


@dataclasses.dataclass(frozen=True)
class Rates:
  """What a device model reads: FLOP/s of a device (and of the host),
  each link's bytes a second each way, a cost an op, whether the devices
  share their cores (logical CPUs), a step's call's own cost, and the
  bytes a second an op that computes little writes (memory-bound; none
  known for the GPU kinds: not counted there), and the seconds of each
  `kernels.Kernel` timed alone here (in place of its estimate)."""
  flops: float
  links: dict
  op_seconds: float
  host_flops: float = HOST_FLOPS
  shared: bool = False
  call_seconds: float = 0.0
  written_bytes: float = float('inf')
  kernel_seconds: dict = dataclasses.field(default_factory=dict)


def for_kind(kind, dtype):
  """The `Rates` of a `device_kinds.Kind` computing in `dtype` (its
  `Kind.rate` key: 'tf32' for float32 matmuls where TF32 is on)."""
  return Rates(kind.rate(dtype), dict(kind.links, network=NETWORK_BYTES),
               GPU_OP_SECONDS)


def device_seconds(device, report, rates):
  """One device's predicted seconds a step (see the module)."""
  flops = (rates.flops if dry_run.device_type(device) == 'GPU' or
           rates.shared else rates.host_flops)
  moved = sum(max(report.sent_bytes[link], report.received_bytes[link]) /
              rates.links[link]
              for link in set(report.sent_bytes) | set(report.received_bytes))
  def estimate(flop_count, written, ops):
    return (flop_count / flops + ops * rates.op_seconds +
            written / rates.written_bytes)
  timed = sum(count * (rates.kernel_seconds[kernel] - estimate(
      kernel.flops, kernel.written_bytes, 1))
              for kernel, count in report.kernels.items()
              if kernel in rates.kernel_seconds)
  return moved + timed + estimate(report.flops, report.written_bytes,
                                  report.ops)


def step_seconds(found, rates):
  """The predicted seconds of a step of `found` (a `dry_run.Plan`)."""
  times = [device_seconds(device, report, rates)
           for device, report in found.devices.items()]
  return rates.call_seconds + (sum(times) if rates.shared else max(times))

