"""`TF_CONFIG`: the one JSON that places a worker in its job.

TensorFlow's multi-worker strategies read the job's workers and this
worker's index from the environment variable `TF_CONFIG`. Everything that
writes one (the one-machine launcher, a cluster found under Slurm or in a
Kubernetes Indexed Job) writes it here. Pure: the launcher imports no
TensorFlow.
"""

import json

VARIABLE = 'TF_CONFIG'  # The environment variable's name.
# Set by an elastic launch (`tfmulti.launch --min_workers`) for every
# worker: the job's start, 0 the first, 1 after the first loss, ...
ELASTIC_START = 'TFMULTI_ELASTIC_START'


def for_worker(workers, index):
  """The `TF_CONFIG` value of worker `index` of `workers` ('host:port'
  addresses, in worker order)."""
  return json.dumps({'cluster': {'worker': list(workers)},
                     'task': {'type': 'worker', 'index': index}})
