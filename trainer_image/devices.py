"""How many host devices XLA makes on a CPU-only machine (imports no JAX).

XLA reads ``--xla_force_host_platform_device_count`` once, when JAX first starts, so
this must run before anything imports JAX: ``alpajob run --devices``, the Python API's
:func:`alpajob.train` and the Ray mesh workers call it first.
"""

from __future__ import annotations

import os
import sys

FLAG = "--xla_force_host_platform_device_count"
DEFAULT_DEVICES = 8


def with_host_devices(xla_flags: str, count: int) -> str:
    """``xla_flags`` with the forced host device count set to ``count``."""
    kept = " ".join(f for f in xla_flags.split() if not f.startswith(FLAG))
    return f"{kept} {FLAG}={count}".strip()


def force_host_devices(count: int | None) -> None:
    """Ask XLA for ``count`` host devices (default 8, unless already asked for in
    ``XLA_FLAGS``); a no-op once JAX is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" in sys.modules or (count is None and FLAG in flags):
        return
    os.environ["XLA_FLAGS"] = with_host_devices(flags, count or DEFAULT_DEVICES)
