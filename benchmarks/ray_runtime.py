"""Ray runtime benchmark: the same plan on the Ray runtime and on the local one,
and cross-mesh transfers through the Ray object store against a memory copy.

A loopback Ray cluster (:mod:`alpajob.trainer_image.distributed.loopback`) runs on this
machine: mesh 0 host 0 and mesh 1 host 0 with 4 forced CPU devices each, mesh 1 host 1
and mesh 2 host 0 with 2. Two plans of one GPT:

- ``2 meshes``: stages on 1 x 4 and 1 x 4 (mesh 0, mesh 1 host 0);
- ``3 meshes, one on 2 hosts``: 1 x 2, 2 x 2 (mesh 1 spans two processes: one JAX
  process group, gloo collectives), 1 x 2.

Each runs ``--steps`` steps with ``alpajob driver``'s code path and with ``alpajob run
--plan`` (8 forced devices in this process); the table compares the median step time
after the first (compiling) step. Then one actor per 4-device host moves arrays of
several sizes from one mesh to the other exactly as the runtime does (cut by the
transfer plan, ``ray.put``, delivered to the receiving actor, assembled on its devices)
and the table compares the bytes per second with ``numpy.copyto`` of the same bytes.

With ``--collective`` every plan also runs with ``alpajob driver --transport
collective`` (XLA collectives over one JAX process group, gloo on CPU) and the table
adds its step time and its ratio to the object store's; the transfers are also made
as that transport makes them (:class:`CollectiveProbe`: two processes, one JAX group),
with gloo's bare ``ppermute`` of the same bytes beside them (what bounds the
transport on this machine). ``--repeat N`` runs each plan N times per transport,
alternating, and takes the median (this machine's speed drifts by tens of percent).

With ``--checkpoints`` the first plan also runs with a checkpoint every 2 steps under
each transport (the collective one saves through its hosts' helpers,
:mod:`alpajob.trainer_image.distributed.saver`), then once more to resume: the table
gives the seconds the training loop was blocked per save (the goodput books'
``checkpoint`` bucket, the end-of-run wait for the last save included), the step time
and the restore.

    python benchmarks/ray_runtime.py [--steps 6] [--config JSON] [--batch 32] [--sizes-mb 4,16,64] [--collective]
                                     [--repeat 1] [--checkpoints]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

HOSTS = [(0, 0, 4), (1, 0, 4), (1, 1, 2), (2, 0, 2)]
PLANS = {
    "2 meshes (1x4, 1x4)": (1, [{"layers": [0, 2], "submeshShape": [1, 4]},
                                {"layers": [2, 4], "submeshShape": [1, 4]}]),
    "3 meshes (1x2, 2x2 on 2 hosts, 1x2)": (4, [{"layers": [0, 1], "submeshShape": [1, 2]},
                                                {"layers": [1, 3], "submeshShape": [2, 2]},
                                                {"layers": [3, 4], "submeshShape": [1, 2]}]),
}


class Probe:
    """One 4-device host's end of a transfer (a Ray actor)."""

    def __init__(self) -> None:
        import jax
        import numpy as np

        self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))

    def tiles(self, shape: tuple[int, ...], spec: tuple) -> dict:
        from jax.sharding import NamedSharding, PartitionSpec

        from alpajob.trainer_image.distributed.transport import position_tiles

        return position_tiles(NamedSharding(self.mesh, PartitionSpec(*spec)), shape)

    def send(self, peer, shape: tuple[int, ...], spec: tuple, dst_tiles: dict, dst_spec: tuple, repeats: int) -> list[float]:
        import jax
        import numpy as np
        import ray
        from jax.sharding import NamedSharding, PartitionSpec

        from alpajob.trainer_image.distributed.transport import cut

        data = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        array = jax.device_put(data, NamedSharding(self.mesh, PartitionSpec(*spec)))
        seconds = []
        for _ in range(repeats):
            began = time.perf_counter()
            ray.get(peer.receive.remote(ray.put(cut(array, dst_tiles)), dst_spec))
            seconds.append(time.perf_counter() - began)
        return seconds

    def receive(self, parcel, spec: tuple) -> int:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from alpajob.trainer_image.distributed.transport import assemble

        moved = assemble(parcel, NamedSharding(self.mesh, PartitionSpec(*spec)))
        jax.block_until_ready(moved)
        return parcel.nbytes


