"""Moved to `tfmulti.engine.registry` (below both doors); this name warns."""

from tfmulti import moved

moved.module(__name__)
