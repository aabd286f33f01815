"""`xla='auto'`, the default of `--xla` and of `TowersModel`'s `jit_compile`.

Whether the towers compile each clone's forward and backward pass with XLA
(one cluster per clone, on its device). The rule, logged once a deploy:
XLA is on where it is faster and keeps every guarantee, that is where

* every clone runs on a GPU, where fusing a clone's elementwise ops into
  its convolutions and matmuls pays most (Keras's own `jit_compile='auto'`
  compiles there too). On CPUs, logical or not, it is off: measured on this
  project's 2-core machine, XLA trains LeNet's steps about 20% and
  ResNet-20's about 7% faster but first compiles for 0.7 s and 3.5 s, so it
  repays only long runs (BENCHMARKS.md); ask for it there with `xla=True`;
* each clone runs whole: stages and micro-batches run their pieces apart
  (`xla=True` is refused there);
* `reproducible_rows` is off: its atoms promise the same bits on every
  layout, which holds for the ops as written;
* BatchNorm is not synchronized: the lockstep clones all-reduce inside the
  pass;
* op determinism is off: XLA does not promise deterministic ops (Keras
  turns its XLA off there too).
"""

import dataclasses

from absl import logging

from tfmulti import keras_internals
from tfmulti import step_options


def why_not(config, options):
  """The first reason XLA stays off for `options` on `config`'s clones
  under the rule, or None when it goes on."""
  if not all('GPU' in device.upper() for device in config.compute_devices()):
    return ('the clones run on CPUs, where the compile repays only long runs '
            '(--xla turns it on)')
  if config.num_stages > 1 or options.num_microbatches > 1:
    return 'the clones run in stages or micro-batches'
  if options.reproducible_rows:
    return 'reproducible_rows promises the bits of the ops as written'
  if options.sync_batch_norm:
    return 'synchronized BatchNorm all-reduces inside the pass'
  if keras_internals.op_determinism_enabled():
    return 'op determinism is on'
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
    logging.info('xla=auto: on, each clone compiled on its GPU.')
  return dataclasses.replace(options, xla=reason is None)
