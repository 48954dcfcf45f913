"""Operator benchmark: time to children, and 100 AlpaJobs at once.

The real operator process (``alpajob operator``) runs against KMock's Kubernetes
emulator (no API server can be installed here); this script plays the API's clients
and the kubelet. Planning is excluded: a plan computed once (``alpajob plan`` on the
2-stage manual example) is written into each job's plan ConfigMap as soon as its
planner pod appears, and the planner pod is marked Succeeded.

1. **Latency**, one job at a time (``--latency-jobs``): job creation to planner pod,
   plus plan written to every child created (Services, head pod, mesh pods).
2. **Scale**: ``--jobs`` AlpaJobs created at once: the time until every job has all
   its children, and until every job is Running (the script marks pods Running as
   they appear), and the operator's peak memory (VmHWM).
3. **At rest**: with every job Running and nothing changing, the API requests the
   operator makes per minute (``--rest`` seconds counted), by method and resource.

    python benchmarks/operator_scale.py [--jobs 100] [--interval S] [--rest 60]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--latency-jobs", type=int, default=5)
    parser.add_argument("--interval", type=float, help="the operator's --interval (default: its own)")
    parser.add_argument("--rest", type=float, default=60.0, help="seconds of the at-rest window")
    args = parser.parse_args()

    import os

    import yaml
    from kube_emulator import Emulator  # tests/kube_emulator.py
    from kubernetes import client

    from alpajob.api.names import GROUP, LABEL_JOB, PLAN_KEY, PLURAL, VERSION

    root = Path(tempfile.mkdtemp(prefix="alpajob-operator-bench-"))
    plan_path = root / "plan.json"
    subprocess.run([sys.executable, "-m", "alpajob.cli.main", "plan", str(ROOT / "manifests/examples/manual-gpt.yaml"),
                    "--output", str(plan_path)], check=True, capture_output=True)
    plan_json = plan_path.read_text()
    emu = Emulator(root, keep_history=False).start()
    api = emu.api()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    emu.cluster_of("ml", nodes=2)
    log = open(root / "operator.log", "w")  # noqa: SIM115
    operator = subprocess.Popen(
        [sys.executable, "-m", "alpajob.cli.main", "operator", "--namespace", "ml", "--no-scanning",
         *(["--interval", str(args.interval)] if args.interval else [])],
        env={**os.environ, "KUBECONFIG": str(emu.kubeconfig)}, stdout=log, stderr=subprocess.STDOUT)
    doc = yaml.safe_load((ROOT / "manifests/examples/manual-gpt.yaml").read_text())
    peak = [0]
    stop = threading.Event()

    def watch_memory() -> None:
        while not stop.is_set():
            try:
                for line in Path(f"/proc/{operator.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peak[0] = max(peak[0], int(line.split()[1]))
            except OSError:
                pass
            time.sleep(0.5)

    threading.Thread(target=watch_memory, daemon=True).start()

    def create(name: str) -> None:
        body = {**doc, "metadata": {"name": name, "namespace": "ml"}}
        custom.create_namespaced_custom_object(GROUP, VERSION, "ml", PLURAL, body)

    def pods() -> dict[str, object]:
        return {p.metadata.name: p for p in core.list_namespaced_pod("ml").items}

    def kubelet(done: set[str], running: bool) -> None:
        """Write plans for new planner pods; mark new job pods Running."""
        for name, pod in pods().items():
            if name in done:
                continue
            job = (pod.metadata.labels or {}).get(LABEL_JOB)
            if name.endswith("-planner"):
                core.patch_namespaced_config_map(f"{job}-plan", "ml", {"data": {PLAN_KEY: plan_json}})
                core.patch_namespaced_pod_status(name, "ml", {"status": {"phase": "Succeeded"}})
                done.add(name)
            elif running:
                core.patch_namespaced_pod_status(name, "ml", {"status": {"phase": "Running"}})
                done.add(name)

    def children_of(job: str, have: dict[str, object]) -> bool:
        return {f"{job}-0-head", f"{job}-0-m0-h0", f"{job}-0-m1-h0"} <= set(have)

    try:
        time.sleep(3)  # the operator starts
        latencies = []
        for k in range(args.latency_jobs):
            name = f"lat-{k}"
            began = time.perf_counter()
            create(name)
            while f"{name}-planner" not in pods():
                time.sleep(0.1)
            to_planner = time.perf_counter() - began
            core.patch_namespaced_config_map(f"{name}-plan", "ml", {"data": {PLAN_KEY: plan_json}})
            core.patch_namespaced_pod_status(f"{name}-planner", "ml", {"status": {"phase": "Succeeded"}})
            planned = time.perf_counter()
            while not children_of(name, pods()):
                time.sleep(0.1)
            latencies.append(to_planner + time.perf_counter() - planned)
            print(f"{name}: {latencies[-1]:.2f} s to every child (planning excluded)", flush=True)

        names = [f"job-{k:03d}" for k in range(args.jobs)]
        began = time.perf_counter()
        for name in names:
            create(name)
        created = time.perf_counter() - began
        done: set[str] = set()
        all_children = all_running = None
        while all_running is None and time.perf_counter() - began < 900:
            kubelet(done, running=True)
            have = pods()
            if all_children is None and all(children_of(n, have) for n in names):
                all_children = time.perf_counter() - began
                print(f"{args.jobs} jobs: every child created after {all_children:.1f} s", flush=True)
            if all_children is not None:
                phases = [(custom.get_namespaced_custom_object(GROUP, VERSION, "ml", PLURAL, n)
                           .get("status") or {}).get("phase") for n in names]
                if all(p == "Running" for p in phases):
                    all_running = time.perf_counter() - began
            time.sleep(0.2)
        # At rest: every job Running, nothing changes; what does the operator ask?
        time.sleep(5)
        before = emu.served.copy()
        time.sleep(args.rest)
        at_rest = emu.served - before
    finally:
        stop.set()
        operator.terminate()
        operator.wait(20)
        emu.stop()

    print("\n| measure | value |")
    print("| --- | --- |")
    print(f"| AlpaJob created to every child created, planning excluded (median of {len(latencies)}) | "
          f"{statistics.median(latencies):.2f} s (max {max(latencies):.2f} s) |")
    print(f"| {args.jobs} AlpaJobs created (API calls of this script) | {created:.1f} s |")
    print(f"| {args.jobs} AlpaJobs: every child of every job created | "
          f"{all_children if all_children is None else f'{all_children:.1f} s'} |")
    print(f"| {args.jobs} AlpaJobs: every job Running | "
          f"{all_running if all_running is None else f'{all_running:.1f} s'} |")
    print(f"| operator peak memory (VmHWM) | {peak[0] / 1024:.0f} MiB |")
    print(f"| operator --interval | {args.interval or 'its default'} |")
    per_minute = 60.0 / args.rest
    total = sum(at_rest.values())
    print(f"\nAPI requests at rest ({args.jobs + args.latency_jobs} jobs Running, nothing changing; "
          f"{args.rest:.0f} s window), per minute: {total * per_minute:,.0f}")
    print("\n| method | addressed | per minute |")
    print("| --- | --- | --- |")
    for (method, kind), count in at_rest.most_common():
        print(f"| {method} | {kind} | {count * per_minute:,.0f} |")


if __name__ == "__main__":
    main()
