"""Token shards: files of token ids, read a window at a time, never whole.

A shard is a raw ``.bin`` file of ``spec.data.tokenDtype`` ids, or a 1-D ``.npy``
array (its header says its dtype). :func:`open_token_files` turns the patterns of one
source into shards, in order:

- a file, or a glob's matches, sorted;
- a folder with an ``index.json`` (what ``alpajob data prepare`` writes): its shards,
  in the index's order, with the token counts and largest id the index records, so
  nothing is listed or read to open them;
- any other folder: its ``*.bin`` and ``*.npy`` files, sorted.

A read of ids ``[start, stop)`` of a shard returns them in the stored dtype:

- **local** files are read with ``os.pread`` into a buffer of exactly that size. No
  memory map: a mapped file's pages count in the process' resident memory as they are
  touched, so a long run over a large corpus would grow to the corpus' size (nanoGPT
  re-creates its ``np.memmap`` every batch for this reason); ``pread`` leaves the pages
  in the kernel's cache, where they are shared and reclaimable, and is safe from many
  threads at once;
- **remote** files are read by ranged requests through :mod:`.remote` (retries, the
  bounded block cache).

What a shard's size says is checked when it is opened: a length that is not a whole
number of tokens, an ``.npy`` that is not a 1-D integer array, an index whose token
counts disagree with its files are each one line naming the field and the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, TypeVar

import numpy as np
import pydantic

from alpajob.api.data import INDEX_FILE, TokenDtype, TokenIndex
from alpajob.api.errors import ManifestError
from alpajob.trainer_image.data.remote import (
    BlockCache,
    DataReadError,
    RemoteFile,
    Retry,
    permanent,
    retried,
)
from alpajob.trainer_image.data.sources import Listing, describe_remote_error, listing

T = TypeVar("T")

#: File suffixes a folder's shards may have.
SHARD_SUFFIXES = (".bin", ".npy")
#: Bytes read to find an .npy file's header (numpy writes it in a multiple of 64 bytes).
NPY_HEADER_PROBE = 4096


@dataclass
class Shard:
    """One file of token ids: ``tokens`` ids of ``dtype`` from byte ``offset``, read
    through ``reader`` (:class:`LocalFile`, :class:`~.remote.RemoteFile` or
    :class:`ArrayFile`)."""

    url: str
    dtype: np.dtype
    offset: int  # bytes before the first id (an .npy header)
    tokens: int
    max_id: int | None  # known from an index, or from tokenizing
    reader: Any = field(repr=False)

    @property
    def remote(self) -> bool:
        """Whether reads go over the network (a pool of threads then reads at once)."""
        return isinstance(self.reader, RemoteFile)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids ``[start, stop)`` in the stored dtype."""
        width = self.dtype.itemsize
        data = self.reader.read(self.offset + start * width, self.offset + stop * width)
        return np.frombuffer(data, dtype=self.dtype)


class FileHandles:
    """Open descriptors of local shards, at most ``limit`` at once, the least recently
    used closed first: a corpus of many thousands of shards stays under the process'
    open-file limit. A read holds the lock while it reads, so no descriptor is closed
    under it (local reads come from the page cache or one disk: one at a time loses
    little)."""

    def __init__(self, limit: int = 128) -> None:
        self.limit = limit
        self._open: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def pread(self, path: str, size: int, offset: int) -> bytes:
        with self._lock:
            fd = self._open.get(path)
            if fd is None:
                fd = self._open[path] = os.open(path, os.O_RDONLY)
                while len(self._open) > self.limit:
                    os.close(self._open.popitem(last=False)[1])
            else:
                self._open.move_to_end(path)
            return os.pread(fd, size, offset)

    def close(self) -> None:
        with self._lock:
            while self._open:
                os.close(self._open.popitem()[1])


class LocalFile:
    """``pread`` of a local file (module docstring), through the shared handles."""

    def __init__(self, path: str, handles: FileHandles) -> None:
        self.path, self.handles = path, handles

    def read(self, start: int, stop: int) -> bytes:
        data = self.handles.pread(self.path, stop - start, start)
        if len(data) != stop - start:
            raise ManifestError("spec.data", f"{self.path} is shorter than when it was opened "
                                             f"(read {len(data)} of {stop - start} bytes at {start}); was "
                                             "it changed while the job ran?")
        return data


