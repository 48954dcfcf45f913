"""One writer per checkpoint folder.

Two runs saving into one folder would interleave their steps and each prune the
other's checkpoints. So a run takes ``<dir>/.alpajob.lock`` (an OS file lock, through
``filelock``) before it reads or writes the folder and holds it to the end; the second
run is refused at once, with the holder's process and host named (written next to the
lock as ``.alpajob.lock.owner``). The OS drops the lock when its process dies, so a
killed run never leaves the folder locked.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import TracebackType

from filelock import FileLock, Timeout

from alpajob.api.errors import AlpaJobError

LOCK_FILE = ".alpajob.lock"


class CheckpointError(AlpaJobError):
    """A checkpoint folder that cannot be used (its message says why and what to do)."""


class FolderLock:
    """The lock on one checkpoint folder, as a context manager."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._path = self.root / LOCK_FILE
        self._owner = self.root / (LOCK_FILE + ".owner")
        self._lock = FileLock(self._path, timeout=0)

    def acquire(self) -> None:
        """Take the lock, or raise :class:`CheckpointError` naming its holder."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            try:
                holder = self._owner.read_text().strip()
            except OSError:
                holder = "another process"
            raise CheckpointError(
                f"{self.root}: another run ({holder}) is writing checkpoints here; stop it, or "
                "give this run its own --checkpoint-dir"
            ) from None
        self._owner.write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")

    def release(self) -> None:
        if self._lock.is_locked:
            self._owner.unlink(missing_ok=True)
            self._lock.release()

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.release()
