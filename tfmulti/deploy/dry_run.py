"""Moved to `tfmulti.plan.dry_run` (the plan's room); this name warns."""

from tfmulti import moved

moved.module(__name__)
