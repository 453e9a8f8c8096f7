"""What a compiled program is made of: conditionals, sorts, loops and kernels.

Read from the optimized HLO XLA compiled (``jax.jit(f).lower(...).compile()``),
so the counts are those of the program that runs on this backend: how many
`conditional`s wait on a predicate (on GPU, each syncs with the host), how many
`sort`s and top-k calls run, how many `while` loops, and how
many kernels a step launches -- the instructions of the entry computation and
of every computation it calls as a branch or loop body, less the ones that
launch nothing (parameters, constants, tuples, bitcasts).
"""

from __future__ import annotations

import re
from typing import Callable

# Instructions that move no data and launch nothing.
_FREE = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                   "after-all", "partition-id", "replica-id", "copy-start", "copy-done"})
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?[%\w.\-]+\s*=\s*[^=]*?\s([a-z][\w\-]*)\(")
_CALLED = re.compile(r"(?:true_computation|false_computation|branch_computations|body|"
                     r"condition)=\{?([%\w.\-, ]+)\}?")
_ANY_CALL = re.compile(r"(?:true_computation|false_computation|branch_computations|body|"
                       r"condition|calls|to_apply|called_computations)=\{?([%\w.\-, ]+)\}?")


def _computations(hlo: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines; the entry under ``"ENTRY"`` too."""
  computations, name = {}, None
  for line in hlo.splitlines():
    # Headers start at column 0 and open a block; instructions are indented.
    header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if header and not line[:1].isspace():
      name = header.group(2)
      computations[name] = []
      if header.group(1):
        computations["ENTRY"] = computations[name]
      continue
    if name is not None and line.strip() == "}":
      name = None
    elif name is not None:
      computations[name].append(line)
  return computations


# XLA numbers the elements of long tuple types (``/*index=5*/``): their "=" would
# end an instruction's type early and hide its opcode (a conditional returning
# six arrays went uncounted).
_COMMENT = re.compile(r"/\*.*?\*/")


def _opcode(line: str):
  match = _INSTRUCTION.match(_COMMENT.sub("", line))
  return match.group(1) if match else None


def _reachable(computations, roots, pattern) -> set:
  """Names of the computations reached from `roots` through attributes `pattern` matches."""
  seen, pending = set(), list(roots)
  while pending:
    name = pending.pop()
    if name in seen or name not in computations:
      continue
    seen.add(name)
    for line in computations[name]:
      for group in pattern.findall(line):
        pending.extend(part.strip().lstrip("%") for part in group.split(","))
  return seen


def count_hlo(hlo: str) -> dict[str, int]:
  """Counts in an optimized HLO module's text (`program_counts` explains them)."""
  computations = _computations(hlo)
  # What launches: the entry, its branches and loop bodies (not fusions' insides).
  launching = _reachable(computations, ["ENTRY"], _CALLED)
  # Where a sort may hide: anything the entry reaches, fusions and comparators too.
  everything = _reachable(computations, ["ENTRY"], _ANY_CALL)
  counts = {"conditionals": 0, "sorts": 0, "top_k": 0, "loops": 0, "kernels": 0}
  for name in launching:
    for op in filter(None, map(_opcode, computations[name])):
      counts["conditionals"] += op == "conditional"
      counts["loops"] += op == "while"
      counts["kernels"] += op not in _FREE and op not in ("conditional", "while")
  for name in everything:
    for line in computations[name]:
      counts["sorts"] += _opcode(line) == "sort"
      counts["top_k"] += 'custom_call_target="TopK"' in line
  return counts


def program_counts(fn: Callable, *args) -> dict[str, int]:
  """Conditionals, sorts, while loops and kernels of ``jax.jit(fn)(*args)`` as compiled here.

  Args:
    fn: a function (jitted or not).
    *args: example arguments (arrays or shape structs).

  Returns:
    ``{"conditionals", "sorts", "top_k", "loops", "kernels"}``: ``top_k``
    counts XLA's TopK custom calls (a full sort on GPU for large k); kernels the
    launching instructions of the entry computation and of the branches and
    loop bodies it reaches (each loop body once, however often it runs).
  """
  import jax  # pylint: disable=g-import-not-at-top

  return count_hlo(jax.jit(fn).lower(*args).compile().as_text())
