"""Run the kopf operator for AlpaJobs (``alpajob operator``'s body).

It talks to the API server of the pod's service account (in a cluster) or of
``$KUBECONFIG``. One replica runs at a time (the Deployment's strategy is Recreate;
kopf runs standalone, without peering). Every pass is idempotent, so the operator may
be restarted at any moment.
"""

from __future__ import annotations

import logging

import kopf

from alpajob.operator.handlers import OperatorOptions, build_registry
from alpajob.operator.kube import Kube, client_from_environment
from alpajob.operator.metrics import OperatorMetrics
from alpajob.operator.network import NetworkSettings


def run_operator(options: OperatorOptions, *, namespaces: tuple[str, ...] = (), clusterwide: bool = False,
                 liveness: str | None = None, metrics_port: int | None = None,
                 default_image: str | None = None, verbose: bool = False,
                 metrics_bind_address: str = "0.0.0.0", network: NetworkSettings | None = None) -> int:
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
    kopf.run(registry=registry, standalone=True, clusterwide=clusterwide, namespaces=namespaces,
             liveness_endpoint=liveness)
    return 0
