"""The training job: what the command line calls, and what it is made of.

  job          train_and_evaluate: data, trainer, loop, evaluation, metrics
  registry     --strategy name -> the builder of its trainer
  config       TrainConfig: what to train, for how long, where to write
  build        the model, optimizer, loss and schedule every path trains
  loop         the training loop over any trainer
  step_calls   one step a call, or many (--steps_per_loop)
  epochs       several epochs' batches through one iterator
  checkpoints, run_dir, metrics, summaries, profiling, learning_rates,
               export
"""
