"""``alpajob operator``: run the kopf operator for AlpaJobs.

    alpajob operator --all-namespaces --liveness http://0.0.0.0:8080/healthz --metrics-port 9090
    alpajob operator --namespace ml --interval 0.5 --resync 600

The flags become one :class:`~alpajob.operator.handlers.OperatorOptions`; the operator
talks to the API server of the pod's service account (in a cluster) or of
``$KUBECONFIG``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from typing import Any

from alpajob.api.data import DEFAULT_DATA_SCHEMES
from alpajob.api.errors import ManifestError


def add_parser(sub: Any) -> None:
    """Register ``alpajob operator`` on the subparsers ``sub``."""
    parser = sub.add_parser("operator", help="run the AlpaJob Kubernetes operator (kopf)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--namespace", "-n", action="append", help="watch this namespace (repeatable)")
    where.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument("--interval", type=float, default=0.5,
                        help="the least seconds between two passes of one job: changes that come "
                             "closer are handled in one pass (default 0.5)")
    parser.add_argument("--resync", type=float, default=600.0,
                        help="pass over every job at least this often in seconds, changed or not "
                             "(a safety net: passes run on changes; default 600)")
    parser.add_argument("--liveness", help="serve kopf's liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--liveness-api-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="the liveness probe fails once the API server has not answered for this long "
                             "(default 60)")
    parser.add_argument("--metrics-port", type=int, help="serve the operator's Prometheus metrics on this port")
    parser.add_argument("--metrics-bind-address", default="0.0.0.0",
                        help="the address the metrics listener binds (default 0.0.0.0: every interface)")
    parser.add_argument("--default-image",
                        help="the trainer image of jobs without spec.image (default: this release's)")
    parser.add_argument("--network-policy", action=argparse.BooleanOptionalAction, default=True,
                        help="make a NetworkPolicy per job: ingress to its pods only from the job, the "
                             "operator and the metrics scraper (default on; needs a network plugin that "
                             "enforces NetworkPolicies)")
    parser.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE") or "alpajob-system",
                        help="the operator's own namespace, whose operator pods the jobs' policies admit "
                             "(default $POD_NAMESPACE, else alpajob-system)")
    parser.add_argument("--metrics-scraper-namespace", metavar="NAMESPACE",
                        help="only pods of this namespace may scrape the jobs' metrics port (default: any)")
    parser.add_argument("--data-schemes", default=",".join(DEFAULT_DATA_SCHEMES), metavar="LIST",
                        help="the URL schemes spec.data may read over, comma-separated; the webhook refuses "
                             "others (default file,s3,gs; add https to allow web URLs)")
    parser.add_argument("--check-creator", action=argparse.BooleanOptionalAction, default=True,
                        help="the webhook refuses a job whose author may not create pods in its namespace "
                             "(a SubjectAccessReview; default on)")
    parser.add_argument("--peering", metavar="NAME",
                        help="run as one of several replicas: kopf's peering object NAME (a KopfPeering in each "
                             "watched namespace, or a ClusterKopfPeering with --all-namespaces) elects the one "
                             "that reconciles (default: standalone, one replica)")
    parser.add_argument("--priority", type=int,
                        help="this replica's peering priority: the highest live one reconciles (default random)")
    parser.add_argument("--no-scanning", action="store_true",
                        help="do not list namespaces and CRDs (least privilege: watch only the "
                             "--namespace names given, discover resources once at start)")
    parser.add_argument("--verbose", "-v", action="store_true", help="log every API call and handler")
    parser.add_argument("--webhook-port", type=int,
                        help="serve the validating admission webhook on this port (HTTPS)")
    parser.add_argument("--webhook-bind-address", default="0.0.0.0",
                        help="the address the webhook listener binds (default 0.0.0.0: every interface)")
    parser.add_argument("--webhook-host",
                        help="how the API server reaches the webhook: NAME.NAMESPACE.svc registers that "
                             "Service (the API server cannot resolve cluster DNS in a URL), any other host a URL")
    parser.add_argument("--webhook-cert", help="TLS certificate file (default: a self-signed one, made at start)")
    parser.add_argument("--webhook-key", help="TLS private key file")
    parser.add_argument("--webhook-managed", action="store_true",
                        help="create and update the ValidatingWebhookConfiguration")
    parser.add_argument("--webhook-insecure", action="store_true",
                        help="plain HTTP (tests only: an API server requires HTTPS)")


def _schemes(text: str) -> tuple[str, ...]:
    """``--data-schemes``: lower-case names such as ``s3`` (no ``://``), at least one."""
    schemes = tuple(s.strip().lower() for s in text.split(",") if s.strip())
    bad = [s for s in schemes if not s.isascii() or not s.replace("-", "").replace("+", "").isalnum()]
    if not schemes or bad:
        raise ManifestError("--data-schemes", f"give scheme names separated by commas, such as file,s3,gs,https; "
                                              f"got {text!r}")
    return schemes


def run(args: argparse.Namespace) -> int:
    """Run until interrupted."""
    from alpajob.operator.handlers import OperatorOptions
    from alpajob.operator.main import run_operator
    from alpajob.operator.network import NetworkSettings

    if args.interval <= 0:
        raise ManifestError("--interval", f"must be positive, got {args.interval}")
    if args.resync < args.interval:
        raise ManifestError("--resync", f"must be at least --interval ({args.interval}), got {args.resync}")
    if args.liveness_api_timeout <= 0:
        raise ManifestError("--liveness-api-timeout", f"must be positive, got {args.liveness_api_timeout}")
    for flag, port in (("--metrics-port", args.metrics_port), ("--webhook-port", args.webhook_port)):
        if port is not None and not 1 <= port <= 65535:
            raise ManifestError(flag, f"must be a port number from 1 to 65535, got {port}")
    for flag, address in (("--metrics-bind-address", args.metrics_bind_address),
                          ("--webhook-bind-address", args.webhook_bind_address)):
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise ManifestError(flag, f"must be an IP address to listen on (0.0.0.0, ::, 127.0.0.1, ...), "
                                      f"got {address!r}") from None
    options = OperatorOptions(
        interval=args.interval, resync=args.resync, scanning=not args.no_scanning, webhook_port=args.webhook_port,
        webhook_host=args.webhook_host, webhook_cert=args.webhook_cert,
        webhook_key=args.webhook_key, webhook_insecure=args.webhook_insecure,
        webhook_managed=args.webhook_managed, webhook_bind_address=args.webhook_bind_address,
        api_loss_seconds=args.liveness_api_timeout, data_schemes=_schemes(args.data_schemes),
        check_creator=args.check_creator)
    return run_operator(options, namespaces=tuple(args.namespace or ()),
                        clusterwide=bool(args.all_namespaces), liveness=args.liveness,
                        metrics_port=args.metrics_port, default_image=args.default_image,
                        verbose=args.verbose, metrics_bind_address=args.metrics_bind_address,
                        peering=args.peering, priority=args.priority,
                        network=NetworkSettings(enabled=args.network_policy,
                                                operator_namespace=args.operator_namespace,
                                                metrics_namespace=args.metrics_scraper_namespace))
