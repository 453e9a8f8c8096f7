"""Forward, backward and per-layer backward times of a Flax model.

Per-layer backward times come from timing each parameter-owning module's VJP
alone on the input it sees in the model (captured with
`flax.linen.intercept_methods`); their sum misses what lies between modules, so
they are scaled to the measured whole backward time.
"""

from __future__ import annotations
import itertools
from typing import Any, Callable, Optional
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from dlgs_jax.compress import grouping
from dlgs_jax.profiling.timing import median_seconds



_PARAM_MODULES = (nn.Conv, nn.Dense, nn.BatchNorm, nn.LayerNorm, nn.Embed, nn.GroupNorm)


def _subtree(tree, path):
  for name in path:
    tree = tree[name]
  return tree


def layer_backward_times(model: nn.Module, variables: dict, inputs: jax.Array, *,
                         repeats: int = 5, barrier: Optional[Callable[[], Any]] = None
                         ) -> dict[tuple[str, ...], float]:
  """Backward time of each parameter-owning module, timed alone (module path -> s)."""
  calls: list[tuple[nn.Module, tuple, dict]] = []

  def record(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and isinstance(context.module, _PARAM_MODULES):
      calls.append((context.module, args, kwargs))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    model.apply(variables, inputs, train=True, mutable=["batch_stats"])
  times: dict[tuple[str, ...], float] = {}
  for module, args, kwargs in calls:
    path = tuple(module.path)
    if path in times:
      continue
    overrides = {"axis_name": None} if hasattr(module, "axis_name") else {}
    alone = module.clone(parent=None, **overrides)
    module_vars = {c: _subtree(variables[c], path) for c in variables
                   if _has_path(variables[c], path)}
    params = module_vars.pop("params")

    def apply(p, x, alone=alone, module_vars=module_vars, kwargs=kwargs):
      if not module_vars:
        return alone.apply({"params": p}, x, **kwargs)
      # Statistics (BatchNorm) are updated in training mode: return only the output.
      return alone.apply({"params": p, **module_vars}, x, mutable=list(module_vars), **kwargs)[0]

    out, vjp_fn = jax.vjp(apply, params, args[0])
    cotangent = jnp.ones_like(out)
    run = jax.jit(lambda f, ct: f(ct))
    times[path] = median_seconds(lambda: run(vjp_fn, cotangent), repeats,
                                 barrier=barrier)
  return times


def _has_path(tree, path) -> bool:
  try:
    _subtree(tree, path)
    return True
  except (KeyError, TypeError):
    return False


# Timed calls of the forward and forward+backward totals: a compute-bound
# step's prediction is mostly this number, and a few calls in lockstep on the
# emulated CPU cluster strayed far from the runs' medians of this many
# (experiments/performance_notes.md).
COMPUTE_TOTAL_REPEATS = 20


def measure_compute(model: nn.Module, variables: dict, images: jax.Array, labels: jax.Array,
                    *, repeats: int = 5, barrier: Optional[Callable[[], Any]] = None,
                    batches: Optional[tuple[np.ndarray, np.ndarray]] = None,
                    total_repeats: int = COMPUTE_TOTAL_REPEATS) -> dict[str, Any]:
  """Forward time, per-leaf backward times in backward order, and the check against the whole.

  The layers are timed alone on `images`, `repeats` times each; the forward
  and the forward+backward totals, which the per-layer times are scaled to
  and which decide a compute-bound step's prediction, `total_repeats` times.
  With `batches` the totals are timed on the train step's own program
  (`losses.batch_loss` on raw uint8 batches, cycled through): timed with a
  few repeats on one noise batch, ResNet-20's forward+backward came out a fifth
  above what the benchmark's runs measured (experiments/performance_notes.md).

  Args:
    model: the Flax classifier.
    variables: its variables ("params", maybe "batch_stats").
    images: float inputs for the per-layer timings and the backward order.
    labels: their int32 labels.
    repeats: timed calls per layer.
    barrier: see `median_seconds`.
    batches: (uint8 images [n, batch, H, W, C], int32 labels [n, batch]) to
      time the totals on; None: `images`, `labels`.
    total_repeats: timed calls of each total.

  Returns:
    dict with ``order`` (leaf paths), ``sizes``, ``t_forward``, ``t_backward``
    (scaled to the measured total; unscaled if that timed <= 0),
    ``backward_measured``, ``backward_sum_alone``, ``backward_difference``
    (relative: sum alone / measured - 1) and ``totals_raw`` (every timed
    call's seconds, "forward" and "forward_backward").

  Raises:
    ValueError: `total_repeats` < 1, or `batches` holds no batch.
  """
  if total_repeats < 1:
    raise ValueError(f"total_repeats must be >= 1, got {total_repeats!r}")
  params = variables["params"]
  others = {k: v for k, v in variables.items() if k != "params"}

  def loss_fn(p, x, y):
    if others:
      logits = model.apply({"params": p, **others}, x, train=True, mutable=list(others))[0]
    else:
      logits = model.apply({"params": p}, x, train=True)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

  order = grouping.backward_order(loss_fn, params, images, labels)
  if batches is None:
    inputs, total_loss = [(images, labels)], loss_fn
  else:
    from dlgs_jax.workload import losses

    if len(batches[0]) < 1 or len(batches[0]) != len(batches[1]):
      raise ValueError(f"batches: need n >= 1 image and label batches, got "
                       f"{len(batches[0])} and {len(batches[1])}")
    inputs = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(*batches)]
    batch_stats = others.get("batch_stats", {})

    def total_loss(p, x, y):
      return losses.batch_loss(model, p, batch_stats, x, y)[0]

  forward = jax.jit(total_loss)
  forward_backward = jax.jit(jax.value_and_grad(total_loss))
  turn = itertools.count()

  def cycled(program):
    return lambda: program(params, *inputs[next(turn) % len(inputs)])

  totals_raw: dict[str, list] = {"forward": [], "forward_backward": []}
  t_forward = median_seconds(cycled(forward), total_repeats, barrier=barrier,
                             samples=totals_raw["forward"])
  t_both = median_seconds(cycled(forward_backward), total_repeats, barrier=barrier,
                          samples=totals_raw["forward_backward"])
  t_backward_total = max(t_both - t_forward, 0.0)
  per_module = layer_backward_times(model, variables, images, repeats=repeats, barrier=barrier)
  paths = grouping.leaf_paths(params)
  sizes = dict(zip(paths, (int(x.size) for x in jax.tree_util.tree_leaves(params))))
  raw = {path: 0.0 for path in order}
  for module_path, t in per_module.items():
    prefix = "/".join(module_path) + "/"
    members = [p for p in order if p.startswith(prefix)]
    if members:
      raw[members[0]] += t  # the module's leaves become ready together
  total_alone = sum(raw.values())
  # On a busy machine forward+backward can time below the forward alone; the
  # layers timed alone are then the better estimate.
  scale = t_backward_total / total_alone if total_alone > 0 and t_backward_total > 0 else 1.0
  return {
      "order": order,
      "sizes": [sizes[p] for p in order],
      "t_forward": t_forward,
      "t_backward": [raw[p] * scale for p in order],
      "backward_measured": t_backward_total,
      "backward_sum_alone": total_alone,
      "backward_difference": (total_alone / t_backward_total - 1.0) if t_backward_total else 0.0,
      "totals_raw": totals_raw,
  }


def model_gradients(model: nn.Module, variables: dict, images: np.ndarray,
                    labels: np.ndarray) -> list[dict]:
  """The training loss's gradient with respect to the params on each of some real batches.

  What a profile times the local updates on (`measure_update`): their
  selection costs depend on the values. One compiled program for all batches.

  Args:
    model: the Flax classifier.
    variables: its variables ("params", maybe "batch_stats").
    images: uint8 [n, batch_size, H, W, C].
    labels: int32 [n, batch_size].

  Returns:
    n gradient trees shaped like ``variables["params"]`` (float32 arrays).
  """
  from dlgs_jax.workload import losses

  batch_stats = variables.get("batch_stats", {})

  @jax.jit
  def grad_fn(p, x, y):
    return losses.batch_gradients(model, p, batch_stats, x, y)[0]

  return [grad_fn(variables["params"], jnp.asarray(x), jnp.asarray(y))
          for x, y in zip(images, labels)]
