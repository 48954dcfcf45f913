"""How many forced CPU devices a local run makes: the count whose plan is fastest.

On a machine without accelerators, ``alpajob run`` trains on XLA's forced host devices
(``--xla_force_host_platform_device_count``), which share the machine's cores. Their
number is not free: with more devices than cores every device runs slower, busy or
not (``benchmarks/forced_devices.py``, 2 cores: one device's chain of small matmuls
takes 47-49 ms with 1 or 2 devices, 51.5 ms with 4, 59.4 ms with 8; the README job
measures 177 ms per step planned on 2 devices and 223 ms on 8). A plan on k of 8 forced
devices pays that too, so using fewer devices than exist cannot recover it: the count
must be chosen before XLA makes the devices.

XLA reads the count when its CPU backend starts, and tracing the step starts it (the
model's constants are concrete arrays). So a child process (spawned, with its own
XLA) plans the job for each candidate count N (the count offered, and one device per
core when that is fewer), on a cluster that knows its devices per core
(:func:`~alpajob.planner.cost.model.oversubscription_factor`), and the run makes the
count whose plan is predicted fastest before it imports JAX. The run then plans again
on the devices it made (the same cluster: the same plan), which with the plan cache
(:mod:`.plan_cache`) is a read of the plan the child stored. The device trial that
follows still times that plan against one device. The choice costs the child's start
and plans (about 10 s for the README job on 2 cores); with the plan cache a rerun
reads the choice back (:func:`choose_cached`) and starts no child.

The choice is made only where it is the run's to make and there is one to make: an
``auto`` job of a shared-host preset (``cpu``), no ``--devices``, no plan file, no
forced count already in ``XLA_FLAGS``, no accelerator plugin installed, JAX not yet
imported, and fewer cores than the 8 devices offered.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from multiprocessing.connection import Connection
from pathlib import Path

from alpajob.api.options import TrainOptions
from alpajob.api.resource import AlpaJob
from alpajob.api.spec import Method
from alpajob.planner.cost.cluster import ClusterSpec, cluster_for, cluster_from_preset
from alpajob.planner.plan.processes import main_module_hidden
from alpajob.trainer_image.devices import DEFAULT_DEVICES, FLAG, with_host_devices

#: Distributions whose presence means JAX may run on an accelerator, not forced devices.
ACCELERATOR_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm60-plugin",
                       "jax-rocm7-plugin", "libtpu", "libtpu-nightly")


@dataclass(frozen=True)
class ForcedCount:
    """The count chosen, and each candidate's predicted step (seconds); ``cached``:
    read from the plan cache (:func:`choose_cached`)."""

    devices: int
    predicted: dict[int, float]
    cached: bool = False

    def line(self) -> str:
        """What the run says about the choice, in one line."""
        others = ", ".join(f"{n} devices {s * 1e3:.1f} ms" for n, s in sorted(self.predicted.items())
                           if n != self.devices)
        return (f"making {self.devices} forced CPU devices: the plan on {self.devices} is predicted "
                f"{self.predicted[self.devices] * 1e3:.1f} ms per step"
                + (f" ({others})" if others else "") + ("; cached" if self.cached else ""))


def choice_key(job: AlpaJob, options: TrainOptions, cores: int) -> str:
    """The plan-cache key of the forced-count choice: the manifest's model, training,
    cluster and parallelism, the planning options, the host's cores and the planner's
    version. The choice is made before JAX starts, so it cannot hash the traced graph
    as a plan's key does: a changed entrypoint can leave a stale count (a slower run,
    never a wrong one: the plan itself is keyed by its graph)."""
    import hashlib
    import json

    from alpajob.trainer_image.plan_cache import planner_version

    spec = job.spec.model_dump(mode="json", include={"model", "training", "cluster", "parallelism"})
    planning = options.planning.model_dump(mode="json", exclude={"cache_dir"})
    material = json.dumps({"spec": spec, "planning": planning,
                           "cores": cores, "planner": planner_version()}, sort_keys=True)
    return "count-" + hashlib.sha256(material.encode()).hexdigest()[:16]


def choose_cached(job: AlpaJob, options: TrainOptions, warn: Callable[[str], None]) -> ForcedCount:
    """:func:`choose_in_child`'s count, read from the plan cache (``cache_dir``) when this
    job was counted on this host before (:func:`choice_key`), else chosen and stored."""
    cache_dir = options.planning.cache_dir
    if cache_dir is None:
        return choose_in_child(job, options)
    from alpajob.trainer_image.plan_cache import PlanCache

    cache = PlanCache(Path(cache_dir), warn)
    key = choice_key(job, options, host_cores())
    stored = cache.get_record(key)
    if stored is not None:
        try:
            predicted = {int(n): float(s) for n, s in stored["predicted"].items()}
            devices = int(stored["devices"])
            if devices in predicted:
                return ForcedCount(devices, predicted, cached=True)
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
        warn(f"plan cache: ignoring the forced device count {key}: not a count; choosing again")
    choice = choose_in_child(job, options)
    cache.put_record(key, {"devices": choice.devices, "predicted": {str(n): s for n, s in choice.predicted.items()}})
    return choice


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def shared_host_cluster(preset: str, devices: int, forced: int, cores: int) -> ClusterSpec:
    """``devices`` of ``forced`` forced devices of a ``cores``-core host, as one node."""
    return dataclasses.replace(cluster_from_preset(preset, 1, devices),
                               devices_per_core=forced / max(1, cores))


def candidates(offered: int, cores: int) -> list[int]:
    """The counts worth planning: the one offered, and one per core when fewer."""
    return sorted({offered, min(offered, cores)})


def may_choose(job: AlpaJob, options: TrainOptions) -> bool:
    """Whether this run's forced device count is the run's to choose (module docstring)."""
    method = options.planning.method or job.spec.parallelism.method
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return (options.devices is None and not options.plan_file and not options.serial
            and method is Method.AUTO and FLAG not in os.environ.get("XLA_FLAGS", "")
            and platforms in ("", "cpu") and not _accelerator_plugin()
            and len(candidates(DEFAULT_DEVICES, host_cores())) > 1
            and job.spec.cluster.pools is None  # several GPU types: no forced CPU devices to choose
            and cluster_for(job.spec.cluster, options.planning).shared_host
            and "jax" not in sys.modules)


def run_devices_line(job: AlpaJob, options: TrainOptions) -> str | None:
    """What ``alpajob plan`` says about the forced devices ``alpajob run`` would make
    for ``job`` on this machine (None where the run does not choose: call it before JAX
    is imported, as :func:`may_choose`)."""
    if not may_choose(job, options):
        return None
    counts = candidates(DEFAULT_DEVICES, host_cores())
    if options.planning.cache_dir is not None:
        from alpajob.trainer_image.plan_cache import PlanCache

        record = PlanCache(Path(options.planning.cache_dir), lambda _line: None).get_record(
            choice_key(job, options, host_cores()))
        if record is not None and isinstance(record.get("devices"), int):
            return (f"`alpajob run` on this machine makes {record['devices']} forced CPU devices "
                    "(its cached choice) and plans again for them; --devices N fixes the count")
    return (f"`alpajob run` on this machine ({host_cores()} cores) plans this job for "
            f"{' and '.join(map(str, counts))} forced CPU devices and makes the faster (more devices "
            "than cores slow every device); --devices N fixes the count")


def choose_forced_count(job: AlpaJob, options: TrainOptions, cores: int | None = None) -> ForcedCount:
    """Plan ``job`` on each candidate count and return the fastest (module docstring)."""
    from alpajob.trainer_image.planning import job_graph, plan_or_cached

    cores = cores or host_cores()
    preset = cluster_for(job.spec.cluster, options.planning).preset
    graph = job_graph(job)
    predicted = {}
    for count in candidates(DEFAULT_DEVICES, cores):
        cluster = shared_host_cluster(preset, count, count, cores)
        predicted[count] = plan_or_cached(job, options.planning, cluster=cluster, graph=graph).plan \
            .predicted_step_seconds
    best = min(predicted, key=lambda n: (predicted[n], n))
    return ForcedCount(best, predicted)


def choose_in_child(job: AlpaJob, options: TrainOptions) -> ForcedCount:
    """:func:`choose_forced_count` in a spawned child process, so that this one has not
    started XLA (nor imported JAX) when it makes the devices."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(job, options, host_cores(), send))
    with main_module_hidden():  # a script calling alpajob.train is not run again in the child
        child.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError as error:  # the child died without an answer
        raise RuntimeError(f"choosing the forced device count failed (exit code "
                           f"{child.exitcode})") from error
    except BaseException:  # interrupted (SIGTERM, Ctrl-C: trainer_image.stopping): the child goes too
        child.terminate()
        raise
    finally:
        child.join()
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome  # type: ignore[no-any-return]


def _child(job: AlpaJob, options: TrainOptions, cores: int, send: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it (choose_in_child)
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        send.send(choose_forced_count(job, options, cores))
    except BaseException as error:  # noqa: BLE001 - handed to the parent, which raises it
        send.send(error)
    finally:
        send.close()


def make_forced_devices(count: int) -> None:
    """Ask XLA for ``count`` forced devices (before JAX is imported)."""
    os.environ["XLA_FLAGS"] = with_host_devices(os.environ.get("XLA_FLAGS", ""), count)


def _accelerator_plugin() -> bool:
    for name in ACCELERATOR_PLUGINS:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return True
    return False
