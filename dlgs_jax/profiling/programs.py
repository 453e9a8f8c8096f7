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
from typing import Callable, NamedTuple, Optional

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


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_LINE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
# Instructions that read only the part of their first operand they output.
_PARTIAL = frozenset({"slice", "dynamic-slice", "gather"})
# Instructions that write into their first operand's buffer in place: the
# operand holding what they write.
_IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}


class _Instruction(NamedTuple):
  name: str
  bytes: int             # of its output (a tuple's arrays summed)
  op: str
  operands: list         # names
  argument: str          # what its parentheses hold (a parameter's number)
  called: Optional[str]  # a fusion's computation
  root: bool


def _array_bytes(shape: str) -> int:
  """Bytes of every array an HLO type names (a tuple's: the sum)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    count = 1
    for dim in filter(None, dims.split(",")):
      count *= int(dim)
    total += count * _BYTES.get(dtype, 4)
  return total


def _parsed(lines: list[str]) -> list[_Instruction]:
  out = []
  for line in lines:
    match = _LINE.match(_COMMENT.sub("", line))
    if not match:
      continue
    root, name, shape, op, rest = match.groups()
    depth, end = 1, 0
    while end < len(rest) and depth:
      depth += {"(": 1, ")": -1}.get(rest[end], 0)
      end += 1
    called = re.search(r"\b(?:calls|to_apply)=%?([\w.\-]+)" if op == "call"
                       else r"\bcalls=%?([\w.\-]+)", rest[end:])
    out.append(_Instruction(name, _array_bytes(shape), op, re.findall(r"%([\w.\-]+)", rest[:end]),
                            rest[:end - 1], called and called.group(1), bool(root)))
  return out


def _fusion_traffic(body: list[_Instruction], operand_bytes: list[int], output: int) -> int:
  """Bytes a fusion reads and writes.

  A parameter that is only sliced or gathered counts the part taken; a fusion
  whose root scatters into (or updates a slice of) a parameter writes in place:
  that parameter counts nothing and the output only what is written.
  """
  number = {i.name: int(i.argument) for i in body if i.op == "parameter"}
  users = {name: [] for name in number}
  for instruction in body:
    for position, operand in enumerate(instruction.operands):
      if operand in users:
        users[operand].append((instruction, position))
  root = next((i for i in body if i.root), None)
  target = (root.operands[0] if root is not None and root.op in _IN_PLACE and root.operands
            and root.operands[0] in number else None)
  sizes = {i.name: i.bytes for i in body}
  total = sizes.get(root.operands[_IN_PLACE[root.op]], 0) if target else output
  for name, i in number.items():
    if name == target or i >= len(operand_bytes):
      continue
    uses = users[name]
    partial = uses and all(user.op in _PARTIAL and position == 0 for user, position in uses)
    total += sum(user.bytes for user, _ in uses) if partial else operand_bytes[i]
  return total


def memory_traffic(hlo: str) -> int:
  """Bytes the entry computation's kernels read and write, outside conditionals and loops.

  What a step that takes no branch moves through memory, as XLA fused it: each
  kernel's operands and outputs, but a part of an operand where only a slice or
  a gather of it is read, and only the written values where a scatter or a
  slice update writes into its operand's buffer in place. Caches are ignored:
  on a model larger than them it says how many passes over its bytes a step
  makes when divided by its bytes (`traffic_by_kernel` itemizes it).
  """
  return sum(moved for _, _, moved in traffic_by_kernel(hlo))


def memory_passes(hlo: str, values: int) -> float:
  """`memory_traffic` as passes over `values` float32 values (a model's: the floor pass makes 4)."""
  return memory_traffic(hlo) / (4 * values)


def traffic_by_kernel(hlo: str) -> list[tuple[str, str, int]]:
  """``(name, opcode, bytes read and written)`` of each kernel `memory_traffic` counts, in order.

  A ``call`` counts the kernels of the computation it calls (XLA:CPU wraps a
  small loop so), which may hold a loop: that counts nothing.
  """
  computations = _computations(hlo)
  return _traffic(computations, computations["ENTRY"])


def _traffic(computations: dict, lines: list[str]) -> list[tuple[str, str, int]]:
  body = _parsed(lines)
  sizes = {i.name: i.bytes for i in body}
  out = []
  for instruction in body:
    if instruction.op in _FREE or instruction.op in ("conditional", "while"):
      continue
    operand_bytes = [sizes.get(name, 0) for name in instruction.operands]
    if instruction.op == "call" and instruction.called in computations:
      out += _traffic(computations, computations[instruction.called])
      continue
    if instruction.called in computations:
      moved = _fusion_traffic(_parsed(computations[instruction.called]), operand_bytes,
                              instruction.bytes)
    elif instruction.op in _PARTIAL:
      moved = 2 * instruction.bytes
    else:
      moved = sum(operand_bytes) + instruction.bytes
    out.append((instruction.name, instruction.op, moved))
  return out
