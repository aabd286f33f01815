"""The training batches of several epochs, read through one iterator.

Each epoch has its own dataset (`data.Data.train_epoch`: its own seed, so
any epoch's order can be rebuilt after a restart), but an iterator a
epoch pays its making (the pipeline's functions and threads, about 10 ms
on 2 cores) and a stall at its start (the shuffle buffer filling) once
an epoch: for a small model on a small set (LeNet on digits, 11 steps an
epoch) that is more than a tenth of the job. `Epochs` concatenates up to
`EPOCHS_AN_ITERATOR` epochs behind one prefetch, so the next epoch's first
batches are read while this one's evaluation runs, as Keras's `fit` reads
one dataset. The rows and their order are the epochs' own.
"""

import dataclasses

import tensorflow as tf

EPOCHS_AN_ITERATOR = 16  # Bounds the Python work of making one chain.


@dataclasses.dataclass(frozen=True)
class Epochs:
  """One iterator over epochs [first, end) of a run, from a position.

  Attributes:
    iterator: what `calls.runner.iterator` made of the batches.
    end: the epoch after its last.
    shares: the trainer's clone shares when it was cut (a feed cuts its
      shards by them: new shares need a new chain).
  """
  iterator: object
  end: int
  shares: object

  def serves(self, epoch, trainer):
    """Whether it holds `epoch`'s batches, cut by `trainer`'s shares."""
    return epoch < self.end and self.shares == trainer.clone_shares


def chain(run, position, runner):
  """`Epochs` from `position` (its epoch's remaining batches first) to the
  run's last step or `EPOCHS_AN_ITERATOR` epochs, read by `runner`."""
  step, epoch, _ = position
  steps_per_epoch = run.dataset.train_examples // run.global_batch_size
  skip = position.steps_done(run.global_batch_size)
  epochs_left = -(-(run.total_steps - step + skip) // steps_per_epoch)
  end = epoch + max(1, min(EPOCHS_AN_ITERATOR, epochs_left))
  batches = run.dataset.train_epoch(epoch, skip_batches=skip)
  for later in range(epoch + 1, end):
    batches = batches.concatenate(run.dataset.train_epoch(later))
  batches = batches.prefetch(tf.data.AUTOTUNE)
  if not run.dataset.per_worker:  # Else it holds this worker's rows only.
    batches = run.trainer.distribute_dataset(batches)
  return Epochs(runner.iterator(batches), end, run.trainer.clone_shares)
