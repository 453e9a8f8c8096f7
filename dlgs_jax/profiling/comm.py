"""Collectives on the current mesh: fitted costs per byte, and whether they overlap work.

Dense all-reduce, sparse all-gather and gTop-k are timed over a range of message
sizes and fitted as ``alpha + beta * bytes sent per worker``, alpha being the
marginal cost of one more collective in a program (`measure_comm`).
`measure_overlap` asks whether the runtime hides a collective behind
computation that does not depend on it (the profile's ``overlap`` flag).
"""

from __future__ import annotations
import re
from typing import Any, Callable, Optional, Sequence
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec
from dlgs_jax.compress import collectives
from dlgs_jax.workload import parallel
from dlgs_jax.compress import selection
from dlgs_jax.compress import wire
from dlgs_jax.planning.timeline import LinearCost
from dlgs_jax.profiling.timing import fit_linear, median_seconds



COMM_KINDS = ("allreduce", "allgather", "gtopk")


def measure_comm(mesh: Mesh, sizes: Sequence[int], density: float, *,
                 repeats: int = 5, chain: int = 8, axis: Optional[str] = None,
                 kinds: Sequence[str] = COMM_KINDS
                 ) -> tuple[dict[str, LinearCost], dict[str, list]]:
  """Fits collective costs on `mesh` against bytes sent per worker.

  The slope ``beta`` is fitted over `sizes`, one collective per program. The
  latency ``alpha`` is the *marginal* cost of one more collective inside a
  program, measured at the smallest size as ``(T(chain) - T(1)) / (chain - 1)``
  with `chain` independent collectives in one jitted program. A lone
  collective's time also carries the cost of launching a program and of the
  workers' arrival skew, which a training step pays once, not once per
  collective: fitted from lone collectives, alpha overpriced the collectives of
  a step (experiments/performance_notes.md).

  Args:
    mesh: the mesh whose devices all take part.
    sizes: leaf sizes (elements); the sparse messages hold
      ``num_to_keep(density, size)`` values.
    density: fraction of values the sparse collectives send.
    repeats: timed calls per measurement.
    chain: collectives per program for the latency; 1 keeps the latency of
      the least-squares fit over lone collectives.
    axis: the axis the collectives run over (default: the mesh's first); on a
      node mesh, "node" times the exchange between nodes with every device of
      a node exchanging at once (they share its link), "local" the fast link.
    kinds: the collectives timed, among `COMM_KINDS`.

  Returns:
    (costs per collective kind, the raw measurements: ``(bytes, seconds)``
    per size and kind, and under ``"latency"`` per kind the bytes, the lone
    and the chained program's time and `chain`).
  """
  if chain < 1:
    raise ValueError(f"chain must be >= 1, got {chain}")
  axis = mesh.axis_names[0] if axis is None else axis
  if axis not in mesh.axis_names:
    raise ValueError(f"axis {axis!r} is not one of the mesh's axes {mesh.axis_names}")
  unknown = sorted(set(kinds) - set(COMM_KINDS))
  if unknown or not kinds:
    raise ValueError(f"kinds must be among {COMM_KINDS}, got {list(kinds)!r}")
  workers, devices = mesh.shape[axis], mesh.devices.size
  spec = PartitionSpec(tuple(mesh.axis_names))
  raw = {kind: [] for kind in kinds}
  rng = np.random.default_rng(0)

  def wrap(fn):
    return jax.jit(jax.shard_map(
        lambda *a: parallel.unsqueeze(fn(*parallel.squeeze(a))), mesh=mesh,
        in_specs=spec, out_specs=spec, check_vma=False))

  def programs(size, k, copies):
    # Distinct inputs per copy, so XLA cannot merge the collectives into one.
    def repeated(collective):
      return wrap(lambda v, i: sum(collective(v + j, i) for j in range(copies)))

    every = {
        "allreduce": lambda v, i: collectives.dense_mean(v, axis_name=axis),
        "allgather": lambda v, i: collectives.sparse_allgather_mean(v[:k], i, size,
                                                                   axis_name=axis),
        "gtopk": lambda v, i: collectives.gtopk_mean(v, v[:k], i, k, axis_name=axis)[0],
    }
    return {kind: repeated(every[kind]) for kind in kinds}

  def inputs(size, k):
    x = parallel.shard_batch(rng.standard_normal((devices, size)).astype(np.float32), mesh)
    idx = parallel.shard_batch(
        np.stack([rng.choice(size, k, replace=False) for _ in range(devices)]).astype(np.int32),
        mesh)
    return x, idx

  def wire_bytes(size, k):
    return {"allreduce": wire.allreduce_bytes(size, workers),
            "allgather": wire.allgather_bytes(k, workers),
            "gtopk": wire.gtopk_bytes(k, workers)[0]}

  for size in sizes:
    k = selection.num_to_keep(density, size)
    x, idx = inputs(size, k)
    sent = wire_bytes(size, k)
    for kind, program in programs(size, k, 1).items():
      raw[kind].append((sent[kind], median_seconds(lambda: program(x, idx), repeats)))
  costs = {kind: fit_linear([b for b, _ in points], [t for _, t in points])
           for kind, points in raw.items()}
  if chain > 1:
    size = min(sizes)
    k = selection.num_to_keep(density, size)
    x, idx = inputs(size, k)
    sent = wire_bytes(size, k)
    raw["latency"] = {}
    for kind, program in programs(size, k, chain).items():
      lone = raw[kind][list(sizes).index(size)][1]
      chained = median_seconds(lambda: program(x, idx), repeats)
      marginal = (chained - lone) / (chain - 1)
      raw["latency"][kind] = {"bytes": sent[kind], "lone": lone, "chained": chained,
                              "chain": chain}
      beta = costs[kind].beta
      costs[kind] = LinearCost(max(marginal - beta * sent[kind], 0.0), beta)
  return costs, raw


