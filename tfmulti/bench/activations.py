"""Activation memory of a pipelined step, counted from its traced graph.

What each stage (chunk) keeps of micro-batch 0 between its passes: from
its forward pass to its backward pass B, and, where the schedule splits W
off, from B to W (`activation_bytes`); and the most a device holds at once
in its order of passes (`peak_bytes`). `schedule_timelines` reports them.
A buffer counts once, whatever views of it are read (`plan.peaks`'s
rules, which a dry run's peaks follow too).
"""

from tfmulti.plan import peaks


def _descendants(ops, among):
  """The names of the ops (in `among`) that read, at any depth, `ops`: by
  their outputs, or by waiting on them (control inputs: the ops W's gate
  releases, `pipeline.backward.release`)."""
  waiting = {}
  for op in ops[0].graph.get_operations() if ops else ():
    for control in op.control_inputs:
      waiting.setdefault(control.name, []).append(op)
  seen, todo = set(), list(ops)
  while todo:
    op = todo.pop()
    readers = [r for t in op.outputs for r in t.consumers()]
    for reader in readers + waiting.get(op.name, []):
      if reader.name in among and reader.name not in seen:
        seen.add(reader.name)
        todo.append(reader)
  return seen


def activation_bytes(graph, num_stages):
  """Per stage, what micro-batch 0 holds between its passes, counted from
  the traced step's graph: (bytes held from its forward pass to its
  backward pass B, bytes held from B to W). Until B: the tensors its
  forward pass made (its inputs too) that B or W reads. From B to W: the
  tensors W reads that F or B made (the deferred layers' inputs and their
  output gradients; under recomputation, B's forward tensors). W's ops are
  those that follow its gates (the ops it releases and what reads them);
  B's the stage's other reachable backward ops. A buffer is counted once,
  whatever views of it are read (`plan.peaks.VIEWS`)."""
  live = peaks.reachable(graph)
  held = []
  for s in range(num_stages):
    gates = [op for op in graph.get_operations()
             if f'microbatch_0/stage_{s}_weights/pass_gate' in op.name]
    reads_in_w = _descendants(gates, live) | {op.name for op in gates}
    to_b, to_w = {}, {}
    for op in graph.get_operations():
      made_in = _pass_of(op.name, s)
      if made_in is None or op.name not in live or op.name in reads_in_w:
        continue
      for tensor in op.outputs:
        if not tensor.shape.is_fully_defined():
          continue
        readers = {c.name for c in tensor.consumers()} & live
        size = {peaks.buffer_of(tensor).name: tensor.shape.num_elements() *
                tensor.dtype.size}
        if readers & reads_in_w:
          to_w.update(size)
          to_b.update(size if made_in == 'F' else {})
        elif made_in == 'F' and any(_pass_of(r, s) == 'B' for r in readers):
          to_b.update(size)
    held.append((sum(to_b.values()), sum(to_w.values())))
  return held


def _pass_of(name, stage):
  """'F' or 'B' for op `name` of micro-batch 0's forward or backward pass
  on `stage` (W's are told apart by what they read), else None."""
  forward = f'microbatch_0/stage_{stage}/'
  if f'microbatch_0/stage_{stage}_backward/' in name or (
      name.startswith('gradient_tape/') and forward in name):
    return 'B'
  return 'F' if forward in name else None


def peak_bytes(device_passes, held):
  """The most bytes of activations a device holds at once in its order of
  passes ((stage, kind, micro-batch), `schedules.device_orders`), each
  micro-batch holding `held[stage]`'s (to_b, to_w): to_b from F to B and
  to_w from B to W."""
  now = peak = 0
  for stage, kind, _ in device_passes:
    to_b, to_w = held[stage]
    now += {'F': to_b, 'B': to_w - to_b, 'W': -to_w}[kind]
    peak = max(peak, now)
  return peak
