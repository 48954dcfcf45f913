"""``alpajob run``'s checkpoints: one process, one part, the folder locked for the run.

A :class:`LocalCheckpoints` locks the folder (lock.py), deletes what a crash left
incomplete (store.tidy), and then for the run:

- :meth:`~LocalCheckpoints.newest` restores the newest intact checkpoint;
- :meth:`~LocalCheckpoints.save` starts a save (async unless told otherwise);
- :meth:`~LocalCheckpoints.poll` (every step) notices a background save finished: that
  step becomes the last complete one and older ones beyond ``keep_last`` are pruned;
- :meth:`~LocalCheckpoints.finish` waits for the last save (the end, SIGTERM).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

from alpajob.trainer_image.checkpoint.lock import FolderLock
from alpajob.trainer_image.checkpoint.store import (
    LOCAL_PART,
    PartWriter,
    Restored,
    complete_steps,
    prune,
    restore_newest,
    tidy,
)


class LocalCheckpoints:
    """The checkpoints of one local run (module docstring); close it at the end."""

    def __init__(self, root: str | Path, keep_last: int | None, asynchronous: bool) -> None:
        self.root = Path(root).absolute()  # orbax refuses relative paths
        self.keep_last = keep_last
        self._lock = FolderLock(self.root)
        self._lock.acquire()
        try:
            tidy(self.root)
            self._writer = PartWriter(self.root, LOCAL_PART, asynchronous)
        except BaseException:
            self._lock.release()
            raise
        steps = complete_steps(self.root)
        self.last: int | None = steps[-1] if steps else None
        self._pending: int | None = None

    def newest(self, targets: Mapping[str, jax.ShapeDtypeStruct], say: Callable[[str], None]) -> Restored | None:
        """The newest intact checkpoint's arrays (store.restore_newest)."""
        restored = restore_newest(self.root, targets, say)
        self.last = restored.step if restored else None
        return restored

    def save(self, step: int, arrays: Mapping[str, jax.Array], run: Mapping[str, Any]) -> None:
        """Start saving step ``step`` (the previous save is finished first)."""
        self.finish()
        self._writer.save(step, arrays, [LOCAL_PART], run)
        self._pending = step

    def poll(self) -> int | None:
        """The last complete step, once a background save has finished."""
        if self._pending is not None and not self._writer.saving():
            self.finish()
        return self.last

    def finish(self) -> int | None:
        """Wait for the save in flight; the last complete step."""
        if self._pending is not None:
            self._writer.wait()
            self.last, self._pending = self._pending, None
            if self.keep_last:
                prune(self.root, self.keep_last)
        return self.last

    def close(self) -> None:
        """Finish the save in flight and let the folder go."""
        try:
            self.finish()
            self._writer.close()
        finally:
            self._lock.release()
