"""The user's loss behind one calling convention, and NNX modules split for the step.

`data_parallel` takes a loss in several shapes (parameters or an NNX module;
with or without model state, metrics and a per-step key); `Loss` calls any of
them as ``(loss, (model_state, metrics))`` and refuses, in one line naming the
fix, what the step cannot use. An ``nnx.Module`` is split into the variables
the gradient sees and a `ModuleState` that carries the rest with the graph.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rest"],
                   meta_fields=["graph"])
@dataclasses.dataclass(frozen=True)
class ModuleState:
  """An ``nnx.Module``'s state besides what the gradient sees, with the module's graph.

  The model state of a `StepState` that `DataParallel.init` made from a
  module: the step rebuilds the module from the graph, its parameters and
  this state inside the loss.
  """
  rest: Any    # nnx.State: BatchNorm statistics and every other non-`wrt` variable
  graph: Any   # nnx.GraphDef (static): the module's structure


def is_nnx_module(x) -> bool:
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return isinstance(x, nnx.Module)


def split_module(model, wrt):
  """(graph, `wrt` variables, the rest) of an nnx.Module, refusing what the step cannot train."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  _warn_if_eval_mode(model)
  graph, params, rest = nnx.split(model, wrt, ...)
  _check_no_rng_streams(rest)
  return graph, params, rest


def check_not_module(params) -> None:
  """Refuses a model class, or a Linen module, where `init` takes a module or parameters."""
  if isinstance(params, type):
    raise ValueError(
        f"init got the class {params.__name__}, not a model: give it an instance (an "
        f"nnx.Module such as {params.__name__}(nnx.Rngs(0))) or a parameter tree")
  try:
    from flax import linen  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  if isinstance(params, linen.Module):
    raise ValueError(
        f"init got the Linen module {type(params).__name__}, not its parameters: give it "
        f"variables['params'] from variables = module.init(key, x), with a loss that "
        f"applies them (module.apply({{'params': params}}, x))")


def _check_no_rng_streams(rest) -> None:
  """Refuses a module holding PRNG streams (``nnx.Dropout(rate, rngs=rngs)``).

  A stream's key would be the same on every worker and could not be averaged
  with the rest of the model state; the step's own key differs per step and worker.
  """
  path = first_prng_key(rest)
  if path is not None:
    raise ValueError(
        f"the module holds a PRNG stream at {path} (an nnx.Rngs given to a layer, e.g. "
        f"nnx.Dropout(rate, rngs=rngs)): build the layer without rngs, give data_parallel "
        f"seed=0, and let the loss take the per-step, per-worker key: "
        f"loss_fn(model, batch, key) calling model(x, rngs=nnx.Rngs(dropout=key))")


def first_prng_key(tree):
  """The path of `tree`'s first PRNG-key leaf (which no mean over workers can take), or None."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jnp.issubdtype(jnp.result_type(leaf), jax.dtypes.prng_key):
      return jax.tree_util.keystr(path)
  return None


def _warn_if_eval_mode(model) -> None:
  """Warns when `model` is in eval mode: the step would train it in that mode."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  frozen = [f"{'/'.join(map(str, path)) or type(module).__name__} ({type(module).__name__})"
            for path, module in nnx.iter_modules(model)
            if getattr(module, "deterministic", None) is True
            or getattr(module, "use_running_average", None) is True]
  if frozen:
    warnings.warn(
        f"data_parallel.init: the module is in eval mode ({', '.join(frozen[:3])}"
        f"{' ...' if len(frozen) > 3 else ''} deterministic or using running averages), and "
        f"the step trains it in the mode it has now: call model.train() before "
        f"dp.init(model), and model.eval() on dp.module(state) to evaluate", stacklevel=4)


