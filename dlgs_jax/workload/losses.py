"""A classifier's loss and gradients on raw image batches, and its initial variables.

Shared by the profiler (which times these programs) and the train step.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax

from dlgs_jax.workload import data


def init_variables(model: nn.Module, sample: np.ndarray, seed: int) -> dict:
  """The model's variables from `seed`, identical in every process.

  Args:
    model: the Flax model.
    sample: an input batch; only its shape matters (values are not read).
    seed: the parameter seed.

  Returns:
    ``model.init``'s variables (``params`` and, for BatchNorm models, ``batch_stats``).
  """
  # Jitted, as it runs faster than op by op, but compiling it still costs
  # seconds on a CPU (experiments/performance_notes.md): callers that need the
  # variables before the train state pass them to `train_state_from_variables`
  # rather than initialise twice.
  sample = np.zeros(np.shape(sample), np.float32)
  return jax.jit(lambda key: model.init(key, sample, train=False))(jax.random.key(seed))



def apply_for_training(model: nn.Module, params, batch_stats, inputs):
  """Forward pass in training mode: ``(logits, updates)``.

  `updates` holds the new BatchNorm statistics (``{}`` for models without).
  """
  if batch_stats:
    return model.apply({"params": params, "batch_stats": batch_stats}, inputs, train=True,
                       mutable=["batch_stats"])
  return model.apply({"params": params}, inputs, train=True), {}



def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()



def batch_loss(model: nn.Module, params, batch_stats, images: jax.Array, labels: jax.Array):
  """Training-mode loss on a raw uint8 batch (normalised, no augmentation).

  Returns:
    (mean cross-entropy, the new BatchNorm statistics or ``{}``): for
    ``jax.grad(..., has_aux=True)``.
  """
  logits, updates = apply_for_training(model, params, batch_stats, data.normalize(images))
  return cross_entropy(logits, labels), updates



def batch_gradients(model: nn.Module, params, batch_stats, images: jax.Array, labels: jax.Array):
  """Gradient of `batch_loss` with respect to the params.

  Returns:
    (gradients shaped like `params`, the new BatchNorm statistics or ``{}``).
  """
  return jax.grad(batch_loss, argnums=1, has_aux=True)(model, params, batch_stats, images, labels)
