"""DLGS's threshold rules: when a reused threshold is recomputed, and how it is aimed.

Every rule computes each leaf's threshold exactly (the k_l-th largest ``|g|``
of that step's values) on step 0 and every `every` steps, and reuses it until
the next exact one (Ju et al. 2024, Algorithm 1); a step selects with the
thresholds it starts from, so an exact threshold serves from the step after
the one it was computed on. They differ on the reuse steps:

* `FixedReuse` -- the paper: thresholds reused as they are.
* `RefreshReuse` -- reused as they are, but a group recomputes early when one
  of its leaves passes fewer than ``below * k_l`` values or more than its buffer.
* `AdaptedReuse` -- the default: each leaf re-aims its threshold every step
  from a few candidates around the reused one, and its group recomputes when
  they pass too little altogether or one leaf overflows badly.

Why adapt: right after an exact step the values sent leave the residual, so
the old threshold passes far fewer than k_l values and a fixed schedule sends
less than the density asks for (measured in experiments/README.md, section 2).

Each rule validates its fields when built and owns both halves of a reuse
step: the thresholds it proposes (`propose`) and the drift test that sends its
group to an exact step (`drifted`); `engine.propose` and `engine.settle`
apply them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from dlgs_jax.compress import selection


def _check_every(rule: str, every) -> None:
  if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
    raise ValueError(f"{rule}(every={every!r}) is invalid: every must be an integer >= 1 "
                     f"(1 computes exact thresholds on every step, for the next)")


def _check_below(rule: str, below) -> None:
  if (isinstance(below, bool) or not isinstance(below, numbers.Real)
      or not 0.0 <= below <= 1.0):
    raise ValueError(f"{rule}(below={below!r}) is invalid: below must be a fraction of k "
                     f"in [0, 1] (0 never recomputes for sending too little)")


class _ReusedAsTheyAre:
  """The reuse step of the rules that keep a reused threshold as it is."""

  def propose(self, previous, **_) -> jax.Array:
    """The reused thresholds as they are (float32 [L])."""
    return previous

  def every_step(self, ks, whole) -> list[bool]:
    """No leaf's threshold is computed exactly on every step."""
    del whole
    return [False] * len(ks)


@dataclasses.dataclass(frozen=True)
class FixedReuse(_ReusedAsTheyAre):
  """The paper's schedule: exact thresholds every `every` steps, reused as they are.

  Attributes:
    every: steps between exact thresholds (>= 1; 1: each step selects at the
      exact thresholds of the step before).
  """
  every: int = 10

  def __post_init__(self):
    _check_every("FixedReuse", self.every)

  def drifted(self, passed, ks, capacities, sparse, live) -> jax.Array:
    """Never: the paper recomputes on its schedule only."""
    del passed, ks, capacities, sparse, live
    return jnp.zeros((), jnp.bool_)


@dataclasses.dataclass(frozen=True)
class RefreshReuse(_ReusedAsTheyAre):
  """Reused thresholds kept as they are until a leaf leaves its band.

  Attributes:
    every: steps between scheduled exact thresholds (>= 1).
    below: a group recomputes early when one of its leaves passes fewer than
      ``below * k_l`` values (in [0, 1]), or more than its buffer holds.
  """
  every: int = 10
  below: float = 0.5

  def __post_init__(self):
    _check_every("RefreshReuse", self.every)
    _check_below("RefreshReuse", self.below)

  def drifted(self, passed, ks, capacities, sparse, live) -> jax.Array:
    """Whether a group's reused thresholds are off: one leaf outside its band (bool scalar).

    Args:
      passed: int32 [L], values each leaf passes at its reused threshold.
      ks: the leaves' k_l (static, [L]).
      capacities: their buffer sizes (static, [L]).
      sparse: static bool [L], False for leaves sent whole or recomputed on every
        step (never checked).
      live: bool [L], False where the threshold is 0: the last exact step found
        fewer than k_l nonzero values, so the leaf sends every one it has and
        recomputing cannot make it send more.
    """
    low = np.ceil(self.below * np.asarray(ks)).astype(np.int64)
    return jnp.any((((passed < low) & live) | (passed > np.asarray(capacities)))
                   & np.asarray(sparse))


