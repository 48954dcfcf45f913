"""A kubelet for tests: runs the pods of a Kubernetes API as local processes.

It plays the node agent for the pods the operator creates, against whatever API its
client talks to (the tests' KMock emulator, or a real cluster's fake nodes), so that
an AlpaJob really trains from the pods' own commands and environment:

- it lists the namespace's pods every ``interval`` seconds; a new pod (not yet
  started, not being deleted) gets a folder of its own, where each ConfigMap volume
  is written as files and each PersistentVolumeClaim volume is a folder shared by
  every pod that mounts the claim (the job's checkpoint volume);
- its init containers run first, one after another (a pod stays Pending with its
  init containers running, as ``kubectl get pods`` shows ``Init:0/1``), then its
  container's ``command`` and ``args`` run as a process with the pod's ``env``,
  where every mount path is replaced by the local folder behind it and every cluster
  DNS name (``*.svc``) by 127.0.0.1: every pod of the test shares the loopback
  address, as pods of one node would share the node's (so two pods cannot bind one
  port: one job at a time); ``alpajob`` runs as ``python -m alpajob``;
- the pod's API credentials are its ServiceAccount's, as a kubelet mounts them: a
  kubeconfig of the test's API with a token issued for that account (none at all with
  ``automountServiceAccountToken: false``), so RBAC judges each pod as itself;
- it reports the pod Running (with ``podIP`` 127.0.0.1), then Succeeded or Failed
  with the exit code and, as ``terminationMessagePolicy: FallbackToLogsOnError``
  asks, the log's tail as the termination message;
- with ``stagger``, pods start one every ``stagger`` seconds (on 2 cores, Ray's
  raylets started together time out; on a cluster they start on separate nodes);
- a pod marked for deletion gets SIGTERM (its main process, as a container runtime
  sends PID 1), SIGKILL for everything once its grace period is over, and is reported
  and confirmed (a DELETE with grace period 0) once its process is gone, plus
  ``linger`` seconds (a slow node); other pods start meanwhile. A pod gone from the
  API (forced) is killed at once, and :meth:`Kubelet.kill` kills one pod's processes
  as a lost node would;
- a pod with scheduling gates waits (no scheduler places it: Kueue's gate holds it
  until Kueue admits it);
- on a real cluster (``nodes``: the fake nodes the test registered) it runs only the
  pods the scheduler bound to those nodes, and keeps the nodes alive as a kubelet
  does: every 10 s it renews each node's Lease in ``kube-node-lease`` and reports
  the node Ready (the node lifecycle controller marks a node whose Lease stops
  being renewed NotReady after 40 s, and evicts its pods).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

#: Runs a pod's init containers in order (any failure ends the pod with its code), marks
#: them done, then becomes the main container.
_CHAIN = """
import json, os, subprocess, sys
steps, marker = json.loads(sys.argv[1]), sys.argv[2]
for command in steps[:-1]:
    code = subprocess.call(command)
    if code:
        sys.exit(code)
open(marker, "w").close()
os.execvp(steps[-1][0], steps[-1])
"""

_SERVICE_HOST = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?\.svc(\.cluster\.local)?")


def _own(folder: Path, group: int) -> None:
    """What the kubelet does to a volume for a pod's fsGroup: the group owns every file,
    may write, and new files inherit it (setgid directories)."""
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, -1, group)
        mode = path.stat().st_mode
        path.chmod(mode | 0o060 | (0o2010 if path.is_dir() else 0))


@dataclass
class RunningPod:
    """One pod's process and where it lives."""

    name: str
    folder: Path
    process: subprocess.Popen
    log: Path
    uid: str = ""
    tracked: set[int] = field(default_factory=set)  # every process seen below it
    initialized: Path | None = None  # a file that appears once the init containers are done
    stopping: float | None = None  # when its deletion was seen (monotonic seconds)
    kill_at: float = 0.0  # when its grace period ends
    container: str = "main"
    boxed: Any = None  # its container (containers.Container), in container mode


