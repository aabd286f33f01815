"""tfmulti.bench.activations: a pipelined step's activation memory,
counted from the traced graph."""

import pytest

from tfmulti.bench import activations
from tfmulti.bench import emulated
from tfmulti.bench import schedule_timelines as bench
from tfmulti.pipeline import schedules

NO_WAITS = {'F': 0.0, 'B': 0.0, 'W': 0.0}


def _peak_bytes(schedule, recompute=False, k=2, m=8):
  log = emulated.PassLog()
  deployed = bench.deploy_stages(k, m, schedule, log, NO_WAITS, recompute)
  images, labels = bench.batch(64)
  graph = deployed.traced_step(images, labels).graph
  counted = activations.activation_bytes(graph, k)
  return [activations.peak_bytes(device, counted)
          for device in schedules.device_orders(schedule, k, m)], counted


@pytest.mark.slow
def test_activation_memory_counted_from_the_graph():
  gpipe, counted = _peak_bytes('gpipe')
  one_f_one_b, _ = _peak_bytes('1f1b')
  recomputed, _ = _peak_bytes('1f1b', recompute=True)
  zero_bubble, split = _peak_bytes('zb_h1')
  # Stage 0 keeps its input and its 6 Dense layers' outputs a micro-batch:
  # 7 tensors of 8 rows x 64 float32 features, until its backward pass.
  tensor = 8 * bench.WIDTH * 4
  assert counted[0] == (7 * tensor, 0)
  assert one_f_one_b[0] == gpipe[0] // 4  # 2 micro-batches held, not 8.
  assert recomputed[0] <= one_f_one_b[0] // 2
  # ZB-H1's stage 0 has no input gradient to give: its B is empty, and W
  # takes the whole backward pass from the 7 tensors and the gradient it
  # was handed. F0 F1 B0 W0 ...: 2 micro-batches and that gradient at most.
  assert split[0] == (7 * tensor, 8 * tensor)
  assert zero_bubble[0] == 15 * tensor
  # The last stage's W reads, of each of its 6 Dense layers, the input and
  # the gradient before the activation (B took the activation's), the
  # emulated layer's output gradient, and the logits' input and gradient:
  # a deferred micro-batch holds more than its forward pass did here.
  assert split[1][1] == 14 * tensor + 8 * 10 * 4
  assert split[1][1] > split[1][0]
  assert max(zero_bubble) > max(one_f_one_b)


@pytest.mark.slow
def test_attention_stages_hold_what_w_reads_and_no_more_than_1f1b():
  """Where the forward pass keeps more than W reads (the attention's
  probabilities), a deferred micro-batch holds less than a whole one, and
  ZB-H1 holds at most 1.1x 1F1B's busiest stage."""
  def peaks(schedule):
    log = emulated.PassLog()
    deployed = bench.deploy_stages(2, 4, schedule, log, NO_WAITS,
                                   block='attention')
    graph = deployed.traced_step(*bench.batch(16, block='attention')).graph
    held = activations.activation_bytes(graph, 2)
    return held, [activations.peak_bytes(device, held) for device in
                  schedules.device_orders(schedule, 2, 4)]
  _, one_f_one_b = peaks('1f1b')
  held, zero_bubble = peaks('zb_h1')
  assert held[1][1] < held[1][0]
  assert max(zero_bubble) <= 1.1 * max(one_f_one_b)
