"""Moved to `tfmulti.mesh.shard_views` (the mesh's room); this name warns."""

from tfmulti import moved

moved.module(__name__)
