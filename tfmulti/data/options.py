"""`InputOptions`: how a dataset is read, one frozen record passed whole.

The command line turns its input flags (`--image_size`, `--augment`,
`--validation_fraction`, `--validation_glob`, `--label_offset`,
`--num_classes`, `--shard_files`) into one `InputOptions` at once;
`data.load` takes it whole. Every rule that needs no data is checked here,
on construction.
"""

import dataclasses
from typing import Optional, Tuple

from tfmulti import errors

FLIP = 'flip'
CROP = 'crop'
AUGMENTATIONS = (FLIP, CROP)


@dataclasses.dataclass(frozen=True)
class InputOptions:
  """How the images and labels of a dataset are read.

  Attributes:
    image_size: (height, width) every image is resized to (bilinear, on
      float pixels in [0, 255]); None keeps the data's own, which must
      then be one size.
    validation_fraction: the share held out for evaluation when a source
      has no evaluation split of its own (a folder without `train` and
      `test` subfolders, a TFDS dataset with only a train split, TFRecords
      without `validation_glob`), drawn with the job's seed.
    validation_glob: TFRecord files of the evaluation split
      (`tfrecord:GLOB` only).
    label_offset: subtracted from every TFRecord label (TF's ImageNet
      converter writes 1..1000: give 1).
    num_classes: the TFRecords' class count; None reads it from the labels
      (the largest, plus one).
    augment: names from `AUGMENTATIONS`, applied to training rows only:
      `flip` mirrors a row left-right with probability 1/2, `crop` pads it
      by an eighth of each side and crops back at a random offset. Each
      row's draw is seeded by (seed, epoch, position in the epoch), so
      every layout and a resumed run see the same augmented rows.
    shard_files: in a multi-worker job, each worker reads its own share of
      the training files (file i to worker i mod N), for I/O, instead of
      every worker reading them all and taking its rows of each global
      batch. It trades exactness: each worker shuffles its own files' rows,
      so the run no longer equals one process. Every worker trains the
      same steps an epoch: those of the worker with the fewest rows.
  """
  image_size: Optional[Tuple[int, int]] = None
  validation_fraction: float = 0.2
  validation_glob: Optional[str] = None
  label_offset: int = 0
  num_classes: Optional[int] = None
  augment: Tuple[str, ...] = ()
  shard_files: bool = False

  def __post_init__(self):
    for side in self.image_size or ():
      errors.check_count('image_size', side, 1)
    if not 0 < self.validation_fraction < 1:
      raise errors.ConfigError(
          f'validation_fraction={self.validation_fraction}: give a share in '
          '(0, 1), e.g. 0.2.')
    errors.check_count('label_offset', self.label_offset, 0)
    if self.num_classes is not None:
      errors.check_count('num_classes', self.num_classes, 2)
    for name in self.augment:
      errors.check_choice('augment', name, AUGMENTATIONS)
    if len(set(self.augment)) < len(self.augment):
      raise errors.ConfigError(
          f'augment={",".join(self.augment)}: name each augmentation once.')


DEFAULTS = InputOptions()
