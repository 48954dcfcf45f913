"""Who may connect to a job's pods: the NetworkPolicy the operator makes for each job.

A job's pods run a Ray cluster whose ports (GCS, raylets, the dashboard agent, Ray
Client) would let anyone who reaches them run code as the pod's user. Ray's token
(the attempt's Secret) already refuses a connection without it; the policy makes the
pods unreachable in the first place, where the cluster's network plugin enforces
NetworkPolicies. ``<job>-pods`` selects every pod of the job (its job label) and
admits ingress only

- from the job's own pods (Ray, JAX's coordinator, cross-mesh transfers), any port;
- from the operator's pods (the ``alpajob-operator`` pods of its namespace), any port;
- to the metrics port only, from the metrics scraper: the pods of one namespace
  (``metrics_namespace``), or of any namespace when none is named.

Egress is left open (the data, the checkpoint store, the image's packages). Turned
off by the operator's ``--no-network-policy`` (the chart's ``networkPolicy.enabled``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from alpajob.api.names import LABEL_JOB
from alpajob.api.runtime import METRICS_PORT

#: The operator's pods, as the chart and manifests/operator.yaml label them.
OPERATOR_LABELS = {"app.kubernetes.io/name": "alpajob-operator"}
#: The label every namespace carries with its own name (since Kubernetes 1.21).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class NetworkSettings:
    """The operator's settings for the jobs' NetworkPolicies."""

    enabled: bool = True
    operator_namespace: str = "alpajob-system"
    metrics_namespace: str | None = None  # None: the metrics port is open to every namespace


def job_network_policy(job: Mapping[str, Any], meta: dict[str, Any], settings: NetworkSettings) -> dict[str, Any]:
    """The job's NetworkPolicy (module docstring), with ``meta`` (name, labels, owner)."""
    name = job["metadata"]["name"]
    scraper: dict[str, Any] = {"namespaceSelector": {}}
    if settings.metrics_namespace:
        scraper = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: settings.metrics_namespace}}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {LABEL_JOB: name}}}]},
                {"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}},
                           "podSelector": {"matchLabels": dict(OPERATOR_LABELS)}}]},
                {"from": [scraper], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
            ],
        },
    }
