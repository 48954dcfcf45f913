"""The kopf operator: one daemon per AlpaJob runs its reconciliation passes, on events.

:func:`build_registry` registers, on a registry of its own (no global state):

- the **watches** of the jobs' children and of the nodes (:mod:`.world`): kopf
  indexes that keep them in memory, and wake-ups of the job a change concerns;
- a **daemon** per AlpaJob: it sleeps until the job or its world changes, then runs
  one pass: read the job, decide (:func:`~.reconcile.reconcile`) on the world's
  snapshot, apply the decision (:class:`~.kube.Kube`). Changes that come within
  ``interval`` seconds of a pass are coalesced into the next one. A rule that fires
  with time alone (a deadline, a TTL) asks for its pass in the decision, and a slow
  ``resync`` (minutes) is only a safety net. An idle job therefore costs the API
  server nothing but the watches. The passes are level-based, so any pass may be
  interrupted and the next (or a restarted operator's first) carries on. kopf stops
  the daemon when the job is deleted (it asks, and cancels it 3 s later); its children
  go with it (owner references), and under Kueue their pod groups are ended first
  (:meth:`~.kube.Kube.release_groups`), so that Kueue frees their quota;
- the **validating webhook** for AlpaJobs (:func:`~.admission.validate_alpajob`):
  what the CRD's schema and CEL rules cannot judge;
- a **liveness probe** that fails once the API server has not answered for
  ``api_loss_seconds`` (:mod:`.health`);
- **login** through the ``kubernetes`` client's configuration (in-cluster, or
  ``$KUBECONFIG``), and a **startup** hook that sets kopf's settings: progress kept in annotations, no
  kopf-generated events (the operator posts its own on every transition).

The blocking API calls run in a worker thread, never in kopf's event loop;
planning runs in a pod, never in the operator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kopf

from alpajob.api.data import DEFAULT_DATA_SCHEMES
from alpajob.api.names import ANNOTATION_PREFIX, CRD_NAME, FINALIZER, GROUP, PLURAL, VERSION
from alpajob.api.status import Phase
from alpajob.operator import world
from alpajob.operator.health import ApiContact, LostApiServer
from alpajob.operator.kube import Kube
from alpajob.operator.metrics import OperatorMetrics
from alpajob.operator.reconcile import reconcile
from alpajob.operator.world import Wakers, World


@dataclass(frozen=True)
class OperatorOptions:
    """How often a job may be reconciled, and the webhook."""

    interval: float = 0.5  # the least time between two passes of one job (bursts of changes coalesce)
    resync: float = 600.0  # a pass at least this often, changed or not (a safety net)
    scanning: bool = True  # list namespaces and watch CRDs (kopf's scanning)
    webhook_port: int | None = None  # serve the validating webhook here (None: no webhook)
    webhook_host: str | None = None  # the name the API server calls it by (its Service)
    webhook_cert: str | None = None  # TLS certificate and key files (else self-signed)
    webhook_key: str | None = None
    webhook_insecure: bool = False  # plain HTTP: for tests, never for an API server
    webhook_managed: bool = False  # kopf keeps a ValidatingWebhookConfiguration up to date
    webhook_bind_address: str = "0.0.0.0"  # the address the webhook listens on
    api_loss_seconds: float = 60.0  # liveness fails after this long without an answer from the API server
    data_schemes: tuple[str, ...] = DEFAULT_DATA_SCHEMES  # the URL schemes spec.data may read over
    check_creator: bool = True  # the webhook refuses a job whose creator may not create pods there


@dataclass(frozen=True)
class PassResult:
    """What one pass left: the job's phase (None: it is gone), whether the API server
    refused to create a child (the next pass then waits longer), and when a rule
    that fires with time alone wants the next pass (seconds; None: on a change)."""

    phase: Phase | None
    refused: bool = False
    wake_after: float | None = None


def reconcile_once(kube: Kube, metrics: OperatorMetrics, namespace: str, name: str, world: World) -> PassResult:
    """One pass over job ``namespace/name``, whose children and nodes are ``world``."""
    began = time.perf_counter()
    job = kube.job(namespace, name)
    if job is None or job["metadata"].get("deletionTimestamp"):
        # Gone, or going: its children go with it (owner references).
        metrics.phase(f"{namespace}/{name}", None)
        metrics.job_time(namespace, name, None, None)
        return PassResult(None)
    before = (job.get("status") or {}).get("phase")
    decision = reconcile(kube.observe(job, datetime.now(UTC), world))
    refusals = kube.apply(job, decision)
    phase = decision.status.phase
    if phase is Phase.RESTARTING and before != Phase.RESTARTING:
        metrics.restarts.inc()
    if before == Phase.PLANNING and phase not in (Phase.PLANNING, Phase.FAILED):
        started = decision.status.start_time
        if started:
            then = datetime.strptime(started, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
            metrics.planning.observe((datetime.now(UTC) - then).total_seconds())
    metrics.reconcile.observe(time.perf_counter() - began)
    metrics.phase(f"{namespace}/{name}", None if decision.delete_job else phase)
    metrics.job_time(namespace, name, None if decision.delete_job else phase, decision.status.time,
                     decision.status.restarts + decision.status.disruptions)
    return PassResult(None if decision.delete_job else phase, bool(refusals), decision.wake_after)


def next_wait(interval: float, refused_in_a_row: int, limit: float = 300.0) -> float:
    """Seconds until the next pass after refused creations: ``interval``, doubled for
    every pass in a row whose creations the API server refused (up to ``limit``), as
    the Job controller backs off; the first pass after a refusal comes after
    ``2 x interval``. (Nothing the operator watches changes when, say, the missing
    ServiceAccount is created, so these passes are timed.)"""
    return min(interval * 2.0 ** refused_in_a_row, max(limit, interval))


async def sleep_until(woken: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Return when ``woken`` is set, the daemon is stopped, or after ``seconds``."""
    waits = [asyncio.ensure_future(woken.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def build_registry(kube: Kube, metrics: OperatorMetrics, options: OperatorOptions) -> kopf.OperatorRegistry:
    """The operator's handlers (see the module docstring)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        """The pod's service account in a cluster, else ``$KUBECONFIG``."""
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX)
        settings.posting.enabled = False
        settings.watching.server_timeout = 60
        world.select_on_server(settings)
        settings.scanning.disabled = not options.scanning
        if options.webhook_port is not None:
            import tempfile
            from pathlib import Path

            from alpajob.operator.webhook import webhook_server

            settings.admission.server = webhook_server(
                options.webhook_port, options.webhook_host, options.webhook_cert, options.webhook_key,
                options.webhook_insecure, Path(tempfile.mkdtemp(prefix="alpajob-webhook-")),
                options.webhook_bind_address)
            if options.webhook_managed:
                settings.admission.managed = CRD_NAME

    contact = ApiContact(lambda: kube.core.get_api_resources(_request_timeout=5.0),
                         threshold=options.api_loss_seconds)

    @kopf.on.startup(registry=registry, id="api-contact")
    def watch_api_server(**_: Any) -> None:
        contact.start()

    @kopf.on.cleanup(registry=registry, id="api-contact")
    def stop_watching_api_server(**_: Any) -> None:
        contact.stop()

    @kopf.on.probe(registry=registry, id="api-server", errors=kopf.ErrorsMode.PERMANENT)
    async def api_server(**_: Any) -> dict[str, float]:
        """Liveness: the API server answered within ``api_loss_seconds`` (:mod:`.health`);
        reads what the contact's thread last saw, on the event loop, so it answers at
        once (no worker thread to wait for)."""
        try:
            return contact.state()
        except LostApiServer as error:
            raise kopf.PermanentError(str(error)) from None

    wakers = Wakers()
    world.register(registry, wakers)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="job-changed")
    def job_changed(**kwargs: Any) -> None:
        """The job itself changed (its spec, or the status a pass wrote): pass again."""
        wakers.wake(kwargs["namespace"], kwargs["name"])

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_backoff=3.0, cancellation_timeout=5.0)
    async def run_job(**kwargs: Any) -> None:
        namespace, name = kwargs["namespace"], kwargs["name"]
        stopped: kopf.DaemonStopped = kwargs["stopped"]
        logger: logging.Logger = kwargs["logger"]
        woken = wakers.of(namespace, name)
        refused = 0  # passes in a row whose creations were refused
        gone: set[str] = set()  # uids an audit found deleted while the watches had a gap
        audited = contact.gaps
        ended = False  # the job is gone or going (its pods go with it)
        try:
            while not stopped:
                woken.clear()  # a change from now on asks for another pass
                snapshot = World.of(kwargs, namespace, name, gone)
                if contact.gaps != audited:  # the API server is back: what did the watches miss?
                    try:
                        found = await asyncio.to_thread(kube.vanished, namespace, name, snapshot)
                    except Exception as error:  # noqa: BLE001 (the server may still be flaky: next pass)
                        logger.warning(f"audit of {namespace}/{name} after a gap in the watches failed: {error}")
                    else:
                        audited = contact.gaps
                        if found:
                            logger.info(f"{len(found)} children of {namespace}/{name} were deleted while the "
                                        "watches had a gap")
                            gone |= found
                            snapshot = World.of(kwargs, namespace, name, gone)
                wait = options.resync
                try:
                    result = await asyncio.to_thread(reconcile_once, kube, metrics, namespace, name, snapshot)
                except Exception as error:  # noqa: BLE001 (one bad pass must not end the loop)
                    metrics.errors.inc()
                    logger.warning(f"reconcile of {namespace}/{name} failed: {error}")
                    wait = next_wait(options.interval, 1)  # the API server may be back in a moment
                else:
                    if result.phase is None:  # the job is gone, or going
                        ended = True
                        return
                    refused = refused + 1 if result.refused else 0
                    if refused:  # back off: wait it out, whatever changes
                        await stopped.wait(next_wait(options.interval, refused))
                        continue
                    if result.wake_after is not None:
                        wait = min(wait, result.wake_after)
                await sleep_until(woken, stopped, wait)
                await stopped.wait(options.interval)  # coalesce a burst of changes into one pass
        finally:
            wakers.forget(namespace, name)
            reason = stopped.reason
            if ended or (reason is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in reason):
                # The job is going, and its pods with it: end their Kueue groups, or
                # Kueue would hold their quota (and their finalizers) for good.
                try:
                    released = await asyncio.to_thread(kube.release_groups, namespace, World.of(kwargs, namespace, name))
                except Exception as error:  # noqa: BLE001 (the job is gone either way; say so)
                    logger.warning(f"could not end the Kueue groups of deleted job {namespace}/{name}: {error}")
                else:
                    if released:
                        logger.info(f"ended the Kueue groups of {released} pods of deleted job {namespace}/{name}")

    if options.webhook_port is not None:
        from alpajob.operator.admission import validate_alpajob  # noqa: I001 (beside its only use)

        @kopf.on.validate(GROUP, VERSION, PLURAL, registry=registry, id="validate-alpajob",
                          operations=["CREATE", "UPDATE"])
        def validate(**kwargs: Any) -> None:
            """Refuse what the CRD's schema and CEL cannot judge; on an update, also a
            change of an immutable field. A job that is new or changes its spec is also
            refused when its author may not create pods in its namespace: creating an
            AlpaJob is creating pods (as a Deployment is), with the job's ServiceAccount."""
            body, old, operation = kwargs["body"], kwargs.get("old"), kwargs.get("operation")
            if operation not in ("CREATE", "UPDATE"):
                return
            problems = validate_alpajob(dict(body), old=dict(old) if operation == "UPDATE" and old else None,
                                        data_schemes=options.data_schemes)
            if problems:
                raise kopf.AdmissionError("; ".join(problems), code=422)
            changed = operation == "CREATE" or (old is not None and dict(old).get("spec") != dict(body).get("spec"))
            user = kwargs.get("userinfo") or {}
            namespace = kwargs.get("namespace") or (body.get("metadata") or {}).get("namespace")
            if options.check_creator and changed and namespace:
                try:
                    allowed = kube.may_create_pods(user, namespace)
                except Exception as error:  # noqa: BLE001 (the API server's own trouble: refuse, and say it)
                    raise kopf.AdmissionError(f"could not ask the API server whether {user.get('username')} may "
                                              f"create pods in {namespace} ({error}); try again", code=503) from None
                if not allowed:
                    raise kopf.AdmissionError(
                        f"{user.get('username')} may not create pods in namespace {namespace}, and an AlpaJob "
                        f"creates pods there (as spec.serviceAccountName); ask for the create verb on pods in "
                        f"{namespace}", code=403)

    return registry
