"""The operator on a busy shared cluster: memory and API bytes with unrelated objects.

The test API server (``tests/kube_emulator.py``, which filters lists and watches by
``labelSelector`` as kube-apiserver does) holds ``--pods`` pods and ``--configmaps``
ConfigMaps that belong to no AlpaJob (another team's workloads, in namespace
``other``), plus one AlpaJob's namespace. ``alpajob operator --all-namespaces`` starts
against it, and once its lists and watches are in (the bytes the server sent stop
growing for 5 s) the script reads the operator's resident memory (VmRSS, and the peak
VmHWM) and the bytes the server sent it, by kind. The same is measured side by side
for the code of ``--before`` (a git revision, checked out in a temporary worktree):
the operator as it was before its watches asked the server for the job label.

    python benchmarks/operator_memory.py [--pods 10000] [--configmaps 1000] [--before REV]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def unrelated_pod(i: int) -> dict[str, Any]:
    """A pod of another team, about the size of a real one (2 to 3 KB of JSON)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"web-{i}", "namespace": "other",
                         "labels": {"app": "web", "pod-template-hash": "5d8f7c9b4"},
                         "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-30T10:00:00Z"}},
            "spec": {"containers": [{"name": "web", "image": "registry.example.com/team/web:1.24.3",
                                     "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                                     "env": [{"name": f"SETTING_{k}", "value": "x" * 40} for k in range(12)],
                                     "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                                                   "limits": {"memory": "512Mi"}}}],
                     "nodeName": f"node-{i % 50}", "serviceAccountName": "default"},
            "status": {"phase": "Running", "podIP": f"10.1.{i // 250}.{i % 250}",
                       "conditions": [{"type": t, "status": "True"} for t in
                                      ("Initialized", "Ready", "ContainersReady", "PodScheduled")]}}


def measure(emu: Any, code: Path, log: Path) -> dict[str, float]:
    """Start the operator of ``code`` (a checkout), wait until its lists and watches
    are in, and read its memory and the bytes it was sent."""
    emu.kmock.sent.clear()
    env = {**os.environ, "KUBECONFIG": str(emu.kubeconfig), "PYTHONPATH": str(code)}
    began = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "alpajob", "operator", "--all-namespaces", "--no-scanning"],
                                cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        last, still = -1, time.monotonic()
        while time.monotonic() - still < 5.0:
            total = sum(emu.kmock.sent.values())
            if total != last:
                last, still = total, time.monotonic()
            if proc.poll() is not None:
                raise RuntimeError(f"the operator stopped:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)
        status = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                      if ":" in line)
        kib = {key: float(status[key].split()[0]) for key in ("VmRSS", "VmHWM")}
        sent = dict(emu.kmock.sent)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"rss_mib": kib["VmRSS"] / 1024, "peak_mib": kib["VmHWM"] / 1024,
            "sent_mib": sum(sent.values()) / 2**20,
            "pods_mib": sum(v for k, v in sent.items() if k.startswith("pods")) / 2**20,
            "settled_s": time.monotonic() - began - 5.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=10000)
    parser.add_argument("--configmaps", type=int, default=1000)
    parser.add_argument("--before", help="a git revision to measure side by side (the operator before)")
    args = parser.parse_args()

    from kube_emulator import Emulator
    from kubernetes import client

    root = Path(tempfile.mkdtemp(prefix="alpajob-operator-memory-"))
    emu = Emulator(root, keep_history=False).start()
    core = client.CoreV1Api(emu.api())
    emu.cluster_of("ml", nodes=2)
    emu.create_namespace("other", restricted=False)
    began = time.monotonic()
    for i in range(args.pods):
        core.create_namespaced_pod("other", unrelated_pod(i))
    for i in range(args.configmaps):
        core.create_namespaced_config_map("other", {"metadata": {"name": f"settings-{i}", "namespace": "other"},
                                                     "data": {"settings.yaml": "key: value\n" * 40}})
    print(f"{args.pods} pods and {args.configmaps} ConfigMaps of another team made in "
          f"{time.monotonic() - began:.0f} s")
    runs = [("now", ROOT)]
    worktree = None
    if args.before:
        worktree = Path(tempfile.mkdtemp(prefix="alpajob-before-")) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.before],
                       check=True, capture_output=True)
        runs.insert(0, (f"before ({args.before})", worktree))
    try:
        print("| operator | RSS | peak RSS | bytes sent to it | of which pods | settled after |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, code in runs:
            m = measure(emu, code, root / f"operator-{name.split()[0]}.log")
            print(f"| {name} | {m['rss_mib']:.0f} MiB | {m['peak_mib']:.0f} MiB | {m['sent_mib']:.1f} MiB | "
                  f"{m['pods_mib']:.1f} MiB | {m['settled_s']:.0f} s |")
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
        emu.stop()


if __name__ == "__main__":
    main()
