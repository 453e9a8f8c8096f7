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
from typing import Iterable, Sequence

from dlgs_jax.compress import methods
from dlgs_jax.planning import planner
from dlgs_jax.planning import network
from dlgs_jax.planning.timeline import METHODS, MethodCosts, Profile, simulate

# How each method groups its layers when it runs (the registry's `grouping`).
METHOD_PLANNERS = {name: methods.METHODS[name].grouping for name in METHODS}


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
    methods: which of `timeline.METHODS` to predict ("dense" is always computed
      because speedups are relative to it).

  Returns:
    One `Prediction` per (bandwidth, P, method), in that nesting order.

  Raises:
    ValueError: for an unknown method, P < 2, or a bad density/bandwidth.
  """
  methods = list(methods)
  for method in methods:
    if method not in METHOD_PLANNERS:
      raise ValueError(f"unknown method {method!r}; choose from {tuple(METHOD_PLANNERS)}")
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
        costs = MethodCosts(method, 1.0 if method == "dense" else density)
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
