"""Moved to `tfmulti.mesh.lookups` (the mesh's room); this name warns."""

from tfmulti import moved

moved.module(__name__)
