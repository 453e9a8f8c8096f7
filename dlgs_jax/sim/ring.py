"""Ring reduce-scatter with a slow node: a discrete-event simulator.

After Zhang, Deng, Song, Xue, Guo and Huang, "Network communication optimization
techniques for distributed machine learning" (2024).

P nodes in a ring reduce P chunks. Chunk c starts at node c, which sends its own
part to c+1 at time 0; every node on the way adds its part and forwards, and
node c-1 ends up with the full sum after P-1 hops. A node works through its P-1
operations in order (operation s handles chunk ``(i - s - 1) mod P``); an
operation can start when the node is free and has received the contributions
of every node before it on the chunk's path, takes T (the slow node: T + ΔT),
and its result reaches the next node T_trans later.

The strategy (Zhang et al. 2024): a node C whose predecessor B is late
waits at most ``α·T + T_trans`` after starting its previous operation, then
forwards its own part of the chunk straight to the next node D and moves on;
B, seeing that its result would arrive after C's deadline, sends it straight
to D, which reduces both in one operation. A node never skips a chunk it
owns. Only the reduce-scatter differs from the plain ring (the all-gather that
follows is the same), so only it is simulated.

Closed forms of the time saved until D holds the late chunk (the paper's eqs. 1-2),
when D is idle by the time the data arrives:
``T_trans + T`` if ``T + ΔT > α·T + T_trans``; ``ΔT + (2 - α)·T`` if
``α·T < T + ΔT <= α·T + T_trans``; 0 if ``T + ΔT <= α·T`` (no trigger).

    python -m dlgs_jax.sim.ring                  # the paper's study, plots in runs/ring
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Optional


@dataclasses.dataclass
class RingResult:
  """Times in seconds."""
  total: float              # when the last chunk is fully reduced
  chunk_done: list[float]   # per chunk: when its owner holds the full sum
  skips: int                # operations skipped by the strategy
  ops: list[tuple[int, int, float, float]]  # (node, chunk, start, end) of each reduce


def simulate_reduce_scatter(nodes: int, T: float, T_trans: float, delta: float = 0.0, *,
                            slow_node: int = 1, alpha: Optional[float] = None,
                            slow_ops: str = "first") -> RingResult:
  """Simulates one ring reduce-scatter.

  Args:
    nodes: P >= 2.
    T: time of one receive-reduce-send operation.
    T_trans: time for a message to cross one link.
    delta: extra time ΔT of the slow node's operations.
    slow_node: which node is slow.
    alpha: the strategy's threshold factor (> 1); ``None`` is the plain ring.
    slow_ops: "first" (the slow node is slow in its first operation, the case
      the paper analyses) or "all" (every operation of the slow node).

  Returns:
    A `RingResult`.

  Raises:
    ValueError: for a bad argument.
  """
  if not isinstance(nodes, int) or nodes < 2:
    raise ValueError(f"nodes must be an integer >= 2, got {nodes!r}")
  for name, value in (("T", T), ("T_trans", T_trans), ("delta", delta)):
    if not (math.isfinite(value) and value >= 0):
      raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
  if alpha is not None and not (math.isfinite(alpha) and alpha > 1):
    raise ValueError(f"alpha must be > 1, got {alpha!r}")
  if not 0 <= slow_node < nodes:
    raise ValueError(f"slow_node must be in [0, {nodes}), got {slow_node!r}")
  if slow_ops not in ("first", "all"):
    raise ValueError(f"slow_ops must be 'first' or 'all', got {slow_ops!r}")
  return _RingSimulation(nodes, T, T_trans, delta, slow_node, alpha, slow_ops).run()


class _RingSimulation:
  """The event queue and every node's progress through its P - 1 operations."""

  def __init__(self, p, T, T_trans, delta, slow_node, alpha, slow_ops):
    self.p, self.T, self.T_trans, self.delta = p, T, T_trans, delta
    self.slow_node, self.alpha, self.slow_ops = slow_node, alpha, slow_ops
    self.received = {}          # (node, chunk) -> set of contributions received
    self.skipped = set()        # (node, chunk) skipped by the strategy
    self.next_op = [0] * p
    self.busy = [False] * p
    self.op_start: dict[tuple[int, int], float] = {}
    self.chunk_done = [math.nan] * p
    self.ops, self.skips = [], 0
    self.events: list = []
    self.order = itertools.count()

  def chunk_of(self, node, op):
    return (node - op - 1) % self.p

  def needed(self, node, chunk):
    """Contributions node must hold before reducing chunk: the nodes before it on the path."""
    return frozenset((chunk + j) % self.p for j in range((node - chunk) % self.p))

  def op_time(self, node, op):
    slow = node == self.slow_node and (self.slow_ops == "all" or op == 0)
    return self.T + (self.delta if slow else 0.0)

  def push(self, time, kind, *payload):
    heapq.heappush(self.events, (time, next(self.order), kind, payload))

  def deadline(self, node, op):
    """When `node` gives up waiting for operation `op`'s input (None: it waits)."""
    if self.alpha is None or op == 0 or (node + 1) % self.p == self.chunk_of(node, op):
      return None  # the plain ring, a node's own first send, or a chunk it owns
    previous = self.op_start.get((node, op - 1))
    return None if previous is None else previous + self.alpha * self.T + self.T_trans

  def send(self, time, src, chunk, parts):
    dest = (src + 1) % self.p
    arrival = time + self.T_trans
    op = (dest - chunk - 1) % self.p
    limit = self.deadline(dest, op)
    if (dest, chunk) in self.skipped or (limit is not None and arrival > limit
                                         and self.next_op[dest] <= op):
      dest = (dest + 1) % self.p  # the next node gave up on us: go straight past it
    self.push(arrival, "arrive", dest, chunk, frozenset(parts))

  def try_start(self, node, now):
    while not self.busy[node] and self.next_op[node] < self.p - 1:
      op = self.next_op[node]
      chunk = self.chunk_of(node, op)
      have = self.received.get((node, chunk), frozenset())
      if have >= self.needed(node, chunk):
        self.busy[node] = True
        self.op_start[(node, op)] = now
        end = now + self.op_time(node, op)
        self.ops.append((node, chunk, now, end))
        self.push(end, "finish", node, op)
        return
      limit = self.deadline(node, op)
      if limit is None:
        return
      if now < limit:
        self.push(limit, "deadline", node, op)
        return
      # Give up: forward our own part (and whatever arrived) and move on.
      self.skipped.add((node, chunk))
      self.skips += 1
      self.op_start[(node, op)] = now
      self.send(now, node, chunk, have | {node})
      self.next_op[node] += 1

  def handle(self, now, kind, payload):
    if kind == "arrive":
      node, chunk, parts = payload
      if (node, chunk) in self.skipped:  # a chain of skips: pass it on
        self.send(now, node, chunk, parts)
        return
      self.received[(node, chunk)] = self.received.get((node, chunk), frozenset()) | parts
      self.try_start(node, now)
    elif kind == "finish":
      node, op = payload
      self.busy[node] = False
      self.next_op[node] += 1
      chunk = self.chunk_of(node, op)
      if (node + 1) % self.p == chunk:
        self.chunk_done[chunk] = now
      else:
        self.send(now, node, chunk, self.received[(node, chunk)] | {node})
      self.try_start(node, now)
    else:  # deadline
      node, op = payload
      if self.next_op[node] == op:
        self.try_start(node, now)

  def run(self) -> RingResult:
    for node in range(self.p):
      self.send(0.0, node, node, {node})
    while self.events:
      now, _, kind, payload = heapq.heappop(self.events)
      self.handle(now, kind, payload)
    if any(math.isnan(t) for t in self.chunk_done):
      raise RuntimeError(f"simulation ended with unfinished chunks: {self.chunk_done}")
    return RingResult(max(self.chunk_done), self.chunk_done, self.skips, self.ops)


