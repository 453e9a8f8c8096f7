"""Where a measurement goes: the machine it ran on, and a JSON written whole or not at all."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> dict:
  """The backend, device and JAX version, and the XLA flags a measurement ran under."""
  import jax  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  return {"backend": jax.default_backend(), "device": device.device_kind,
          "devices": jax.device_count(), "platform": platform.platform(),
          "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}


def write_json(path: Path, result: dict) -> None:
  """Writes `result` to `path` through a temporary file, so a kill never leaves half a JSON."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(result, indent=1))
  tmp.replace(path)
