"""Moved to `tfmulti.engine.checkpoints` (below both doors); this name warns."""

from tfmulti import moved

moved.module(__name__)
