"""Layer-merging planners and plans (Ju et al. 2024, Sec. 3.3-3.4, Algorithm 2).

A planner returns groups: contiguous runs of layers in backward order. Four are
offered:

* ``wfbp`` -- every layer alone (wait-free backpropagation);
* ``single`` -- everything in one message;
* ``greedy`` -- the paper's Algorithm 2: for each boundary in backward order,
  merge the two neighbouring groups if the modelled iteration time drops;
* ``optimal`` -- the exact minimum of the timeline model over all 2^(L-1)
  groupings, by dynamic programming over group boundaries. The state after a
  prefix of groups is (compute-stream clock, communication-stream clock);
  everything that follows is non-decreasing in both, so a state that is no
  better in either is dropped (Pareto pruning) without losing the optimum.

A `Plan` is data: JSON with the groups by leaf path, the profile it came from
and the predicted times. Rank 0 makes it and `broadcast_plan` gives every
process the same one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from typing import Any, Callable, Optional, Sequence

import numpy as np

from dlgs_jax.planning.timeline import METHODS, LinearCost, MethodCosts, Profile, simulate

PLANNERS = ("wfbp", "single", "greedy", "optimal")


def wfbp(profile: Profile, costs: MethodCosts) -> list[list[int]]:
  del costs
  return [[i] for i in range(profile.num_layers)]


def single(profile: Profile, costs: MethodCosts) -> list[list[int]]:
  del costs
  return [list(range(profile.num_layers))]


def greedy(profile: Profile, costs: MethodCosts) -> list[list[int]]:
  """Algorithm 2: try merging each layer into the next one (backward order); keep if faster."""
  groups = wfbp(profile, costs)
  best = simulate(profile, groups, costs).t_iter
  position = 0
  while position < len(groups) - 1:
    trial = groups[:position] + [groups[position] + groups[position + 1]] + groups[position + 2:]
    t = simulate(profile, trial, costs).t_iter
    if t < best:
      groups, best = trial, t
    else:
      position += 1
  return groups


def optimal(profile: Profile, costs: MethodCosts) -> list[list[int]]:
  """Exact minimum of the timeline model over all contiguous groupings."""
  n = profile.num_layers
  backward = np.concatenate([[0.0], np.cumsum(profile.t_backward)])
  sizes = np.concatenate([[0], np.cumsum(profile.sizes)])
  # LAGS/DLGS layers sent whole ride in their group's message at full size.
  whole = np.concatenate([[0], np.cumsum(
      [n if costs.in_message(i) else 0 for i, n in enumerate(profile.sizes)])])
  # Cost of a group [j, m) depends only on its sizes: precompute per (j, m).
  # states[j] = arrays (compute clock, comm clock, parent j, parent index).
  states: list[Optional[tuple[np.ndarray, ...]]] = [None] * (n + 1)
  states[0] = (np.asarray([profile.t_forward]), np.asarray([0.0]),
               np.asarray([-1]), np.asarray([-1]))
  for m in range(1, n + 1):
    pool_t, pool_c, pool_j, pool_i = [], [], [], []
    for j in range(m):
      t0, c0, _, _ = states[j]
      size = int(sizes[m] - sizes[j])
      in_message = int(whole[m] - whole[j])
      t_s = costs.sparsify_time(profile, size)
      t_c = costs.comm_time(profile, size - in_message, in_message)
      t1 = t0 + (backward[m] - backward[j]) + t_s
      c1 = np.maximum(t1, c0) + t_c
      if not profile.overlap:
        t1 = c1  # the collective blocks the compute stream
      pool_t.append(t1)
      pool_c.append(c1)
      pool_j.append(np.full(t1.shape, j))
      pool_i.append(np.arange(t1.shape[0]))
    t_all, c_all = np.concatenate(pool_t), np.concatenate(pool_c)
    j_all, i_all = np.concatenate(pool_j), np.concatenate(pool_i)
    keep = _pareto(t_all, c_all)
    states[m] = (t_all[keep], c_all[keep], j_all[keep], i_all[keep])
  # The iteration ends with the last message (comm clock >= compute clock).
  t_end, c_end, _, _ = states[n]
  index = int(np.argmin(np.maximum(c_end, t_end)))
  groups, m = [], n
  while m > 0:
    _, _, parent_j, parent_i = states[m]
    j = int(parent_j[index])
    groups.append(list(range(j, m)))
    index, m = int(parent_i[index]), j
  return groups[::-1]


def _pareto(t: np.ndarray, c: np.ndarray) -> np.ndarray:
  """Indices of the points not dominated in (t, c), both smaller-is-better."""
  order = np.lexsort((c, t))
  best_c = np.minimum.accumulate(c[order])
  # Keep a point when its c is strictly below every c seen at smaller-or-equal t.
  previous = np.concatenate([[np.inf], best_c[:-1]])
  return order[c[order] < previous]


def brute_force(profile: Profile, costs: MethodCosts) -> list[list[int]]:
  """Tries all 2^(L-1) groupings (tests only; L <= ~16)."""
  n = profile.num_layers
  best, best_groups = np.inf, None
  for cuts in itertools.product((False, True), repeat=n - 1):
    groups, current = [], [0]
    for layer, cut in zip(range(1, n), cuts):
      if cut:
        groups.append(current)
        current = [layer]
      else:
        current.append(layer)
    groups.append(current)
    t = simulate(profile, groups, costs).t_iter
    if t < best:
      best, best_groups = t, groups
  return best_groups


PLANNER_FUNCTIONS: dict[str, Callable[[Profile, MethodCosts], list[list[int]]]] = {
    "wfbp": wfbp, "single": single, "greedy": greedy, "optimal": optimal}


def profile_id(profile: Profile) -> str:
  """Short content hash that identifies a profile."""
  blob = json.dumps(profile.to_dict(), sort_keys=True).encode()
  return hashlib.sha256(blob).hexdigest()[:16]


@dataclasses.dataclass
class Plan:
  """A grouping of a model's leaves with the profile and predictions behind it."""
  model: str
  method: str
  density: float
  workers: int
  planner: str
  order: list[str]          # every leaf path, backward order
  groups: list[list[str]]   # leaf paths per group, backward order
  predicted: dict[str, float]
  profile: dict[str, Any]
  profile_id: str
  # Two-level exchange (`compress.hierarchical`): devices per node (1: flat);
  # `workers` are then the nodes, and each group is selected and sent on its
  # 1/fast_size slices. fast_link: {"alpha", "beta"} of the link inside a node.
  fast_size: int = 1
  fast_link: Optional[dict[str, float]] = None

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  @classmethod
  def from_json(cls, text: str) -> "Plan":
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"not a valid plan: not JSON ({e})") from None
    fields = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    keys = set(data) if isinstance(data, dict) else set()  # not a dict: every field missing
    wrong = [f"{what} {sorted(names)}" for what, names in
             (("missing", required - keys), ("unknown", keys - fields)) if names]
    if wrong:
      raise ValueError(f"not a valid plan (one dlgs-plan writes): {', '.join(wrong)}")
    plan = cls(**data)
    if [p for g in plan.groups for p in g] != list(plan.order):
      raise ValueError("plan groups are not contiguous runs of its order")
    return plan

  def save(self, path) -> None:
    with open(path, "w") as f:
      f.write(self.to_json())

  @classmethod
  def load(cls, path) -> "Plan":
    with open(path) as f:
      return cls.from_json(f.read())

  def group_indices(self, paths: Sequence[str]) -> list[list[int]]:
    """The groups as positions in `paths` (e.g. a profile's backward order).

    Args:
      paths: leaf paths, each plan leaf among them.

    Returns:
      One list of indices into `paths` per group, in the plan's order.
    """
    index = {path: i for i, path in enumerate(paths)}
    missing = [p for g in self.groups for p in g if p not in index]
    if missing:
      raise ValueError(f"plan leaves not in these paths: {missing[:5]}")
    return [[index[p] for p in g] for g in self.groups]

  def check_compatible(self, *, paths: Sequence[str], workers: int,
                       model: Optional[str] = None, fast_size: int = 1) -> None:
    """Raises ValueError unless the plan was made for these leaves and this exchange.

    Args:
      paths: the run's leaf paths.
      workers: every worker of the run (nodes x devices per node).
      model: the run's model, if checked.
      fast_size: devices per node of a two-level exchange; 1: flat.
    """
    if model is not None and model != self.model:
      raise ValueError(f"plan is for model {self.model!r}, not {model!r}")
    if sorted(paths) != sorted(self.order):
      missing = sorted(set(paths) - set(self.order))[:5]
      extra = sorted(set(self.order) - set(paths))[:5]
      raise ValueError(
          f"plan for model {self.model!r} does not match these parameters "
          f"(leaves not in the plan: {missing}, plan leaves not in the parameters: {extra})")
    mine = _exchange(self.workers * self.fast_size, self.fast_size)
    theirs = _exchange(workers, fast_size)
    if mine != theirs:
      raise ValueError(f"plan was made for {mine}, this run has {theirs}")


