"""Moved to `tfmulti.mesh.sharding` (the mesh's room); this name warns."""

from tfmulti import moved

moved.module(__name__)
