"""Starting child processes from library code that a user's script may call.

Kept apart from :mod:`.workers` so that the trainer's forced-count child can use it
without importing the planner's search (numpy, pulp): the CLI imports this module at
start-up and must stay light."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start processes inside the block without the caller's ``__main__``.

    A new multiprocessing child first runs the parent's main module again (as
    ``__mp_main__``) so that functions defined there can be unpickled: for a plain
    script that calls ``alpajob.plan`` at its top level, without ``if __name__ ==
    "__main__":``, every worker would plan again, and start workers of its own, which
    multiprocessing refuses (a ``BrokenPipeError`` per worker). The workers run only
    this module's functions, so they need nothing of ``__main__``: for the block, the
    main module shows neither a spec nor a file, which is what multiprocessing reads
    to find it (a notebook's or ``python -``'s main has neither anyway)."""
    main = sys.modules.get("__main__")
    keys: tuple[str, ...] = ("__spec__", "__file__")
    saved: dict[str, object] = {key: main.__dict__[key] for key in keys if main and key in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)
