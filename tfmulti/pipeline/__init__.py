"""Model and pipeline parallelism inside a clone: stages and micro-batches.

  stages     cut a functional model into stages; one clone's step through
             them in micro-batches
  schedules  each schedule's order of passes (GPipe, 1F1B, ZB-H1,
             interleaved 1F1B, ZB-V) and where its chunks run
  backward   a stage's backward pass and the loss: fused, or split (B, W)
  partition  the optimal contiguous cut of the layers' costs
  costs      each layer's cost: estimated from shapes, or measured
"""

from tfmulti.pipeline.stages import Stages  # noqa: F401
