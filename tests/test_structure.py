"""The package's layout holds: imports run one way between layers, no cycles, small parts.

Every import counts, also those inside functions. Layers, lowest first:
compress -> planning -> workload -> profiling -> training -> cluster -> cli
(`sim` beside workload). A module may import its own layer and those below.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dlgs_jax"
LAYERS = {"compress": 0, "planning": 1, "workload": 2, "sim": 2, "profiling": 3,
          "training": 4, "cluster": 5, "cli": 6}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80  # of code: the docstring is not counted


def modules() -> dict[str, Path]:
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    found[".".join(parts)] = path
  return found


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
  """The package modules `path` imports (a package counts as its ``__init__``)."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([base] if base else []))
      targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                 for alias in node.names]
    else:
      continue
    found.update(t for t in targets if t in known and t != name)
  return found


def graph() -> dict[str, set[str]]:
  mods = modules()
  return {name: imports_of(path, name, set(mods)) for name, path in mods.items()}


def layer(module: str):
  parts = module.split(".")
  return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_subpackage_has_a_layer():
  subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
  assert subpackages == set(LAYERS)
  top_level = {p.stem for p in PACKAGE.glob("*.py")}
  assert top_level == {"__init__"}, "modules belong to a layer, not the package root"


def test_imports_only_run_downward():
  upward = [(module, target) for module, targets in graph().items() for target in targets
            if layer(module) is not None and layer(target) is not None
            and layer(target) > layer(module)]
  assert upward == []


def test_no_import_cycles():
  edges = graph()
  state, cycles = {}, []

  def visit(node, stack):
    state[node] = "open"
    for target in edges[node]:
      if state.get(target) == "open":
        cycles.append(stack[stack.index(target):] + [target])
      elif target not in state:
        visit(target, stack + [target])
    state[node] = "done"

  for node in sorted(edges):
    if node not in state:
      visit(node, [node])
  assert cycles == []


def test_the_checks_see_a_violation():
  """The graph is read right: a known downward import and a known package import are in it."""
  edges = graph()
  assert "dlgs_jax.compress.transforms" in edges["dlgs_jax.compress.methods"]
  assert "dlgs_jax.training.config" in edges["dlgs_jax.cli.train"]
  assert layer("dlgs_jax.cli.train") > layer("dlgs_jax.compress.engine")


def test_training_rooms_stay_apart():
  """Timing a step (`bench`) and keeping a run alive (`persistence`, `outputs`) do not mix."""
  edges = graph()
  rooms = {"bench": "dlgs_jax.training.bench", "persistence": "dlgs_jax.training.persistence",
           "outputs": "dlgs_jax.training.outputs"}
  crossing = [(a, b) for a, b in ((a, b) for a in edges for b in edges[a])
              for one, two in (("bench", "persistence"), ("persistence", "bench"),
                               ("bench", "outputs"), ("outputs", "bench"),
                               ("outputs", "persistence"))
              if a.startswith(rooms[one]) and b.startswith(rooms[two])]
  assert crossing == []
  assert {"dlgs_jax.training.persistence.checkpoint",
          "dlgs_jax.training.persistence.resume"} <= set(edges["dlgs_jax.training.loop"])


@pytest.mark.parametrize("name, path", sorted(modules().items()))
def test_modules_and_functions_stay_small(name, path):
  text = path.read_text()
  assert len(text.splitlines()) <= MAX_MODULE_LINES, name
  long = []
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      code = node.body[1:] if ast.get_docstring(node) is not None else node.body
      body = node.end_lineno - code[0].lineno + 1 if code else 0
      if body > MAX_FUNCTION_LINES:
        long.append((node.name, body))
  assert long == [], name


def test_no_module_reaches_into_another_modules_privates():
  reached = []
  for name, path in modules().items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dlgs_jax"):
        reached += [(name, node.module, a.name) for a in node.names if a.name.startswith("_")]
  assert reached == []


# A number with a unit of time, or a percentage: a measurement, which belongs in the
# report (experiments/performance_notes.md), written once and dated.
TIMING = r"(?<![\w.])\d[\d.,]*\s?(?:ms|µs|us|s)\b|(?<![\w.])\d[\d.,]*\s?%"
# Constants that justify code, not one machine's timings: (module, the words).
TIMING_ALLOWED = {
    ("dlgs_jax.training.distributed", "100 s"),  # JAX's default heartbeat timeout
    ("dlgs_jax.training.distributed", "30 s"),   # the shutdown timeout it sets
    ("dlgs_jax.workload.sharded_step", "40 s"),  # XLA:CPU's collective abort
    ("dlgs_jax.compress.rules", "3%"),           # 1/sqrt(1024): counting error
    ("dlgs_jax.compress.rules", "9%"),           # 2^(1/8): the candidates' step
    ("dlgs_jax.profiling.in_step", "95%"),       # a confidence level
    ("dlgs_jax.profiling.timing", "95%"),
}


def prose_of(path: Path) -> list[tuple[int, str]]:
  """(line, text) of every docstring and comment of a module."""
  import io
  import tokenize

  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=False)
      if doc:
        found.append((node.body[0].lineno, doc))
  for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
    if token.type == tokenize.COMMENT:
      found.append((token.start[0], token.string))
  return found


def test_library_prose_quotes_no_measured_timings():
  import re

  found = []
  for name, path in modules().items():
    for line, text in prose_of(path):
      for hit in re.findall(TIMING, " ".join(text.split())):
        if (name, hit) not in TIMING_ALLOWED:
          found.append(f"{name}:{line}: {hit!r}")
  assert not found, found


def test_the_timing_rule_sees_a_timing():
  import re

  assert re.findall(TIMING, "it took 36-43 ms and +53% on the step, 0.22 s in all, 3us "
                            "each; 2 steps, v0.11s") == ["43 ms", "53%", "0.22 s", "3us"]
