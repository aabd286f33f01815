"""Benchmarks: what each design costs, measured side by side.

Every module is a command (`python -m tfmulti.bench.NAME`), but for the
four that hold what the others share:

  designs             `python -m tfmulti.bench`: each design's step cost
  activations         (shared) a pipelined step's activations, from the graph
  variants            the variants `designs` times, built as training does
  e2e                 whole training runs against plain Keras `fit`
  checkpoint_stall    what a checkpoint adds to the steps, background or not
  processes           train.py against a Keras script, as whole processes
  fit_script          the plain Keras script `processes` times
  embedding_transfers an Embedding's gradient bytes a step: slices, not a table
  flags               (shared) the flags benchmarks share: model, clones, output
  flops               a step's share of the device's matmul rate
  input               the input pipeline against data already on device
  pipeline            the model-parallel experiment (ResNet-50 in stages)
  plan_calibration    the plan's predicted steps against those measured here
  schedule_timelines  each schedule's idle and activations, emulated
  sharded             a layout map's bytes held and moved, and its step
  step_profile        where a step's op time goes, towers against mirrored
  emulated            (shared) devices whose passes wait, not compute
  sync_batch_norm     synchronized BatchNorm's first step, against plain
  table_plan          a recommender's tables planned, against whole and rows
  tables              a table by rows: bytes held, and moved against touched
  tensor_parallel     split feed-forward blocks: activations, all-reduces
  transfers           each device's bytes held and moved, from the graph
  unequal_clones      automatic shares on an unequal pair of clones
"""
