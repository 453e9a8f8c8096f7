"""Every test runs with 8 simulated CPU devices (set before JAX starts).

The suite also shares one persistent XLA compilation cache, fresh for each test run,
with every process it starts (pytest-xdist's workers too: they inherit the
directory the controlling process made before starting them): many tests launch
`dlgs-train` several times on the same program (a run, the same run killed and
resumed, a refused resume), and on a 2-core machine compiling that program again in
each process was most of their time (e.g. the kill-and-resume test: 346 s without
the cache, 153 s with it). Each program is still compiled once per test run, so
compile errors are still caught. In a multi-process run only process 0 finds its
programs there: JAX writes no entry from another process, and process 1's programs
have their own keys (their CPU topology fingerprint and compile options differ from
process 0's; for the same reason `jax_share_binary_between_hosts` leaves process 1
waiting for a binary that process 0 shares under another key), so every launch's
other processes compile again.
Setting JAX_COMPILATION_CACHE_DIR yourself keeps your directory instead.
"""

import atexit
import os
import shutil
import tempfile

# The suite is mostly compilation (small programs run a few steps), so unless told
# otherwise (DLGS_TESTS_XLA_OPTIMIZE=1) it compiles without LLVM's optimisations
# (one DGC training run: 35 s at XLA's default level, 25 s at level 0) and with
# XLA:CPU's older loop emitters instead of its fusion emitters (a DLGS train step
# of SmallCNN compiled in 3.3-3.7 s instead of 6.0-6.2 s; the whole suite took 1,764
# CPU seconds instead of 3,117). The programs and their results are checked the same
# way; only their speed differs. tests/helpers.child_env hands the same flags to
# every process the tests start (at level 1 where a child runs more than it compiles).
TEST_XLA_FLAGS = ("" if os.environ.get("DLGS_TESTS_XLA_OPTIMIZE") == "1" else
                  "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join(filter(None, (
    os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS,
    "--xla_force_host_platform_device_count=8")))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="dlgs-jax-tests-xla-cache-")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  # Every program, however quick to compile: a profile of smallcnn compiles ~150
  # small ones, and a second profile in another process took 23 s with only the
  # programs over 0.5 s cached against 15 s with all of them (57-61 s cold).
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after the flags)

assert jax.device_count() == 8, jax.devices()
assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]


def pytest_collection_modifyitems(config, items):
  """Under pytest-xdist, the long tests first, in their order; the short ones then.

  The workers take tests in collection order, so a multi-process test that came
  last ran on one worker while the other had nothing left to do; with the short
  tests last, both workers stay busy to the end. A run in one process keeps the
  usual order (module fixtures set up once).
  """
  del config
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    return

  def rank(item) -> int:
    if item.get_closest_marker("multiprocess") or item.get_closest_marker("cluster"):
      return 0
    return 1 if item.get_closest_marker("slow") else 2

  items.sort(key=rank)  # stable: each rank keeps the collection order
