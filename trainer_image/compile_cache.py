"""JAX's persistent compilation cache for ``alpajob run``: a rerun does not compile
its step again.

XLA compiles every stage executable of a step (forward, backward, update) on the
first step; for the README job that is most of the first step's seconds. JAX can keep
each compiled executable on disk under a hash of its lowered program, its devices and
the compiler's version, and read it back in a later process
(``jax_compilation_cache_dir``). The plan cache (:mod:`.plan_cache`) makes a rerun
skip planning; this makes it skip compiling. Tracing and lowering still run: the
cache key is the lowered program.

JAX caches only executables that took ``jax_persistent_cache_min_compile_time_secs``
(default 1 s) to compile; a small model's stage executables take less each, so the
threshold is lowered to 0 here: every executable of the step is kept (kilobytes
each). Entries are written by JAX as whole files; a damaged one is a cache miss
(JAX logs it and compiles again).

The folder defaults to ``$JAX_COMPILATION_CACHE_DIR`` when the user set it, else
``$XDG_CACHE_HOME/alpajob/xla`` beside the plans; ``--no-compile-cache`` turns it
off. The setting is JAX's, one per process: :func:`compile_cache` sets it for the
run and restores it after.

In a job's pods the mesh hosts compile, in Ray workers their raylet spawns: the
mesh pod's command gives its raylet the environment of :func:`compile_cache_env`
(JAX reads its settings from ``JAX_*`` variables at import), with the folder the
operator names on the job's checkpoint volume (``ALPAJOB_COMPILE_CACHE``). A new
attempt after a restart, or a replaced mesh pod, then loads its stage executables
instead of compiling them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


def default_compile_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """``$JAX_COMPILATION_CACHE_DIR`` if set, else XDG's user cache ``alpajob/xla``."""
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(env["JAX_COMPILATION_CACHE_DIR"])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "alpajob" / "xla"


def writable(folder: str, warn: Callable[[str], None], hint: str) -> bool:
    """Whether ``folder`` can be made and written; else one ``warn`` line, with ``hint``."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as error:
        warn(f"compile cache: {folder} cannot be written ({error.strerror or error}); compiling without it{hint}")
        return False
    return True


def compile_cache_env(folder: str | None, warn: Callable[[str], None]) -> dict[str, str]:
    """The environment under which a JAX process (a Ray worker) keeps every executable
    it compiles in ``folder`` and reads back those compiled before: nothing for None or
    a folder that cannot be written (one ``warn`` line)."""
    if folder is None or not writable(folder, warn, ""):
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": folder, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


@contextmanager
def compile_cache(folder: str | None, warn: Callable[[str], None]) -> Iterator[bool]:
    """Within the block, JAX keeps every executable it compiles in ``folder`` (created
    if missing) and reads back those compiled before; yields whether it does. None, or
    a folder that cannot be written (one ``warn`` line), leaves compiling as it was.
    JAX's settings are restored after the block, and its cache reset both times (JAX
    opens the cache once per process, at the first compile)."""
    if folder is None:
        yield False
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    path = Path(folder)
    if not writable(folder, warn, " (--no-compile-cache silences this)"):
        yield False
        return
    settings = {"jax_compilation_cache_dir": str(path),
                "jax_persistent_cache_min_compile_time_secs": 0.0}
    before = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()
    try:
        yield True
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        jax_cache.reset_cache()
