"""Moved to `tfmulti.engine.step_calls` (below both doors); this name warns."""

from tfmulti import moved

moved.module(__name__)
