"""The plan's room: a built step read before it runs.

Above the towers (it builds the real job and traces its step), below the
doors that offer a dry run (`train.planned_job`, `fit.planned`).

  dry_run  a step traced for absent GPUs: kernels, bytes, FLOPs
  peaks    each device's most tensor bytes at once, from the graph
  traffic  each device's bytes held and moved, from the graph
  device_model  a step's time predicted from its plan and a device kind
  measured_rates  this machine's rates, measured: what a CPU plan reads
  kernels  a step's heavy ops rebuilt alone, timed here
  search   the layouts of N devices (`--plan=auto`), planned and ranked
"""
