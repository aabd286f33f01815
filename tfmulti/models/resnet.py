"""ResNets for small images: D2L's ResNet-18 and He et al.'s CIFAR ResNets."""

import functools

import keras
from keras import layers

from tfmulti import errors
from tfmulti.models import pixels

# BatchNorm's moving averages keep 0.9 of the old value per step: PyTorch's
# default (momentum=0.1), which D2L and He et al.'s Torch code trained with.
# Keras's 0.99 averages over ~100 steps and lags the weights in short runs,
# so evaluation (which uses the averages) trails training.
_BATCH_NORM_MOMENTUM = 0.9


def _batch_norm(synchronized, **options):
  """A BatchNormalization factory with the momentum above."""
  return functools.partial(layers.BatchNormalization,
                           momentum=_BATCH_NORM_MOMENTUM,
                           synchronized=synchronized, **options)


def _d2l_residual(x, filters, strides, use_1x1conv, batch_norm):
  """D2L's residual block: two 3x3 convs (with bias) and BN; 1x1 shortcut."""
  y = layers.Conv2D(filters, 3, strides=strides, padding='same')(x)
  y = layers.ReLU()(batch_norm()(y))
  y = batch_norm()(layers.Conv2D(filters, 3, padding='same')(y))
  if use_1x1conv:
    x = layers.Conv2D(filters, 1, strides=strides)(x)
  return layers.ReLU()(layers.Add()([y, x]))


def resnet18(input_shape, num_classes, *, sync_batch_norm=False):
  """ResNet-18 in the small-image form of D2L section 13.6.

  A 3x3 stem of 64 channels and no max pooling, then four stages of two
  residual blocks (64, 128, 256, 512 channels), global average pooling and a
  dense layer.

  Args:
    input_shape: (height, width, channels) of one image.
    num_classes: number of output logits.
    sync_batch_norm: see `cifar_resnet`.

  Returns:
    A functional `keras.Model` mapping images to logits.
  """
  batch_norm = _batch_norm(sync_batch_norm)
  inputs = keras.Input(input_shape, name='images')
  x = layers.Conv2D(64, 3, padding='same')(pixels.scaled(inputs))
  x = layers.ReLU()(batch_norm()(x))
  for stage, filters in enumerate((64, 128, 256, 512)):
    for block in range(2):
      downsample = stage > 0 and block == 0
      x = _d2l_residual(x, filters, 2 if downsample else 1, downsample,
                        batch_norm)
  x = layers.GlobalAveragePooling2D()(x)
  outputs = layers.Dense(num_classes, name='logits')(x)
  return keras.Model(inputs, outputs, name='resnet18')


