"""One run per run folder: an advisory lock file ``<run_dir>/run.lock``.

The lock is an ``fcntl.flock`` on ``run.lock``, held for as long as the run lives; the file holds
the owner's pid and host (JSON) so that a second run can say who has the folder. The kernel drops
the lock when its process dies, however it dies (SIGKILL included), so a lock file that can be
locked but still names a pid was left by a dead run: it is taken over with a warning. A lock file
written on another host is never taken over (that host's run may be alive on a file system that
does not share locks); the message names the file to delete instead. POSIX only (``fcntl``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from xmc_engine.errors import RunFolderBusy

logger = logging.getLogger(__name__)

__all__ = ["LOCK_NAME", "RunLock"]

LOCK_NAME = "run.lock"


def _read_owner(path: Path) -> dict:
    """The owner record in a lock file (``{}`` if empty or unreadable)."""
    try:
        owner = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe(owner: dict) -> str:
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"


class RunLock:
    """Exclusive use of a run folder by this process, as a context manager.

    Parameters
    ----------
    run_dir : str or os.PathLike
        The run folder; created if missing. When this lock created it and it is empty again on
        release (the run stopped on bad input before writing anything), it is removed.

    Raises
    ------
    RunFolderBusy
        On :meth:`acquire` (or ``with``), when another live run holds the folder, or when a lock
        file left on another host cannot be checked; the message names the owner and what to do.
    """

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self._created_dir = False

    def acquire(self) -> RunLock:
        """Take the lock (at once or not at all); returns ``self``."""
        if self._fd is not None:
            return self
        self._created_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = self._lock()
        except BaseException:
            self._remove_dir_if_created()
            raise
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    def _busy(self, owner: dict, why: str) -> RunFolderBusy:
        return RunFolderBusy(f"run folder {self.run_dir} is in use by {_describe(owner)} ({why}); "
                             f"wait for that run or choose another --out")

    def _take_over(self, owner: dict) -> None:
        """Accept a lock file whose owner is gone; refuse one from another host."""
        if not owner.get("pid"):
            return
        if owner.get("host") not in (None, socket.gethostname()):
            raise RunFolderBusy(
                f"run folder {self.run_dir} has a lock from {_describe(owner)}, which this host "
                f"cannot check; if that run is gone, delete {self.path} and start again")
        logger.warning("%s: taking over the lock of %s, which is no longer running",
                       self.path, _describe(owner))

    def _lock(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._busy(_read_owner(self.path), "it holds the lock") from None
            # The holder may have unlinked the file between our open and our flock: then we
            # locked an orphan inode, and must lock the file that is there now.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            self._take_over(_read_owner(self.path))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        """Give the folder up: delete the lock file (idempotent)."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still locked: no one can lock it in between
        os.close(self._fd)
        self._fd = None
        self._remove_dir_if_created()

    def _remove_dir_if_created(self) -> None:
        if self._created_dir:
            try:
                self.run_dir.rmdir()  # only if empty
            except OSError:
                pass
            self._created_dir = False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RunLock({str(self.run_dir)!r}, held={self._fd is not None})"
