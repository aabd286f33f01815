"""Moved to `tfmulti.mesh.table_plan` (the mesh's room); this name warns."""

from tfmulti import moved

moved.module(__name__)