def nnx_loss(loss_fn: Callable, has_aux: bool, seed, wrt) -> Callable:
  """``loss_fn(model, batch[, key])`` as a loss of (params, `ModuleState`, batch[, key])
  returning the module's new `ModuleState`."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  def loss(params, state: ModuleState, batch, *key):
    model = nnx.merge(state.graph, params, state.rest, copy=True)  # fresh variables per trace
    value, aux = loss_and_aux(loss_fn(model, batch, *key), has_aux, loss_fn)
    new_state = ModuleState(nnx.split(model, wrt, ...)[2], state.graph)
    return (value, (new_state, aux)) if has_aux else (value, new_state)

  return loss if seed is not None else (lambda params, state, batch: loss(params, state, batch))


class Loss:
  """The user's loss behind one calling convention: ``(loss, model_state, aux)``."""

  def __init__(self, fn, with_state: bool, has_aux: bool, seed):
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
      raise ValueError(f"seed must be an integer or None, got {seed!r}")
    self.fn, self.with_state, self.has_aux, self.seed = fn, with_state, has_aux, seed
    try:
      wanted = 2 + with_state + (seed is not None)
      inspect.signature(fn).bind(*range(wanted))
    except TypeError:
      raise ValueError(
          f"loss_fn {getattr(fn, '__name__', fn)!r} must take (params"
          f"{', model_state' if with_state else ''}, batch{', key' if seed is not None else ''})"
          f" for model_state={with_state}, seed={seed!r}") from None
    except ValueError:  # builtins without a signature: called as they are
      pass

  def __call__(self, params, model_state, batch, key):
    args = (params, model_state, batch) if self.with_state else (params, batch)
    try:
      out = self.fn(*args, key) if self.seed is not None else self.fn(*args)
    except Exception as e:  # pylint: disable=broad-except
      if type(e).__name__ != "TraceContextError":
        raise
      raise ValueError(
          "the loss changes an NNX object created outside the step (typically an nnx.Rngs "
          "it closes over, for dropout): give data_parallel seed=0 and let the loss take "
          "the per-step, per-worker key, loss_fn(model, batch, key), calling "
          "model(x, rngs=nnx.Rngs(dropout=key))") from None
    value, rest = loss_and_aux(out, self.with_state or self.has_aux, self.fn,
                                "new_model_state" if self.with_state else "metrics",
                                "model_state=True" if self.with_state else "has_aux=True")
    if self.with_state:
      new_state, aux = rest if self.has_aux else (rest, {})
    else:
      new_state, aux = model_state, (rest if self.has_aux else {})
    return value, (new_state, _scalar_metrics(aux))


def _scalar_metrics(aux) -> dict:
  """The loss's metrics as a dict, refusing anything but named scalars (averaged over workers).

  Raises:
    ValueError: for metrics that are not a dict, or a metric that is not a scalar.
  """
  if not isinstance(aux, Mapping):
    got = (f"an array of shape {tuple(jnp.shape(aux))}" if hasattr(aux, "shape")
           else f"a {type(aux).__name__}")
    raise ValueError(f"with has_aux=True the loss returns (loss, metrics), metrics a dict of "
                     f"scalars, got {got}: return e.g. (loss, {{'accuracy': accuracy}})")
  for name, value in aux.items():
    if jnp.ndim(value) != 0:
      raise ValueError(
          f"the metric {name!r} has shape {tuple(jnp.shape(value))}, but metrics are scalars "
          f"averaged over the workers: reduce it in the loss (e.g. accuracy as "
          f"jnp.mean(logits.argmax(-1) == labels)); per-example outputs such as logits for "
          f"nnx.metrics belong in an evaluation pass on dp.module(state)")
  return dict(aux)


def loss_and_aux(out, paired: bool, fn, second: str = "metrics", why: str = "has_aux=True"
                  ) -> tuple:
  """``(loss, second)`` of what a loss returned (``(out, None)`` unless `paired`).

  Raises:
    ValueError: in one line, for a pair where none was asked for or the
      reverse, or a loss that is not a scalar.
  """
  name = getattr(fn, "__name__", "loss_fn")
  if paired and not (isinstance(out, (tuple, list)) and len(out) == 2):
    got = (f"a tuple of {len(out)}" if isinstance(out, (tuple, list)) else
           f"one {jnp.result_type(out)}{list(jnp.shape(out))} value" if hasattr(out, "shape")
           else f"a {type(out).__name__}")
    raise ValueError(f"{name} must return (loss, {second}) with {why}, got {got}")
  if not paired and isinstance(out, (tuple, list)):
    raise ValueError(f"{name} returned a tuple of {len(out)}: return the scalar loss, or give "
                     f"data_parallel has_aux=True for (loss, metrics)")
  value, rest = out if paired else (out, None)
  if jnp.ndim(value) != 0:
    raise ValueError(f"{name} must return a scalar loss, got shape {tuple(jnp.shape(value))}: "
                     f"take its mean over the worker's batch")
  return value, rest