class CollectiveProbe:
    """One 4-device host's end of a collective transfer (a Ray actor): the two probes
    form one two-process JAX group (gloo on CPU) and move a message exactly as
    ``--transport collective`` does (:class:`~alpajob.trainer_image.distributed.collective.CollectiveMover`:
    the crossing's ``ppermute`` rounds, then the receiver's assembly)."""

    def address(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{s.getsockname()[1]}"

    def join(self, coordinator: str, process: int) -> None:
        import jax

        jax.distributed.initialize(coordinator, num_processes=2, process_id=process, initialization_timeout=120)
        self.process = process
        self.grids = [[d for d in jax.devices() if d.process_index == p][:4] for p in (0, 1)]

    def move(self, shape: tuple[int, ...], spec: tuple, dst_spec: tuple, repeats: int) -> list[float]:
        """Send (process 0) or receive (process 1) one float32 message ``repeats``
        times; the seconds of each, until this end's arrays are ready."""
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from alpajob.trainer_image.distributed.collective import CollectiveMover, Source
        from alpajob.trainer_image.distributed.transport import position_tiles
        from alpajob.trainer_image.runtime.messages import Send

        meshes = [Mesh(np.array(g), ("x",)) for g in self.grids]
        src = NamedSharding(meshes[0], PartitionSpec(*spec))
        dst = NamedSharding(meshes[1], PartitionSpec(*dst_spec))
        key = ("act", 0, 1)
        layouts = [{"sources": {("act", 1): Source(position_tiles(src, shape), shape, "float32")}},
                   {"tiles": {("act", 1): position_tiles(dst, shape)}}]
        mover = CollectiveMover(self.grids, layouts)
        message = Send(0, 1, key)
        if self.process == 0:
            data = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
            array = jax.make_array_from_callback(shape, src, lambda index: data[index])
        seconds = []
        for _ in range(repeats):
            began = time.perf_counter()
            if self.process == 0:
                mover.send(message, array)
            else:
                jax.block_until_ready(mover.receive(message, dst))
            seconds.append(time.perf_counter() - began)
        return seconds


    def permute(self, elements: int, repeats: int) -> list[float]:
        """gloo alone: one ``ppermute`` of ``elements`` float32 from each of process 0's 4
        devices to process 1's (the x -> x message's one round, without the transport's
        slicing, padding and assembly); the seconds of each, until its result is ready."""
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        union = self.grids[0] + self.grids[1]
        mesh = Mesh(np.array(union), ("x",))
        run = jax.jit(jax.shard_map(lambda b: jax.lax.ppermute(b, "x", [(i, 4 + i) for i in range(4)]),
                                    mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x")))
        sharding = NamedSharding(mesh, PartitionSpec("x"))
        mine = [d for d in union if d.process_index == self.process]
        blocks = jax.make_array_from_single_device_arrays(
            (8 * elements,), sharding, [jax.device_put(np.ones(elements, np.float32), d) for d in mine])
        seconds = []
        for _ in range(repeats):
            began = time.perf_counter()
            jax.block_until_ready(run(blocks))
            seconds.append(time.perf_counter() - began)
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--config", default='{"hidden":256,"layers":4,"heads":8,"seqLen":128,"vocab":1024}')
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sizes-mb", default="4,16,64")
    parser.add_argument("--collective", action="store_true",
                        help="also run every plan with the collective transport")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each plan per transport, alternating; the table takes the median")
    parser.add_argument("--checkpoints", action="store_true",
                        help="also time checkpoints of the first plan with each transport")
    args = parser.parse_args()
    config = json.loads(args.config) if args.config.startswith("{") else args.config

    import numpy as np
    import ray
    import yaml
    from local_jobs import FAST_PLANNING, job_document

    from alpajob.api.options import TrainOptions
    from alpajob.api.plan import write_plan
    from alpajob.api.resource import parse_job
    from alpajob.api.runtime import Transport
    from alpajob.trainer_image.distributed.driver import DriverOptions, drive
    from alpajob.trainer_image.distributed.loopback import LoopbackCluster
    from alpajob.trainer_image.local_run import run
    from alpajob.trainer_image.planning import plan_job

    root = Path(tempfile.mkdtemp(prefix="alpajob-ray-bench-"))
    cluster = LoopbackCluster(root, HOSTS)
    print(f"starting a loopback Ray cluster in {root} ...", flush=True)
    cluster.start()
    rows: list[tuple] = []
    jobs: list[tuple] = []
    saves: list[tuple] = []
    try:
        for name, (nodes, stages) in PLANS.items():
            doc = job_document("ray-bench", "gpt", config,
                               {"method": "manual", "numMicroBatches": 4, "numLayers": 4, "stages": stages},
                               batch=args.batch, optimizer="sgd", nodes=nodes)
            manifest = parse_job(doc)
            plan = plan_job(manifest, FAST_PLANNING).plan  # for the manifest's cluster, as written
            write_plan(plan, root / "plan.json")
            local = run(manifest, TrainOptions(steps=args.steps, plan_file=str(root / "plan.json")))
            lo = statistics.median(local.step_seconds[1:])
            transports = list(Transport) if args.collective else [Transport.OBJECT_STORE]
            medians: dict[Transport, list[float]] = {t: [] for t in transports}
            for _ in range(args.repeat):  # the transports alternate: this machine's speed drifts
                for transport in transports:
                    remote = drive(yaml.safe_dump(doc), plan, DriverOptions(
                        address=cluster.address, steps=args.steps, transport=transport))
                    np.testing.assert_allclose(remote.losses, local.losses, rtol=1e-4)
                    medians[transport].append(statistics.median(remote.step_seconds[1:]))
                    mb = statistics.median(remote.sent_bytes) / 2**20
            ra = statistics.median(medians[Transport.OBJECT_STORE])
            co = statistics.median(medians[Transport.COLLECTIVE]) if args.collective else None
            rows.append((name, lo, ra, mb, co))
            jobs.append((doc, plan))
            extra = f", collective {co * 1e3:.1f} ms" if co is not None else ""
            print(f"{name}: local {lo * 1e3:.1f} ms, ray {ra * 1e3:.1f} ms{extra}, "
                  f"{mb:.1f} MiB between meshes per step", flush=True)

        if args.checkpoints:
            doc, plan = jobs[0]
            for transport in Transport:
                folder = root / f"ckpt-{transport.value}"
                saved = drive(yaml.safe_dump(doc), plan, DriverOptions(
                    address=cluster.address, steps=args.steps, transport=transport, checkpoint_dir=str(folder),
                    checkpoint_every=2))
                resumed = drive(yaml.safe_dump(doc), plan, DriverOptions(
                    address=cluster.address, steps=args.steps + 1, transport=transport, checkpoint_dir=str(folder)))
                count = args.steps // 2
                size = sum(f.stat().st_size for f in folder.rglob(f"{args.steps}/**/*") if f.is_file())
                saves.append((transport.value, count, saved.badput["checkpoint"] / count,
                              statistics.median(saved.step_seconds[1:]), resumed.badput["restore"], size))
                print(f"{transport.value}: {saves[-1]}", flush=True)

        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        actor = ray.remote(Probe)
        a = actor.options(resources={"alpajob-mesh-0-host-0": 1}, num_cpus=0).remote()
        b = actor.options(resources={"alpajob-mesh-1-host-0": 1}, num_cpus=0).remote()
        transfers = []
        for size in [int(x) for x in args.sizes_mb.split(",")]:
            shape = (size * 2**20 // 4 // 1024, 1024)
            buffer = np.ones(shape, np.float32)
            out = np.empty_like(buffer)
            copies = []
            for _ in range(5):
                began = time.perf_counter()
                np.copyto(out, buffer)
                copies.append(time.perf_counter() - began)
            copy = statistics.median(copies)
            for label, src, dst in [("x -> x", ("x",), ("x",)), ("x -> (None, x)", ("x",), (None, "x"))]:
                tiles = ray.get(b.tiles.remote(shape, dst))
                seconds = statistics.median(ray.get(a.send.remote(b, shape, src, tiles, dst, 5))[1:])
                transfers.append((size, label, seconds, copy))
                print(f"{size} MiB {label}: object store {size / 1024 / seconds:.2f} GiB/s, "
                      f"memcpy {size / 1024 / copy:.2f} GiB/s", flush=True)
        for probe in (a, b):
            ray.kill(probe)  # their hosts' resources go to the collective probes
        if args.collective:
            actor = ray.remote(CollectiveProbe)
            ca = actor.options(resources={"alpajob-mesh-0-host-0": 1}, num_cpus=0).remote()
            cb = actor.options(resources={"alpajob-mesh-1-host-0": 1}, num_cpus=0).remote()
            coordinator = ray.get(ca.address.remote())
            ray.get([ca.join.remote(coordinator, 0), cb.join.remote(coordinator, 1)])
            for k, (size, label, _, _) in enumerate(transfers):
                shape = (size * 2**20 // 4 // 1024, 1024)
                src, dst = ("x",), ("x",) if label == "x -> x" else (None, "x")
                _, seconds = ray.get([ca.move.remote(shape, src, dst, 6), cb.move.remote(shape, src, dst, 6)])
                transfers[k] += (statistics.median(seconds[1:]),)
                if label == "x -> x":
                    elements = size * 2**20 // 4 // 4
                    _, raw = ray.get([ca.permute.remote(elements, 6), cb.permute.remote(elements, 6)])
                    transfers[k] += (statistics.median(raw[1:]),)
                else:
                    transfers[k] += (None,)
                print(f"{size} MiB {label}: collective {size / 1024 / transfers[k][4]:.2f} GiB/s", flush=True)
        ray.shutdown()
    finally:
        left = cluster.stop()
        if left:
            print(f"warning: {len(left)} process(es) still alive after the cluster stopped")

    print("\n| plan | local runtime (ms/step) | Ray runtime (ms/step) | Ray / local | between meshes (MiB/step) |")
    print("| --- | --- | --- | --- | --- |")
    for name, lo, ra, mb, _ in rows:
        print(f"| {name} | {lo * 1e3:.1f} | {ra * 1e3:.1f} | {ra / lo:.2f}x | {mb:.1f} |")
    if args.collective:
        print("\n| plan | object store (ms/step) | collective (ms/step) | collective / object store |")
        print("| --- | --- | --- | --- |")
        for name, _, ra, _, co in rows:
            print(f"| {name} | {ra * 1e3:.1f} | {co * 1e3:.1f} | {co / ra:.2f}x |")
    if saves:
        print("\n| transport | saves | loop blocked per save (s) | step (ms) | restore (s) | checkpoint (MiB) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for transport, count, blocked, step, restored, size in saves:
            print(f"| {transport} | {count} | {blocked:.3f} | {step * 1e3:.1f} | {restored:.2f} | {size / 2**20:.1f} |")
    if args.collective:
        print("\n| bytes | sharding | memcpy (GiB/s) | object store (GiB/s) | collective (GiB/s) "
              "| gloo ppermute alone (GiB/s) | object store / memcpy | collective / memcpy |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for size, label, seconds, copy, collective, raw in transfers:
            alone = f"{size / 1024 / raw:.2f}" if raw else "-"
            print(f"| {size} MiB | {label} | {size / 1024 / copy:.2f} | {size / 1024 / seconds:.2f} "
                  f"| {size / 1024 / collective:.2f} | {alone} | {copy / seconds:.1%} | {copy / collective:.1%} |")
        return
    print("\n| bytes | sharding | object store (GiB/s) | memcpy (GiB/s) | object store / memcpy |")
    print("| --- | --- | --- | --- | --- |")
    for size, label, seconds, copy in transfers:
        print(f"| {size} MiB | {label} | {size / 1024 / seconds:.2f} | {size / 1024 / copy:.2f} | {copy / seconds:.1%} |")


if __name__ == "__main__":
    main()
