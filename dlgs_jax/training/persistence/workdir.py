"""One writer per workdir: an exclusive lock taken before a run writes anything.

The lock is an advisory ``flock`` on ``<workdir>/.lock``, so the kernel drops it
when its process dies however it dies: a stale lock of a dead run is recovered by
the next run without any clean-up. The file names the holder (process id, host,
start time) for the message a second run gets.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Optional


class WorkdirBusy(RuntimeError):
  """Another live run holds the workdir."""


class WorkdirLock:
  """The exclusive lock of one workdir (a context manager).

  Args:
    workdir: the run's directory (created if missing).
  """

  def __init__(self, workdir):
    self.path = Path(workdir) / ".lock"
    self.file = None

  def acquire(self) -> "WorkdirLock":
    """Takes the lock at once or raises `WorkdirBusy` naming the live holder."""
    self.path.parent.mkdir(parents=True, exist_ok=True)
    file = open(self.path, "a+")
    try:
      fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      file.seek(0)
      holder = file.read().strip() or "another process"
      file.close()
      raise WorkdirBusy(f"{self.path.parent} is in use by a live run ({holder}); wait for it "
                        "to end or use another --workdir") from None
    file.seek(0)
    file.truncate()
    file.write(f"process {os.getpid()} on {socket.gethostname()}, since "
               f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    file.flush()
    self.file = file
    return self

  def release(self) -> None:
    if self.file is not None:
      fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
      self.file.close()
      self.file = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def lock_for_run(workdir, leader: bool) -> Optional[WorkdirLock]:
  """Process 0 takes the workdir's lock; every process of the run learns the outcome.

  Returns:
    The held lock on process 0, None elsewhere.

  Raises:
    WorkdirBusy: in every process, when process 0 could not take it.
  """
  import jax
  import numpy as np

  lock, message = None, ""
  if leader:
    try:
      lock = WorkdirLock(workdir).acquire()
    except WorkdirBusy as e:
      message = str(e)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    busy = int(multihost_utils.broadcast_one_to_all(np.int32(bool(message))))
    if busy and not message:
      message = f"{workdir} is in use by a live run (process 0 could not lock it)"
  if message:
    raise WorkdirBusy(message)
  return lock
