"""Compiling on a host shared by several processes, a few processes at a time.

Every process of a job compiles the same programs at the same moment, and a
compile takes host memory the run does not: a process of the emulated cluster
holding ResNet-50's state for six methods went from 3.8 GB to 6.9 GB while
XLA:CPU compiled their train steps. Processes sharing one host's memory (the
emulated cluster; eight GPUs' processes on one node) can run it out of memory
together where a few at a time fit. `compile_in_turns` lets ``slots``
processes compile at once, the others waiting at a barrier, and hands the
compiler's freed memory back to the system after each turn (glibc keeps it
otherwise: 1.2 of 2 GB after compiling a ResNet-50 selection).

JAX can send one process's executable to the others
(``jax_share_binary_between_hosts``), but on CPU each process's cache key
differs (its device topology), so every process waits for a key no one writes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from typing import Callable, Optional


def check_slots(slots: Optional[int]) -> None:
  """Raises ValueError unless `slots` is None (no turns) or an integer >= 1."""
  if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
    raise ValueError(f"--compile-slots must be an integer >= 1, got {slots!r}")


def turn_of(process_index: int, slots: int) -> int:
  """The turn in which process `process_index` compiles: processes in blocks of `slots`."""
  return process_index // slots


def compile_in_turns(compile_all: Callable[[], None], slots: Optional[int]
                     ) -> tuple[float, float]:
  """Runs `compile_all` in this process's turn; every process of the job must call it.

  Args:
    compile_all: this process's compilations; it must not run a collective
      (e.g. `TrainStep.compile`, not a step).
    slots: processes compiling at once, in index order (None: all at once).

  Returns:
    The wall-clock times (``time.time()``) at which this process's
    compilations started and ended.
  """
  check_slots(slots)
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return _timed(compile_all)
  # The first collective sets up the processes' connections (gloo wants them
  # close together in time), so it runs before compiling, while the processes
  # are together; later barriers wait as long as a turn. Processes compiling at
  # once finish far apart too, and a first step after them failed to connect
  # (experiments/performance_notes.md).
  multihost_utils.sync_global_devices("compile turns")
  slots = jax.process_count() if slots is None else slots
  turns = turn_of(jax.process_count() - 1, slots) + 1
  for turn in range(turns):
    if turn == turn_of(jax.process_index(), slots):
      times = _timed(compile_all)
    multihost_utils.sync_global_devices(f"compile turn {turn}")
  return times


def _timed(compile_all: Callable[[], None]) -> tuple[float, float]:
  start = time.time()
  compile_all()
  end = time.time()
  release_freed_memory()
  return start, end


def release_freed_memory() -> bool:
  """Returns the heap's free pages to the system (glibc's ``malloc_trim``); False elsewhere."""
  if not sys.platform.startswith("linux"):
    return False
  name = ctypes.util.find_library("c")
  if name is None:
    return False
  trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
  return bool(trim(0)) if trim is not None else False
