"""Leaving a run cleanly when the job is stopped: SIGTERM or SIGINT -> a checkpoint, then exit.

With one process, a handler notes the first SIGTERM or SIGINT and the loop saves
and leaves after the step in flight (a second signal stops at once). With
several processes, JAX's preemption service (started by `jax.distributed`)
catches SIGTERM in any process and agrees on one step at which every process
reaches its sync point (`multihost_utils.reached_preemption_sync_point`); there
every process saves the same checkpoint and leaves. SIGINT is turned into that
same notice.
"""

from __future__ import annotations

import signal
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatch:
  """Asked once per step whether the run must save now and leave.

  Use as a context manager around the train loop (the handlers are restored on exit).
  """

  def __init__(self):
    self.received: Optional[str] = None  # the signal's name, once one arrived
    self._previous = {}
    self._multi = False

  def __enter__(self) -> "PreemptionWatch":
    import jax

    self._multi = jax.process_count() > 1 and jax.distributed.is_initialized()
    for signum in STOP_SIGNALS:
      if self._multi and signum == signal.SIGTERM:
        continue  # JAX's preemption notifier owns SIGTERM there
      self._previous[signum] = signal.signal(signum, self._on_signal)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def _on_signal(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    if self._multi:
      # Every process must leave at the same step: hand the notice to JAX's service.
      self.received = name
      signal.raise_signal(signal.SIGTERM)
      return
    if self.received is not None:  # a second signal: stop now
      signal.signal(signum, signal.SIG_DFL)
      signal.raise_signal(signum)
    self.received = name

  def should_stop(self, step: int) -> bool:
    """True at the step where this run saves and leaves (the same step in every process).

    Args:
      step: the number of steps done, counted alike in every process.
    """
    if not self._multi:
      return self.received is not None
    from jax.experimental import multihost_utils

    if multihost_utils.reached_preemption_sync_point(step):
      self.received = self.received or "SIGTERM"
      return True
    return False
