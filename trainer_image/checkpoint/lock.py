"""One writer per checkpoint folder, and an orderly hand-over between a job's attempts.

Two runs saving into one folder would interleave their steps and each prune the
other's checkpoints. So a run takes ``<dir>/.alpajob.lock`` (an OS file lock, through
``filelock``) before it reads or writes the folder and holds it to the end. The OS
drops the lock when its process dies, so a killed run never leaves the folder locked.

Next to the lock, ``.alpajob.lock.owner`` names the holder (:class:`Holder`): its job
and attempt when it is a job's driver, its process and host. What a run does when the
lock is taken depends on who holds it:

- **an earlier attempt of the same job** (a restart: the old head pod still terminates,
  saving its last checkpoint after SIGTERM): the new attempt waits for the lock, up to
  ``wait_for_older`` seconds, and then resumes from that checkpoint. This is the
  hand-over; the operator starts a new attempt only once the old pods are gone, so the
  wait is short or none, but a pod force-deleted from the API may still run for a
  moment on its node;
- **anyone else**, or an earlier attempt that outlasts the wait: :class:`FolderBusy`,
  naming the holder. It is no configuration error (the holder may finish any moment),
  so it exits 3, which the operator's default pod failure policy restarts, never 2.

A folder the run cannot write (a volume owned by root, pods running as uid 1000
without ``fsGroup``) is a :class:`CheckpointError` of one line naming the folder, the
volume and the uid: exit 2, as no restart can fix it.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from filelock import FileLock, Timeout

from alpajob.api.errors import AlpaJobError, TransientError

LOCK_FILE = ".alpajob.lock"


class CheckpointError(AlpaJobError):
    """A checkpoint folder that cannot be used (its message says why and what to do)."""


class FolderBusy(TransientError):
    """Another run holds the checkpoint folder (exit 3: a restart may find it free)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a checkpoint folder: a job's attempt (None for a local run), a process."""

    pid: int
    host: str
    job: str | None = None
    attempt: int | None = None

    def describe(self) -> str:
        run = f"job {self.job} attempt {self.attempt}, " if self.job is not None else ""
        return f"{run}pid {self.pid} on {self.host}"

    def to_text(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @staticmethod
    def from_text(text: str) -> Holder | None:
        """The holder written by :meth:`to_text`; None for anything else."""
        try:
            fields = json.loads(text)
            return Holder(int(fields["pid"]), str(fields["host"]), fields.get("job"),
                          None if fields.get("attempt") is None else int(fields["attempt"]))
        except (ValueError, KeyError, TypeError):
            return None

    def is_earlier_attempt_of(self, other: Holder) -> bool:
        return (self.job is not None and self.job == other.job and self.attempt is not None
                and other.attempt is not None and self.attempt < other.attempt)


def not_writable(root: Path, volume: str | None, error: PermissionError) -> CheckpointError:
    """The one line for a checkpoint folder this process cannot write, and its fix."""
    where = f" ({volume})" if volume else ""
    return CheckpointError(
        f"checkpoint folder {root}{where} is not writable by uid {os.getuid()} gid "
        f"{os.getgid()} ({error.strerror}: {error.filename}); give the pods an fsGroup that owns "
        "the volume (spec.podTemplate securityContext.fsGroup, set by default with "
        "spec.checkpoint.volumeClaimTemplate) or a volume that uid can write")


def check_writable(root: str | Path, volume: str | None = None) -> None:
    """Raise :class:`CheckpointError` (:func:`not_writable`) unless this process can make
    ``root`` and write a file in it: the head checks before it starts Ray, so a job
    whose checkpoint volume it cannot write fails in seconds, not after Ray's start."""
    root = Path(root)
    probe = root / f".alpajob-write-check-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except PermissionError as error:
        raise not_writable(root, volume, error) from None


class FolderLock:
    """The lock on one checkpoint folder, as a context manager.

    ``job`` and ``attempt`` name a job's driver (module docstring); ``volume`` says
    where the folder lives for messages (``PersistentVolumeClaim ckpt at /checkpoints``);
    ``say`` reports a wait for an earlier attempt.
    """

    def __init__(self, root: str | Path, job: str | None = None, attempt: int | None = None,
                 wait_for_older: float = 120.0, volume: str | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        self.me = Holder(os.getpid(), socket.gethostname(), job, attempt)
        self.wait_for_older = wait_for_older
        self.volume = volume
        self.say = say or (lambda _what: None)
        self._path = self.root / LOCK_FILE
        self._owner = self.root / (LOCK_FILE + ".owner")
        self._lock = FileLock(self._path, timeout=0)

    def holder(self) -> Holder | None:
        try:
            return Holder.from_text(self._owner.read_text())
        except OSError:
            return None

    def acquire(self) -> None:
        """Take the lock (waiting for an earlier attempt of the same job), or raise
        :class:`FolderBusy` naming its holder, or :class:`CheckpointError` when the
        folder cannot be written."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._take()
        except PermissionError as error:
            raise not_writable(self.root, self.volume, error) from None
        self._owner.write_text(self.me.to_text())

    def _take(self) -> None:
        try:
            self._lock.acquire()
            return
        except Timeout:
            pass
        holder = self.holder()
        if holder is not None and holder.is_earlier_attempt_of(self.me):
            self.say(f"waiting up to {self.wait_for_older:.0f} s for {holder.describe()} to release "
                     f"the checkpoint folder {self.root} (it saves its last checkpoint while it stops)")
            try:
                self._lock.acquire(timeout=self.wait_for_older, poll_interval=0.5)
                self.say(f"took over the checkpoint folder {self.root} from {holder.describe()}")
                return
            except Timeout:
                raise FolderBusy(
                    f"{self.root}: {holder.describe()} still holds the checkpoint folder after "
                    f"{self.wait_for_older:.0f} s; its pod is gone from the API but its process still "
                    "runs on its node. The next attempt tries again") from None
        who = holder.describe() if holder is not None else "another process"
        raise FolderBusy(
            f"{self.root}: another run ({who}) is writing checkpoints here; stop it, or give this "
            "run its own folder (--checkpoint-dir, or spec.checkpoint.path)") from None

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
