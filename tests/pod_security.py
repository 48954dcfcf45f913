"""Pod Security Standards, as the API server's admission plugin applies them, for tests.

A namespace labelled ``pod-security.kubernetes.io/enforce=restricted`` refuses a pod
with 403 and one message listing every rule it breaks (see
``shared/apiserver-observed/pod-create-podsecurity-restricted.response.json``). KMock
has no admission plugins, so the tests that build pods check them here. The rules
are the "baseline" and "restricted" levels of
https://kubernetes.io/docs/concepts/security/pod-security-standards/ that a pod
spec can break (the Windows and AppArmor rules do not apply to these pods).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"

#: Volume types "restricted" allows.
ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                   "projected", "secret"}
#: Capabilities "restricted" lets a container add back after dropping ALL.
ADDABLE = {"NET_BIND_SERVICE"}


def _containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(field) or []


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Every rule of the "restricted" level that ``pod`` breaks, one line each (empty:
    the pod is admitted)."""
    spec = pod.get("spec") or {}
    pod_security = spec.get("securityContext") or {}
    problems: list[str] = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            problems.append(f"host namespaces ({field}=true)")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            problems.append(f"restricted volume types (volume {volume['name']!r} uses {', '.join(sorted(kinds))})")
    pod_non_root = pod_security.get("runAsNonRoot")
    pod_seccomp = (pod_security.get("seccompProfile") or {}).get("type")
    if pod_security.get("runAsUser") == 0:
        problems.append("runAsUser=0 (pod must not run as root)")
    for container in _containers(spec):
        name = container.get("name", "?")
        security = container.get("securityContext") or {}
        if security.get("privileged"):
            problems.append(f"privileged (container {name!r} must not set securityContext.privileged=true)")
        if security.get("allowPrivilegeEscalation") is not False:
            problems.append(f"allowPrivilegeEscalation != false (container {name!r} must set "
                            "securityContext.allowPrivilegeEscalation=false)")
        capabilities = security.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"unrestricted capabilities (container {name!r} must set "
                            'securityContext.capabilities.drop=["ALL"])')
        added = set(capabilities.get("add") or []) - ADDABLE
        if added:
            problems.append(f"unrestricted capabilities (container {name!r} adds {', '.join(sorted(added))})")
        non_root = security.get("runAsNonRoot", pod_non_root)
        if non_root is not True:
            problems.append(f"runAsNonRoot != true (pod or container {name!r} must set "
                            "securityContext.runAsNonRoot=true)")
        if security.get("runAsUser") == 0:
            problems.append(f"runAsUser=0 (container {name!r} must not run as root)")
        seccomp = (security.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"seccompProfile (pod or container {name!r} must set "
                            'securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")')
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"hostPort (container {name!r} uses hostPort {port['hostPort']})")
    return problems