class Kubelet:
    """Runs the pods of ``namespace`` (module docstring) until :meth:`stop`."""

    def __init__(self, api: client.ApiClient, namespace: str, root: Path, env: dict[str, str] | None = None,
                 interval: float = 0.3, stagger: float = 0.0, nodes: frozenset[str] | None = None,
                 linger: float = 0.0, runtime: Any = None, fs_group: bool = True) -> None:
        self.core = client.CoreV1Api(api)
        self.leases = client.CoordinationV1Api(api)
        self.nodes = nodes  # None: run every pod (an API without a scheduler)
        self.linger = linger  # seconds a deleted pod stays after its process ended
        #: containers.Runtime: run each pod as a container of the trainer image (None:
        #: as a local process); fs_group False: volumes keep their owner (root), as
        #: hostPath and NFS volumes do, whatever the pod's fsGroup
        self.runtime, self.fs_group = runtime, fs_group
        self.extra_env = dict(env or {})  # what the test adds to every pod's env (KUBECONFIG)
        self._beat = 0.0
        self.namespace, self.root, self.interval, self.stagger = namespace, root, interval, stagger
        self._last_start = 0.0
        self.env = {**os.environ, **(env or {})}
        self.pods: dict[str, RunningPod] = {}
        self.finished: dict[str, int] = {}  # pod name -> exit code (of the last pod of that name)
        self.ended: set[str] = set()  # uids of the pods that ran: a pod runs once, a new one of its name anew
        self.started: list[str] = []  # pod names, in the order they started
        self.signalled: dict[str, float] = {}  # pod name -> when (time.monotonic()) its deletion's SIGTERM went
        self.envs: dict[str, dict[str, str]] = {}  # pod name -> its env as the pod spec gave it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self.errors: list[str] = []

    # ------------------------------------------------------------ lifecycle
    def start(self) -> Kubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for name in list(self.pods):
            self._kill(name)

    def kill(self, name: str) -> None:
        """SIGKILL pod ``name``'s processes (a lost node); the pod is then reported
        Failed like any other exit."""
        pod = self.pods.get(name)
        if pod is not None:
            self._end(pod, signal.SIGKILL)

    # ------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as error:  # noqa: BLE001 - a test's kubelet keeps going, and tells
                self.errors.append(f"{type(error).__name__}: {error}")
            self._stop.wait(self.interval)

    def _sync(self) -> None:
        if self.nodes is not None and time.monotonic() - self._beat >= 10.0:
            self._heartbeat()
        seen = {p.metadata.name: p for p in self.core.list_namespaced_pod(self.namespace).items
                if self.nodes is None or p.spec.node_name in self.nodes}
        for name in list(self.pods):
            pod = seen.get(name)
            if pod is None:  # gone from the API (forced): its processes go at once
                self._kill(name)
            elif pod.metadata.deletion_timestamp:
                self._terminate(self.pods[name], pod)
        for name, pod in seen.items():
            if name in self.pods or pod.metadata.uid in self.ended or pod.metadata.deletion_timestamp:
                continue
            if (pod.status and pod.status.phase) in ("Succeeded", "Failed"):
                continue
            if pod.spec.scheduling_gates:
                continue  # no scheduler places a gated pod (Kueue's, until it admits it)
            if time.monotonic() - self._last_start < self.stagger:
                break  # one pod per ``stagger`` seconds: the rest start on later passes
            self._start(pod)
            self._last_start = time.monotonic()
        from alpajob.trainer_image.distributed.loopback import descendants

        for running in list(self.pods.values()):
            running.tracked |= descendants([running.process.pid])
            if running.initialized is not None and running.initialized.exists():
                running.initialized = None
                self._running(running.name, running.container)
            code = running.process.poll()
            if code is not None and running.name in self.pods:
                if running.stopping is not None and time.monotonic() < running.stopping + self.linger:
                    continue  # stopped, but the pod lingers (volumes unmounting, a slow node)
                self._end(running)  # what it left behind goes with the container
                self._report_exit(running, code)
                if running.stopping is not None:  # the kubelet confirms the deletion once it is gone
                    with contextlib.suppress(client.ApiException):
                        self.core.delete_namespaced_pod(running.name, self.namespace, grace_period_seconds=0)

    def _terminate(self, running: RunningPod, pod: Any) -> None:
        """A pod marked for deletion: SIGTERM to its main process once (what a container
        runtime sends PID 1), SIGKILL to everything once its grace period is over; the
        loop reports and confirms it when the process is gone. Other pods keep starting
        meanwhile, as on a real node."""
        now = time.monotonic()
        if running.stopping is None:
            running.stopping = now
            grace = pod.metadata.deletion_grace_period_seconds
            running.kill_at = now + (30 if grace is None else grace)
            self.signalled[running.name] = now
            with contextlib.suppress(ProcessLookupError):
                os.kill(running.process.pid, signal.SIGTERM)
        elif now >= running.kill_at and running.process.poll() is None:
            self._end(running, signal.SIGKILL)

    def _heartbeat(self) -> None:
        """Renew every node's Lease and report it Ready, as a kubelet does: the Lease is
        read and updated at the version read (an update must name it; 409 means another
        writer came first, and the next beat reads again), or created if missing."""
        from datetime import UTC, datetime

        now = datetime.now(UTC)
        for node in sorted(self.nodes or ()):
            lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                     "metadata": {"name": node, "namespace": "kube-node-lease"},
                     "spec": {"holderIdentity": node, "leaseDurationSeconds": 40,
                              "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
            try:
                current = self.leases.read_namespaced_lease(node, "kube-node-lease")
            except client.ApiException as error:
                if error.status != 404:
                    raise
                self.leases.create_namespaced_lease("kube-node-lease", lease)
            else:
                lease["metadata"]["resourceVersion"] = current.metadata.resource_version
                try:
                    self.leases.replace_namespaced_lease(node, "kube-node-lease", lease)
                except client.ApiException as error:
                    if error.status != 409:
                        raise
            stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
            self.core.patch_node_status(node, {"status": {"conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test kubelet",
                 "lastHeartbeatTime": stamp}]}})
        self._beat = time.monotonic()

    # ------------------------------------------------------------ one pod
    def _start(self, pod: Any) -> None:
        name = pod.metadata.name
        folder = self.root / "pods" / name
        folder.mkdir(parents=True, exist_ok=True)
        mounts = self._volumes(pod, folder)
        [container] = pod.spec.containers
        message = folder / "termination-log"  # the container's terminationMessagePath, as a kubelet makes it
        message.write_text("")
        message.chmod(0o666)
        if container.termination_message_path:
            mounts.append((container.termination_message_path, message))
        self.envs[name] = {e.name: e.value or "" for e in container.env or []}
        env = {k: self._local(v, mounts) for k, v in self.envs[name].items()}
        kubeconfig = self._credentials(pod, folder)
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        steps = [self._command(c) for c in [*(pod.spec.init_containers or []), container]]
        initialized = folder / "status" / "initialized" if len(steps) > 1 else None
        if initialized is not None:
            initialized.parent.mkdir(parents=True, exist_ok=True)
        log = folder / "log.txt"
        boxed = None
        if self.runtime is not None:
            boxed = self._boxed(pod, folder, steps, initialized, kubeconfig)
            process = self.runtime.start(boxed, log)
        else:
            steps = [self._as_process(c) for c in steps]
            command = steps[0] if initialized is None else [sys.executable, "-c", _CHAIN, json.dumps(steps),
                                                            str(initialized)]
            with open(log, "ab") as out:
                process = subprocess.Popen(command, env={**self.env, **env}, stdout=out, stderr=subprocess.STDOUT,
                                           cwd=folder, start_new_session=True)
        self.pods[name] = RunningPod(name, folder, process, log, pod.metadata.uid, initialized=initialized,
                                     container=container.name, boxed=boxed)
        self.started.append(name)
        if initialized is None:
            self._running(name, container.name)
        else:
            self._status(name, {"phase": "Pending", "initContainerStatuses": [
                self._container(c.name, {"running": {}}) for c in pod.spec.init_containers[:1]]})

    def _running(self, name: str, container: str) -> None:
        self._status(name, {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
                            "containerStatuses": [self._container(container, {"running": {}})]})

    @staticmethod
    def _command(container: Any) -> list[str]:
        return list(container.command or []) + list(container.args or [])

    @staticmethod
    def _as_process(command: list[str]) -> list[str]:
        """A pod's command as a process of this machine: ``alpajob`` as this Python's
        module, without the image's init (tini) in front: a local process is not PID 1."""
        from alpajob.api.runtime import INIT_COMMAND

        if tuple(command[:len(INIT_COMMAND)]) == INIT_COMMAND:
            command = command[len(INIT_COMMAND):]
        return [sys.executable, "-m", "alpajob", *command[1:]] if command[:1] == ["alpajob"] else command

    def _credentials(self, pod: Any, folder: Path) -> Path | None:
        """The pod's API credentials, as a kubelet mounts its ServiceAccount's token: a
        kubeconfig of the test's API (``KUBECONFIG`` of ``env``) whose user is a token
        issued for the pod's ServiceAccount (the TokenRequest API), so that the API
        server's RBAC judges the pod as itself. A pod with
        ``automountServiceAccountToken: false`` (or, when the pod does not say, its
        ServiceAccount with it) gets a path with nothing there (no credentials at all). None: the test gave no API to the pods."""
        from e2e_cluster import account_token, token_kubeconfig

        base = self.extra_env.get("KUBECONFIG")
        if not base:
            return None
        account = pod.spec.service_account_name or "default"
        mount = pod.spec.automount_service_account_token
        if mount is None:  # the pod does not say: its ServiceAccount does (default true)
            try:
                stored = self.core.read_namespaced_service_account(account, self.namespace)
                mount = stored.automount_service_account_token is not False
            except client.ApiException as error:  # `default`, which the emulator does not store
                if error.status != 404:
                    raise
                mount = True
        if not mount:
            return folder / "no-service-account-token"
        token = account_token(self.core.api_client, self.namespace, account)
        path = token_kubeconfig(Path(base), token, folder / "kubeconfig")
        path.chmod(0o644)  # readable by the container's user
        return path

    def _boxed(self, pod: Any, folder: Path, steps: list[list[str]], initialized: Path | None,
               kubeconfig: Path | None = None) -> Any:
        """The pod as a container of the runtime's image (``containers.Container``): its
        volumes at their mount paths (group-owned by its fsGroup, as the kubelet makes a
        volume that supports ownership, unless ``fs_group`` is off), its user and groups,
        its /dev/shm and memory limit, its env with cluster names on loopback, and the
        init containers run first inside it."""
        from containers import Container
        from kubernetes.utils import parse_quantity

        [container] = pod.spec.containers
        security = pod.spec.security_context
        fs_group = security.fs_group if security is not None else None
        uid = (container.security_context and container.security_context.run_as_user) or \
            (security and security.run_as_user) or 1000
        gid = (security and security.run_as_group) or 1000
        sources = {v.name: v for v in pod.spec.volumes or []}
        mounts: list[tuple[str, Path, bool]] = []
        shm = 64 << 20
        for mount in container.volume_mounts or []:
            volume = sources[mount.name]
            if volume.empty_dir is not None and volume.empty_dir.medium == "Memory" and mount.mount_path == "/dev/shm":
                shm = int(parse_quantity(volume.empty_dir.size_limit or "64Mi"))
                continue
            where = self._where(pod, folder, volume)
            if fs_group is not None and (volume.persistent_volume_claim is not None or volume.empty_dir is not None) \
                    and (self.fs_group or volume.empty_dir is not None):
                _own(where, fs_group)
            if fs_group is not None and volume.secret is not None:  # group-readable, as a kubelet makes it
                for path in where.iterdir():
                    os.chown(path, -1, fs_group)
                    path.chmod(path.stat().st_mode | 0o040)
            mounts.append((mount.mount_path, where, bool(mount.read_only)))
        if container.termination_message_path:
            mounts.append((container.termination_message_path, folder / "termination-log", False))
        for inside, outside, _ in mounts:  # a mount inside a read-only one needs its folder there first
            for other, _, _ in mounts:
                if other.startswith(inside.rstrip("/") + "/") and outside.is_dir():
                    (outside / other[len(inside.rstrip("/")) + 1:]).mkdir(parents=True, exist_ok=True)
        env = {k: _SERVICE_HOST.sub("127.0.0.1", v) for k, v in self.envs[pod.metadata.name].items()}
        env.update(self.extra_env)
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
            if kubeconfig.exists():
                mounts.append((str(kubeconfig), kubeconfig, True))
        command = steps[0]
        if initialized is not None:
            status = initialized.parent
            status.mkdir(parents=True, exist_ok=True)
            status.chmod(0o777)
            mounts.append(("/run/kubelet-status", status, False))
            command = ["python", "-c", _CHAIN, json.dumps(steps), "/run/kubelet-status/initialized"]
        limit = (container.resources and container.resources.limits or {}).get("memory")
        return Container(name=f"{pod.metadata.name}-{pod.metadata.uid[:8]}",
                         hostname=pod.spec.hostname or pod.metadata.name, command=command, env=env,
                         mounts=mounts, uid=int(uid), gid=int(gid),
                         groups=[int(fs_group)] if fs_group is not None else [], shm_bytes=shm,
                         memory_limit=int(parse_quantity(limit)) if limit else None)

    def _where(self, pod: Any, folder: Path, volume: Any) -> Path:
        """The folder behind a volume (written by :meth:`_volumes`)."""
        if volume.persistent_volume_claim is not None:
            return self.root / "claims" / volume.persistent_volume_claim.claim_name
        return folder / "volumes" / volume.name

    def _volumes(self, pod: Any, folder: Path) -> list[tuple[str, Path]]:
        """Each volume's contents as a local folder; (mount path, folder), longest first."""
        local: dict[str, Path] = {}
        for volume in pod.spec.volumes or []:
            if volume.config_map is not None:
                where = folder / "volumes" / volume.name
                where.mkdir(parents=True, exist_ok=True)
                data = self.core.read_namespaced_config_map(volume.config_map.name, self.namespace).data or {}
                for key, text in data.items():
                    (where / key).write_text(text)
                local[volume.name] = where
            elif volume.secret is not None:  # its keys as files of defaultMode (0644 unless told)
                where = folder / "volumes" / volume.name
                where.mkdir(parents=True, exist_ok=True)
                secret = self.core.read_namespaced_secret(volume.secret.secret_name, self.namespace)
                for key, encoded in (secret.data or {}).items():
                    (where / key).write_bytes(base64.b64decode(encoded))
                    (where / key).chmod(volume.secret.default_mode if volume.secret.default_mode is not None
                                        else 0o644)
                local[volume.name] = where
            elif volume.persistent_volume_claim is not None:
                where = self.root / "claims" / volume.persistent_volume_claim.claim_name
                where.mkdir(parents=True, exist_ok=True)
                local[volume.name] = where
            elif volume.empty_dir is not None:
                where = folder / "volumes" / volume.name
                where.mkdir(parents=True, exist_ok=True)
                local[volume.name] = where
        [container] = pod.spec.containers
        mounts = [(m.mount_path.rstrip("/"), local[m.name]) for m in container.volume_mounts or []
                  if m.name in local]
        return sorted(mounts, key=lambda m: -len(m[0]))

    @staticmethod
    def _local(value: str, mounts: list[tuple[str, Path]]) -> str:
        """An env value as this machine reads it: mount paths to their folders, cluster
        DNS names to the loopback address."""
        for path, folder in mounts:
            if value == path or value.startswith(path + "/"):
                value = str(folder) + value[len(path):]
                break
        return _SERVICE_HOST.sub("127.0.0.1", value)

    def _report_exit(self, running: RunningPod, code: int) -> None:
        code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as container runtimes say
        if running.boxed is not None:
            self.runtime.remove(running.boxed, keep_logs=running.folder / "ray-logs")
        del self.pods[running.name]
        self.finished[running.name] = code
        self.ended.add(running.uid)
        # The termination message as a kubelet reads it: the container's file (4096
        # bytes), else, for a failure (FallbackToLogsOnError), the log's tail.
        note = running.folder / "termination-log"
        text = note.read_text(errors="replace")[:4096] if note.exists() else ""
        if not text.strip() and code:
            text = (running.log.read_text(errors="replace") if running.log.exists() else "")[-2000:]
        finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                "message": text, "finishedAt": finished}}
        with contextlib.suppress(client.ApiException):
            pod = self.core.read_namespaced_pod(running.name, self.namespace)
            self._status(running.name, {"phase": "Succeeded" if code == 0 else "Failed",
                                        "containerStatuses": [self._container(pod.spec.containers[0].name, state)]})

    @staticmethod
    def _container(name: str, state: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "ready": "running" in state, "restartCount": 0, "image": "local",
                "imageID": "local", "state": state}

    def _status(self, name: str, status: dict[str, Any]) -> None:
        with contextlib.suppress(client.ApiException):
            self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status})

    def _kill(self, name: str) -> None:
        running = self.pods.pop(name, None)
        if running is None:
            return
        self._end(running, signal.SIGTERM)
        deadline = time.monotonic() + 20  # its grace, cut short once the test is over
        while running.process.poll() is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.1)
        self._end(running, signal.SIGKILL)
        running.process.wait(10)
        if running.boxed is not None:
            self.runtime.remove(running.boxed, keep_logs=running.folder / "ray-logs")
        self.finished[name] = running.process.returncode
        self.ended.add(running.uid)

    @staticmethod
    def _end(running: RunningPod, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the pod's process and everything it started (Ray's daemons
        leave its process group and outlive their parent: seen from /proc all along)."""
        from alpajob.trainer_image.distributed.loopback import descendants

        running.tracked |= descendants([running.process.pid])
        for pid in [running.process.pid, *running.tracked]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def log(self, name: str) -> str:
        """Pod ``name``'s output so far."""
        path = self.root / "pods" / name / "log.txt"
        return path.read_text(errors="replace") if path.exists() else ""