def saved_time_closed_form(T: float, T_trans: float, delta: float, alpha: float) -> float:
  """The paper's eqs. (1)-(2): time saved until D holds the slow node's chunk."""
  if T + delta <= alpha * T:
    return 0.0
  if T + delta > alpha * T + T_trans:
    return T_trans + T
  return delta + (2 - alpha) * T


def late_chunk_saving(nodes, T, T_trans, delta, alpha, slow_node=1, slow_ops="first"):
  """(baseline, strategy) completion of the chunk the slow node handles first."""
  chunk = (slow_node - 1) % nodes
  base = simulate_reduce_scatter(nodes, T, T_trans, delta, slow_node=slow_node,
                                 slow_ops=slow_ops)
  strat = simulate_reduce_scatter(nodes, T, T_trans, delta, slow_node=slow_node, alpha=alpha,
                                  slow_ops=slow_ops)
  return base.chunk_done[chunk], strat.chunk_done[chunk]



def _seconds(text: str) -> float:
  units = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
  for unit in ("ns", "us", "ms", "s"):
    if text.endswith(unit):
      try:
        return float(text[:-len(unit)]) * units[unit]
      except ValueError:
        break
  try:
    return float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a time: {text!r} (seconds, or a number with a "
                                     f"unit: ns, us, ms or s)") from None


def _bytes(text: str) -> float:
  units = {"KB": 1024, "MB": 1024 ** 2, "B": 1}
  for unit, factor in units.items():
    if text.upper().endswith(unit):
      try:
        return float(text[:-len(unit)]) * factor
      except ValueError:
        break
  raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8KB)")


