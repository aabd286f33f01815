"""`xla='auto'`, the default of `--xla` and of `TowersModel`'s `jit_compile`.

Whether the towers compile each clone's forward and backward pass with XLA
(one cluster per clone, on its device). The rule, logged once a deploy:
XLA is on where it is faster and keeps every guarantee, that is where

* each clone runs whole: stages and micro-batches run their pieces apart
  (`xla=True` is refused there);
* `reproducible_rows` is off: its atoms promise the same bits on every
  layout, which holds for the ops as written;
* BatchNorm is not synchronized: the lockstep clones all-reduce inside the
  pass;
* op determinism is off: XLA does not promise deterministic ops (Keras
  turns its XLA off there too);
* and the clones run on GPUs, where fusing a clone's elementwise ops into
  its convolutions and matmuls pays from the first steps (Keras's own
  `jit_compile='auto'` compiles there too), or on CPUs in a run of at
  least `CPU_MIN_STEPS` steps. Measured on this project's 2-core machine
  (BENCHMARKS.md, "The whole job"), XLA trained LeNet's steps about 2x and
  ResNet-20's 1.4-2x faster on CPUs after a first compile 0.7-1.2 s and
  about 3 s longer, and the whole job of 55 ResNet-20 steps took 0.74x
  (2 clones) the wall time without it. A run whose length is not known
  here (`deploy` called directly, `TowersModel.fit`) keeps it off on CPUs,
  as Keras does.
"""

import dataclasses

from absl import logging

from tfmulti import keras_internals
from tfmulti import step_options

CPU_MIN_STEPS = 50  # Steps after which XLA's compile has repaid on CPUs.


def why_not(config, options, total_steps=None):
  """The first reason XLA stays off for `options` on `config`'s clones
  in a run of `total_steps` steps (None: unknown) under the rule, or None
  when it goes on."""
  if config.num_stages > 1 or options.num_microbatches > 1:
    return 'the clones run in stages or micro-batches'
  if options.reproducible_rows:
    return 'reproducible_rows promises the bits of the ops as written'
  if options.sync_batch_norm:
    return 'synchronized BatchNorm all-reduces inside the pass'
  if keras_internals.op_determinism_enabled():
    return 'op determinism is on'
  on_gpus = all('GPU' in device.upper() for device in config.compute_devices())
  if not on_gpus and (total_steps or 0) < CPU_MIN_STEPS:
    return (f'the clones run on CPUs, where its compile repays a run of '
            f'{CPU_MIN_STEPS} steps or more, and this run has '
            f'{total_steps or "an unknown number of"} steps')
  return None


def resolve(config, options, total_steps=None):
  """`options` with `xla` True or False: as given, or by the rule when it
  is 'auto' (logged)."""
  if options.xla != step_options.AUTO:
    return options
  reason = why_not(config, options, total_steps)
  if reason:
    logging.info('xla=auto: off, as %s.', reason)
  else:
    logging.info('xla=auto: on, each clone compiled on its device.')
  return dataclasses.replace(options, xla=reason is None)