OVERLAP_PROGRAMS = ("compute", "collectives", "independent", "chained")


def _overlap_work(v: jax.Array, rounds: int) -> jax.Array:
  for _ in range(rounds):
    v = jnp.sin(v) * 1.0001 + jnp.cos(v) * 0.5
  return v


def overlap_programs(mesh: Mesh, *, leaves: int, message: int, rounds: int
                     ) -> dict[str, Callable[[jax.Array], jax.Array]]:
  """The four programs `measure_overlap` times, on input float32[workers, leaves, size].

  Per leaf, "work" is `rounds` elementwise passes over the whole leaf, and its
  message is the first `message` values of the result times the result's mean
  (so the message needs the whole pass: XLA cannot slice the work away).

  * ``compute``: every leaf's work; the message is stacked `workers` times on
    the worker instead of all-gathered (same shapes, no collective).
  * ``collectives``: every leaf's first `message` input values all-gathered,
    one collective per leaf, no work.
  * ``independent``: work and all-gather per leaf; leaf i's collective
    depends on leaf i's work only, so a runtime may run it while the next
    leaves' work proceeds, as a planned group's collective could run under
    the rest of the backward pass.
  * ``chained``: the same, but leaf i's input depends on leaf i-1's gathered
    result, so nothing can overlap (the control).

  Every program returns float32[leaves, message] per worker: the sum over
  workers of each leaf's message (``compute``: `workers` times its own).
  """
  if min(leaves, message, rounds) < 1:
    raise ValueError(f"leaves, message and rounds must be >= 1, got {leaves}, {message}, "
                     f"{rounds}")
  axis = mesh.axis_names[0]
  workers = mesh.devices.size

  def send(v, mode):
    if mode == "collectives":
      msg = v[:message]
    else:
      v = _overlap_work(v, rounds)
      msg = v[:message] * jnp.mean(v)
    gathered = (jnp.stack([msg] * workers) if mode == "compute"
                else lax.all_gather(msg, axis))
    return jnp.sum(gathered, axis=0)

  def body(xs, mode):
    outs = []
    for i in range(leaves):
      v = xs[i]
      if mode == "chained" and outs:
        v = v.at[:message].add(outs[-1] * 1e-3)
      outs.append(send(v, "independent" if mode == "chained" else mode))
    return jnp.stack(outs)

  spec = PartitionSpec(axis)
  return {mode: jax.jit(jax.shard_map(
      lambda x, mode=mode: parallel.unsqueeze(body(parallel.squeeze(x), mode)),
      mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
          for mode in OVERLAP_PROGRAMS}


def measure_overlap(mesh: Mesh, *, leaves: int = 32, size: int = 200_000, message: int = 2_000,
                    rounds: int = 1, repeats: int = 7,
                    barrier: Optional[Callable[[], Any]] = None) -> dict[str, Any]:
  """Whether the runtime hides collectives behind independent computation.

  Times the four `overlap_programs` and reports the share of the smaller of
  the two parts (work, collectives) that the ``independent`` program hid::

      hidden = (T_compute + T_collectives - T_independent) / min(T_compute, T_collectives)

  1 means fully hidden, 0 nothing (the collectives block the computation, as
  `Profile.overlap` = False models), negative the interleaving cost extra.
  ``chained`` is the control that cannot overlap. This is the question of the
  paper's wait-free backpropagation (DLGS, Sec. 3): a group's collective
  running while the remaining backward computes. It is asked here on one
  program of independent work, not on a model's backward pass.

  Args:
    mesh: the mesh whose collectives are timed (one axis).
    leaves: pieces of work, each followed by its own collective.
    size: elements of each piece.
    message: values each piece all-gathers.
    rounds: elementwise passes per piece (more: more work per collective).
    repeats: timed calls per program.
    barrier: see `median_seconds`.

  Returns:
    ``{"seconds": {program: median}, "samples": {program: [seconds]},
    "hidden": ..., "leaves", "size", "message", "rounds", "workers"}``.
  """
  if size < message:
    raise ValueError(f"size ({size}) must be >= message ({message})")
  programs = overlap_programs(mesh, leaves=leaves, message=message, rounds=rounds)
  workers = mesh.devices.size
  x = parallel.shard_batch(np.random.default_rng(0).standard_normal(
      (workers, leaves, size)).astype(np.float32), mesh)
  # Compiled once, ahead of time: the timings and the schedule use the same executables.
  compiled = {name: program.lower(x).compile() for name, program in programs.items()}
  seconds, samples = {}, {}
  for name, program in compiled.items():
    samples[name] = []
    seconds[name] = median_seconds(lambda: program(x), repeats, barrier=barrier,
                                   samples=samples[name])
  schedule = collective_schedule(compiled["independent"].as_text())
  return {"seconds": seconds, "samples": samples, "hidden": overlap_hidden(seconds),
          "schedule": schedule, "leaves": leaves, "size": size, "message": message,
          "rounds": rounds, "workers": workers}


def collective_schedule(hlo_text: str) -> list[list]:
  """Where the collectives sit in a compiled program's entry computation.

  Run-length encoded over its instructions in the compiled order, parameters,
  constants and tuples left out: ``[["other", 18], ["all-gather", 6],
  ["other", 7]]`` says every collective was scheduled after all the work
  before it could overlap. For reporting; the text format is XLA's.
  """
  start = hlo_text.find("ENTRY")
  if start < 0:
    raise ValueError("no ENTRY computation in the HLO text")
  runs: list[list] = []
  for line in hlo_text[start:].splitlines()[1:]:
    if line.strip() == "}":
      break
    found = re.search(r"=\s+\S+\s+([a-z][a-z0-9-]*)\(", line)
    if not found or found.group(1) in ("parameter", "constant", "tuple", "get-tuple-element"):
      continue
    op = found.group(1)
    kind = op if op.startswith(("all-", "reduce-scatter", "collective-")) else "other"
    if runs and runs[-1][0] == kind:
      runs[-1][1] += 1
    else:
      runs.append([kind, 1])
  return runs


def overlap_hidden(seconds: dict[str, float]) -> float:
  """The ``hidden`` share of `measure_overlap` from its programs' seconds."""
  parts = (seconds["compute"], seconds["collectives"])
  if min(parts) <= 0:
    raise ValueError(f"compute and collectives times must be positive, got {parts}")
  return (sum(parts) - seconds["independent"]) / min(parts)