def main(argv=None) -> int:
  from dlgs_jax.planning.network import parse_bandwidth

  parser = argparse.ArgumentParser(
      prog="python -m dlgs_jax.sim.ring",
      description="Slow-node ring reduce-scatter study (Zhang et al. 2024).")
  parser.add_argument("--nodes", type=int, default=4)
  parser.add_argument("--T", type=_seconds, default=3e-6,
                      help="per-step time: seconds, or a number with a unit (ns, us, ms, s)")
  parser.add_argument("--link-delay", type=_seconds, default=5e-6)
  parser.add_argument("--packet", type=_bytes, default=8 * 1024.0, help="e.g. 8KB")
  parser.add_argument("--bandwidth", default="100gbit")
  parser.add_argument("--alphas", default="1.2,1.5,2,2.5,3")
  parser.add_argument("--max-delta", type=_seconds, default=40e-6)
  parser.add_argument("--points", type=int, default=161)
  parser.add_argument("--slow-ops", default="first", choices=("first", "all"))
  parser.add_argument("--out-dir", default="runs/ring")
  args = parser.parse_args(argv)
  T = args.T
  T_trans = args.link_delay + args.packet * 8 / parse_bandwidth(args.bandwidth)
  alphas = [float(a) for a in args.alphas.split(",")]
  deltas = [args.max_delta * i / (args.points - 1) for i in range(args.points)]
  rows = []
  for alpha in alphas:
    for delta in deltas:
      base = simulate_reduce_scatter(args.nodes, T, T_trans, delta, slow_ops=args.slow_ops)
      strat = simulate_reduce_scatter(args.nodes, T, T_trans, delta, alpha=alpha,
                                      slow_ops=args.slow_ops)
      chunk = (1 - 1) % args.nodes
      rows.append({
          "alpha": alpha, "delta": delta, "t_ring": base.total, "t_strategy": strat.total,
          "saving": (base.total - strat.total) / base.total,
          "late_chunk_saved": base.chunk_done[chunk] - strat.chunk_done[chunk],
          "closed_form": saved_time_closed_form(T, T_trans, delta, alpha),
          "skips": strat.skips})
  out = Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  best = max(rows, key=lambda r: r["saving"])
  print(f"{args.nodes} nodes, T = {T * 1e6:g} us, T_trans = {T_trans * 1e6:.3f} us "
        f"({args.link_delay * 1e6:g} us link + {args.packet:g} B at {args.bandwidth}), "
        f"slow node slow in {args.slow_ops} operation(s)")
  print("| alpha | dT us | T_ring us | T_strategy us | saving | late chunk saved us | eqs. (1)-(2) us |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    if round(r["delta"] * 1e6, 6) % 5 == 0:
      print(f"| {r['alpha']:g} | {r['delta'] * 1e6:.1f} | {r['t_ring'] * 1e6:.3f} | "
            f"{r['t_strategy'] * 1e6:.3f} | {r['saving'] * 100:.1f}% | "
            f"{r['late_chunk_saved'] * 1e6:.3f} | {r['closed_form'] * 1e6:.3f} |")
  print(f"\nlargest saving: {best['saving'] * 100:.1f}% of the reduce-scatter time at "
        f"alpha = {best['alpha']:g}, dT = {best['delta'] * 1e6:.2f} us "
        f"(T_ring {best['t_ring'] * 1e6:.2f} us -> {best['t_strategy'] * 1e6:.2f} us); "
        "the paper reports up to 25.3%")
  (out / "ring_study.json").write_text(json.dumps(
      {"nodes": args.nodes, "T": T, "T_trans": T_trans, "slow_ops": args.slow_ops,
       "rows": rows, "best": best}, indent=1))
  _plot(rows, alphas, out, args.nodes)
  print(f"wrote {out / 'ring_study.json'}, {out / 'ring_time_vs_delta.png'}, "
        f"{out / 'ring_saving.png'}")
  return 0


def _plot(rows, alphas, out, nodes):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  middle = alphas[len(alphas) // 2]
  sel = [r for r in rows if r["alpha"] == middle]
  dts = [r["delta"] * 1e6 for r in sel]
  ax.plot(dts, [r["t_ring"] * 1e6 for r in sel], label="ring all-reduce")
  for alpha in alphas:
    sel_a = [r for r in rows if r["alpha"] == alpha]
    ax.plot(dts, [r["t_strategy"] * 1e6 for r in sel_a], label=f"strategy, alpha={alpha:g}",
            linewidth=0.9)
  ax.set_xlabel("slow node's extra time dT (us)")
  ax.set_ylabel("reduce-scatter time (us)")
  ax.set_title(f"{nodes} nodes: time vs dT (Zhang et al. 2024, Fig. 7)", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / "ring_time_vs_delta.png", dpi=110)
  plt.close(fig)

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for alpha in alphas:
    sel_a = [r for r in rows if r["alpha"] == alpha]
    axes[0].plot([r["delta"] * 1e6 for r in sel_a], [r["saving"] * 100 for r in sel_a],
                 label=f"alpha={alpha:g}")
  axes[0].set_xlabel("dT (us)")
  axes[0].set_ylabel("time saved (% of ring)")
  axes[0].set_title("saving vs dT (Figs. 8, 10)", fontsize=9)
  axes[0].legend(fontsize=7)
  all_deltas = sorted({r["delta"] for r in rows})
  for delta in all_deltas[:: max(1, len(all_deltas) // 6)]:
    sel_d = [r for r in rows if r["delta"] == delta]
    axes[1].plot([r["alpha"] for r in sel_d], [r["saving"] * 100 for r in sel_d], marker="o",
                 markersize=3, label=f"dT={delta * 1e6:.1f}us")
  axes[1].set_xlabel("alpha")
  axes[1].set_title("saving vs alpha (Fig. 9)", fontsize=9)
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / "ring_saving.png", dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
