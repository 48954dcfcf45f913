"""Checks of the paths a command will write, made before any work is done."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
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
    """``path`` as a directory to write into, made if it does not exist yet (with its
    parents) and writable; else a :class:`ManifestError` naming ``flag``: a file, a
    folder under a file, a place such as ``/proc`` where nothing can be made."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ManifestError(flag, f"{path} is a file, not a directory")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ManifestError(flag, f"cannot make the directory {path} ({error.strerror or error}); "
                                  "give a folder you may write") from None
    if not os.access(target, os.W_OK | os.X_OK):
        raise ManifestError(flag, f"{path} is not writable by this user; give a folder you may write")
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


def add_plan_cache_flags(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir`` and ``--no-plan-cache`` (:mod:`~alpajob.trainer_image.plan_cache`)."""
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="keep plans in DIR and reuse one made before for the same model, cluster, "
                             "options and planner (default $XDG_CACHE_HOME/alpajob/plans)")
    parser.add_argument("--no-plan-cache", action="store_true",
                        help="plan from scratch: neither read nor write the plan cache")


def _cache_folder(given: str | None, off: bool, flag: str, off_flag: str,
                  default: Callable[[], object]) -> str | None:
    """A cache's folder from its pair of flags: ``given`` (``flag``), None when ``off``
    (``off_flag``; refused together with ``flag``), else ``default()``."""
    if off:
        if given:
            raise ManifestError(flag, f"cannot be used with {off_flag}; drop one of them")
        return None
    if given:
        return str(directory(given, flag))
    return str(default())


def plan_cache_dir(args: argparse.Namespace, default: str | None = None) -> str | None:
    """The plan cache folder the flags ask for (else ``default``, else the user cache);
    None with ``--no-plan-cache``."""
    from alpajob.trainer_image.plan_cache import default_cache_dir

    return _cache_folder(args.cache_dir, args.no_plan_cache, "--cache-dir", "--no-plan-cache",
                         lambda: default or default_cache_dir())


def add_compile_cache_flags(parser: argparse.ArgumentParser) -> None:
    """``--compile-cache`` and ``--no-compile-cache`` (:mod:`~alpajob.trainer_image.compile_cache`)."""
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="keep XLA's compiled step in DIR and reuse it in a later run (default "
                             "$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/alpajob/xla)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile the step from scratch: neither read nor write compiled executables")


def compile_cache_dir(args: argparse.Namespace) -> str | None:
    """The compilation cache folder the flags ask for; None with ``--no-compile-cache``."""
    from alpajob.trainer_image.compile_cache import default_compile_cache_dir

    return _cache_folder(args.compile_cache, args.no_compile_cache, "--compile-cache",
                         "--no-compile-cache", default_compile_cache_dir)