@dataclasses.dataclass(frozen=True)
class AdaptedReuse:
  """Reused thresholds re-aimed on every step from a few candidates (the default).

  On a reuse step each leaf counts the values passing at `candidates`
  multiples ``2^(j/8)`` of its reused threshold, two thirds of them below it,
  and interpolates linearly between the two that bracket ``max(aim, below) *
  k_l`` values. Below, because the residual loses what was sent; close
  together, because error feedback piles the residual up just below the
  threshold, where a few percent change the count several-fold. Leaves of
  ``k_l < exact_below_k`` have their exact threshold computed on every step
  instead (serving on the next, as every exact threshold does): their counts
  move by whole values, too coarse to aim with.

  A group recomputes every threshold exactly when its leaves together send
  fewer than ``below`` of its k, or one leaf passes more than `overflow` times
  its buffer: asking every leaf of a large merged group to stay in its band
  would have the group recompute on nearly every step.

  Attributes:
    every: steps between scheduled exact thresholds (>= 1).
    below: the group's recompute trigger, a fraction of its k (in [0, 1]).
    candidates: thresholds tried per leaf and step (in [2, 16]).
    aim: the target count as a fraction of k_l (in (0, 2]), counted on the
      values the threshold is re-aimed on. The step that uses it passes fewer,
      since what the step before sent has left the residual, so an aim of 1
      sends less than k on average; above about 1, a leaf passing more than
      its buffer sends its first passing values in index order, not its
      largest, and above 1 exact steps overflow too, so what is laid out last
      can wait indefinitely (with one threshold per message, the first
      layers; experiments/README.md, section 2, measures both).
    overflow: how many times its buffer a leaf may pass before its group
      recomputes (>= 1; ``math.inf``: never); what does not fit waits in the
      residual.
    exact_below_k: leaves keeping fewer values have their exact threshold
      computed on every step (>= 0).
  """
  every: int = 10
  below: float = 0.5
  candidates: int = 7
  aim: float = 0.9
  overflow: float = 2.0
  exact_below_k: int = 16

  def __post_init__(self):
    _check_every("AdaptedReuse", self.every)
    _check_below("AdaptedReuse", self.below)
    if (isinstance(self.candidates, bool) or not isinstance(self.candidates, numbers.Integral)
        or not 2 <= self.candidates <= 16):
      raise ValueError(f"AdaptedReuse(candidates={self.candidates!r}) is invalid: candidates "
                       f"must be an integer in [2, 16] (for none, use RefreshReuse)")
    if isinstance(self.aim, bool) or not isinstance(self.aim, numbers.Real) or not (
        0.0 < self.aim <= 2.0):
      raise ValueError(f"AdaptedReuse(aim={self.aim!r}) is invalid: aim must be in (0, 2]")
    if (isinstance(self.overflow, bool) or not isinstance(self.overflow, numbers.Real)
        or not self.overflow >= 1.0):
      raise ValueError(f"AdaptedReuse(overflow={self.overflow!r}) is invalid: overflow must "
                       f"be a number >= 1")
    if (isinstance(self.exact_below_k, bool)
        or not isinstance(self.exact_below_k, numbers.Integral) or self.exact_below_k < 0):
      raise ValueError(f"AdaptedReuse(exact_below_k={self.exact_below_k!r}) is invalid: it "
                       f"must be an integer >= 0")

  @property
  def target(self) -> float:
    """Values an adapted threshold aims to pass, as a fraction of k_l."""
    return max(self.aim, self.below)

  def factors(self) -> np.ndarray:
    """Multipliers of a reused threshold tried on a reuse step, float32 [candidates]."""
    below = (2 * (self.candidates - 1) + 2) // 3
    return (2.0 ** (np.arange(-below, self.candidates - below) / 8)).astype(np.float32)

  def propose(self, previous: jax.Array, *, ks: Sequence[int], whole: Sequence[bool],
              count: Callable, sizes: Sequence[int]) -> jax.Array:
    """Each leaf's threshold re-aimed at ``target * k_l`` values (those of small k kept).

    Returns float32 [L].

    Args:
      previous: float32 [L], the group's thresholds of the last step.
      ks: the leaves' k_l (static).
      whole: static, per leaf whether it is sent whole (never aimed).
      count: ``(thresholds [N, M], strides, leaves) -> int32 [N, M]``, the values
        of each listed leaf passing each threshold, counted on every stride-th
        value (`segmented.count_at`).
      sizes: the leaves' sizes (static).
    """
    few = self.every_step(ks, whole)
    aimed = [i for i, w in enumerate(whole) if not w and not few[i]]
    chosen = self._aimed(previous, ks, aimed, count, sizes) if aimed else previous
    return chosen

  def every_step(self, ks, whole) -> list[bool]:
    """The leaves of ``k_l < exact_below_k``: their exact threshold is computed every step."""
    return [k < self.exact_below_k and not w for k, w in zip(ks, whole)]

  def _aimed(self, previous, ks, aimed, count, sizes) -> jax.Array:
    """Thresholds of the `aimed` leaves aimed at ``target * k_l`` values, float32 [L].

    The candidates are `factors` multiples of `previous`; their counts fall
    with the threshold. Between the last candidate passing more than the
    target and the next one, the threshold is interpolated linearly (count
    against threshold): below a reused threshold, where the residual piles
    up, the count is close to linear, and interpolating log(count) against
    log(threshold) there overshot to 2-3 times the buffer (ResNet-20, density
    0.01). A leaf whose every candidate passes more (fewer) takes the highest
    (lowest) one. The other leaves keep `previous` and are not counted.
    """
    aimed_at = np.asarray(aimed)
    factors = self.factors()
    trials = previous[aimed_at][:, None] * factors[None, :]
    strides = [selection.coprime_stride(min(_MAX_COUNT_STRIDE, ks[i] // _COUNTED_NEAR_K),
                                        sizes[i]) for i in aimed]
    counts = count(trials, strides, aimed).astype(jnp.float32) + 0.5
    target = jnp.asarray(self.target * np.asarray(ks, np.float32)[aimed_at])[:, None]
    # Every adjacent pair interpolated, and the bracketing one kept, in one
    # pass: the counts fall with the threshold, so those above the target are
    # a prefix and the pair is where it ends (the first pair if none is
    # above, the last if all are).
    above = counts > target
    pairs = np.arange(len(factors) - 1)
    ends = (((pairs == 0) | above[:, :-1])
            & ((pairs == len(factors) - 2) | ~above[:, 1:]))
    c_lo, c_hi = counts[:, :-1], counts[:, 1:]
    rise = c_lo - target
    span = c_lo - c_hi
    part = jnp.where(span > 0, rise / jnp.where(span > 0, span, 1.0),
                     (rise > 0).astype(jnp.float32))
    part = jnp.clip(part, 0.0, 1.0)
    f_lo, f_hi = factors[None, :-1], factors[None, 1:]
    factor = jnp.sum(jnp.where(ends, f_lo + part * (f_hi - f_lo), 0.0), axis=1)
    return selection.set_at(previous, aimed_at, previous[aimed_at] * factor)

  def drifted(self, passed, ks, capacities, sparse, live) -> jax.Array:
    """Whether a group sends too little altogether or a leaf overflows (bool scalar).

    Arguments as in `RefreshReuse.drifted`; leaves not `live` count in neither test.
    """
    sparse = np.asarray(sparse)
    capacities = np.asarray(capacities)
    counted = live & sparse
    # The three totals in one reduction: values sent, their k, leaves overflowing.
    if math.isinf(self.overflow):  # never: floor(inf * capacity) has no int64 value
      over = jnp.zeros_like(passed)
    else:
      most = np.floor(self.overflow * capacities).astype(np.int64)
      over = ((passed > most) & sparse).astype(passed.dtype)
    sent, asked, overflowing = jnp.sum(jnp.stack([
        jnp.where(counted, jnp.minimum(passed, capacities), 0),
        jnp.where(counted, np.asarray(ks, np.int32), 0), over]), axis=1)
    return (sent < jnp.ceil(self.below * asked)) | (overflowing > 0)


# Counting candidates on every stride-th value keeps about this many values of
# a leaf near k_l in the count: a relative error of ~3%, against the ~9% step
# between candidates.
_COUNTED_NEAR_K = 1024
_MAX_COUNT_STRIDE = 15

ThresholdRule = Union[FixedReuse, RefreshReuse, AdaptedReuse]
RULES = (FixedReuse, RefreshReuse, AdaptedReuse)


def check_rule(rule) -> ThresholdRule:
  """Returns `rule` if it is one of `RULES`.

  Raises:
    ValueError: naming the value and the rules to choose from.
  """
  if not isinstance(rule, RULES):
    raise ValueError(f"thresholds={rule!r} is not a threshold rule: pass "
                     f"dlgs_jax.AdaptedReuse(), dlgs_jax.RefreshReuse() or "
                     f"dlgs_jax.FixedReuse() (the paper's schedule)")
  return rule
