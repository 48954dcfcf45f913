"""The plan cache: a rerun, a resume or a restarted planner never plans the same job twice.

A plan is a pure function of four things, and its cache key hashes all four:

- the **traced graph**: its fingerprint (ops, shapes, dtypes, FLOPs, batch size), its
  name and its parameters' names (the plan names parameters; the fingerprint does not);
- the **cluster** it is planned for (:class:`~alpajob.planner.cost.cluster.ClusterSpec`:
  devices, links, the forced-device share of a host's cores);
- the **search** (:class:`~alpajob.planner.plan.make.SearchOptions`: method, schedule,
  manual stages, ILP time limit, baselines, calibration constants);
- the **planner itself**: a hash of every source and data file of the planner package
  and the AlpaJob version, so a changed cost model or search never serves a plan the
  new code would not make.

An entry is one JSON file, ``<directory>/<key>.json``: the key, the plan document and
the SHA-256 of that document. It is written to a temporary file in the same folder
and renamed into place, so a reader (another run, the next attempt) sees a whole
entry or none. Reading checks everything before trusting anything: the key, the
digest, the plan's own validation and content hash, and that the plan was made for
this graph; an entry failing any of them is ignored with a warning (and replaced by
the new plan), never used. A cache that cannot be written (a read-only folder, a
full disk) costs a warning, never the run.

The directory is ``$XDG_CACHE_HOME/alpajob/plans`` (``~/.cache/alpajob/plans``),
``--cache-dir`` elsewhere (a job's volume), none with ``--no-plan-cache``.

Beside a plan, the cache keeps the verdict of its **device trial** on forced CPU
devices (:mod:`.device_trial`: the plan timed against the step on one device), under
the plan's key and the machine (processor, cores, devices, JAX version): the same job
on the same machine takes the same decision without timing it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alpajob.api.errors import PlanFormatError
from alpajob.api.plan import Plan, plan_from_json
from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.planner.plan.make import SearchOptions

#: What the planner's version hashes: its code and its stored constants.
_PLANNER_FILES = (".py", ".json")


def default_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Where plans are cached unless ``--cache-dir`` says otherwise (XDG's user cache)."""
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "alpajob" / "plans"


def planner_version() -> str:
    """A hash of the AlpaJob version and every planner source and data file (their
    paths and bytes, in sorted order): it changes whenever the planner could."""
    import alpajob.planner

    root = Path(alpajob.planner.__file__).resolve().parent
    digest = hashlib.sha256(alpajob.__version__.encode())
    for path in sorted(p for p in root.rglob("*") if p.suffix in _PLANNER_FILES and p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def plan_key(graph: OpGraph, cluster: ClusterSpec | tuple[ClusterSpec, ...], search: SearchOptions,
             version: str, link_bandwidth: float | None = None) -> str:
    """The cache key of planning ``graph`` for ``cluster`` (a tuple of them: a plan
    across GPU types, one per pool, ``link_bandwidth`` between them) with ``search``
    by planner ``version`` (module docstring). The clusters and search options are
    frozen dataclasses of numbers, strings and enums, whose ``repr`` is stable."""
    material = json.dumps({
        "graph": [graph.fingerprint(), graph.name, list(graph.param_names)],
        "cluster": repr(cluster),
        "search": repr(search),
        "planner": version,
    } | ({"link": link_bandwidth} if link_bandwidth is not None else {}), sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def machine_id(num_devices: int) -> str:
    """What a device trial's verdict depends on besides the plan: this machine's
    processor and cores, the devices the run made, and the JAX that runs them."""
    import platform
    from importlib import metadata

    return (f"{platform.machine()} {platform.processor() or 'cpu'}, {os.cpu_count()} cores, "
            f"{num_devices} devices, jax {metadata.version('jax')}")


def trial_key(key: str, machine: str) -> str:
    """The key of a device trial's verdict: the plan's cache key on ``machine``."""
    return hashlib.sha256(f"{key}\n{machine}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PlanCache:
    """Plans stored under ``directory`` by key; ``warn`` hears why an entry was ignored
    or could not be written."""

    directory: Path
    warn: Callable[[str], None]

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str, graph: OpGraph) -> Plan | None:
        """The plan stored under ``key``, if there is one that passes every check."""
        path = self.path(key)
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):  # no entry (or no folder) yet
            return None
        except OSError as error:
            self.warn(f"plan cache: cannot read {path} ({error.strerror}); planning again")
            return None
        try:
            entry = json.loads(text)
            if not isinstance(entry, dict) or entry.get("key") != key:
                raise PlanFormatError("not an entry of this key")
            document = entry.get("plan")
            if not isinstance(document, str) or hashlib.sha256(document.encode()).hexdigest() != entry.get("sha256"):
                raise PlanFormatError("the plan does not match its digest")
            plan = plan_from_json(document, str(path))
            if plan.model.fingerprint != graph.fingerprint():
                raise PlanFormatError(f"made for model fingerprint {plan.model.fingerprint}")
        except (ValueError, PlanFormatError) as error:  # JSONDecodeError is a ValueError
            self.warn(f"plan cache: ignoring {path}: {error}; planning again")
            return None
        return plan

    def put(self, key: str, plan: Plan) -> None:
        """Store ``plan`` under ``key``, atomically."""
        document = plan.to_json()
        self._write(self.path(key), json.dumps({
            "key": key, "sha256": hashlib.sha256(document.encode()).hexdigest(), "plan": document}))

    def get_record(self, key: str) -> dict[str, Any] | None:
        """A small JSON record stored under ``key`` (:meth:`put_record`); a damaged one
        is ignored with a warning."""
        path = self.directory / f"{key}.json"
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("record"), dict):
                raise ValueError("not a record of this key")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError) as error:
            self.warn(f"plan cache: ignoring {path}: {error}")
            return None
        return dict(entry["record"])

    def put_record(self, key: str, record: dict[str, Any]) -> None:
        """Store a small JSON ``record`` under ``key``, atomically."""
        self._write(self.directory / f"{key}.json", json.dumps({"key": key, "record": record}))

    def get_trial(self, key: str) -> tuple[float, float] | None:
        """A device trial's verdict stored under ``key`` (:func:`trial_key`): the plan's
        and one device's seconds per step."""
        record = self.get_record(f"trial-{key}")
        if record is None:
            return None
        try:
            seconds = (float(record["plan_seconds"]), float(record["one_device_seconds"]))
        except (KeyError, TypeError, ValueError):
            seconds = (0.0, 0.0)
        if min(seconds) <= 0:
            self.warn(f"plan cache: ignoring the device trial trial-{key}: not a verdict; timing the plan again")
            return None
        return seconds

    def put_trial(self, key: str, plan_seconds: float, one_device_seconds: float) -> None:
        """Store a device trial's verdict under ``key``."""
        self.put_record(f"trial-{key}", {"plan_seconds": plan_seconds, "one_device_seconds": one_device_seconds})

    def _write(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path`` atomically; a failure is a warning."""
        temporary: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=self.directory, prefix=f".{path.stem}.",
                                             suffix=".tmp", delete=False) as f:
                temporary = f.name
                f.write(text)
            os.replace(temporary, path)
        except OSError as error:
            self.warn(f"plan cache: cannot write to {self.directory} ({error.strerror}); "
                      "the next run plans again")
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
