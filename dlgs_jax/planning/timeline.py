"""Timeline model of one training iteration (Ju et al. 2024, eqs. 2-8).

Backward computation and sparsification share one stream (compute); messages
go out on a second stream (communication) in backward order. For a grouping of
the layers (listed in backward order) into contiguous groups, each group is
sparsified once its last layer's gradient exists and sent once both its
sparsification and the previous message are done (eq. 5); a merged layer adds
its size to its group and costs no sparsification or communication of its own
(eq. 6). The iteration ends when the last message ends (eq. 7).

Times are in seconds, sizes in elements. Everything here is plain Python/NumPy.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, FrozenSet, Optional, Sequence

from dlgs_jax.compress import methods, selection
from dlgs_jax.compress import wire

# Methods the planner groups (`planner.make_plan`), and those whose iteration
# time the model predicts (DGC and TernGrad too, whose grouping is fixed).
METHODS = methods.names(planner_prices=True)
MODELLED = methods.names(modelled=True)
# Methods that can send some layers whole (`MethodCosts.whole_layers`).
WHOLE_LAYER_METHODS = tuple(m.name for m in methods.METHODS.values() if m.whole_layers)


@dataclasses.dataclass(frozen=True)
class LinearCost:
  """``t(x) = alpha + beta * x`` (seconds); x is elements or bytes."""
  alpha: float
  beta: float

  def __post_init__(self):
    for name in ("alpha", "beta"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"LinearCost.{name} must be a finite number >= 0, got {value!r}")

  def __call__(self, x: float) -> float:
    return self.alpha + self.beta * x


@dataclasses.dataclass(frozen=True)
class Profile:
  """What the timeline model needs to know about one model on one cluster.

  Attributes:
    model: model name (plans made from this profile carry it).
    paths: leaf paths in backward order (the order gradients become ready).
    sizes: elements per leaf, same order.
    t_forward: forward time t_f.
    t_backward: backward time t_b per leaf, same order (a layer's whole time
      on its first leaf, 0 on the others of the same layer).
    workers: P, the number of workers the costs were measured or modelled for.
    sparsify: local update cost per message as a function of its elements,
      one `LinearCost` per method: selection, error-feedback bookkeeping and
      the optimizer after it ("dlgs" amortised over its reuse period; "dense"
      the optimizer alone); missing methods cost nothing. DLGS's two kinds of
      step may also be given apart, as "dlgs_exact" (every threshold computed
      exactly) and "dlgs_reuse" (every threshold reused), for
      `MethodCosts.exact_fraction`.
    comm: communication cost per collective as a function of the bytes each
      worker sends ("allreduce", "allgather", "gtopk").
    source: how the numbers were obtained (e.g. "measured on 8 CPU devices").
    overlap: whether a group's collective runs while backward computation
      continues (GPU with async collectives). False: collectives block the
      compute stream, as measured with XLA on CPU (experiments/README.md), so
      the iteration is the plain sum of all times.
    dlgs_exact_fraction: measured share of DLGS leaf thresholds computed
      exactly per step with the refresh rule on (`profiling.measure_refresh`),
      or None when not measured. The fixed schedule alone gives
      ``1 / reuse_every``; the refresh rule recomputes stale thresholds early,
      as measured on ResNet-20 and VGG16 (experiments/README.md).
  """
  model: str
  paths: tuple[str, ...]
  sizes: tuple[int, ...]
  t_forward: float
  t_backward: tuple[float, ...]
  workers: int
  sparsify: dict[str, LinearCost]
  comm: dict[str, LinearCost]
  source: str = ""
  overlap: bool = True
  dlgs_exact_fraction: Optional[float] = None

  def __post_init__(self):
    object.__setattr__(self, "paths", tuple(self.paths))
    object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
    object.__setattr__(self, "t_backward", tuple(float(t) for t in self.t_backward))
    if not self.paths:
      raise ValueError("profile has no layers")
    if len(self.sizes) != len(self.paths) or len(self.t_backward) != len(self.paths):
      raise ValueError(
          f"profile lengths differ: {len(self.paths)} paths, {len(self.sizes)} sizes, "
          f"{len(self.t_backward)} backward times")
    if len(set(self.paths)) != len(self.paths):
      raise ValueError("profile paths repeat a leaf")
    for path, size in zip(self.paths, self.sizes):
      if size < 1:
        raise ValueError(f"layer {path!r} has size {size!r}; sizes must be >= 1")
    for path, t in zip(self.paths, self.t_backward):
      if not math.isfinite(t) or t < 0:
        raise ValueError(f"layer {path!r} has backward time {t!r}; times must be finite and >= 0")
    if not math.isfinite(self.t_forward) or self.t_forward < 0:
      raise ValueError(f"forward time must be finite and >= 0, got {self.t_forward!r}")
    if not isinstance(self.workers, int) or self.workers < 1:
      raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
    fraction = self.dlgs_exact_fraction
    if fraction is not None and not (isinstance(fraction, (int, float)) and 0.0 <= fraction <= 1.0):
      raise ValueError(f"dlgs_exact_fraction must be in [0, 1] or None, got {fraction!r}")
    for table in (self.sparsify, self.comm):
      for key, cost in table.items():
        if not isinstance(cost, LinearCost):
          raise ValueError(f"cost {key!r} must be a LinearCost, got {cost!r}")

  @property
  def num_layers(self) -> int:
    return len(self.paths)

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["paths"] = list(self.paths)
    out["sizes"] = list(self.sizes)
    out["t_backward"] = list(self.t_backward)
    return out

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> "Profile":
    try:
      return cls(
          model=data["model"], paths=data["paths"], sizes=data["sizes"],
          t_forward=float(data["t_forward"]), t_backward=data["t_backward"],
          workers=int(data["workers"]),
          sparsify={k: LinearCost(**v) for k, v in data.get("sparsify", {}).items()},
          comm={k: LinearCost(**v) for k, v in data.get("comm", {}).items()},
          source=data.get("source", ""), overlap=bool(data.get("overlap", True)),
          dlgs_exact_fraction=data.get("dlgs_exact_fraction"))
    except (KeyError, TypeError) as e:
      raise ValueError(f"not a valid profile: {e!r}") from None

  def save(self, path) -> None:
    with open(path, "w") as f:
      json.dump(self.to_dict(), f, indent=1)

  @classmethod
  def load(cls, path) -> "Profile":
    with open(path) as f:
      return cls.from_dict(json.load(f))

  def with_comm(self, comm: dict[str, LinearCost], workers: int, source: str) -> "Profile":
    """The same compute profile on another network / worker count."""
    return dataclasses.replace(self, comm=dict(comm), workers=workers,
                               source=f"{self.source}; {source}".strip("; "))


@dataclasses.dataclass(frozen=True)
class MethodCosts:
  """Per-message sparsification and communication times for one method.

  Attributes:
    method: one of `MODELLED`.
    density: the sparse methods' density (dense and TernGrad ignore it).
    fixed_collectives: small all-reduces every iteration pays besides the
      gradient messages (the train step has two: the workers' agreement on
      finite gradients, and the fused mean of BatchNorm statistics and
      metrics); each costs the all-reduce latency. TernGrad adds its own (the
      shared scalers' max), counted by `fixed_overhead`.
    exact_fraction: DLGS only: the share of steps on which a message's
      thresholds are computed exactly. The update then costs
      ``f * sparsify["dlgs_exact"] + (1 - f) * sparsify["dlgs_reuse"]``;
      None uses the profile's "dlgs" cost, amortised over the fixed schedule.
      Pass ``profile.dlgs_exact_fraction`` for DLGS with the refresh rule.
    whole_layers: layers (positions in backward order) sent whole. DGC: by
      one fused all-reduce after the sparse messages (leaves of fewer than
      ``min_ndim`` dimensions), so `simulate` leaves them out of their groups'
      sparse messages. LAGS and DLGS (``min_ndim``, ``send_whole``): as every
      value of the layer, in its group's message.
    wire_dtype: the values' dtype on the wire (`wire.value_scale`).
    fast_size: L > 1 prices the two-level exchange (`compress.hierarchical`):
      the profile's network and workers are then those between nodes, each
      message is selected and sent on its 1/L slice, and the dense
      reduce-scatter and all-gather of the whole message inside the node cost
      `fast_link` on the ring's bytes.
    fast_link: α-β cost of bytes on the fast link inside a node (with `fast_size`).
    collective: the sparse collective a method that takes one sends with
      (``"allgather"``, ``"gtopk"``, ``"owners"``); None: the method's own.
  """
  method: str
  density: float
  fixed_collectives: int = 0
  exact_fraction: Optional[float] = None
  whole_layers: FrozenSet[int] = frozenset()
  wire_dtype: str = "float32"
  fast_size: int = 1
  fast_link: Optional[LinearCost] = None
  collective: Optional[str] = None

  def __post_init__(self):
    if self.method not in MODELLED:
      raise ValueError(f"unknown method {self.method!r}; choose from {MODELLED}")
    if not 0.0 < self.density <= 1.0:
      raise ValueError(f"density must be in (0, 1], got {self.density!r}")
    fraction = self.exact_fraction
    if fraction is not None and not 0.0 <= fraction <= 1.0:
      raise ValueError(f"exact_fraction must be in [0, 1] or None, got {fraction!r}")
    if fraction is not None and self.method != "dlgs":
      raise ValueError(f"exact_fraction applies to dlgs only, not {self.method!r}")
    object.__setattr__(self, "whole_layers", frozenset(self.whole_layers))
    if self.wire_dtype not in wire.WIRE_DTYPES:
      raise ValueError(f"wire_dtype must be one of {wire.WIRE_DTYPES}, got {self.wire_dtype!r}")
    if not isinstance(self.fast_size, int) or self.fast_size < 1:
      raise ValueError(f"fast_size must be an integer >= 1, got {self.fast_size!r}")
    if self.fast_size > 1 and self.fast_link is None:
      raise ValueError("a two-level exchange (fast_size > 1) needs its fast_link cost")
    if self.collective is not None and self.collective != methods.METHODS[self.method].collective:
      if "collective" not in methods.METHODS[self.method].options:
        raise ValueError(f"collective applies to {methods.names(collective=True)}, not "
                         f"{self.method!r}")
      methods.MethodConfig(self.method, collective=self.collective).validate()
    if self.whole_layers and self.method not in WHOLE_LAYER_METHODS:
      raise ValueError(
          f"whole_layers applies to {WHOLE_LAYER_METHODS} only, not {self.method!r}")

  @property
  def kind(self) -> str:
    """The collective its messages go by: `collective`, else the method's own."""
    return self.collective or methods.METHODS[self.method].collective

  def sliced(self, size: int) -> int:
    """Values of a message of `size` one device handles: all, or its 1/L slice."""
    return -(-size // self.fast_size) if size > 0 else 0

  def sparsify_time(self, profile: Profile, size: int) -> float:
    size = self.sliced(size)
    if size <= 0:
      return 0.0
    if self.method == "dlgs" and self.exact_fraction is not None:
      missing = [k for k in ("dlgs_exact", "dlgs_reuse") if k not in profile.sparsify]
      if missing:
        raise ValueError(f"exact_fraction needs the profile's {missing} update costs "
                         f"(has {sorted(profile.sparsify)}); measure the profile again")
      f = self.exact_fraction
      return (f * profile.sparsify["dlgs_exact"](size)
              + (1.0 - f) * profile.sparsify["dlgs_reuse"](size))
    cost = profile.sparsify.get(self.method)
    return 0.0 if cost is None else cost(size)

  def comm_bytes(self, profile: Profile, size: int, whole: int = 0) -> float:
    """Bytes the busiest worker sends for one message.

    Args:
      profile: gives the worker count.
      size: elements of the message's sparsified layers.
      whole: LAGS/DLGS: elements of its layers sent whole (`whole_layers`).
    """
    p = profile.workers
    spec = methods.METHODS[self.method]
    size, whole = self.sliced(size), self.sliced(whole)
    if whole and not spec.layer_wise:
      raise ValueError(f"{self.method!r} sends no whole layers inside a message")
    if whole > 0:
      k = selection.num_to_keep(self.density, size) if size > 0 else 0
      if self.kind == "owners":
        return wire.owners_bytes(k + whole, k + whole, p)
      return wire.allgather_bytes(k + whole, p, self.wire_dtype)
    if size <= 0:
      return 0.0
    if self.kind in ("owners", "gtopk") and self.collective is not None:
      k = selection.num_to_keep(self.density, size)
      return (wire.owners_bytes(k, k, p) if self.kind == "owners"
              else wire.gtopk_bytes(k, p)[0])
    return (spec.message_bytes(size, selection.num_to_keep(self.density, size), p)
            * wire.value_scale(spec.collective, self.wire_dtype))

  def comm_time(self, profile: Profile, size: int, whole: int = 0) -> float:
    """Seconds of one message (arguments as `comm_bytes`)."""
    if size + whole <= 0:
      return 0.0
    fast = (self.fast_link(wire.allreduce_bytes(size + whole, self.fast_size))
            if self.fast_size > 1 else 0.0)
    if profile.workers <= 1:
      return fast
    return fast + _collective(profile, self.kind)(self.comm_bytes(profile, size, whole))

  def in_message(self, layer: int) -> bool:
    """Whether `layer` is sent whole inside its group's message (LAGS/DLGS)."""
    return not methods.METHODS[self.method].whole_below_ndim and layer in self.whole_layers


def layers_below_ndim(profile: Profile, shapes: dict[str, Sequence[int]], min_ndim: int
                      ) -> frozenset[int]:
  """Positions (backward order) of the layers whose leaf has fewer than `min_ndim` dims.

  For `MethodCosts.whole_layers` (DGC sends those leaves whole).

  Args:
    profile: the profile whose layer order is used.
    shapes: leaf path -> shape, for every path of the profile.
    min_ndim: DGC's ``min_ndim``.
  """
  missing = [p for p in profile.paths if p not in shapes]
  if missing:
    raise ValueError(f"no shape for the profile's layers {missing[:3]!r}")
  return frozenset(i for i, path in enumerate(profile.paths) if len(shapes[path]) < min_ndim)


def _collective(profile: Profile, kind: str) -> LinearCost:
  if kind not in profile.comm:
    raise ValueError(
        f"profile has no '{kind}' communication cost (has {sorted(profile.comm)})")
  return profile.comm[kind]


@dataclasses.dataclass
class Timeline:
  """Result of `simulate` (seconds)."""
  t_iter: float
  compute: float               # t_f + sum of t_b
  sparsify: float              # sum of sparsification times
  comm: float                  # sum of communication times
  comm_exposed: float          # communication not hidden behind compute
  backward_start: list[float]  # per layer
  groups: list[list[int]]      # layer indices per group
  # Per message: one per group, then (DGC) the all-reduce of the whole layers.
  sparsify_start: list[float]
  sparsify_time: list[float]
  comm_start: list[float]      # per message, as sparsify_start
  comm_time: list[float]

  def breakdown(self) -> dict[str, float]:
    return {"t_iter": self.t_iter, "compute": self.compute, "sparsify": self.sparsify,
            "comm_exposed": self.comm_exposed, "comm_total": self.comm}


def check_groups(groups: Sequence[Sequence[int]], num_layers: int) -> list[list[int]]:
  """Groups must be contiguous runs covering 0..L-1 in order."""
  groups = [list(g) for g in groups]
  flat = [i for g in groups for i in g]
  if flat != list(range(num_layers)) or any(not g for g in groups):
    raise ValueError(
        f"groups must be non-empty contiguous runs of layers 0..{num_layers - 1} in order, "
        f"got {groups!r}")
  return groups


def fixed_overhead(profile: Profile, costs: MethodCosts) -> float:
  """Latency of the iteration's small fixed collectives (see `MethodCosts`)."""
  count = costs.fixed_collectives + (1 if costs.method == "terngrad" else 0)
  if profile.workers <= 1 or not count or "allreduce" not in profile.comm:
    return 0.0
  return count * profile.comm["allreduce"].alpha


def simulate(profile: Profile, groups: Sequence[Sequence[int]], costs: MethodCosts) -> Timeline:
  """Iteration time of `groups` by eqs. (3)-(7), merged layers per eq. (6).

  Args:
    profile: the measured or modelled profile.
    groups: layer indices (positions in backward order) per group.
    costs: the method whose sparsification and communication costs apply.

  Returns:
    The `Timeline`.
  """
  groups = check_groups(groups, profile.num_layers)
  compute_clock = profile.t_forward
  comm_clock = 0.0
  backward_start = [0.0] * profile.num_layers
  s_start, s_time, c_start, c_time = [], [], [], []
  whole = 0  # elements DGC sends by its final all-reduce
  for group in groups:
    size = 0
    in_message = 0  # LAGS/DLGS: elements of whole layers inside this message
    for layer in group:
      backward_start[layer] = compute_clock
      compute_clock += profile.t_backward[layer]
      if costs.in_message(layer):
        in_message += profile.sizes[layer]
      elif layer in costs.whole_layers:
        whole += profile.sizes[layer]
      else:
        size += profile.sizes[layer]
    # The update still passes over the whole layers (residual, packing).
    t_s = costs.sparsify_time(profile, size + in_message)
    s_start.append(compute_clock)
    s_time.append(t_s)
    compute_clock += t_s
    t_c = costs.comm_time(profile, size, in_message)
    start = max(compute_clock, comm_clock)
    c_start.append(start)
    c_time.append(t_c)
    comm_clock = start + t_c
    if not profile.overlap:
      compute_clock = comm_clock  # the collective blocks the compute stream
  if whole:
    # DGC: the small leaves' velocities, momentum SGD's work, one all-reduce.
    t_s = MethodCosts("dense", 1.0).sparsify_time(profile, whole)
    s_start.append(compute_clock)
    s_time.append(t_s)
    compute_clock += t_s
    t_c = (_collective(profile, "allreduce")(wire.allreduce_bytes(whole, profile.workers))
           if profile.workers > 1 else 0.0)
    start = max(compute_clock, comm_clock)
    c_start.append(start)
    c_time.append(t_c)
    comm_clock = start + t_c
    if not profile.overlap:
      compute_clock = comm_clock
  t_iter = max(comm_clock, compute_clock) + fixed_overhead(profile, costs)
  compute = profile.t_forward + sum(profile.t_backward)
  sparsify = sum(s_time)
  comm_total = sum(c_time) + fixed_overhead(profile, costs)
  return Timeline(
      t_iter=t_iter, compute=compute, sparsify=sparsify, comm=comm_total,
      comm_exposed=t_iter - compute - sparsify, backward_start=backward_start,
      groups=groups, sparsify_start=s_start, sparsify_time=s_time,
      comm_start=c_start, comm_time=c_time)
