"""What the operator knows of every job's world, kept current by watches.

The operator does not poll. kopf watches the AlpaJobs' pods, ConfigMaps and Services
(the objects with the job label, selected by the API server: :func:`select_on_server`)
and the Nodes, and keeps them in memory in kopf
*indexes* (:func:`register`): children by ``(namespace, job)``, nodes under one key.
Each change also wakes the job it concerns (:class:`Wakers`), whose daemon then runs
one reconciliation pass on a :class:`World` snapshot of the indexes. A Node wakes
every job only when what the pool is made of changed (:func:`node_signature`:
Ready, schedulable, labels, allocatable GPUs), not on every heartbeat of its status.

The snapshot is taken on kopf's event loop, where the indexes change, and the pass
runs in a worker thread on the snapshot: the thread never reads a structure the loop
is changing. At start kopf fills every index before it starts any daemon, so a
restarted operator's first pass already sees every child that exists.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from alpajob.api.names import GPU_RESOURCE, LABEL_JOB

#: The kinds of a job's children that are watched, each in the index of that name.
CHILD_KINDS = ("pods", "configmaps", "services", "persistentvolumeclaims")
NODES = "nodes"


@dataclass(frozen=True)
class World:
    """One job's children and the cluster's nodes, as the watches last saw them."""

    pods: tuple[dict[str, Any], ...] = ()
    configmaps: tuple[dict[str, Any], ...] = ()
    services: tuple[dict[str, Any], ...] = ()
    claims: tuple[dict[str, Any], ...] = ()
    nodes: tuple[dict[str, Any], ...] = ()

    @staticmethod
    def of(indexes: Mapping[str, Any], namespace: str, job: str, gone: Collection[str] = ()) -> World:
        """The snapshot of ``namespace/job``'s world in kopf's ``indexes`` (by id),
        without the objects whose uid is in ``gone`` (found deleted by an audit after a
        gap in the watches: kopf's index still holds them)."""

        def values(index: str, key: object) -> tuple[dict[str, Any], ...]:
            store = indexes[index].get(key)
            if store is None:
                return ()
            return tuple(obj for obj in store if ((obj.get("metadata") or {}).get("uid")) not in gone)

        return World(pods=values("pods", (namespace, job)), configmaps=values("configmaps", (namespace, job)),
                     services=values("services", (namespace, job)),
                     claims=values("persistentvolumeclaims", (namespace, job)), nodes=values(NODES, NODES))


def slim_node(body: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a Node the pool is made of (name, labels, schedulability, taints,
    allocatable resources, the Ready condition): nodes carry image lists and more
    that the operator has no use to keep in memory."""
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    return {"metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
            "spec": {"unschedulable": bool(spec.get("unschedulable")),
                     "taints": [{k: t[k] for k in ("key", "value", "effect") if t.get(k) is not None}
                                for t in spec.get("taints") or []]},
            "status": {"allocatable": dict(status.get("allocatable") or {}),
                       "conditions": [dict(c) for c in status.get("conditions") or [] if c.get("type") == "Ready"]}}


def node_signature(node: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a (slim) Node can change a job's pool: a change of it wakes every job."""
    status = node["status"]
    ready = [c.get("status") for c in status["conditions"]]
    taints = tuple(tuple(sorted(t.items())) for t in node["spec"].get("taints") or [])
    return (tuple(sorted(node["metadata"]["labels"].items())), node["spec"]["unschedulable"], taints, tuple(ready),
            status["allocatable"].get(GPU_RESOURCE))


class Wakers:
    """One wake-up flag per job: set by a change of the job's world, waited on by
    its daemon. Belongs to one registry (no global state)."""

    def __init__(self) -> None:
        self._flags: dict[tuple[str, str], asyncio.Event] = {}

    def of(self, namespace: str, job: str) -> asyncio.Event:
        return self._flags.setdefault((namespace, job), asyncio.Event())

    def wake(self, namespace: str, job: str) -> None:
        flag = self._flags.get((namespace, job))
        if flag is not None:
            flag.set()

    def wake_all(self) -> None:
        for flag in self._flags.values():
            flag.set()

    def forget(self, namespace: str, job: str) -> None:
        self._flags.pop((namespace, job), None)

    def jobs(self) -> Iterable[tuple[str, str]]:
        return list(self._flags)


def select_on_server(settings: kopf.OperatorSettings) -> None:
    """Ask the API server for the jobs' children only: every list and watch of a
    child kind carries ``labelSelector=alpajob.io/job``. (kopf's ``labels=`` on a
    handler filters after the objects arrive: without this, every Pod, ConfigMap,
    Service and claim of the cluster would stream into the operator.)"""
    for kind in CHILD_KINDS:
        settings.watching.label_selectors["v1", kind] = LABEL_JOB


def register(registry: kopf.OperatorRegistry, wakers: Wakers) -> None:
    """The indexes and wake-ups of the module docstring, on ``registry``."""
    job_label = {LABEL_JOB: kopf.PRESENT}

    def child_index(kind: str) -> None:
        @kopf.index("", "v1", kind, id=kind, labels=job_label, registry=registry)
        def index(**kwargs: Any) -> dict[Any, Any]:
            return {(kwargs["namespace"], kwargs["labels"][LABEL_JOB]): copy.deepcopy(dict(kwargs["body"]))}

        @kopf.on.event("", "v1", kind, id=f"{kind}-changed", labels=job_label, registry=registry)
        def changed(**kwargs: Any) -> None:
            wakers.wake(kwargs["namespace"], kwargs["labels"][LABEL_JOB])

    for kind in CHILD_KINDS:
        child_index(kind)

    signatures: dict[str, tuple[Any, ...]] = {}

    @kopf.index("", "v1", NODES, id=NODES, registry=registry)
    def nodes(**kwargs: Any) -> dict[Any, Any]:
        return {NODES: slim_node(kwargs["body"])}

    @kopf.on.event("", "v1", NODES, id=f"{NODES}-changed", registry=registry)
    def node_changed(**kwargs: Any) -> None:
        name = kwargs["name"]
        signature = None if kwargs["type"] == "DELETED" else node_signature(slim_node(kwargs["body"]))
        if signatures.get(name) != signature:
            if signature is None:
                signatures.pop(name, None)
            else:
                signatures[name] = signature
            wakers.wake_all()
