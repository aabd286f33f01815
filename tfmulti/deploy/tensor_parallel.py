"""Moved to `tfmulti.mesh.tensor_parallel` (the mesh's room); this name
warns."""

from tfmulti import moved

moved.module(__name__)
