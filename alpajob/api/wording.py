"""How every message counts things: ``1 restart``, ``2 restarts``.

Messages reach users through the CLI, the job's conditions and events, and logs; a
count in any of them goes through :func:`counted`, so none says "restarted 1 times".
"""

from __future__ import annotations


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` and ``noun``, the noun plural unless the number is one (``plural``:
    the plural where adding an ``s`` is wrong)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"
