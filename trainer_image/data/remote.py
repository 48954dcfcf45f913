"""Ranged reads of remote shards: retried with backoff, through a bounded local cache.

A remote shard (``s3://``, ``gs://``, ``https://``) is never downloaded whole. A read
of bytes ``[start, stop)`` is cut into fixed blocks of :data:`BLOCK_BYTES`; each block
comes from the host's cache folder if it is there, else from one ranged request
(``fs.cat_file(path, start, end)``: a ``Range`` header), and is then kept there. The
cache (:class:`BlockCache`) drops the least recently used blocks beyond its size.

Why blocks of 64 KiB: the sample order is a global shuffle, so successive windows of
a large corpus land in unrelated places and a block is rarely read twice in an epoch;
a small block keeps the bytes fetched per window (a window is 2-8 KiB) close to what
is used, while an object store's cost is per request, which a window read pays once
either way. A corpus that fits in the cache is fetched once and then read locally,
epoch after epoch.

**Retries.** A request that fails for any reason but a missing object or refused
credentials (a dropped connection, a timeout, a 5xx, a body cut short) is tried again
after ``0.25, 0.5, 1, ...`` seconds (at most 8 s apart, :class:`Retry`), and a block
is only used once all of its bytes have arrived: a server that drops connections
mid-read slows a job down but neither fails nor corrupts it. When the tries are spent
the read fails with :class:`DataReadError`, a transient error (exit code 3: the
operator restarts the pod).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from alpajob.api.errors import ManifestError, TransientError

T = TypeVar("T")

#: Bytes per cached block (module docstring).
BLOCK_BYTES = 64 * 1024


class DataReadError(TransientError):
    """A remote shard could not be read after every retry."""


@dataclass(frozen=True)
class Retry:
    """How often, and how patiently, a failed request is tried again."""

    attempts: int = 8  # tries in all
    first_delay: float = 0.25  # seconds before the second try; doubled each time
    max_delay: float = 8.0  # at most this between two tries

    def delays(self) -> list[float]:
        return [min(self.first_delay * 2**k, self.max_delay) for k in range(self.attempts - 1)]


#: Failures no retry fixes: the object is gone, the store refuses us, or ignores ranges.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ManifestError)
#: HTTP statuses worth another try: a timeout, too many requests, any 5xx.
RETRIED_STATUSES = (408, 429)


def permanent(error: BaseException) -> bool:
    """Whether ``error`` is one no retry fixes (:data:`PERMANENT`, or a 4xx answer)."""
    status = getattr(error, "status", None) or getattr(error, "code", None)
    return isinstance(error, PERMANENT) or (
        isinstance(status, int) and 400 <= status < 500 and status not in RETRIED_STATUSES)


def retried(call: Callable[[], T], what: str, retry: Retry, check: Callable[[T], str | None] = lambda _: None,
            sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``'s answer, tried again on a failure, or on an answer ``check`` finds
    fault with (it says what), until ``retry``'s tries are spent (module docstring)."""
    delays = retry.delays()
    for attempt in range(retry.attempts):
        try:
            answer = call()
            problem = check(answer)
            if problem is None:
                return answer
        except Exception as error:  # noqa: BLE001 - every backend raises its own transient errors
            if permanent(error):
                raise
            problem = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if attempt < len(delays):
            sleep(delays[attempt])
    raise DataReadError(f"cannot read {what} after {retry.attempts} tries (last: {problem}); the "
                        "store is unreachable or keeps dropping the connection")


def with_retries(fetch: Callable[[], bytes], expected: int, what: str, retry: Retry,
                 sleep: Callable[[float], None] = time.sleep) -> bytes:
    """``fetch()``'s bytes, tried again on a failure or a short answer (module
    docstring); ``expected``: how many bytes a whole answer has."""
    return retried(fetch, what, retry, lambda data: None if len(data) == expected
                   else f"{len(data)} of {expected} bytes arrived", sleep)