class ArrayFile:
    """An in-memory file (a tokenized text corpus), read without copying it."""

    def __init__(self, array: np.ndarray) -> None:
        self.view = np.ascontiguousarray(array).data.cast("B")

    def read(self, start: int, stop: int) -> memoryview:
        return self.view[start:stop]


@dataclass(frozen=True)
class Opener:
    """What opening a source's files needs: its field (for messages), the raw dtype,
    the remote cache and retry policy, and the local files' handles."""

    field: str
    dtype: TokenDtype
    cache: BlockCache
    retry: Retry = Retry()
    handles: FileHandles = dataclasses.field(default_factory=FileHandles)


def in_memory(tokens: np.ndarray, name: str) -> Shard:
    """A shard holding ``tokens`` (1-D ids) in memory; its largest id is known."""
    array = np.ascontiguousarray(tokens)
    return Shard(name, array.dtype, 0, len(array), int(array.max()) if len(array) else -1, ArrayFile(array))


def _ask(found: Listing, opener: Opener, what: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)`` (a listing or a small read of ``found``'s store, of
    ``what``), retried when the store is remote."""
    if found.protocol in ("file", "memory"):
        return call(*args, **kwargs)
    return retried(lambda: call(*args, **kwargs), what, opener.retry)


def version_of(info: dict[str, Any]) -> str:
    """What tells one version of a remote object from the next (S3's ETag, GCS's
    generation, else its modification time): part of its cache key, so a corpus
    uploaded again under the same name is never read from the old one's blocks."""
    for key in ("ETag", "etag", "generation", "LastModified", "mtime", "updated", "created"):
        if info.get(key):
            return str(info[key])
    return ""


def _reader(found: Listing, path: str, info: dict[str, Any], opener: Opener) -> Any:
    if found.protocol == "file":
        return LocalFile(path, opener.handles)
    return RemoteFile(found.fs, path, found.url(path), int(info.get("size") or 0), opener.cache, opener.retry,
                      version_of(info))


def _npy_header(reader: Any, size: int, url: str, field: str) -> tuple[np.dtype, int, int]:
    """(dtype, header bytes, ids) of an .npy file, from its first bytes."""
    import io

    head = reader.read(0, min(size, NPY_HEADER_PROBE))
    stream = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(stream)
        reader_of = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        shape, _fortran, dtype = reader_of.get(version, np.lib.format.read_array_header_2_0)(stream)
    except (ValueError, SyntaxError, KeyError) as error:
        raise ManifestError(field, f"{url} is not a readable .npy file ({error})") from None
    if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
        raise ManifestError(field, f"{url} must hold a 1-D array of token ids, got {dtype} {shape}")
    offset = stream.tell()
    if offset + shape[0] * dtype.itemsize != size:
        raise ManifestError(field, f"{url} has {size} bytes, but its header says {shape[0]:,} {dtype} ids "
                                   f"after {offset} header bytes; the file is cut short or damaged")
    return dtype, offset, int(shape[0])


