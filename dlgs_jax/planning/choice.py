"""Which collective sends a sparse message fastest, for a given P, bandwidth and latency.

Each worker's all-gather of its k pairs moves (P-1)·8k bytes, so it loses to a
dense bfloat16 all-reduce near P = 50 at density 0.01; gTop-k's bytes grow as
log2 P and the owners' exchange (`compress.owners`) keeps them flat, at the
price of more latency steps. The α-β costs are `network.network_comm`'s and the
bytes `wire`'s, the same functions the timeline model prices a step with; the
selection's own cost (gTop-k's merges, the owners' sort) is not counted here.
"""

from __future__ import annotations

from typing import Sequence

from dlgs_jax.compress import methods, selection, wire
from dlgs_jax.planning.network import network_comm
from dlgs_jax.planning.timeline import LinearCost

# The exchanges a sparse method can take, and the dense bfloat16 all-reduce they must beat.
CHOICES = ("allgather", "gtopk", "owners", "dense-bf16")


def exchange_seconds(size: int, density: float, workers: int,
                     comm: dict[str, LinearCost]) -> dict[str, float]:
  """Seconds of one message of `size` values at `density` by each exchange `comm` prices.

  Args:
    size: values in the message (the model, for one message).
    density: the sparse methods' share of values sent.
    workers: P.
    comm: α-β costs by collective kind (`network.network_comm`, or a profile's);
      an exchange whose kind it lacks is left out.

  Returns:
    ``{choice: seconds}`` in `CHOICES` order.
  """
  k = selection.num_to_keep(density, size)
  priced = {
      "allgather": ("allgather", wire.allgather_bytes(k, workers)),
      "gtopk": ("gtopk", wire.gtopk_bytes(k, workers)[0]),
      "owners": ("owners", wire.owners_bytes(k, k, workers)),
      "dense-bf16": ("allreduce", wire.allreduce_bytes(size, workers, itemsize=2)),
  }
  return {name: comm[kind](amount) for name, (kind, amount) in priced.items() if kind in comm}


def fastest(seconds: dict[str, float]) -> str:
  """The exchange of least seconds (ties: the first listed)."""
  if not seconds:
    raise ValueError("no exchange is priced: the costs hold none of their collectives")
  return min(seconds, key=seconds.get)


def for_method(method: str, size: int, density: float, workers: int,
               comm: dict[str, LinearCost]) -> dict:
  """``collective="auto"``: each exchange priced, and the fastest that `method` can take.

  Args:
    method: a key of `compress.methods.METHODS` that takes a collective.
    size, density, workers, comm: as `exchange_seconds`.

  Returns:
    ``{"seconds": {choice: seconds} of the exchanges `method` takes and dense
    bfloat16 (for comparison), "fastest": the fastest of those,
    "collective": the fastest `method` takes}``.

  Raises:
    ValueError: when `comm` prices none of the exchanges `method` takes.
  """
  seconds = {name: t for name, t in exchange_seconds(size, density, workers, comm).items()
             if name == "dense-bf16" or methods.takes(method, name)}
  taken = {name: t for name, t in seconds.items() if name != "dense-bf16"}
  if not taken:
    raise ValueError(f"the costs price none of {method}'s exchanges "
                     f"({', '.join(c for c in CHOICES if methods.takes(method, c))})")
  return {"seconds": seconds, "fastest": fastest(seconds), "collective": fastest(taken)}


def choose(size: int, density: float, workers: int, comm: dict[str, LinearCost]) -> str:
  """The fastest of `exchange_seconds` (ties: the first in `CHOICES`)."""
  return fastest(exchange_seconds(size, density, workers, comm))


def crossover_table(size: int, density: float, workers: Sequence[int],
                    bandwidths: Sequence[float], latency: float = 25e-6) -> str:
  """A markdown table: per link and P, each exchange's ms, the fastest in bold.

  Args:
    size: values in the message.
    density: the share sent.
    workers: the P of each row.
    bandwidths: links in bits per second.
    latency: seconds per step.
  """
  head = "| link | P | " + " | ".join(CHOICES) + " |"
  lines = [head, "|" + "---|" * (len(CHOICES) + 2)]
  for bits in bandwidths:
    for p in workers:
      seconds = exchange_seconds(size, density, p, network_comm(p, bits, latency))
      best = fastest(seconds)
      cells = [f"**{seconds[c] * 1e3:.2f}**" if c == best else f"{seconds[c] * 1e3:.2f}"
               for c in CHOICES]
      lines.append(f"| {bits / 1e9:g} Gb/s | {p} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
