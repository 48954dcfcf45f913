"""Real containers for the test kubelet: the trainer image built from its Dockerfile, and
each pod run in it with runc.

**The image.** ``trainer_image/Dockerfile`` is built by buildah (Debian's package: it
builds a Dockerfile without a daemon or a registry) from a local Debian bookworm made
by debootstrap, with ``BASE_IMAGE`` set to it and ``LOCK`` the CPU lock (CPU JAX, hashes
checked): :func:`build_image`. Nothing here rewrites the Dockerfile: its own ``RUN`` steps
install Python 3.11 from apt and the locked packages and the project with pip. Two things of this
machine are lent to the build only, never kept in the image: its CA bundle and a
pip configuration naming it (PyPI is reached through a TLS-inspecting proxy here).
The built image's root filesystem is then mounted once (``buildah mount``) and its
config read (``buildah inspect``): env, user, working directory.

**A pod.** :class:`Runtime` runs one container as a kubelet's container runtime does
(containerd's shim hands runc an OCI bundle; we hand it one directly): a root
filesystem that is the image under a writable overlay of the pod's own, the image's
env with the pod's on top, uid 1000 (the pod's ``runAsUser``) with its ``fsGroup`` as
a supplementary group and no capabilities, the pod's volumes bind-mounted at their
mount paths, ``/dev/shm`` a tmpfs of the pod's Memory ``emptyDir`` size (64 MiB, the
runtime default, without one), the container's ``limits.memory`` as the cgroup's
memory limit, its own PID, IPC, UTS (hostname: the pod's) and mount namespaces, and
the node's network (the test's pods share the loopback address, as they do in
process mode). ``runc run`` stays in the foreground: the kubelet's process is the
container's, SIGTERM reaches the container's PID 1, and its exit code is the pod's.

Needs root, runc, buildah and debootstrap (``apt-get install runc buildah debootstrap``);
``available()`` says whether this machine has them. The first build takes several
minutes (the base, Python, JAX, the project's dependencies); later builds reuse
buildah's cached layers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where the base file system, buildah's storage and the pods' overlays live.
CACHE = Path(os.environ.get("ALPAJOB_IMAGE_CACHE", "/var/tmp/alpajob-images"))
BASE = "localhost/debian:bookworm"
IMAGE = "localhost/alpajob:cpu"
OPERATOR_IMAGE = "localhost/alpajob-operator:test"
MIRROR = "http://deb.debian.org/debian"
_BUILDAH = ["buildah", "--storage-driver", "overlay"]


def available() -> str | None:
    """Why containers cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (runc, mounts)"
    missing = [tool for tool in ("runc", "buildah", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install runc buildah debootstrap)"
    return None


@dataclass(frozen=True)
class Image:
    """A built image, mounted: its root file system and its config."""

    rootfs: Path
    env: dict[str, str]
    user: str
    workdir: str


def _run(command: list[str], log: Path | None = None) -> str:
    """Run ``command``; its output (or its log's tail in the error when it fails)."""
    if log is None:
        return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()
    with open(log, "ab") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_bytes()[-3000:].decode(errors="replace")
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({done.returncode}):\n{tail}")
    return ""


def _base(log: Path) -> None:
    """``localhost/debian:bookworm``: Debian's minimal base, by debootstrap, as an image."""
    if _run([*_BUILDAH, "images", "--quiet", "--filter", f"reference={BASE}"]):
        return
    rootfs = CACHE / "bookworm-rootfs"
    if not (rootfs / "etc" / "debian_version").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR], log)
    container = _run([*_BUILDAH, "from", "scratch"])
    mount = Path(_run([*_BUILDAH, "mount", container]))
    _run(["cp", "-a", f"{rootfs}/.", f"{mount}/"])
    _run([*_BUILDAH, "commit", "--quiet", container, BASE])
    _run([*_BUILDAH, "rm", container])


