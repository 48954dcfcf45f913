"""Which files ``spec.data.train`` / ``eval`` name, and what text they hold.

A pattern is a path, a glob or an fsspec URL (``s3://bucket/corpus/*.bin``,
``gs://...``, ``https://host/file.bin``, ``memory://...``, ``file://...``);
``{stdlib}`` stands for the Python standard library's folder, text that is on every
machine. Every pattern must match a file; the files are read in sorted order, so a
corpus is the same wherever it is read. One listing per pattern gives every file's
size, so opening a corpus of many remote shards costs one request per pattern, not
one per shard.

What goes wrong at a remote store is said in one line naming the field: a bucket
that does not exist, credentials it refuses, a backend that is not installed.
"""

from __future__ import annotations

import glob
import json
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from alpajob.api.data import DataFormat
from alpajob.api.errors import ManifestError
from alpajob.api.limits import GLOB_FILES
from alpajob.trainer_image.data.remote import DataReadError, Retry, retried

#: What a pattern may say for the Python standard library's folder.
STDLIB = "{stdlib}"
#: What makes a pattern a glob (as fsspec tells one).
GLOB_CHARACTERS = "*?["
#: fsspec's backend package per protocol, for the message when one is missing.
BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}


@dataclass(frozen=True)
class SourceFile:
    """One file of a source: its URL (a plain path when local) and its size in bytes."""

    url: str
    size: int

    @property
    def local(self) -> bool:
        return "://" not in self.url


@dataclass(frozen=True)
class Listing:
    """What one pattern names: its filesystem, and every match with its fsspec info."""

    fs: Any
    protocol: str
    entries: dict[str, dict[str, Any]]  # path (no protocol) -> info (size, type)

    def url(self, path: str) -> str:
        """``path`` as a URL (https paths are URLs already; local ones stay paths)."""
        return path if self.protocol == "file" or "://" in path else f"{self.protocol}://{path}"


def resolve(pattern: str) -> str:
    return pattern.replace(STDLIB, sysconfig.get_path("stdlib"))


def describe_remote_error(error: BaseException, what: str) -> str:
    """One line on why a remote store refused ``what`` (a bucket that does not exist,
    credentials it refuses), for a message that names the field."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    name = type(error).__name__
    if isinstance(error, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text \
            or "SignatureDoesNotMatch" in text or name in ("NoCredentialsError", "PartialCredentialsError"):
        return (f"{what} refused the credentials ({text}); give the pods credentials in "
                "spec.podTemplate.mesh.env (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from a Secret, "
                "or GOOGLE_APPLICATION_CREDENTIALS), see the data guide")
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return f"{what}: the bucket does not exist ({text}); check the URL's bucket name"
    return f"cannot read {what} ({name}: {text})"


#: Seconds a local pattern may take to list before it is refused as too wide.
GLOB_SECONDS = 30.0


def bounded_walk(path: str, pattern: str, field: str) -> None:
    """Refuse a local glob that matches more than :data:`~alpajob.api.limits.GLOB_FILES`
    paths or takes more than :data:`GLOB_SECONDS` to list, before fsspec lists it whole:
    ``/**/*`` walked the whole filesystem. Python's ``iglob`` yields lazily, so the walk
    stops at the bound."""
    start = time.monotonic()
    for count, _ in enumerate(glob.iglob(path, recursive=True), 1):
        if count > GLOB_FILES.most or time.monotonic() - start > GLOB_SECONDS:
            raise ManifestError(field, f"{pattern!r} matches more than {count - 1:,} paths in "
                                       f"{time.monotonic() - start:.0f} s; narrow it, e.g. corpus/*.bin: "
                                       f"{GLOB_FILES.why}")


def listing(pattern: str, field: str) -> Listing:
    """The files and folders ``pattern`` names (a glob: its matches; a path: itself)."""
    resolved = resolve(pattern)
    try:
        fs, path = url_to_fs(resolved)
    except ImportError as error:
        protocol = resolved.split("://", 1)[0] if "://" in resolved else "file"
        package = BACKENDS.get(protocol, "the fsspec backend")
        raise ManifestError(field, f"cannot read {pattern!r}: {protocol}:// needs {package}, which is not "
                                   f"installed here ({error}); pip install 'alpajob[cloud]'") from None
    except ValueError as error:
        raise ManifestError(field, f"cannot read {pattern!r}: {error}") from None
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]

    def matches() -> dict[str, Any]:
        if any(c in path for c in GLOB_CHARACTERS):
            if protocol == "file":
                bounded_walk(path, pattern, field)
            return dict(fs.glob(path, detail=True))
        return {path: fs.info(path)} if fs.exists(path) else {}

    try:
        entries = matches() if protocol in ("file", "memory") else retried(matches, repr(pattern), Retry())
    except FileNotFoundError:
        entries = {}
    except (DataReadError, ManifestError):
        raise
    except Exception as error:  # noqa: BLE001 - every backend raises its own; each gets one line
        raise ManifestError(field, describe_remote_error(error, repr(pattern))) from None
    if not entries and protocol not in ("file", "memory"):
        _check_bucket(fs, path, pattern, field)
    return Listing(fs, protocol, {p: dict(info) for p, info in entries.items()})


def _check_bucket(fs: Any, path: str, pattern: str, field: str) -> None:
    """Say so if ``path``'s bucket does not exist (an object store lists a missing
    bucket as empty); for a web server (no buckets: its path is the whole URL), why the
    URL gave nothing: not found, or the server's own error."""
    if "://" in path:  # http(s): fsspec keeps the URL whole, and says "missing" for any failure
        try:
            fs.info(path)
        except FileNotFoundError as error:
            cause = error.__cause__  # fsspec's http raises this for every failure, the real one below
            if cause is None or "404" in str(cause):
                raise ManifestError(field, f"{pattern!r} is not there (the server answered 404 Not Found); "
                                           "check the URL") from None
            raise ManifestError(field, describe_remote_error(cause, repr(pattern))) from None
        except Exception as error:  # noqa: BLE001 - aiohttp's own errors (TLS, refused, DNS)
            raise ManifestError(field, describe_remote_error(error, repr(pattern))) from None
        return
    bucket = path.split("/", 1)[0]
    try:
        fs.info(bucket)
    except FileNotFoundError as error:
        raise ManifestError(field, f"{pattern!r}: the bucket {bucket!r} does not exist ({error}); check the "
                                   "URL's bucket name") from None
    except Exception as error:  # noqa: BLE001 - every backend raises its own
        raise ManifestError(field, describe_remote_error(error, repr(pattern))) from None