class BlockCache:
    """A folder of blocks of remote files, at most ``size`` bytes (a quantity), least recently
    used first out. Safe for many threads of one process; several processes may share
    a folder (a block is written to a temp file and renamed into place, and a block
    another process evicted is fetched again), each keeping its own count."""

    def __init__(self, folder: str | Path, size: int | str) -> None:
        self.folder, self.size = Path(folder), size
        self._lock = threading.Lock()
        self._sizes: OrderedDict[Path, int] = OrderedDict()  # oldest first
        self._limit: int | None = None
        self.total = 0
        self.hits = self.misses = 0

    @property
    def limit(self) -> int:
        """The cache's size in bytes; the folder is opened (its blocks counted) on first use,
        so a run that reads no remote file never touches it."""
        if self._limit is None:
            from kubernetes.utils import parse_quantity  # a Kubernetes quantity: 4Gi, 500M

            with self._lock:
                self._limit = int(parse_quantity(self.size))
                if self._limit > 0:
                    self.folder.mkdir(parents=True, exist_ok=True)
                    found = sorted((p.stat().st_mtime, p) for p in self.folder.glob("*/*.blk"))
                    for _, path in found:
                        self._add(path, path.stat().st_size)
        return self._limit

    def _add(self, path: Path, size: int) -> None:
        assert self._limit is not None
        self._sizes[path] = size
        self.total += size
        while self.total > self._limit and self._sizes:
            old, old_size = self._sizes.popitem(last=False)
            self.total -= old_size
            old.unlink(missing_ok=True)

    def path(self, key: str, block: int) -> Path:
        name = hashlib.sha256(key.encode()).hexdigest()[:20]
        return self.folder / name / f"{block}.blk"

    def get(self, key: str, block: int) -> bytes | None:
        """The block if cached (it becomes the most recently used)."""
        if self.limit <= 0:
            return None
        path = self.path(key, block)
        try:
            data = path.read_bytes()
        except OSError:
            with self._lock:
                self.misses += 1
            return None
        with self._lock:
            self.hits += 1
            if path in self._sizes:
                self._sizes.move_to_end(path)
        return data

    def put(self, key: str, block: int, data: bytes) -> None:
        """Keep a block of the file ``key`` names (whole: callers put only complete blocks)."""
        if self.limit <= 0 or len(data) > self.limit:
            return
        path = self.path(key, block)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        with self._lock:
            if path not in self._sizes:
                self._add(path, len(data))


class RemoteFile:
    """Ranged, retried, cached reads of one remote file of known ``size``; ``version``
    (an ETag, a generation) tells its blocks from an earlier upload's in the cache."""

    def __init__(self, fs: Any, path: str, url: str, size: int, cache: BlockCache, retry: Retry,
                 version: str = "") -> None:
        self.fs, self.path, self.url, self.size = fs, path, url, size
        self.cache, self.retry = cache, retry
        self.key = f"{url}\0{version}\0{size}"  # the cache's name for this version of the file
        self.fetched = 0  # bytes that came over the network

    def _fetch(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` by one ranged request, retried (module docstring)."""
        def ranged() -> bytes:
            data = self.fs.cat_file(self.path, start=start, end=stop)
            if len(data) == self.size != stop - start:
                raise ManifestError("spec.data", f"{self.url}: the server answers a request for bytes {start}-{stop} with the "
                                    f"whole file; AlpaJob reads windows by ranges: serve the files from a store "
                                    "that honours Range requests (object stores and CDNs do), or copy them to a volume")
            return data

        data = with_retries(ranged, stop - start, f"{self.url} bytes {start}-{stop}", self.retry)
        self.fetched += len(data)
        return data

    def _block(self, block: int) -> bytes:
        cached = self.cache.get(self.key, block)
        if cached is not None:
            return cached
        start = block * BLOCK_BYTES
        data = self._fetch(start, min(start + BLOCK_BYTES, self.size))
        self.cache.put(self.key, block, data)
        return data

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the file."""
        if not 0 <= start <= stop <= self.size:
            raise ValueError(f"{self.url}: bytes {start}-{stop} are outside its {self.size}")
        if start == stop:
            return b""
        if self.cache.limit <= 0:  # no cache: exactly the bytes asked for
            return self._fetch(start, stop)
        first, last = start // BLOCK_BYTES, (stop - 1) // BLOCK_BYTES
        data = b"".join(self._block(b) for b in range(first, last + 1))
        offset = start - first * BLOCK_BYTES
        return data[offset:offset + stop - start]