def build_image(log: Path, target: str = "trainer") -> Image:
    """Build a target of ``trainer_image/Dockerfile`` on the local Debian base and mount
    it (module docstring): ``trainer`` (CPU JAX), or ``operator`` (the operator's image,
    tagged :data:`OPERATOR_IMAGE`)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    _base(log)
    pip_conf = CACHE / "pip.conf"
    pip_conf.write_text("[global]\ncert = /run/host-ca.crt\n")
    tag = IMAGE if target == "trainer" else OPERATOR_IMAGE
    _run([*_BUILDAH, "bud", "--network", "host", "--isolation", "chroot", "--layers",
          "-f", "trainer_image/Dockerfile", "--ignorefile", "trainer_image/Dockerfile.dockerignore",
          "--volume", "/etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro",
          "--volume", f"{pip_conf}:/etc/pip.conf:ro",
          "--build-arg", f"BASE_IMAGE={BASE}", "--build-arg", f"OPERATOR_BASE_IMAGE={BASE}",
          "--build-arg", "LOCK=requirements/trainer-cpu.txt", "--target", target,
          "-t", tag, str(ROOT)], log)
    name = f"alpajob-test-{target}"
    for old in _run([*_BUILDAH, "containers", "--quiet", "--filter", f"name={name}"]).split():
        _run([*_BUILDAH, "rm", old])
    container = _run([*_BUILDAH, "from", "--name", name, tag])
    rootfs = Path(_run([*_BUILDAH, "mount", container]))
    config = json.loads(_run([*_BUILDAH, "inspect", "--type", "image", tag]))["OCIv1"]["config"]
    env = dict(item.split("=", 1) for item in config.get("Env") or [])
    return Image(rootfs, env, str(config.get("User") or "0"), str(config.get("WorkingDir") or "/"))


def run_in(image: str, command: list[str]) -> subprocess.CompletedProcess:
    """``command`` in a throwaway container of ``image`` as its user (buildah run)."""
    container = _run([*_BUILDAH, "from", image])
    try:
        return subprocess.run([*_BUILDAH, "run", "--isolation", "chroot", container, "--", *command],
                              capture_output=True, text=True, timeout=120)
    finally:
        _run([*_BUILDAH, "rm", container])


@dataclass
class Container:
    """One pod's container: what :class:`Runtime` needs to run it."""

    name: str  # the container id (unique: the pod's uid)
    hostname: str
    command: list[str]
    env: dict[str, str]
    mounts: list[tuple[str, Path, bool]]  # (path inside, folder or file outside, read-only)
    uid: int = 1000
    gid: int = 1000
    groups: list[int] = field(default_factory=list)
    shm_bytes: int = 64 << 20
    memory_limit: int | None = None


class Runtime:
    """Runs :class:`Container` s of one :class:`Image` with runc (module docstring)."""

    def __init__(self, image: Image, root: Path) -> None:
        self.image, self.root = image, root

    def start(self, container: Container, log: Path) -> subprocess.Popen:
        """Start ``container`` in the foreground (``runc run``); its output goes to ``log``."""
        bundle = self.root / container.name
        upper, work, rootfs = bundle / "upper", bundle / "work", bundle / "rootfs"
        for folder in (upper, work, rootfs):
            folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={self.image.rootfs},upperdir={upper},workdir={work}", str(rootfs)], check=True)
        (bundle / "config.json").write_text(json.dumps(self._spec(container)))
        with open(log, "ab") as out:
            return subprocess.Popen(["runc", "run", "--bundle", str(bundle), container.name],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    def remove(self, container: Container, keep_logs: Path | None = None) -> None:
        """Tear the container down (after it exited, or to kill it); Ray's own logs of
        the container (its workers' stderr: where an actor's crash is told) are copied
        to ``keep_logs`` first."""
        subprocess.run(["runc", "delete", "--force", container.name], capture_output=True)
        bundle = self.root / container.name
        if keep_logs is not None and (bundle / "upper" / "tmp" / "ray").exists():
            for session in (bundle / "upper" / "tmp" / "ray").glob("session_2*"):
                if (session / "logs").is_dir():
                    shutil.copytree(session / "logs", keep_logs / session.name, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("*.log.*"))
        subprocess.run(["umount", "-l", str(bundle / "rootfs")], capture_output=True)
        shutil.rmtree(bundle, ignore_errors=True)

    def _spec(self, container: Container) -> dict:
        env = {**self.image.env, **container.env}
        mounts = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "nodev", "mode=1777", f"size={container.shm_bytes}"]},
            {"destination": "/etc/resolv.conf", "type": "bind", "source": "/etc/resolv.conf", "options": ["rbind", "ro"]},
        ]
        mounts += [{"destination": inside, "type": "bind", "source": str(outside),
                    "options": ["rbind", "ro" if read_only else "rw"]}
                   for inside, outside, read_only in container.mounts]
        resources: dict = {"devices": [{"allow": False, "access": "rwm"}]}
        if container.memory_limit:
            resources["memory"] = {"limit": container.memory_limit}
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False, "args": container.command, "cwd": self.image.workdir,
                "env": [f"{k}={v}" for k, v in env.items()],
                "user": {"uid": container.uid, "gid": container.gid, "additionalGids": container.groups},
                "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []},
                "noNewPrivileges": True,
            },
            "root": {"path": "rootfs", "readonly": False},
            "hostname": container.hostname,
            "mounts": mounts,
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
                "resources": resources,
                "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
                "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
            },
        }
