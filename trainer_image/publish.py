"""Publish a job's results into the Kubernetes API from inside its pods.

The planning pod writes the Plan into the job's ``<job>-plan`` ConfigMap (created
empty, and owned, by the operator) with :func:`write_plan_configmap`; the driver
keeps its :class:`~alpajob.api.progress.Progress` in ``<job>-progress`` with
:func:`write_progress_configmap`, and the operator copies it into the job's status.
The pods' service account needs ``get`` and ``patch`` on ConfigMaps in their
namespace. The client configures itself from the pod's service account, or else from
``$KUBECONFIG`` / ``~/.kube/config`` (a developer's machine, or a test's emulator).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alpajob.api.errors import AlpaJobError, TransientError
from alpajob.api.names import PLAN_KEY, PROGRESS_KEY
from alpajob.api.progress import Progress

#: What a ConfigMap may hold (the API server refuses more).
CONFIGMAP_LIMIT = 1024 * 1024
#: What a kubelet keeps of a container's termination message (it cuts the rest).
TERMINATION_LIMIT = 4096


def write_termination_message(text: str) -> None:
    """Write ``text`` as this container's termination message, where its pod names the
    file (``ALPAJOB_TERMINATION_LOG``, :data:`~alpajob.api.runtime.TERMINATION_LOG`);
    outside a pod, nothing. The kubelet reports the file as the container's
    ``state.terminated.message`` once the container ends, and keeps reporting it until
    the API server takes it: a message outlives an API server that is away when the
    container ends."""
    from alpajob.api.runtime import TrainerRuntime

    path = os.environ.get(TrainerRuntime.env_name("termination_log"))
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(text.strip()[:TERMINATION_LIMIT - 96] + "\n")


def final_report_message(report: Progress) -> str:
    """``report`` as a termination message: its JSON, shortened to fit the kubelet's
    limit (the free-text message first, then the data line, never a number), so that
    it stays parseable."""
    text = report.to_json()
    for field in ("message", "data"):
        if len(text.encode()) <= TERMINATION_LIMIT - 96:
            break
        report = report.model_copy(update={field: None})
        text = report.to_json()
    return text


def kube_client() -> Any:
    """A configured ``kubernetes.client.ApiClient``."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def parse_target(target: str, flag: str) -> tuple[str, str]:
    """``namespace/name`` -> (namespace, name), or an error naming ``flag``."""
    namespace, _, name = target.partition("/")
    if not namespace or not name or "/" in name:
        raise AlpaJobError(f"{flag}: expected NAMESPACE/NAME, got {target!r}")
    return namespace, name


#: The flag each target comes from (or the runtime contract's variable, in a job's pods).
_PLAN_TARGET = "--output-configmap ($ALPAJOB_PLAN_CONFIGMAP)"
_PROGRESS_TARGET = "--status-configmap ($ALPAJOB_PROGRESS_CONFIGMAP)"