def expand(patterns: Sequence[str], field: str) -> list[SourceFile]:
    """The files ``patterns`` match, sorted per pattern, each once; a pattern that
    matches nothing is a :class:`ManifestError` naming ``field``."""
    files: dict[str, SourceFile] = {}
    for pattern in patterns:
        found = listing(pattern, field)
        matched = sorted(p for p, info in found.entries.items() if info.get("type") != "directory")
        if not matched:
            raise ManifestError(field, f"{pattern!r} matches no file; check the path (globs such as "
                                       "data/*.txt and fsspec URLs such as s3://bucket/x/*.bin work)")
        for path in matched:
            url = found.url(path)
            files.setdefault(url, SourceFile(url, int(found.entries[path].get("size") or 0)))
    return list(files.values())


def read_documents(files: Sequence[str], fmt: DataFormat, field: str = "text") -> Iterator[str]:
    """The documents of ``files``: a whole text file, each jsonl line's ``field``, or
    each ArrayRecord record (UTF-8 text; ArrayRecord files are read from local disk)."""
    if fmt is DataFormat.ARRAYRECORD:
        yield from _array_records(files)
        return
    for path in files:
        with fsspec.open(path, "rb") as handle:
            data = handle.read()
        text = data.decode("utf-8", errors="replace")
        if fmt is DataFormat.TEXT:
            yield text
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            document = jsonl_document(line, path, number, field)
            if document is not None:
                yield document


def jsonl_document(line: str, path: str, number: int, field: str) -> str | None:
    """The text of one jsonl line (None for a blank line); a clear error for a line that
    is not a JSON object with a string under ``field``."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ManifestError("spec.data.format", f"{path}:{number} is not JSON ({error.msg}); "
                                                "jsonl needs one JSON object per line") from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise ManifestError("spec.data.field", f"{path}:{number} has no text under {field!r}; "
                                               "set spec.data.field to the key of the text")
    return record[field]


def _array_records(files: Sequence[str]) -> Iterator[str]:
    import grain

    remote = [f for f in files if "://" in f]
    if remote:
        raise ManifestError("spec.data.format", f"arrayrecord files are read from local disk, not "
                                                f"{remote[0]}; copy them to a volume first")
    source = grain.sources.ArrayRecordDataSource(list(files))
    for index in range(len(source)):
        yield bytes(source[index]).decode("utf-8", errors="replace")
