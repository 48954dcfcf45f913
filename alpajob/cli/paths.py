"""Checks of the paths a command will write, made before any work is done."""

from __future__ import annotations

from pathlib import Path

from alpajob.api.errors import ManifestError


def writable_file(path: str, flag: str) -> Path:
    """``path`` as a file the command may write at the end: its folder exists and it is
    not a folder itself; else a :class:`ManifestError` naming ``flag``."""
    target = Path(path)
    if target.is_dir():
        raise ManifestError(flag, f"{path} is a directory; give a file name")
    if not target.parent.is_dir():
        raise ManifestError(flag, f"the directory {target.parent} does not exist; create it first")
    return target


def directory(path: str, flag: str) -> Path:
    """``path`` as a directory to write into: it may not exist yet, but it may not be a
    file; else a :class:`ManifestError` naming ``flag``."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ManifestError(flag, f"{path} is a file, not a directory")
    return target


def existing_file(path: str, flag: str) -> Path:
    """``path`` as a file to read: it exists and is not a folder; else a
    :class:`ManifestError` naming ``flag``."""
    target = Path(path)
    if not target.exists():
        raise ManifestError(flag, f"{path} does not exist")
    if target.is_dir():
        raise ManifestError(flag, f"{path} is a directory; give a file")
    return target
