"""Flax models used by the demo and the experiments."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class SmallCNN(nn.Module):
  """A compact CIFAR CNN (0.59M parameters): 4 conv + BatchNorm, 2 dense.

  Attributes:
    num_classes: output classes.
    bn_axis_name: mesh axis for synchronised BatchNorm statistics, or None for
      per-worker statistics.
  """
  num_classes: int = 10
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    for block_features in (32, 64):
      for _ in range(2):
        x = nn.Conv(block_features, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                         axis_name=self.bn_axis_name if train else None)(x)
        x = nn.relu(x)
      x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(128)(x))
    return nn.Dense(self.num_classes)(x)


def _batch_norm(train: bool, axis_name: str | None, name: str | None = None, zero_init=False):
  return nn.BatchNorm(
      use_running_average=not train, momentum=0.9, epsilon=1e-5,
      axis_name=axis_name if train else None, name=name,
      scale_init=nn.initializers.zeros if zero_init else nn.initializers.ones)


class _BasicBlock(nn.Module):
  """CIFAR ResNet basic block with the parameter-free shortcut (He et al. 2016, option A)."""
  features: int
  stride: int
  bn_axis_name: str | None

  @nn.compact
  def __call__(self, x, train):
    y = nn.Conv(self.features, (3, 3), self.stride, use_bias=False)(x)
    y = nn.relu(_batch_norm(train, self.bn_axis_name)(y))
    y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
    y = _batch_norm(train, self.bn_axis_name)(y)
    if self.stride != 1 or x.shape[-1] != self.features:
      x = x[:, ::self.stride, ::self.stride, :]
      extra = self.features - x.shape[-1]
      x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))
    return nn.relu(x + y)


class ResNetCifar(nn.Module):
  """ResNet-(6n+2) for CIFAR (He et al. 2016, Sec. 4.2); depth 20 has 0.27M parameters."""
  depth: int = 20
  num_classes: int = 10
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    if (self.depth - 2) % 6:
      raise ValueError(f"CIFAR ResNet depth must be 6n+2, got {self.depth}")
    blocks = (self.depth - 2) // 6
    x = nn.Conv(16, (3, 3), use_bias=False)(x)
    x = nn.relu(_batch_norm(train, self.bn_axis_name)(x))
    for stage, features in enumerate((16, 32, 64)):
      for block in range(blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        x = _BasicBlock(features, stride, self.bn_axis_name)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


VGG16_LAYERS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
  """VGG16 with BatchNorm for 32x32 inputs (14.7M parameters), one linear classifier."""
  num_classes: int = 10
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    for layer in VGG16_LAYERS:
      if layer == "M":
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
      else:
        x = nn.Conv(layer, (3, 3))(x)
        x = nn.relu(_batch_norm(train, self.bn_axis_name)(x))
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(self.num_classes)(x)


class _Bottleneck(nn.Module):
  features: int
  stride: int
  bn_axis_name: str | None

  @nn.compact
  def __call__(self, x, train):
    y = nn.Conv(self.features, (1, 1), use_bias=False)(x)
    y = nn.relu(_batch_norm(train, self.bn_axis_name)(y))
    y = nn.Conv(self.features, (3, 3), self.stride, use_bias=False)(y)
    y = nn.relu(_batch_norm(train, self.bn_axis_name)(y))
    y = nn.Conv(4 * self.features, (1, 1), use_bias=False)(y)
    y = _batch_norm(train, self.bn_axis_name, zero_init=True)(y)
    if self.stride != 1 or x.shape[-1] != 4 * self.features:
      x = nn.Conv(4 * self.features, (1, 1), self.stride, use_bias=False)(x)
      x = _batch_norm(train, self.bn_axis_name)(x)
    return nn.relu(x + y)


class ResNet50(nn.Module):
  """ResNet-50 (He et al. 2016) for ImageNet-sized input; 25.6M parameters at 1000 classes."""
  num_classes: int = 1000
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(64, (7, 7), 2, padding=((3, 3), (3, 3)), use_bias=False)(x)
    x = nn.relu(_batch_norm(train, self.bn_axis_name)(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for stage, (blocks, features) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
      for block in range(blocks):
        stride = 2 if stage > 0 and block == 0 else 1
        x = _Bottleneck(features, stride, self.bn_axis_name)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


MODELS = {
    "smallcnn": (SmallCNN, (32, 32, 3), 10),
    "resnet20": (ResNetCifar, (32, 32, 3), 10),
    "vgg16": (VGG16, (32, 32, 3), 10),
    "resnet50": (ResNet50, (224, 224, 3), 1000),
}


def create_model(name: str, *, num_classes: int | None = None, bn_axis_name: str | None = None):
  """Builds a model by name; returns (module, input shape without batch).

  Raises:
    ValueError: for an unknown name.
  """
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
  cls, shape, classes = MODELS[name]
  return cls(num_classes=num_classes or classes, bn_axis_name=bn_axis_name), shape


def param_shapes(name: str, *, num_classes: int | None = None, image_size: int | None = None):
  """Parameter tree of `name` as `jax.ShapeDtypeStruct`s (nothing allocated)."""
  import jax
  model, shape = create_model(name, num_classes=num_classes)
  if image_size is not None:
    shape = (image_size, image_size, shape[2])
  sample = jax.ShapeDtypeStruct((1,) + shape, jnp.float32)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(sample.shape), train=False))
  return variables["params"]


def leaf_shapes(name: str, *, num_classes: int | None = None, image_size: int | None = None
                ) -> dict[str, tuple[int, ...]]:
  """Leaf path (as `grouping.leaf_paths` writes it) -> shape of `name`'s parameters."""
  import jax
  from dlgs_jax.compress import grouping
  params = param_shapes(name, num_classes=num_classes, image_size=image_size)
  return dict(zip(grouping.leaf_paths(params),
                  (tuple(x.shape) for x in jax.tree_util.tree_leaves(params))))
