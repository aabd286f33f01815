"""A mesh's room: variables stored, and split layers computed, where
Keras's layouts say.

Below the towers (`deploy` builds its step on what is here), above the
ground floor; nothing here knows a clone's step, a model zoo or a data
set. A Keras `DeviceMesh` and `LayoutMap` are read once into
`VariableLayouts`; the storage follows from them.

  mesh_layouts     a ModelParallel's mesh and layout map, pure
  auto_layout      a layout map derived from a model (`layout_map='auto'`;
                   `tfmulti.mesh.auto_layout_map(model, device_mesh)`)
  sharding         each variable kind's storage: whole, or sharded into
                   its layout's shards
  records          each stored variable's read for a pass and its
                   gradient's cut: kept, joined, a table, released, blocks
  shards           a tensor cut into its shards (equal or as even as they
                   go) and joined back; a gradient's slices cut
  lookups          sharded Embedding tables looked up where they live
  table_plan       tables planned whole, by rows or by columns, balanced
                   (decided when the storage is made)
  tensor_parallel  split Dense and conv layers computed where their
                   kernels' blocks live, a mesh row one clone
  releases         a layer's sharded variables joined in its call and let
                   go after, joined again for its gradient (FSDP's)
  shard_views      a sharded optimizer checkpointed as one device's
"""

from tfmulti.mesh.mesh_layouts import auto_layout_map  # noqa: F401
