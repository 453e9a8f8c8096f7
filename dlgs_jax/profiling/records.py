"""Where a measurement goes: the machine it ran on, and a JSON written whole or not at all."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> dict:
  """The backend, device and JAX version, and the settings a measurement ran under.

  Besides the XLA flags: the cores the process may run on, the kernel's
  transparent huge page mode and glibc's allocator settings from the
  environment, since on CPU an update's time is largely first touches of fresh
  pages, which those decide.
  """
  import jax  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  allocator = {k: v for k, v in sorted(os.environ.items())
               if k == "GLIBC_TUNABLES" or k.startswith("MALLOC_")}
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return {"backend": jax.default_backend(), "device": device.device_kind,
          "devices": jax.device_count(), "platform": platform.platform(),
          "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "cores": cores, "transparent_hugepages": huge_page_mode(), "allocator_env": allocator}


def huge_page_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled"):
  """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or None.

  The file lists every mode and brackets the one in force; None where it
  cannot be read (not Linux).
  """
  try:
    text = Path(path).read_text()
  except OSError:
    return None
  chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
  return chosen[0] if chosen else None


def write_json(path: Path, result: dict) -> None:
  """Writes `result` to `path` through a temporary file, so a kill never leaves half a JSON."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(result, indent=1))
  tmp.replace(path)
