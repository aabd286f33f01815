"""Moved to `tfmulti.plan.traffic` (the plan's room); this name warns."""

from tfmulti import moved

moved.module(__name__)
