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

from typing import Any

from alpajob.api.errors import AlpaJobError
from alpajob.api.names import PLAN_KEY, PROGRESS_KEY
from alpajob.api.progress import Progress

#: What a ConfigMap may hold (the API server refuses more).
CONFIGMAP_LIMIT = 1024 * 1024


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


def write_plan_configmap(plan_json: str, target: str, api: Any = None) -> None:
    """Put ``plan_json`` into the ConfigMap ``target`` (``namespace/name``) under
    :data:`~alpajob.api.names.PLAN_KEY`."""
    from kubernetes import client

    namespace, name = parse_target(target, _PLAN_TARGET)
    if len(plan_json.encode()) > CONFIGMAP_LIMIT:
        raise AlpaJobError(
            f"{_PLAN_TARGET}: the plan is {len(plan_json.encode()):,} bytes, more than a "
            f"ConfigMap holds ({CONFIGMAP_LIMIT:,}); write it to a file with --output instead"
        )
    core = client.CoreV1Api(api or kube_client())
    try:
        core.patch_namespaced_config_map(name, namespace, {"data": {PLAN_KEY: plan_json}})
    except client.ApiException as error:
        raise AlpaJobError(
            f"{_PLAN_TARGET}: cannot write ConfigMap {namespace}/{name} "
            f"({error.status} {error.reason}); it must exist and this pod's service account "
            "needs get and patch on configmaps"
        ) from None


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
