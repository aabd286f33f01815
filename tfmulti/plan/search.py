"""`--plan=auto`: the layouts tfmulti can run for a job, ranked.

`candidates(n)` lists the layouts of one worker's n devices: variables
on the host, on one device, spread, spread with packed gradients,
sharded over all n (FSDP's layout: joined in each layer's call, with one
layer or none gathered ahead, or joined once and kept), and split over a
compute axis of m devices for each m dividing n (Megatron's, on a mesh
(n/m, m)), every map derived from the model (`layout_map='auto'`). The
caller plans each with the dry run (a candidate the towers refuse is
dropped with its reason); `ranked` drops those a device's memory cannot
hold, orders the rest by the step a device model predicts
(`device_model`), and says why each lost.
"""

import dataclasses
from typing import Optional

from tfmulti import device_kinds
from tfmulti.mesh import mesh_layouts


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One layout: its name, the command line's flags that say it, and the
  `DeploymentConfig` and `StepOptions` fields it sets."""
  name: str
  flags: tuple
  deploy: tuple = ()
  options: tuple = ()

  def applied(self, config, deploy_config):
    """The job's `TrainConfig` and `DeploymentConfig` with this layout's
    fields in place of theirs."""
    return (dataclasses.replace(config, step_options=dataclasses.replace(
        config.step_options, **dict(self.options))),
            deploy_config.replaced(**dict(self.deploy)))


@dataclasses.dataclass(frozen=True)
class Scored:
  """A candidate's plan: the most bytes a device needs (held and its
  step's peak), the most it moves a step, the predicted step in seconds,
  and why it was dropped (None: it runs)."""
  candidate: Candidate
  need_bytes: int = 0
  moved_bytes: int = 0
  seconds: float = float('inf')
  dropped: Optional[str] = None


def candidates(n, on_cpus=False):
  """The layouts of `n` devices (see the module), in a fixed order; on
  logical CPUs (`on_cpus`) without the one device's, which is the
  host's."""
  def mesh(shape, axes, **fields):
    return ('variable_layouts', mesh_layouts.VariableLayouts(
        shape, axes, mesh_layouts.AUTO, **fields)), ('variables_device', None)

  def whole(device):
    return ('variables_device', device), ('variable_layouts', None)

  def mesh_flags(shape, axes, *extra):
    return (('mesh_shape', ','.join(map(str, shape))),
            ('mesh_axes', ','.join(axes)), ('layout_map', 'auto'), *extra)
  found = [Candidate('variables on the host', (('variables_device', 'cpu'),),
                     whole(None))]
  if not on_cpus:
    found.append(Candidate('variables on GPU:0', (
        ('variables_device', 'gpu:0'),), whole('/device:GPU:0')))
  found += [
      Candidate('spread', (('variables_device', 'spread'),),
                whole('spread')),
      Candidate('spread, gradients packed',
                (('variables_device', 'spread'), ('gradient_packs', 'auto')),
                whole('spread'), (('gradient_packs', 'auto'),)),
  ]
  if n > 1:
    found += [
        Candidate('sharded', mesh_flags((n,), ('batch',)),
                  mesh((n,), ('batch',))),
        Candidate('sharded, none gathered ahead',
                  mesh_flags((n,), ('batch',), ('gather_ahead', '0')),
                  mesh((n,), ('batch',), gather_ahead=0)),
        Candidate('sharded, joins kept',
                  mesh_flags((n,), ('batch',), ('keep_joins', 'true')),
                  mesh((n,), ('batch',), keep_joins=True)),
    ]
  for m in (m for m in range(2, n + 1) if n % m == 0):
    shape = (n // m, m)
    found.append(Candidate(
        f'split over {m}', mesh_flags(shape, ('batch', 'model')),
        mesh(shape, ('batch', 'model'))))
  return found


def scored(candidate, found, seconds):
  """A candidate's `Scored` from its dry run (`dry_run.Plan`) and its
  predicted step: its GPUs' figures (the host's apart), or on logical
  CPUs every device's."""
  reports = ([r for d, r in found.devices.items() if 'GPU' in d] or
             list(found.devices.values()))
  return Scored(
      candidate,
      max(r.held_bytes + r.peak_bytes for r in reports),
      max(max(sum(r.sent_bytes.values()), sum(r.received_bytes.values()))
          for r in reports),
      seconds)


def ranked(rows, memory_bytes):
  """`rows` (`Scored`) with those over `memory_bytes` dropped, the runs
  first, fastest first, then the dropped in their order."""
  text = device_kinds.size_text
  rows = [dataclasses.replace(row, dropped=(
      f'needs {text(row.need_bytes)} a device, over its '
      f'{text(memory_bytes)}'))
          if row.dropped is None and memory_bytes is not None and
          row.need_bytes > memory_bytes else row for row in rows]
  runs = sorted((r for r in rows if r.dropped is None),
                key=lambda r: r.seconds)
  return runs + [r for r in rows if r.dropped is not None]
