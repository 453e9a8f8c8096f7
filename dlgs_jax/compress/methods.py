"""Every method, declared once: its factory, its options, how it is priced and planned.

`METHODS` maps a method's name to its `Method`; `VARIANTS` names settings of a
method that experiments compare (``dlgs-paper`` is DLGS on the paper's fixed
threshold schedule). A `MethodConfig` is one method with its options; it
builds the compressor:

    config = method_config("dlgs-paper", density=0.01)
    tx = config.compressor(axis_name="data", order=order)

The command line, the profiler, the planner, the scaling predictions, the
benchmarks and the experiments read these tables instead of keeping their own.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Optional, Sequence

import jax
import optax

from dlgs_jax.compress import engine, grouping, rules, wire
from dlgs_jax.compress.deep_gradient_compression import dgc
from dlgs_jax.compress.ternary import terngrad
from dlgs_jax.compress.transforms import dense, dlgs, gtopk, lags, topk


class ConfigError(ValueError):
  """A bad option value: names the option, the value and the rule it breaks."""

  def __init__(self, option: str, value, rule: str):
    super().__init__(f"{option} {value!r} is invalid: {rule}")
    self.option, self.value, self.rule = option, value, rule


@dataclasses.dataclass(frozen=True)
class MethodConfig:
  """One method and its options (each method reads only the options it takes).

  Attributes:
    name: a key of `METHODS`.
    density: fraction of values sent (the sparse methods).
    reuse_every: DLGS: exact thresholds every this many steps.
    refresh_below: DLGS: recompute a group's thresholds early when they send
      fewer than this fraction of k (or overflow); None: the paper's schedule.
    candidates: DLGS with `refresh_below` set: thresholds each leaf tries on a
      reuse step (multiples of its reused one, interpolated between); 1: the
      reused one only.
    aim: DLGS's adapted rule (more than one candidate): the count a reused
      threshold is re-aimed at, as a fraction of k, on the values of the step
      before the one it serves (in (0, 2]; `rules.AdaptedReuse`).
    budget: DLGS: ``"message"`` (one threshold per message, its leaves' k
      together: the default) or ``"layer"`` (a threshold per leaf, k_l each:
      the paper's); `dlgs_jax.dlgs`.
    min_ndim: LAGS/DLGS: leaves with fewer dimensions are sent whole.
    send_whole: LAGS/DLGS: leaf paths sent whole; ``"head"`` names the output
      layer (found from the backward order).
    collective: Top-k, LAGS, DLGS: ``"allgather"``, ``"owners"`` (bytes flat in
      the workers, `compress.owners`), (LAGS, DLGS) ``"gtopk"``, or
      ``"auto"``: the fastest of those on the run's modelled network
      (`planning.choice.for_method`), which a run resolves before it builds
      the transform.
    dgc_warmup_epochs: DGC: epochs of exponential density warm-up.
    terngrad_clip: TernGrad: clip at this many standard deviations (0: none).
    wire_dtype: dense, Top-k, LAGS, DLGS: the values' dtype on the wire,
      ``"float32"`` or ``"bfloat16"`` (dense: a bf16 all-reduce; sparse: 6-byte
      pairs, the rounding kept in the residuals).
  """
  name: str = "dlgs"
  density: float = 0.01
  reuse_every: int = 10
  refresh_below: Optional[float] = 0.5
  candidates: int = 7
  aim: float = 0.9
  budget: str = "message"
  min_ndim: int = 0
  send_whole: tuple[str, ...] = ()
  collective: str = "allgather"
  dgc_warmup_epochs: float = 4.0
  terngrad_clip: float = 2.5
  wire_dtype: str = "float32"

  def __post_init__(self):
    object.__setattr__(self, "send_whole", tuple(self.send_whole))

  @property
  def spec(self) -> "Method":
    return METHODS[self.name]

  def validate(self) -> "MethodConfig":
    """Raises `ConfigError` naming the first bad option; returns self."""
    if self.name not in METHODS:
      raise ConfigError("method", self.name, f"choose from {tuple(METHODS)}")
    _check_number("density", self.density, 0.0, 1.0, low_open=True)
    if not isinstance(self.reuse_every, int) or self.reuse_every < 1:
      raise ConfigError("reuse_every", self.reuse_every, "must be >= 1")
    if self.refresh_below is not None:
      _check_number("refresh_below", self.refresh_below, 0.0, 1.0)
    if (isinstance(self.candidates, bool) or not isinstance(self.candidates, int)
        or not 1 <= self.candidates <= 16):
      raise ConfigError("candidates", self.candidates, "must be an integer in [1, 16]")
    if self.refresh_below is None and self.candidates != MethodConfig.candidates:
      raise ConfigError("candidates", self.candidates, "candidates apply only with refresh_below "
                        "set (--refresh-below 0.5); the paper's schedule (none) has none")
    _check_number("aim", self.aim, 0.0, 2.0, low_open=True)
    if self.aim != MethodConfig.aim and (self.refresh_below is None or self.candidates == 1):
      raise ConfigError("aim", self.aim, "re-aims the adapted rule's thresholds, which needs "
                        "refresh_below set and candidates >= 2 (--refresh-below 0.5 "
                        "--candidates 7)")
    if self.min_ndim < 0:
      raise ConfigError("min_ndim", self.min_ndim, "must be >= 0")
    if self.budget not in engine.BUDGETS:
      raise ConfigError("budget", self.budget, f"choose from {engine.BUDGETS}")
    if "budget" in self.spec.options and self.budget == "message":
      # The message's one threshold already gives each leaf its share.
      for option, value in (("send_whole", ",".join(self.send_whole)), ("min_ndim", self.min_ndim)):
        if value:
          raise ConfigError(option, value, "sends leaves whole, which needs a threshold per "
                            "layer: add budget 'layer' (--budget layer); the default budget, "
                            "one threshold per message, gives each leaf its share")
    if self.collective not in engine.SPARSE_COLLECTIVES + (AUTO,):
      raise ConfigError("collective", self.collective,
                        f"choose {', '.join(engine.SPARSE_COLLECTIVES)} or {AUTO}")
    if self.collective != "allgather" and "collective" not in self.spec.options:
      raise ConfigError("collective", self.collective,
                        f"applies to {', '.join(names(collective=True))}, not {self.name}")
    if self.collective == "gtopk" and not self.spec.layer_wise:
      raise ConfigError("collective", self.collective,
                        f"gTop-k's reduction applies to lags and dlgs, not {self.name}: for a "
                        "global top-k of the sum, run gtopk")
    _check_number("dgc_warmup_epochs", self.dgc_warmup_epochs, 0.0, math.inf)
    _check_number("terngrad_clip", self.terngrad_clip, 0.0, math.inf)
    if self.wire_dtype not in wire.WIRE_DTYPES:
      raise ConfigError("wire_dtype", self.wire_dtype, f"choose from {wire.WIRE_DTYPES}")
    if self.wire_dtype != "float32" and "wire_dtype" not in self.spec.options:
      raise ConfigError("wire_dtype", self.wire_dtype,
                        f"applies to {', '.join(names(wire_dtype=True))}, not {self.name}")
    if self.wire_dtype != "float32" and self.collective != "allgather":
      raise ConfigError("wire_dtype", self.wire_dtype,
                        f"needs the all-gather: collective {self.collective!r} sums on the way")
    layer_wise = self.spec.layer_wise
    if self.min_ndim and not layer_wise:
      raise ConfigError("min_ndim", self.min_ndim, f"applies to lags and dlgs, not {self.name}")
    if self.send_whole and not layer_wise:
      raise ConfigError("send_whole", ",".join(self.send_whole),
                        f"applies to lags and dlgs, not {self.name}")
    return self

  def effective_density(self) -> Optional[float]:
    """The density the method uses, None for the density-free methods."""
    return self.density if self.spec.uses_density else None

  def whole_paths(self, order: Sequence[str]) -> list[str]:
    """The leaf paths sent whole (``send_whole`` resolved against the backward `order`).

    Raises:
      ConfigError: naming a path the model does not have.
    """
    paths = []
    for name in self.send_whole:
      for path in (grouping.output_layer(order) if name == "head" else [name]):
        if path not in order:
          raise ConfigError("send_whole", ",".join(self.send_whole),
                            f"the model has no leaf {path!r} (its leaves: "
                            f"{', '.join(sorted(order))}; or 'head')")
        if path not in paths:
          paths.append(path)
    return paths

  def threshold_rule(self) -> rules.ThresholdRule:
    """DLGS's threshold rule from the flat options (`rules`).

    ``refresh_below=None`` is the paper's `FixedReuse`; one candidate the
    `RefreshReuse` rule; more, `AdaptedReuse`.
    """
    if self.refresh_below is None:
      return rules.FixedReuse(self.reuse_every)
    if self.candidates == 1:
      return rules.RefreshReuse(self.reuse_every, self.refresh_below)
    return rules.AdaptedReuse(self.reuse_every, self.refresh_below, self.candidates,
                              aim=self.aim)

  def whole_mask(self, order: Sequence[str]):
    """The transforms' ``send_whole`` mask: the leaves named and those of < ``min_ndim`` dims.

    None when no leaf is sent whole.
    """
    named = frozenset(self.whole_paths(order))
    min_ndim = self.min_ndim
    if not named and not min_ndim:
      return None

    def mask(tree):
      leaves, treedef = jax.tree_util.tree_flatten(tree)
      return jax.tree_util.tree_unflatten(treedef, [
          path in named or len(leaf.shape) < min_ndim
          for path, leaf in zip(grouping.leaf_paths(tree), leaves)])

    return mask

  def whole_layers(self, order: Sequence[str], shapes: dict) -> frozenset:
    """Positions in `order` of the leaves sent whole, for `timeline.MethodCosts`.

    Args:
      order: every leaf path in backward order (a profile's ``paths``).
      shapes: leaf path -> shape.
    """
    spec = self.spec
    if spec.whole_below_ndim:
      return frozenset(i for i, p in enumerate(order) if len(shapes[p]) < spec.whole_below_ndim)
    if not spec.layer_wise:
      return frozenset()
    named = set(self.whole_paths(order))
    return frozenset(i for i, path in enumerate(order)
                     if path in named or len(shapes[path]) < self.min_ndim)

  def compressor(self, *, axis_name=None, groups=None, order: Sequence[str] = (),
                 seed: int = 0, warmup_steps: int = 0, momentum: float = 0.9
                 ) -> optax.GradientTransformation:
    """The method's ``optax.GradientTransformation``.

    Args:
      axis_name: the data-parallel mesh axis, or None outside ``shard_map``.
      groups: layer groups (lists of leaf paths) for the methods that take them,
        or None for a run's grouping without a plan (dense: one message;
        LAGS and DLGS: one per leaf of `order`).
      order: leaf paths in backward order.
      seed: the random methods' seed (DGC's sampling, TernGrad's rounding).
      warmup_steps: DGC's density warm-up in steps.
      momentum: DGC's momentum (DGC holds the momentum itself).
    """
    self.validate()
    if self.collective == AUTO:
      raise ConfigError("collective", AUTO, "is chosen by a run on its network (dlgs-train "
                        "--collective auto --bandwidth ...); a transform needs one of "
                        f"{', '.join(engine.SPARSE_COLLECTIVES)}")
    return self.spec.build(self, _BuildContext(axis_name, groups, list(order), seed,
                                               warmup_steps, momentum))


# The collective a run chooses on its network (`planning.choice.for_method`).
AUTO = "auto"


def takes(method: str, collective: str) -> bool:
  """Whether `method` (a key of `METHODS`) can send by `collective`."""
  try:
    MethodConfig(method, collective=collective).validate()
  except ConfigError:
    return False
  return collective != AUTO


@dataclasses.dataclass(frozen=True)
class _BuildContext:
  axis_name: object
  groups: Optional[list]
  order: list
  seed: int
  warmup_steps: int
  momentum: float


@dataclasses.dataclass(frozen=True)
class Method:
  """What a method is.

  Attributes:
    name: its key in `METHODS`.
    summary: one line for help texts.
    build: ``(MethodConfig, context) -> GradientTransformation``.
    options: the `MethodConfig` fields it reads (the others change nothing in
      it: a run may resume with them changed).
    takes_groups: a run may give it planned groups (``--planner``/``--plan``).
    holds_momentum: the optimizer's momentum lives inside it (DGC), so the
      optimizer chain around it differs.
    planner_prices: `planning.planner.make_plan` can group it.
    modelled: the timeline model predicts its iteration time.
    per_leaf_update: its update sends each leaf as its own message; the
      profiler fits its cost per leaf.
    whole_layers: `timeline.MethodCosts` may price some layers as sent whole.
    whole_below_ndim: leaves of fewer dimensions are always sent whole (DGC: 2).
    grouping: the planner behind its messages in predictions and benchmarks
      ("optimal": planned, "wfbp": one per leaf, "single": one for the model).
    collective: the collective it is priced with: ``"allreduce"``,
      ``"allgather"`` or ``"gtopk"``.
    message_bytes: ``(size, k, workers) -> bytes`` the busiest worker sends for
      a message of `size` values of which `k` are selected (`wire`).
  """
  name: str
  summary: str
  build: Callable
  options: tuple[str, ...] = ("density",)
  takes_groups: bool = False
  holds_momentum: bool = False
  planner_prices: bool = True
  modelled: bool = True
  per_leaf_update: bool = False
  whole_layers: bool = False
  whole_below_ndim: int = 0
  grouping: str = "single"
  collective: str = "allgather"
  message_bytes: Callable = lambda size, k, workers: wire.allgather_bytes(k, workers)

  @property
  def uses_density(self) -> bool:
    """False for the methods ``density`` changes nothing in (experiments run those once)."""
    return "density" in self.options

  @property
  def layer_wise(self) -> bool:
    """Takes ``min_ndim`` and ``send_whole`` (a budget per leaf)."""
    return "send_whole" in self.options


@dataclasses.dataclass(frozen=True)
class Variant:
  """Named settings of a method that experiments compare.

  Attributes:
    name: the variant's name (e.g. ``dlgs-paper``).
    base: the method's name.
    options: `MethodConfig` fields the variant sets.
    summary: one line.
  """
  name: str
  base: str
  options: dict
  summary: str


def _build_dense(c: MethodConfig, ctx: _BuildContext):
  return dense(axis_name=ctx.axis_name, groups=ctx.groups or [list(ctx.order)], order=ctx.order,
               wire_dtype=c.wire_dtype)


def _build_topk(c: MethodConfig, ctx: _BuildContext):
  return topk(c.density, axis_name=ctx.axis_name, collective=c.collective,
              wire_dtype=c.wire_dtype)


def _build_gtopk(c: MethodConfig, ctx: _BuildContext):
  return gtopk(c.density, axis_name=ctx.axis_name)


def _layer_groups(ctx: _BuildContext):
  """LAGS's and DLGS's groups in a run: the plan's, else one per leaf (``--planner none``).

  Without an order (nothing to list leaves by), the transforms' own buckets.
  """
  if ctx.groups is not None or not ctx.order:
    return ctx.groups
  return [[path] for path in ctx.order]


def _build_lags(c: MethodConfig, ctx: _BuildContext):
  return lags(c.density, axis_name=ctx.axis_name, groups=_layer_groups(ctx), order=ctx.order,
              collective=c.collective, send_whole=c.whole_mask(ctx.order),
              wire_dtype=c.wire_dtype)


def _build_dlgs(c: MethodConfig, ctx: _BuildContext):
  # A message budget over one leaf would be the layer budget: without a plan,
  # its messages are the transform's buckets (in the backward order).
  groups = ctx.groups if c.budget == "message" else _layer_groups(ctx)
  return dlgs(c.density, axis_name=ctx.axis_name, thresholds=c.threshold_rule(),
              budget=c.budget, groups=groups, order=ctx.order, collective=c.collective,
              send_whole=c.whole_mask(ctx.order), wire_dtype=c.wire_dtype)


def _build_dgc(c: MethodConfig, ctx: _BuildContext):
  return dgc(c.density, axis_name=ctx.axis_name, momentum=ctx.momentum,
             warmup_steps=ctx.warmup_steps, seed=ctx.seed)


def _build_terngrad(c: MethodConfig, ctx: _BuildContext):
  return terngrad(axis_name=ctx.axis_name, clip=c.terngrad_clip or None, seed=ctx.seed)


# DGC's buffer per sparsified leaf is ceil(DGC_BAND_UPPER * k) pairs (`dgc`'s default band).
DGC_BAND_UPPER = 1.3


def _dgc_bytes(size: int, k: int, workers: int) -> float:
  return wire.allgather_bytes(min(size, math.ceil(DGC_BAND_UPPER * k)), workers)


_LAYER_WISE = ("density", "min_ndim", "send_whole", "collective", "wire_dtype")

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("dense", "all-reduce of everything, fused into planned groups", _build_dense,
           options=("wire_dtype",), takes_groups=True, grouping="optimal", collective="allreduce",
           message_bytes=lambda size, k, workers: wire.allreduce_bytes(size, workers)),
    Method("topk", "global top-k of all leaves, all-gathered", _build_topk,
           options=("density", "wire_dtype", "collective")),
    Method("lags", "exact top-k per leaf every step (LAGS)", _build_lags, takes_groups=True,
           options=_LAYER_WISE, per_leaf_update=True, whole_layers=True, grouping="wfbp"),
    Method("gtopk", "global top-k of the sum in log2 P pairwise rounds", _build_gtopk,
           collective="gtopk", message_bytes=lambda size, k, workers: wire.gtopk_bytes(k, workers)[0]),
    Method("dlgs", "per-leaf thresholds, exact every reuse_every steps, planned merging",
           _build_dlgs, takes_groups=True, whole_layers=True,
           options=_LAYER_WISE + ("reuse_every", "refresh_below", "candidates", "aim", "budget"),
           grouping="optimal"),
    Method("dgc", "Deep Gradient Compression (sampled thresholds, momentum correction)",
           _build_dgc, options=("density", "dgc_warmup_epochs"), holds_momentum=True, planner_prices=False, per_leaf_update=True,
           whole_layers=True, whole_below_ndim=2, grouping="wfbp", message_bytes=_dgc_bytes),
    Method("terngrad", "TernGrad: stochastic ternary values, 4 per byte", _build_terngrad,
           options=("terngrad_clip",), planner_prices=False, per_leaf_update=True, grouping="wfbp",
           message_bytes=lambda size, k, workers: wire.packed_allgather_bytes(
               wire.ternary_bytes(size), workers)),
)}

VARIANTS: dict[str, Variant] = {v.name: v for v in (
    # The paper's DLGS: a threshold per layer on a fixed schedule. Variants that
    # send leaves whole name the layer budget, since a message's one threshold
    # sends no leaf whole.
    Variant("dlgs-paper", "dlgs", {"refresh_below": None, "budget": "layer"},
            "the paper's DLGS: a threshold per layer, on a fixed schedule"),
    Variant("dlgs-layer", "dlgs", {"budget": "layer"},
            "a threshold per layer (k_l each, the paper's budget), adapted every step"),
    Variant("dlgs-message", "dlgs", {"budget": "message"},
            "one threshold per message (the default, named)"),
    Variant("dlgs-paper-message", "dlgs", {"refresh_below": None, "budget": "message"},
            "the paper's fixed schedule, one threshold per message"),
    Variant("dlgs-spend", "dlgs", {"aim": 1.1},
            "one threshold per message, re-aimed at 1.1 k to send about all of k (the "
            "default aims at 0.9 k)"),
    Variant("dlgs-refresh", "dlgs", {"candidates": 1, "budget": "layer"},
            "a threshold per layer kept as it is until one leaves the band (the refresh rule)"),
    Variant("dlgs-adapt", "dlgs", {"candidates": 7, "budget": "layer"},
            "a threshold per layer adapted from 7 candidates per step"),
    Variant("dlgs-whole1d", "dlgs", {"min_ndim": 2, "budget": "layer"},
            "a threshold per layer, biases and BatchNorm sent whole"),
    Variant("lags-whole1d", "lags", {"min_ndim": 2}, "biases and BatchNorm sent whole"),
    Variant("dlgs-head", "dlgs", {"send_whole": ("head",), "budget": "layer"},
            "a threshold per layer, the classifier head sent whole"),
    Variant("dlgs-paper-head", "dlgs", {"refresh_below": None, "send_whole": ("head",),
                                        "budget": "layer"},
            "the paper's DLGS, the classifier head sent whole"),
    Variant("lags-head", "lags", {"send_whole": ("head",)}, "the classifier head sent whole"),
    Variant("dlgs-owners", "dlgs", {"collective": "owners", "budget": "layer"},
            "a threshold per layer, summed at the owners of hashed regions: bytes flat in the "
            "workers"),
    Variant("topk-owners", "topk", {"collective": "owners"},
            "summed at the owners of hashed regions: bytes flat in the workers"),
)}


def base_method(name: str) -> str:
  """The method a method or variant name runs.

  Raises:
    ValueError: for a name that is neither.
  """
  if name in METHODS:
    return name
  if name in VARIANTS:
    return VARIANTS[name].base
  raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)} or a variant "
                   f"({', '.join(VARIANTS)})")


def known(name: str) -> bool:
  """Whether `name` is a method or a variant."""
  return name in METHODS or name in VARIANTS


def density_free(name: str) -> bool:
  """Whether density changes nothing in method or variant `name` (experiments run it once)."""
  return not METHODS[base_method(name)].uses_density


def method_config(name: str, **options) -> MethodConfig:
  """The `MethodConfig` of a method or variant; a variant's own options win over `options`."""
  base = base_method(name)
  own = VARIANTS[name].options if name in VARIANTS else {}
  return MethodConfig(name=base, **{**options, **own})


def names(*, planner_prices: Optional[bool] = None, modelled: Optional[bool] = None,
          uses_density: Optional[bool] = None, takes_groups: Optional[bool] = None,
          wire_dtype: Optional[bool] = None, collective: Optional[bool] = None) -> tuple:
  """Method names whose declared properties match every given value, in table order.

  ``wire_dtype=True``, ``collective=True``: the methods that take the option of that name.
  """
  wanted = {k: v for k, v in dict(planner_prices=planner_prices, modelled=modelled,
                                  uses_density=uses_density, takes_groups=takes_groups).items()
            if v is not None}
  return tuple(m.name for m in METHODS.values()
               if all(getattr(m, k) == v for k, v in wanted.items())
               and (wire_dtype is None or ("wire_dtype" in m.options) == wire_dtype)
               and (collective is None or ("collective" in m.options) == collective))


def configurations(methods: Sequence[str], densities: Sequence[float],
                   base: Callable[[str], str] = lambda name: name) -> list[tuple[str, float]]:
  """(method, density) pairs an experiment runs: density-free methods once (first density).

  Args:
    methods: method or variant names, as the experiment names them.
    densities: the densities, the first one the density-free methods' run.
    base: an experiment's name -> the registry's (e.g. dropping an exchange suffix).
  """
  return [(method, density) for density in densities for method in methods
          if not density_free(base(method)) or density == densities[0]]


def _check_number(option: str, value, low: float, high: float, low_open: bool = False) -> None:
  number = isinstance(value, numbers.Real) and not isinstance(value, bool)
  ok = number and not math.isnan(value) and (
      (low < value if low_open else low <= value) and value <= high)
  if not number:
    raise ConfigError(option, value, f"must be a number, not {type(value).__name__}")
  if not ok:
    bracket = "(" if low_open else "["
    raise ConfigError(option, value, f"must be in {bracket}{low:g}, {high:g}]"
                      if math.isfinite(high) else f"must be >= {low:g}")
