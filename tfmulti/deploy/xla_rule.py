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
  `jit_compile='auto'` compiles there, and only there). On CPUs it stays
  off, as Keras keeps it: what it gains there depends on the CPU. On one
  2-core machine it trained LeNet's steps about 2x and ResNet-20's 1.4-2x
  faster; on this project's AMD EPYC (AVX-512) it made the whole job
  slower, ResNet-20's 5 epochs 1.22-1.41x plain `fit`'s wall against
  0.75-0.88x without it, and LeNet's 40 epochs 1.53x against 1.19-1.31x
  (BENCHMARKS.md, "The whole job"). `--xla` compiles CPU clones on request.
"""

import dataclasses

from absl import logging

from tfmulti import keras_internals
from tfmulti import layouts
from tfmulti import step_options


def why_not(config, options):
  """The first reason XLA stays off for `options` on `config`'s clones
  under the rule, or None when it goes on."""
  if layouts.is_staged(config, options):
    return 'the clones run in stages or micro-batches'
  if options.reproducible_rows:
    return 'reproducible_rows promises the bits of the ops as written'
  if options.sync_batch_norm:
    return 'synchronized BatchNorm all-reduces inside the pass'
  if keras_internals.op_determinism_enabled():
    return 'op determinism is on'
  if not all('GPU' in device.upper()
             for device in config.compute_devices()):
    return ('the clones run on CPUs, where what XLA gains depends on the '
            'CPU (give --xla to compile them)')
  return None


def resolve(config, options):
  """`options` with `xla` True or False: as given, or by the rule when it
  is 'auto' (logged)."""
  if options.xla != step_options.AUTO:
    return options
  reason = why_not(config, options)
  if reason:
    logging.info('xla=auto: off, as %s.', reason)
  else:
    logging.info('xla=auto: on, each clone compiled on its device.')
  return dataclasses.replace(options, xla=reason is None)