def _shard(found: Listing, path: str, info: dict[str, Any], opener: Opener) -> Shard:
    url = found.url(path)
    size = int(info.get("size") or 0)
    reader = _reader(found, path, info, opener)
    if path.endswith(".npy"):
        try:
            dtype, offset, tokens = _npy_header(reader, size, url, opener.field)
        except (ManifestError, DataReadError):
            raise
        except Exception as error:  # noqa: BLE001 - a remote store's own errors
            raise ManifestError(opener.field, describe_remote_error(error, url)) from None
        return Shard(url, dtype, offset, tokens, None, reader)
    dtype = np.dtype(opener.dtype.value)
    if size % dtype.itemsize:
        raise ManifestError("spec.data.tokenDtype", f"{url} has {size} bytes, not a whole number of "
                                                    f"{dtype.name} tokens; set spec.data.tokenDtype to the "
                                                    "type it was written in, or check the file")
    return Shard(url, dtype, 0, size // dtype.itemsize, None, reader)


def _folder_infos(found: Listing, folder: str, opener: Opener) -> dict[str, dict[str, Any]]:
    """Name -> fsspec info of the files in ``folder`` (one listing; an https server
    without folder listings gives none)."""
    try:
        listed = _ask(found, opener, found.url(folder), found.fs.find, folder, maxdepth=1, detail=True)
    except Exception as error:  # noqa: BLE001 - an https server that lists no folders (403, 404)
        if permanent(error):
            return {}
        raise
    return {PurePosixPath(p).name: info for p, info in listed.items()}


def _from_index(found: Listing, folder: str, opener: Opener) -> list[Shard]:
    """The shards an ``index.json`` in ``folder`` lists, checked against their sizes."""
    index_path = f"{folder.rstrip('/')}/{INDEX_FILE}"
    url = found.url(index_path)
    try:
        text = _ask(found, opener, url, found.fs.cat_file, index_path).decode()
        index = TokenIndex.model_validate_json(text)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ManifestError(opener.field, f"{url} is not an index AlpaJob reads ({where}: {first['msg']}); "
                                          "write it with alpajob data prepare") from None
    except DataReadError:
        raise
    except Exception as error:  # noqa: BLE001 - a remote store's own errors
        raise ManifestError(opener.field, describe_remote_error(error, url)) from None
    dtype = np.dtype(index.dtype.value)
    infos = _folder_infos(found, folder, opener)
    shards = []
    for entry in index.shards:
        name = PurePosixPath(entry.path).name
        if name not in infos:  # a store that lists no folders (https): ask for the one file
            with contextlib.suppress(FileNotFoundError):
                infos[name] = _ask(found, opener, name, found.fs.info, f"{folder.rstrip('/')}/{entry.path}")
        if name not in infos:
            raise ManifestError(opener.field, f"{url} lists {entry.path}, which is not in {found.url(folder)}; "
                                              "the folder is incomplete (copy it again, or prepare it again)")
        size = int(infos[name].get("size") or 0)
        if size != entry.tokens * dtype.itemsize:
            raise ManifestError(opener.field, f"{url} says {entry.path} holds {entry.tokens:,} {dtype.name} ids "
                                              f"({entry.tokens * dtype.itemsize:,} bytes), but the file has "
                                              f"{size:,} bytes; the index and its shards disagree "
                                              "(prepare the folder again)")
        path = f"{folder.rstrip('/')}/{entry.path}"
        shards.append(Shard(found.url(path), dtype, 0, entry.tokens, entry.max_id,
                            _reader(found, path, infos[name], opener)))
    return shards


def open_token_files(patterns: Sequence[str], opener: Opener) -> list[Shard]:
    """The shards of one source's ``patterns`` (module docstring), in order; each file once."""
    shards: list[Shard] = []
    seen: set[str] = set()
    for pattern in patterns:
        found = listing(pattern, opener.field)
        opened: list[Shard] = []
        for path in sorted(found.entries):
            info = found.entries[path]
            if info.get("type") == "directory":
                index = f"{path.rstrip('/')}/{INDEX_FILE}"
                if _ask(found, opener, found.url(index), found.fs.exists, index):
                    opened += _from_index(found, path, opener)
                    continue
                inside = _ask(found, opener, found.url(path), found.fs.find, path, maxdepth=1, detail=True)
                opened += [_shard(found, p, i, opener)
                           for p, i in sorted(inside.items()) if p.endswith(SHARD_SUFFIXES)]
            elif PurePosixPath(path).name == INDEX_FILE:
                opened += _from_index(found, path.rsplit("/", 1)[0], opener)
            else:
                opened.append(_shard(found, path, info, opener))
        if not opened:
            raise ManifestError(opener.field, f"{pattern!r} matches no token file; give .bin or .npy files, a "
                                              "glob of them, or a folder alpajob data prepare wrote")
        for shard in opened:
            if shard.url not in seen:
                seen.add(shard.url)
                shards.append(shard)
    return shards