def refusal(error: BaseException) -> int | None:
    """The HTTP status of an API refusal that retrying cannot fix (a 4xx but 408 and
    429: RBAC, a missing object, an invalid body), else None: the server is away or
    overloaded (connection refused or reset, a timeout, a 5xx, 429), so try again."""
    status = getattr(error, "status", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return status
    return None


def write_plan_configmap(plan_json: str, target: str, api: Any = None, patience: float = 600.0,
                         say: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep) -> None:
    """Put ``plan_json`` into the ConfigMap ``target`` (``namespace/name``) under
    :data:`~alpajob.api.names.PLAN_KEY`. An API server that is away (a control-plane
    restart) is waited for, with a doubling pause up to 30 s, for at most ``patience``
    seconds: the plan took minutes to make and a restart of the planning pod would
    make it again. A refusal (:func:`refusal`) fails at once."""
    from kubernetes import client

    namespace, name = parse_target(target, _PLAN_TARGET)
    if len(plan_json.encode()) > CONFIGMAP_LIMIT:
        raise AlpaJobError(
            f"{_PLAN_TARGET}: the plan is {len(plan_json.encode()):,} bytes, more than a "
            f"ConfigMap holds ({CONFIGMAP_LIMIT:,}); write it to a file with --output instead"
        )
    core = client.CoreV1Api(api or kube_client())
    began, pause, said = time.monotonic(), 1.0, False
    while True:
        try:
            core.patch_namespaced_config_map(name, namespace, {"data": {PLAN_KEY: plan_json}}, _request_timeout=10.0)
            return
        except Exception as error:  # noqa: BLE001 - sorted by refusal(): what retrying cannot fix fails
            status = refusal(error)
            if status is not None:
                raise AlpaJobError(
                    f"{_PLAN_TARGET}: cannot write ConfigMap {namespace}/{name} "
                    f"({status} {getattr(error, 'reason', '')}); it must exist and this pod's service account "
                    "needs get and patch on it"
                ) from None
            waited = time.monotonic() - began
            if waited + pause > patience:
                raise TransientError(
                    f"{_PLAN_TARGET}: the API server did not take the plan for {waited:.0f} s "
                    f"({_first_line(error)})"
                ) from None
            if not said:
                say(f"warning: the API server is unreachable ({_first_line(error)}); the plan is written "
                    "once it is back")
                said = True
            sleep(pause)
            pause = min(pause * 2, 30.0)


def write_progress_configmap(report: Progress, target: str, api: Any = None) -> None:
    """Put the trainer's ``report`` into the ConfigMap ``target`` under
    :data:`~alpajob.api.names.PROGRESS_KEY` (the operator copies it into the job's
    ``status.progress``)."""
    from kubernetes import client

    namespace, name = parse_target(target, _PROGRESS_TARGET)
    core = client.CoreV1Api(api or kube_client())
    try:
        core.patch_namespaced_config_map(name, namespace, {"data": {PROGRESS_KEY: report.to_json()}})
    except client.ApiException as error:
        raise AlpaJobError(
            f"{_PROGRESS_TARGET}: cannot write ConfigMap {namespace}/{name} ({error.status} {error.reason})"
        ) from None


class ProgressPublisher:
    """Writes the driver's progress to its ConfigMap from a thread of its own, so that
    training never waits for, nor fails with, the API server.

    :meth:`publish` only replaces the latest report (reports coalesce: the newest wins)
    and returns at once. The thread writes it with a bounded request timeout; while the
    API server is unreachable (a control-plane restart or upgrade: connection refused,
    reset, timed out; a 5xx or 429) it retries the newest report with a growing pause
    (``backoff`` doubling up to ``longest`` seconds), says once that the server is
    away and once that it is back. A refusal that retrying cannot fix (403 for missing
    RBAC, 404 for a missing ConfigMap) is said once per kind and not retried until a
    newer report comes. :meth:`close` waits up to ``flush`` seconds for the last report.
    """

    def __init__(self, target: str, say: Callable[[str], None], api: Any = None, timeout: float = 5.0,
                 backoff: float = 1.0, longest: float = 30.0,
                 write: Callable[[Progress], None] | None = None) -> None:
        parse_target(target, _PROGRESS_TARGET)  # a malformed target fails now, not in the thread
        self.target, self.say, self.timeout = target, say, timeout
        self.backoff, self.longest = backoff, longest
        self._api = api
        self._write = write or self._patch
        self._latest: Progress | None = None
        self._written: Progress | None = None
        self._wake = threading.Condition()
        self._closing = False
        self.away_since: float | None = None  # monotonic time of the first failed write of an outage
        self.failures = 0  # writes that failed, in all
        self._thread = threading.Thread(target=self._run, name="progress-publisher", daemon=True)
        self._thread.start()

    def publish(self, report: Progress) -> None:
        with self._wake:
            self._latest = report
            self._wake.notify()

    def close(self, flush: float = 10.0) -> bool:
        """Stop after writing the newest report, waiting at most ``flush`` seconds; True
        when it was written."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(flush)
        written = self._written is not None and self._written is self._latest
        if not written and self._latest is not None:
            self.say(f"warning: the last progress report was not written to ConfigMap {self.target} "
                     f"within {flush:.0f} s (the API server is unreachable); the job's pods say how it ended")
        return written

    def _patch(self, report: Progress) -> None:
        from kubernetes import client

        namespace, name = parse_target(self.target, _PROGRESS_TARGET)
        if self._api is None:
            self._api = kube_client()
        client.CoreV1Api(self._api).patch_namespaced_config_map(
            name, namespace, {"data": {PROGRESS_KEY: report.to_json()}}, _request_timeout=self.timeout)

    def _run(self) -> None:
        pause = self.backoff
        said: set[int] = set()
        while True:
            with self._wake:
                while self._latest is self._written and not self._closing:
                    self._wake.wait()
                if self._latest is self._written:
                    return  # closing, nothing new
                report = self._latest
            assert report is not None
            try:
                self._write(report)
            except Exception as error:  # noqa: BLE001 - whatever the API server did, training goes on
                self.failures += 1
                status = refusal(error)
                if status is not None:
                    if status not in said:
                        said.add(status)
                        self.say(f"warning: cannot write progress to ConfigMap {self.target} ({status} "
                                 f"{getattr(error, 'reason', '')}); training goes on")
                    with self._wake:
                        self._written = report  # not retried: a newer report tries again
                    continue
                if self.away_since is None:
                    self.away_since = time.monotonic()
                    self.say(f"warning: the API server is unreachable ({_first_line(error)}); training goes "
                             f"on and progress is written once it is back")
                with self._wake:
                    if self._closing and self._latest is report:
                        self._wake.wait(min(pause, 1.0))
                    else:
                        self._wake.wait(pause)
                pause = min(pause * 2, self.longest)
                continue
            pause = self.backoff
            if self.away_since is not None:
                self.say(f"the API server is back after {time.monotonic() - self.away_since:.0f} s; "
                         "progress written")
                self.away_since = None
            with self._wake:
                self._written = report


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
