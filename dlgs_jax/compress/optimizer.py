"""The whole optimizer of a run: the compressor, weight decay, then SGD.

Weight decay is added after the exchange, so it costs no traffic and never
enters the residuals. DGC is the exception, as in its paper: weight decay,
then DGC (which holds the momentum), then plain SGD.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import optax

from dlgs_jax.compress.hierarchical import two_level
from dlgs_jax.compress.methods import ConfigError, MethodConfig


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """SGD with momentum and decoupled-from-the-exchange weight decay.

  Attributes:
    lr: the base learning rate (the schedule divides it; see `training.config`).
    momentum: SGD momentum in [0, 1) (0: none).
    nesterov: Nesterov momentum.
    weight_decay: L2 weight decay added to the update after the exchange.
  """
  lr: float = 0.1
  momentum: float = 0.9
  nesterov: bool = False
  weight_decay: float = 5e-4

  def validate(self) -> "OptimizerConfig":
    """Raises `ConfigError` naming the first bad option; returns self."""
    if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
      raise ConfigError("lr", self.lr, "must be a positive number")
    if not 0 <= self.momentum < 1:
      raise ConfigError("momentum", self.momentum, "must be in [0, 1)")
    if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
      raise ConfigError("weight_decay", self.weight_decay, "must be >= 0")
    return self


def build_optimizer(method: MethodConfig, optimizer: OptimizerConfig, *, axis_name,
                    schedule, groups=None, order: Sequence[str] = (), seed: int = 0,
                    warmup_steps: int = 0, fast_size: Optional[int] = None
                    ) -> optax.GradientTransformation:
  """The chain whose updates are added to the parameters.

  Args:
    method: the compressor's config.
    optimizer: momentum, Nesterov and weight decay (its ``lr`` is not read:
      `schedule` gives the learning rate).
    axis_name: the data-parallel mesh axis, or None for one worker; with
      `fast_size`, the pair ``(node axis, local axis)``.
    schedule: learning rate, a number or an optax schedule.
    groups: planned layer groups for the methods that take them, or None.
    order: leaf paths in backward order.
    seed: the random methods' seed.
    warmup_steps: DGC's density warm-up in steps.
    fast_size: devices per node: the compressor runs as `hierarchical.two_level`
      (dense inside a node, the method between nodes); None: flat.
  """
  optimizer.validate()
  options = (dict(seed=seed, warmup_steps=warmup_steps, momentum=optimizer.momentum)
             if method.spec.holds_momentum else dict(groups=groups, order=order, seed=seed))
  if fast_size is None:
    compressor = method.compressor(axis_name=axis_name, **options)
  else:
    slow_axis, fast_axis = axis_name
    compressor = two_level(lambda axis: method.compressor(axis_name=axis, **options),
                           fast_axis=fast_axis, slow_axis=slow_axis, fast_size=fast_size)
  if method.spec.holds_momentum:
    # Momentum lives inside DGC (momentum correction), and weight decay goes in
    # before it, as in the paper; the optimizer after it is plain SGD.
    return optax.chain(optax.add_decayed_weights(optimizer.weight_decay), compressor,
                       optax.sgd(schedule))
  return optax.chain(
      compressor,
      optax.add_decayed_weights(optimizer.weight_decay),
      optax.sgd(schedule, momentum=optimizer.momentum or None, nesterov=optimizer.nesterov))