def _exchange(workers: int, fast_size: int) -> str:
  if fast_size == 1:
    return f"{workers} workers"
  return f"{workers // fast_size} nodes x {fast_size} devices (two-level, slices of 1/{fast_size})"


def dlgs_exact_fraction(profile: Profile, method: str,
                        refresh_below: Optional[float]) -> Optional[float]:
  """`MethodCosts.exact_fraction` for `method` as it runs.

  DLGS with the refresh rule on (`refresh_below` not None) recomputes
  thresholds as often as the profile measured; everything else (DLGS on the
  fixed schedule, other methods, profiles without the measurement) gets None.
  """
  if method != "dlgs" or refresh_below is None:
    return None
  return profile.dlgs_exact_fraction


def make_plan(profile: Profile, method: str, density: float, planner: str, *,
              exact_fraction: Optional[float] = None,
              whole_layers: Sequence[int] = (), wire_dtype: str = "float32",
              fast_size: int = 1, fast_link: Optional[LinearCost] = None) -> Plan:
  """Runs `planner` on `profile` for `method` and packages the result.

  Args:
    profile: the measured or modelled profile.
    method: one of `timeline.METHODS`.
    density: the method's density.
    planner: one of `PLANNERS`.
    exact_fraction: DLGS: share of thresholds computed exactly per step (see
      `MethodCosts.exact_fraction`; pass ``profile.dlgs_exact_fraction`` when
      the refresh rule is on); None: the fixed schedule's amortised cost.
    whole_layers: LAGS/DLGS: layers (positions in the profile's order) sent
      whole (`MethodCosts.whole_layers`).
    wire_dtype: the values' dtype on the wire (`MethodCosts.wire_dtype`).
    fast_size, fast_link: a two-level exchange of nodes of `fast_size`
      devices (`MethodCosts.fast_size`); the profile's workers and network are
      then those between nodes.

  Raises:
    ValueError: for an unknown method or planner, or a bad density.
  """
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
  if planner not in PLANNER_FUNCTIONS:
    raise ValueError(f"unknown planner {planner!r}; choose from {PLANNERS}")
  if not 0.0 < density <= 1.0:
    raise ValueError(f"density must be in (0, 1], got {density!r}")
  costs = MethodCosts(method, density, exact_fraction=exact_fraction,
                      whole_layers=frozenset(whole_layers), wire_dtype=wire_dtype,
                      fast_size=fast_size, fast_link=fast_link)
  groups = PLANNER_FUNCTIONS[planner](profile, costs)
  timeline = simulate(profile, groups, costs)
  return Plan(
      model=profile.model, method=method, density=density, workers=profile.workers,
      planner=planner, order=list(profile.paths),
      groups=[[profile.paths[i] for i in g] for g in groups],
      predicted=timeline.breakdown(), profile=profile.to_dict(),
      profile_id=profile_id(profile), fast_size=fast_size,
      fast_link=dataclasses.asdict(fast_link) if fast_link is not None else None)


def broadcast_plan(plan: Optional[Plan]) -> Plan:
  """Gives every process process 0's plan (paper Sec. 3.4).

  Args:
    plan: the plan on process 0; ignored (may be None) elsewhere.

  Returns:
    Process 0's plan, in every process.
  """
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    if plan is None:
      raise ValueError("broadcast_plan needs a plan on process 0")
    return plan
  payload = plan.to_json().encode() if jax.process_index() == 0 else b""
  length = int(multihost_utils.broadcast_one_to_all(np.asarray(len(payload), np.int32)))
  buffer = np.zeros(length, np.uint8)
  if jax.process_index() == 0:
    buffer[:] = np.frombuffer(payload, np.uint8)
  data = multihost_utils.broadcast_one_to_all(buffer)
  return Plan.from_json(np.asarray(data, np.uint8).tobytes().decode())
