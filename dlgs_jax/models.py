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
