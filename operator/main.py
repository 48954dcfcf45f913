"""Run the kopf operator for AlpaJobs (``alpajob operator``'s body).

It talks to the API server of the pod's service account (in a cluster) or of
``$KUBECONFIG``. Without ``peering`` it runs standalone: one replica at a time. With
``peering`` (the name of a KopfPeering, or a ClusterKopfPeering with
``--all-namespaces``, which must exist), several replicas run and kopf's peering
elects one: each replica announces itself in the peering object with a random
``priority`` and every :data:`PEER_LIFETIME` seconds; every replica but the one of
the highest priority pauses its watches and daemons (it still serves the webhook),
and when that one stops (its record removed) or dies (its record not renewed for
:data:`PEER_LIFETIME` seconds) the next one resumes. Every pass is idempotent, so a
brief overlap at a handover does no harm, and the operator may be restarted at any
moment.
"""

from __future__ import annotations

import logging
import secrets

import kopf

from alpajob.operator.handlers import OperatorOptions, build_registry
from alpajob.operator.kube import Kube, client_from_environment
from alpajob.operator.metrics import OperatorMetrics
from alpajob.operator.network import NetworkSettings

#: Seconds a replica's peering record stays valid without being renewed: a killed
#: leader is replaced after at most this long (kopf renews records a few seconds early).
PEER_LIFETIME = 15


def run_operator(options: OperatorOptions, *, namespaces: tuple[str, ...] = (), clusterwide: bool = False,
                 liveness: str | None = None, metrics_port: int | None = None,
                 default_image: str | None = None, verbose: bool = False,
                 metrics_bind_address: str = "0.0.0.0", network: NetworkSettings | None = None,
                 peering: str | None = None, priority: int | None = None) -> int:
    """Run until interrupted; the exit status."""
    kopf.configure(verbose=verbose)
    if not verbose:  # kopf logs every watch event's handler at INFO: one line per pod change
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics = OperatorMetrics()
    if metrics_port is not None:
        metrics.serve(metrics_port, metrics_bind_address)
    api = client_from_environment()
    metrics.count_requests(api)
    registry = build_registry(Kube(api, default_image=default_image, network=network), metrics, options)
    settings = kopf.OperatorSettings()
    settings.peering.lifetime = PEER_LIFETIME
    if priority is None:
        priority = secrets.randbelow(2**31 - 1) + 1  # distinct replicas: one is the highest
    kopf.run(registry=registry, settings=settings, standalone=peering is None, peering_name=peering,
             priority=priority if peering else None, clusterwide=clusterwide, namespaces=namespaces,
             liveness_endpoint=liveness)
    return 0
