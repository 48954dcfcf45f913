"""The generated reference pages: which file each is, and how it is made.

:func:`stale` compares each committed page with what its generator renders now;
:func:`write` renders them all into ``docs/reference/``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alpajob.reference import alerts, api, cli, helm_values, metrics

#: The repository's docs/reference folder.
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"

#: Page file name -> its generator.
PAGES: dict[str, Callable[[], str]] = {
    "api.md": api.render,
    "cli.md": cli.render,
    "metrics.md": metrics.render,
    "alerts.md": alerts.render,
    "helm-values.md": helm_values.render,
}


def stale(folder: Path = REFERENCE) -> list[str]:
    """The pages whose committed text differs from what the code generates (a missing
    page is stale)."""
    return [name for name, render in PAGES.items()
            if not (folder / name).is_file() or (folder / name).read_text() != render()]


def write(folder: Path = REFERENCE) -> list[str]:
    """Render every page into ``folder``; the names of those that changed."""
    changed = []
    for name, render in PAGES.items():
        path = folder / name
        text = render()
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(name)
    return changed
