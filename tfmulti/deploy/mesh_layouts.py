"""Moved to `tfmulti.mesh.mesh_layouts` (the mesh's room); this name warns."""

from tfmulti import moved

moved.module(__name__)
