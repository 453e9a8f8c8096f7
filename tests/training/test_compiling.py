"""Compiling in turns: the slots' checks, the turns, and the memory handed back."""
import re
import sys

import pytest

from dlgs_jax.cluster.launch import free_port
from dlgs_jax.training import compiling
from tests.helpers import child_env, run_group


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


# Two processes; the second compiles (sleeps) past gloo's 30 s to connect, then
# both run a collective: without the barriers around compiling, the first
# process's collective would wait alone for the connection and fail.
SLOW_COMPILE = """
import sys, time
import jax
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from jax.experimental import multihost_utils
from dlgs_jax.training import compiling
start, end = compiling.compile_in_turns(
    lambda: time.sleep(40 if jax.process_index() == 1 else 0), None)
print("process", jax.process_index(), "waited", round(time.time() - end, 1), flush=True)
multihost_utils.sync_global_devices("after compiling")
print("process", jax.process_index(), "done", flush=True)
"""


@pytest.mark.multiprocess
def test_processes_that_finish_compiling_far_apart_still_connect():
  coordinator = f"127.0.0.1:{free_port()}"
  outputs = run_group([([sys.executable, "-c", SLOW_COMPILE, coordinator, str(i)], child_env())
                       for i in range(2)], timeout=300)
  for i, out in enumerate(outputs):
    assert f"process {i} done" in out, out[-3000:]
  waited = float(re.search(r"process 0 waited ([\d.]+)", outputs[0])[1])
  assert waited >= 30, outputs[0][-3000:]  # the fast process waited at the barrier
