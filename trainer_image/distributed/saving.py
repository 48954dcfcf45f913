"""The driver's side of the Ray runtime's checkpoints.

Every mesh saves its own part (:meth:`.mesh_host.MeshHost.save`, all of its hosts at
once, through orbax); the driver, which holds the folder's lock for the whole run,
decides the rest (:mod:`alpajob.trainer_image.checkpoint`):

- :meth:`MeshCheckpoints.resume` (each attempt): delete what a crash left incomplete,
  then restore every mesh from the newest complete checkpoint that every mesh reads
  back intact; a damaged one is set aside and the one before it tried;
- :meth:`MeshCheckpoints.save`: finish the previous save, then start this one;
- :meth:`MeshCheckpoints.poll` (every step): a save whose parts are all finalized is
  the new last complete checkpoint, and older ones beyond ``keep_last`` are pruned;
- :meth:`MeshCheckpoints.finish` (the end, a stop): wait for the save in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from alpajob.trainer_image.checkpoint.lock import CheckpointError, FolderLock
from alpajob.trainer_image.checkpoint.store import DAMAGED, complete_steps, prune, set_aside, tidy


class Meshes(Protocol):
    """What the checkpoints ask of the mesh actors (:class:`.group.MeshGroup`)."""

    def save(self, root: str, step: int, run: dict[str, Any], asynchronous: bool) -> None: ...
    def wait_saved(self) -> None: ...
    def restore(self, root: str, step: int) -> list[str]: ...


class MeshCheckpoints:
    """The checkpoint folder of one driver run, locked until :meth:`close`."""

    def __init__(self, root: str, keep_last: int, asynchronous: bool, run: dict[str, Any],
                 lock: FolderLock | None = None) -> None:
        """``lock``: the folder's lock, naming the job's attempt (default: an anonymous one)."""
        self.root, self.keep_last, self.asynchronous, self.run = root, keep_last, asynchronous, run
        self._lock = lock or FolderLock(root)
        self._lock.acquire()
        self.last: int | None = None  # the newest complete checkpoint
        self._pending: int | None = None

    def resume(self, meshes: Meshes, say: Callable[[str], None]) -> int:
        """Restore every mesh from the newest intact complete checkpoint; its step (0:
        none). A run whose every checkpoint is damaged is refused."""
        self._pending = None  # an attempt's saves in flight died with its actors
        tidy(self.root)
        damaged = []
        for step in reversed(complete_steps(self.root)):
            say(f"restoring every mesh from the checkpoint of step {step}")
            problems = meshes.restore(self.root, step)
            if not problems:
                self.last = step
                return step
            where = set_aside(self.root, step)
            damaged.append(step)
            say(f"checkpoint {step} is damaged ({problems[0]}); moved it to {where}, trying the one before")
        if damaged:
            raise CheckpointError(
                f"{self.root}: every checkpoint ({', '.join(map(str, damaged))}) is damaged; they are "
                f"kept in {Path(self.root) / DAMAGED}. Delete them or move them away to start from scratch")
        self.last = None
        return 0

    def save(self, meshes: Meshes, step: int) -> None:
        """Start saving ``step`` on every mesh (the previous save finished first)."""
        if self._pending == step or self.last == step:
            return
        self.finish(meshes)
        meshes.save(self.root, step, self.run, self.asynchronous)
        self._pending = step

    def poll(self) -> int | None:
        """The last complete checkpoint's step, once every mesh finalized the save in flight."""
        if self._pending is not None and self._pending in complete_steps(self.root):
            self._complete()
        return self.last

    def finish(self, meshes: Meshes) -> int | None:
        """Wait for every mesh's save in flight; the last complete checkpoint's step."""
        if self._pending is not None:
            meshes.wait_saved()
            self._complete()
        return self.last

    def _complete(self) -> None:
        self.last, self._pending = self._pending, None
        prune(self.root, self.keep_last)

    def close(self) -> None:
        self._lock.release()
