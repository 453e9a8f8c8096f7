"""Compiling in turns: the slots' checks, the turns, and the memory handed back."""
import sys

import pytest

from dlgs_jax.training import compiling


@pytest.mark.parametrize("slots", [0, -1, 1.5, True, "2"])
def test_bad_slots_are_named(slots):
  with pytest.raises(ValueError, match=f"--compile-slots must be an integer >= 1, got {slots!r}"):
    compiling.check_slots(slots)


def test_processes_compile_in_blocks_of_slots():
  assert [compiling.turn_of(p, 1) for p in range(4)] == [0, 1, 2, 3]
  assert [compiling.turn_of(p, 2) for p in range(5)] == [0, 0, 1, 1, 2]
  assert [compiling.turn_of(p, 8) for p in range(4)] == [0, 0, 0, 0]


@pytest.mark.parametrize("slots", [None, 1])
def test_one_process_compiles_once_and_says_when(slots):
  calls = []
  start, end = compiling.compile_in_turns(lambda: calls.append(1), slots)
  assert calls == [1] and start <= end


def test_bad_slots_are_refused_before_compiling():
  calls = []
  with pytest.raises(ValueError, match="got 0"):
    compiling.compile_in_turns(lambda: calls.append(1), 0)
  assert calls == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_memory_goes_back_to_the_system():
  # Blocks under glibc's mmap threshold (128 KiB) live on the heap; freed below
  # one still in use, they stay mapped until trimmed.
  blocks = [bytearray(64 << 10) for _ in range(1024)]
  del blocks[:-1]
  before = resident_bytes()
  assert compiling.release_freed_memory() is True
  assert before - resident_bytes() > 32 << 20  # of the 64 MiB freed


def resident_bytes() -> int:
  status = open("/proc/self/status").read()
  return int(status.split("VmRSS:")[1].split()[0]) * 1024
