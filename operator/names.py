"""Deterministic names of an AlpaJob's children (their labels: :mod:`alpajob.api.names`).

Every child's name follows from the job's name and the **attempt** (0 for the first
run, one more after every restart of the whole job), so a restarted operator finds
what it created before instead of creating it twice. The operator saves the names
it is about to use into ``status.children`` before creating anything.

=====================  ==========================================================
``<job>-config``       ConfigMap: the AlpaJob as applied (``manifest.yaml``)
``<job>-plan``         ConfigMap: the Plan (``plan.json``), written by the planner
``<job>-progress``     ConfigMap: the driver's progress (``progress.json``)
``<job>-planner``      Pod: runs ``alpajob plan`` once
``<job>-head``         Service: the Ray head's GCS and the driver's metrics
``<job>-hosts``        headless Service: DNS names of the mesh pods
``<job>-pods``         NetworkPolicy: ingress to the job's pods (:mod:`.network`)
``<job>-<a>-head``     Pod: Ray head + driver of attempt ``a``
``<job>-<a>-m<i>-h<j>`` Pod: host ``j`` of mesh ``i``, attempt ``a``
``<job>-<a>``          PodGroup of attempt ``a`` (gang scheduling)
``<job>-<a>-ray``      Secret: attempt ``a``'s Ray token (head and mesh pods only)
``<job>-trainer``      ServiceAccount, Role and RoleBinding: the pods' identity (get
                       and patch on ``<job>-plan`` and ``<job>-progress`` only)
=====================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from alpajob.api.status import Children


@dataclass(frozen=True)
class ChildNames:
    """The names of one job's children for one attempt."""

    job: str
    attempt: int

    @property
    def config(self) -> str:
        return f"{self.job}-config"

    @property
    def plan(self) -> str:
        return f"{self.job}-plan"

    @property
    def progress(self) -> str:
        return f"{self.job}-progress"

    @property
    def planner(self) -> str:
        return f"{self.job}-planner"

    @property
    def service(self) -> str:
        return f"{self.job}-head"

    @property
    def hosts_service(self) -> str:
        return f"{self.job}-hosts"

    @property
    def network_policy(self) -> str:
        return f"{self.job}-pods"

    @property
    def head(self) -> str:
        return f"{self.job}-{self.attempt}-head"

    @property
    def pod_group(self) -> str:
        return f"{self.job}-{self.attempt}"

    @property
    def ray_token(self) -> str:
        return f"{self.job}-{self.attempt}-ray"

    @property
    def identity(self) -> str:
        return f"{self.job}-trainer"

    def mesh_pod(self, mesh: int, host: int) -> str:
        return f"{self.job}-{self.attempt}-m{mesh}-h{host}"

    def mesh_hostname(self, mesh: int, host: int) -> str:
        """The pod's hostname: ``m<mesh>-h<host>``, a DNS name under the hosts Service."""
        return f"m{mesh}-h{host}"

    def to_status(self, hosts: list[tuple[int, int]]) -> Children:
        """What ``status.children`` records for this attempt."""
        return Children(
            attempt=self.attempt, config=self.config, plan=self.plan, progress=self.progress,
            planner=self.planner, service=self.service, hosts_service=self.hosts_service,
            head=self.head, pod_group=self.pod_group,
            mesh_pods=[self.mesh_pod(m, h) for m, h in hosts])