def _option_a_shortcut(x, filters, strides):
  """Subsample, then zero-pad the new channels: no parameters.

  Built from Keras's own layers (no Lambda), so a saved `.keras` file loads
  anywhere without tfmulti's code.
  """
  if strides > 1:  # A 1x1 pool with stride s keeps rows and columns ::s.
    x = layers.MaxPooling2D(pool_size=1, strides=strides)(x)
  height, width, channels = x.shape[1:]
  pad = filters - channels
  x = layers.Reshape((height, width, channels, 1))(x)
  x = layers.ZeroPadding3D(((0, 0), (0, 0), (pad // 2, pad - pad // 2)))(x)
  return layers.Reshape((height, width, filters))(x)


def _cifar_block(x, filters, strides, regularizer, batch_norm):
  """He et al.'s basic block with the parameter-free shortcut (option A)."""
  def conv(strides):
    return layers.Conv2D(filters, 3, strides=strides, padding='same',
                         use_bias=False, kernel_initializer='he_normal',
                         kernel_regularizer=regularizer)
  y = layers.ReLU()(batch_norm()(conv(strides)(x)))
  y = batch_norm()(conv(1)(y))
  if strides > 1 or x.shape[-1] != filters:
    x = _option_a_shortcut(x, filters, strides)
  return layers.ReLU()(layers.Add()([y, x]))


def cifar_resnet(input_shape, num_classes, *, depth=20, width=16,
                 weight_decay=1e-4, name=None, sync_batch_norm=False):
  """The CIFAR-10 ResNet of He et al. 2016 (section 4.2), depth 6n + 2.

  Args:
    input_shape: (height, width, channels) of one image.
    num_classes: number of output logits.
    depth: 6n + 2 layers (20, 32, 44, 56, 110).
    width: channels of the first stage; the stages have width, 2x, 4x.
    weight_decay: L2 penalty on the kernels (1e-4 in the paper).
    name: model name, by default `resnet<depth>`.
    sync_batch_norm: BatchNorm uses the statistics of the global
      batch, all-reduced over tf.distribute replicas, not each replica's.

  Returns:
    A functional `keras.Model` mapping images to logits.

  Raises:
    errors.ConfigError: `depth` is not 6n + 2.
  """
  if depth < 8 or (depth - 2) % 6:
    raise errors.ConfigError(f'depth={depth}: a CIFAR ResNet has 6n + 2 layers '
                     '(8, 20, 32, ...).')
  regularizer = keras.regularizers.L2(weight_decay) if weight_decay else None
  batch_norm = _batch_norm(sync_batch_norm)
  inputs = keras.Input(input_shape, name='images')
  x = layers.Conv2D(width, 3, padding='same', use_bias=False,
                    kernel_initializer='he_normal',
                    kernel_regularizer=regularizer)(pixels.scaled(inputs))
  x = layers.ReLU()(batch_norm()(x))
  for stage in range(3):
    for block in range((depth - 2) // 6):
      strides = 2 if stage > 0 and block == 0 else 1
      x = _cifar_block(x, width * 2**stage, strides, regularizer, batch_norm)
  x = layers.GlobalAveragePooling2D()(x)
  outputs = layers.Dense(num_classes, kernel_regularizer=regularizer,
                         name='logits')(x)
  return keras.Model(inputs, outputs, name=name or f'resnet{depth}')


def resnet20(input_shape, num_classes, **options):
  """ResNet-20 for CIFAR-10 (He et al. 2016): 0.27M parameters."""
  return cifar_resnet(input_shape, num_classes, depth=20, **options)


def resnet8_thin(input_shape, num_classes, **options):
  """A shallow and thin CIFAR ResNet (depth 8, width 4) for fast tests."""
  return cifar_resnet(input_shape, num_classes, depth=8, width=4,
                      name='resnet8_thin', **options)


def _bottleneck(x, planes, strides, batch_norm, name):
  """torchvision's Bottleneck (ResNet v1.5): 1x1, 3x3 (strided), 1x1 x4."""
  def conv(filters, size, strides, suffix):
    return layers.Conv2D(filters, size, strides=strides, padding='same',
                         use_bias=False, name=f'{name}_{suffix}')
  y = layers.ReLU()(batch_norm()(conv(planes, 1, 1, 'conv1')(x)))
  y = layers.ReLU()(batch_norm()(conv(planes, 3, strides, 'conv2')(y)))
  y = batch_norm()(conv(planes * 4, 1, 1, 'conv3')(y))
  if strides > 1 or x.shape[-1] != planes * 4:
    x = batch_norm()(conv(planes * 4, 1, strides, 'downsample')(x))
  return layers.ReLU()(layers.Add(name=f'{name}_add')([y, x]))


def resnet50(input_shape, num_classes, *, sync_batch_norm=False):
  """ResNet-50 (He et al. 2016), as torchvision builds it.

  A 7x7 stride-2 stem and 3x3 stride-2 max pooling, bottleneck blocks
  [3, 4, 6, 3] of 64, 128, 256, 512 planes (the stride on the 3x3, v1.5),
  convolutions without bias, global average pooling and a dense layer:
  25,557,032 parameters with 1,000 classes. Blocks are named
  `layer<L>_block<B>_...` as torchvision's `layer<L>.<B>`, so stage
  boundaries read like the classic split (e.g. `layer3_block0_conv1`).

  Args:
    input_shape: (height, width, channels) of one image.
    num_classes: number of output logits.
    sync_batch_norm: see `cifar_resnet`.

  Returns:
    A functional `keras.Model` mapping images to logits.
  """
  batch_norm = _batch_norm(sync_batch_norm, epsilon=1e-5)
  inputs = keras.Input(input_shape, name='images')
  x = layers.Conv2D(64, 7, strides=2, padding='same', use_bias=False,
                    name='stem_conv')(pixels.scaled(inputs))
  x = layers.ReLU()(batch_norm()(x))
  x = layers.MaxPooling2D(3, strides=2, padding='same', name='stem_pool')(x)
  for layer, (planes, blocks) in enumerate(
      zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
    for block in range(blocks):
      strides = 2 if layer > 1 and block == 0 else 1
      x = _bottleneck(x, planes, strides, batch_norm,
                      name=f'layer{layer}_block{block}')
  x = layers.GlobalAveragePooling2D()(x)
  outputs = layers.Dense(num_classes, name='logits')(x)
  return keras.Model(inputs, outputs, name='resnet50')
