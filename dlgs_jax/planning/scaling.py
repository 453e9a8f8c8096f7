"""Predicted iteration time past one machine.

Takes a *measured* compute profile (forward, per-layer backward, selection
costs) and replaces its communication costs with an α-β network model
(`network.network_comm`) for P workers on links of a given bandwidth. Each
method is then planned the way it runs in practice and simulated with the
timeline model (`timeline.simulate`, paper eqs. 3-7):

=========  ==========================  ===============================
method     grouping                    collective
=========  ==========================  ===============================
dense      optimal fusion (planner)    ring all-reduce of all values
topk       one message (global Top-k)  all-gather of k values+indices
gtopk      one message                 gTop-k tree + k-value all-reduce
lags       one message per layer       all-gather per layer
dlgs       optimal merging (planner)   all-gather per group
=========  ==========================  ===============================

This is weak scaling: every worker keeps its batch, so compute and selection
times are the measured ones for every P; only communication changes with P and
bandwidth. Everything returned is a prediction.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

from dlgs_jax.compress import methods
from dlgs_jax.planning import planner
from dlgs_jax.planning import network
from dlgs_jax.planning.timeline import METHODS, LinearCost, MethodCosts, Profile, simulate

# How each method groups its layers when it runs (the registry's `grouping`).
METHOD_PLANNERS = {name: methods.METHODS[name].grouping for name in METHODS}
# Variants predicted besides the methods: those that only change the collective
# (and DLGS's budget, which sends the same bytes).
COLLECTIVE_VARIANTS = tuple(name for name, v in methods.VARIANTS.items()
                            if set(v.options) - {"budget"} == {"collective"}
                            and v.base in METHOD_PLANNERS)
PREDICTABLE = tuple(METHOD_PLANNERS) + COLLECTIVE_VARIANTS


def method_costs(name: str, density: float, **options) -> MethodCosts:
  """The costs of a method of `timeline.METHODS` or a variant of `COLLECTIVE_VARIANTS`.

  Args:
    name: the method or variant.
    density: its density (dense: 1).
    **options: further `MethodCosts` fields (wire dtype, a two-level exchange).
  """
  if name not in PREDICTABLE:
    raise ValueError(f"unknown method {name!r}; choose from {PREDICTABLE}")
  config = methods.method_config(name)
  collective = config.collective if name in COLLECTIVE_VARIANTS else None
  return MethodCosts(config.name, 1.0 if config.name == "dense" else density,
                     collective=collective, **options)


@dataclasses.dataclass(frozen=True)
class Prediction:
  """One predicted configuration (seconds, bytes per worker per iteration)."""
  model: str
  method: str
  density: float
  workers: int
  bandwidth_bits: float
  t_iter: float
  compute: float
  sparsify: float
  comm_exposed: float
  comm_total: float
  groups: int
  bytes_sent: float
  speedup_vs_dense: float

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def predict(profile: Profile, *, workers: Sequence[int], bandwidths: Sequence[float],
            density: float, latency: float = 25e-6,
            methods: Iterable[str] = METHODS) -> list[Prediction]:
  """Predicts every method for every (bandwidth, P) pair.

  Args:
    profile: a measured profile; only its compute and selection costs are used.
    workers: worker counts P (each >= 2).
    bandwidths: link bandwidths in bits per second.
    density: fraction of values each sparse method sends (dense ignores it).
    latency: per-step latency of the α-β model, seconds.
    methods: which of `PREDICTABLE` to predict ("dense" is always computed
      because speedups are relative to it).

  Returns:
    One `Prediction` per (bandwidth, P, method), in that nesting order.

  Raises:
    ValueError: for an unknown method, P < 2, or a bad density/bandwidth.
  """
  methods = list(methods)
  for method in methods:
    if method not in PREDICTABLE:
      raise ValueError(f"unknown method {method!r}; choose from {PREDICTABLE}")
  for p in workers:
    if not isinstance(p, int) or p < 2:
      raise ValueError(f"worker counts must be integers >= 2, got {p!r}")
  if not 0.0 < density <= 1.0:
    raise ValueError(f"density must be in (0, 1], got {density!r}")
  out = []
  for bits in bandwidths:
    for p in workers:
      net = profile.with_comm(network.network_comm(p, bits, latency), p,
                              f"modelled {p} workers at {bits / 1e9:g} Gb/s")
      dense_costs = MethodCosts("dense", 1.0)
      dense = _simulate(net, dense_costs)
      for method in methods:
        costs = method_costs(method, density)
        groups, tl = (dense if method == "dense" else _simulate(net, costs))
        sent = sum(costs.comm_bytes(net, sum(net.sizes[i] for i in g)) for g in groups)
        out.append(Prediction(
            model=profile.model, method=method, density=density, workers=p,
            bandwidth_bits=float(bits), t_iter=tl.t_iter, compute=tl.compute,
            sparsify=tl.sparsify, comm_exposed=tl.comm_exposed, comm_total=tl.comm,
            groups=len(groups), bytes_sent=float(sent),
            speedup_vs_dense=dense[1].t_iter / tl.t_iter))
  return out


def _simulate(profile: Profile, costs: MethodCosts):
  groups = planner.PLANNER_FUNCTIONS[METHOD_PLANNERS[costs.method]](profile, costs)
  return groups, simulate(profile, groups, costs)


# What `predict_nodes` compares: (label, method, two-level, wire dtype).
NODE_CONFIGS = (
    ("dense flat", "dense", False, "float32"),
    ("dense two-level", "dense", True, "float32"),
    ("dense two-level bf16", "dense", True, "bfloat16"),
    ("dlgs flat", "dlgs", False, "float32"),
    ("dlgs two-level", "dlgs", True, "float32"),
    ("gtopk flat", "gtopk", False, "float32"),
    ("dlgs-owners flat", "dlgs-owners", False, "float32"),
    ("dlgs-owners two-level", "dlgs-owners", True, "float32"),
)


def predict_nodes(profile: Profile, *, nodes: Sequence[int], local: int,
                  bandwidths: Sequence[float], fast_bandwidth: float, density: float,
                  latency: float = 25e-6, fast_latency: float = 5e-6) -> list[Prediction]:
  """Predicts flat and two-level exchanges on N nodes of L devices each.

  The L devices of a node share its network link. Flat: one ring all-reduce
  or all-gather over all N·L workers, nodes contiguous on the ring, so one
  edge per node crosses the network and carries a worker's whole traffic at
  the link's bandwidth -- every worker's message among it; gTop-k's pairwise
  rounds send from all L devices of a node at once (1/L of the link each).
  Two-level (`compress.hierarchical`): a dense reduce-scatter and all-gather
  inside the node on the fast link (`fast_bandwidth` bytes/s, `fast_latency`
  per ring step), and the method between the N nodes on each device's 1/L
  slice, planned per slice, the L slices sharing the link (1/L each). Weak
  scaling, as `predict`.

  Args:
    profile: a measured profile (its compute and selection costs are used).
    nodes: node counts N (each >= 2).
    local: devices per node L (>= 2).
    bandwidths: link bandwidths between nodes, bits per second.
    fast_bandwidth: bytes per second on the fast link inside a node.
    density: the sparse methods' density.
    latency, fast_latency: per-step latencies of the two links, seconds.

  Returns:
    One `Prediction` per (bandwidth, N, configuration of `NODE_CONFIGS`); its
    ``method`` is the configuration's label, ``workers`` is N·L, ``bytes_sent``
    a device's bytes between nodes per iteration, and ``speedup_vs_dense`` is
    against "dense flat".

  Raises:
    ValueError: for N < 2, L < 2, or a bad bandwidth or density.
  """
  if not isinstance(local, int) or local < 2:
    raise ValueError(f"local (devices per node) must be an integer >= 2, got {local!r}")
  if any(not isinstance(n, int) or n < 2 for n in nodes):
    raise ValueError(f"node counts must be integers >= 2, got {list(nodes)!r}")
  if not fast_bandwidth > 0:
    raise ValueError(f"fast_bandwidth must be > 0 bytes/s, got {fast_bandwidth!r}")
  if not 0.0 < density <= 1.0:
    raise ValueError(f"density must be in (0, 1], got {density!r}")
  fast = LinearCost(2 * (local - 1) * fast_latency, 1.0 / fast_bandwidth)
  out = []
  for bits in bandwidths:
    for n in nodes:
      flat = dict(network.network_comm(n * local, bits, latency))
      # gTop-k's rounds and the owners' all-to-all send from all L devices of a node at once.
      shared = network.network_comm(n * local, bits / local, latency)
      flat["gtopk"], flat["owners"] = shared["gtopk"], shared["owners"]
      nets = {False: profile.with_comm(flat, n * local,
                                       f"modelled flat {n}x{local} at {bits / 1e9:g} Gb/s"),
              True: profile.with_comm(network.network_comm(n, bits / local, latency), n,
                                      f"modelled {n} nodes x {local} at {bits / 1e9:g} Gb/s")}
      rows = [_node_row(profile, nets[two], label, method, two, dtype, density, local, fast)
              for label, method, two, dtype in NODE_CONFIGS]
      reference = rows[0].t_iter
      out.extend(dataclasses.replace(r, workers=n * local, bandwidth_bits=float(bits),
                                     speedup_vs_dense=reference / r.t_iter) for r in rows)
  return out


def _node_row(profile, net, label, method, two, dtype, density, local, fast) -> Prediction:
  costs = method_costs(method, density, wire_dtype=dtype, fast_size=local if two else 1,
                       fast_link=fast if two else None)
  groups, tl = _simulate(net, costs)
  sent = sum(costs.comm_bytes(net, sum(net.sizes[i] for i in g)) for g in groups)
  return Prediction(model=profile.model, method=label, density=density, workers=0,
                    bandwidth_bits=0.0, t_iter=tl.t_iter, compute=tl.compute,
                    sparsify=tl.sparsify, comm_exposed=tl.comm_exposed, comm_total=tl.comm,
                    groups=len(groups), bytes_sent=float(sent), speedup_vs_dense=1.0)


def load_profiles(paths: Iterable) -> tuple[list[Profile], dict[str, dict]]:
  """The measured profiles a prediction starts from, and what each of them measured.

  Args:
    paths: profile JSON files (`Profile.save`).

  Returns:
    ``(profiles, measured)``: the profiles in order, and per model its file,
    its source, and its forward and whole backward seconds.
  """
  profiles, measured = [], {}
  for path in paths:
    profile = Profile.load(path)
    profiles.append(profile)
    measured[profile.model] = {"file": str(path), "source": profile.source,
                               "t_forward": profile.t_forward,
                               "t_backward": sum(profile.t_backward)}
  return profiles, measured


def measured_lines(measured: dict[str, dict], per: str, note: str = "") -> list[str]:
  """Lines saying what each profile measured, per `per` (a worker, a GPU), for a report."""
  lines = [f"Measured (per {per}):"]
  for model, m in measured.items():
    lines.append(f"  {model}: forward {m['t_forward'] * 1e3:.2f} ms, backward "
                 f"{m['t_backward'] * 1e3:.2f} ms{note}; {m['source']}")
  return lines


def speedup_table(predictions: Sequence[Prediction], labels: Sequence[str],
                  local: Optional[int] = None) -> str:
  """A markdown table of predictions: per model, link and size, each label's ms and speedup.

  Args:
    predictions: from `predict` or `predict_nodes` (a prediction's `method` is its label).
    labels: the columns, in order (dense's speedup is 1 by definition).
    local: GPUs per node: sizes are written ``nodes x GPUs``; None: as P workers.

  Returns:
    The table's lines joined, the fastest label of each row in its last column.
  """
  rows = {}
  for p in predictions:
    rows.setdefault((p.model, p.bandwidth_bits, p.workers), {})[p.method] = p
  head = (f"| model | link | {'P' if local is None else 'nodes x GPUs'} | "
          + " | ".join(f"{label} ms / speedup" for label in labels) + " | best |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for (model, bits, workers), by_label in rows.items():
    size = workers if local is None else f"{workers // local} x {local}"
    cells = [f"{by_label[x].t_iter * 1e3:.2f} / {by_label[x].speedup_vs_dense:.2f}x"
             for x in labels]
    best = min(by_label.values(), key=lambda x: x.t_iter).method
    lines.append(f"| {model} | {bits / 1e9:g} Gb/s | {size} | " + " | ".join(cells)
                 + f" | {best} |")
  return "\n".join(lines)
