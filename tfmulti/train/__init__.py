"""The training job: what the command line calls, and what it is made of.

  job          train_and_evaluate: data, trainer, loop, evaluation, metrics
  planned_job  --dry_run: the job planned for its GPUs, traced, not run
  config       TrainConfig: what to train, for how long, where to write
  build        the model, optimizer, loss and schedule every path trains
  loop         the training loop over any trainer
  epochs       several epochs' batches through one iterator
  run_dir, metrics, summaries, profiling, learning_rates, export
  registry, step_calls, checkpoints   moved to `tfmulti.engine` (these
               names warn)
"""
