"""The mesh hosts' actors of one attempt, as the driver (:mod:`.driver`) works them.

:class:`MeshGroup` starts one :class:`~.mesh_host.MeshHost` actor per mesh host,
pinned by its resource, joins each mesh's JAX process group (or, with the
``collective`` transport, one group for the job), builds the stages and hands every
actor every layout and handle; then it runs steps, evaluations, saves and restores
on all of them. :func:`gather` waits for a set of actor calls and tells a lost host
(:class:`HostFailure`, recoverable by a restart) from a training error. After a mesh
failed, :meth:`MeshGroup.repair` replaces that mesh's actors alone and keeps the
others with their compiled stages.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from alpajob.api.plan import Plan
from alpajob.api.runtime import Transport
from alpajob.api.wording import counted
from alpajob.trainer_image.checkpoint.store import mesh_part
from alpajob.trainer_image.distributed.cluster import MeshHostSpec, host_node
from alpajob.trainer_image.distributed.mesh_host import MeshHost
from alpajob.trainer_image.distributed.pieces import assemble_pieces


class HostFailure(Exception):
    """A mesh host died or hung during an attempt (recoverable by a restart)."""


def recoverable() -> tuple[type[BaseException], ...]:
    """The exceptions of a lost host: a restart may fix them."""
    import ray.exceptions as rex

    return (HostFailure, rex.RayActorError, rex.ObjectLostError, rex.GetTimeoutError,
            rex.NodeDiedError, rex.WorkerCrashedError)


#: Seconds :func:`gather` waits, after a host's call raised, for the others to show
#: whether a host died (what Ray takes to declare a killed node's actor dead).
DEATH_GRACE = 30.0


#: Seconds :func:`gather` waits on calls still running before it asks whether the hosts
#: whose calls already returned are still there.
PROBE_EVERY = 5.0


def gather(refs: Sequence[Any], timeout: float, what: str, grace: float = DEATH_GRACE,
           actors: Sequence[Any] | None = None) -> list[Any]:
    """The results of ``refs`` in order; raises as soon as one fails (a dead actor is
    noticed at once, not after its peers time out waiting for it), or
    :class:`HostFailure` if they are not all done within ``timeout`` seconds.

    A call that raised an error of its own (a :class:`ray.exceptions.RayTaskError`) may
    be the consequence of another host's death: with the collective transport a
    surviving host's collective fails ("connection closed by peer") as soon as its
    peer's process is gone, often before Ray has declared the dead actor dead. So the
    other calls get up to ``grace`` seconds to fail as a lost host; if one does, the
    attempt fails with that (recoverable) error, else with the task's own error (not
    retried).

    With ``actors`` (``refs[i]`` is a call of ``actors[i]``), a host whose call returned
    is asked every :data:`PROBE_EVERY` seconds whether it is still there while others
    run: one that left after its part of a step (its pod deleted: a message it sent
    lost with its node) raises :class:`HostFailure` at once, instead of its peers
    waiting out their receive timeouts for that message."""
    import ray
    import ray.exceptions as rex

    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HostFailure(f"{what}: {len(pending)} of {counted(len(refs), 'mesh host')} gave no answer "
                              f"within {timeout:g} s (hung?)")
        done, pending = ray.wait(pending, num_returns=1, timeout=min(left, PROBE_EVERY) if actors else left)
        if not done and actors is not None:
            running = set(pending)
            _raise_gone([actor for actor, ref in zip(actors, refs, strict=True) if ref not in running], what)
        for ref in done:
            try:
                ray.get(ref)  # raises the host's error, if any
            except rex.RayTaskError:
                _raise_lost_host(pending, min(grace, max(deadline - time.monotonic(), 0.0)), what)
                raise
    return ray.get(list(refs))


def _raise_gone(finished: Sequence[Any], what: str) -> None:
    """Raise :class:`HostFailure` if an actor of ``finished`` (their calls returned) is
    gone (see :func:`gather`)."""
    import ray

    probes = [actor.alive.remote() for actor in finished]
    ready, _ = ray.wait(probes, num_returns=len(probes), timeout=PROBE_EVERY)
    for ref in ready:
        try:
            ray.get(ref)
        except recoverable() as lost:
            reason = str(lost).splitlines()[0] if str(lost) else ""
            raise HostFailure(f"{what}: a mesh host left after its part of the step "
                              f"({type(lost).__name__}: {reason})") from lost


def _raise_lost_host(pending: Sequence[Any], grace: float, what: str) -> None:
    """Raise :class:`HostFailure` if one of ``pending`` fails as a lost host within
    ``grace`` seconds (see :func:`gather`)."""
    import ray

    deadline = time.monotonic() + grace
    pending = list(pending)
    while pending and (left := deadline - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                ray.get(ref)
            except recoverable() as lost:
                reason = str(lost).splitlines()[0] if str(lost) else ""
                raise HostFailure(f"{what}: a mesh host was lost ({type(lost).__name__}: {reason})") from lost
            except Exception:  # another host's own error: look on
                continue


class MeshGroup:
    """The actors of one attempt: ``actors[stage][host]``, built and connected.

    After a mesh failed, :meth:`repair` replaces that mesh's actors alone (the object
    store transport: each mesh is its own JAX process group) and connects every actor
    again under a new epoch; the other meshes keep their processes, their built
    stages and their compiled executables. With the collective transport, whose one
    JAX group spans the job, nothing can be kept: the driver builds a new group."""

    def __init__(self, manifest_yaml: str, plan: Plan, hosts: Sequence[MeshHostSpec], seed: int, timeout: float,
                 transport: Transport = Transport.OBJECT_STORE, checkpoints: bool = False) -> None:
        self.manifest_yaml, self.plan_json, self.seed = manifest_yaml, plan.to_json(), seed
        self.timeout, self.checkpoints, self.transport = timeout, checkpoints, Transport(transport)
        self.hosts = list(hosts)
        self.epoch = 0
        self._calls: list[Any] = []  # the last step's (or evaluation's) calls, drained after a repair
        self.layouts: list[dict] = [{} for _ in plan.stages]
        self.actors: list[list[Any]] = [[] for _ in plan.stages]
        self.nodes: dict[str, str] = {}  # host resource -> the Ray node its actor runs on
        for host in self.hosts:
            self.actors[host.mesh].append(self._actor(host))
        try:
            self._connect(range(len(self.actors)))
        except BaseException:
            # No actor of a failed setup may live on: one waiting in
            # jax.distributed.initialize (collective transport) for a peer that died
            # would hold its host's resource, and the next attempt could not start.
            self.stop()
            raise

    def _actor(self, host: MeshHostSpec, node: str | None = None) -> Any:
        """A mesh host's actor, pinned by its resource (and to ``node``, if given)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        pinned = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)} if node else {}
        return (ray.remote(MeshHost).options(resources={host.resource: 1}, num_cpus=0, max_concurrency=16, **pinned)
                .remote(self.manifest_yaml, self.plan_json, host.mesh, host.host, self.seed,
                        transport=str(self.transport)))

    @property
    def repairable(self) -> bool:
        """Whether a failed mesh can be replaced alone (:meth:`repair`): with the object
        store transport, several meshes, and checkpoints (every mesh, survivors too,
        goes back to the same step; without one a new mesh would start from its seed
        beside trained ones)."""
        return self.transport is Transport.OBJECT_STORE and len(self.actors) > 1 and self.checkpoints

    def broken(self, timeout: float = 10.0) -> set[int]:
        """The meshes with a host whose actor no longer answers."""
        import ray

        asked = [(mesh, actor.alive.remote()) for mesh, group in enumerate(self.actors) for actor in group]
        broken = set()
        for mesh, ref in asked:
            try:
                ray.get(ref, timeout=timeout)
            except Exception:  # noqa: BLE001 - dead, unreachable or hung: that mesh is replaced
                broken.add(mesh)
        return broken

    def repair(self, meshes: set[int], join_timeout: float) -> None:
        """Replace every actor of ``meshes`` (a mesh's JAX group died with its failed
        host) with a new one on the same host resource, on a node that is not the
        lost one (:func:`~.cluster.host_node`, waiting up to ``join_timeout`` seconds
        for it to join), build their stages, and connect every actor under a new
        epoch. On failure the new actors are stopped and the survivors kept:
        :meth:`broken` then names what to repair again."""
        import ray

        for mesh in sorted(meshes):
            for actor in self.actors[mesh]:
                ray.kill(actor)
        survivors = [a for mesh, group in enumerate(self.actors) if mesh not in meshes for a in group]
        # A survivor's background save of a checkpoint the failed mesh never finished
        # ends first: the restore that follows tidies that checkpoint away.
        with contextlib.suppress(*recoverable()):
            gather([a.wait_saved.remote() for a in survivors], self.timeout, "checkpoint")
        lost = {node for host in self.hosts if host.mesh in meshes and (node := self.nodes.get(host.resource))}
        # Every new host's node first (this may time out), then the actors.
        placed = {host: host_node(host.resource, lost, ray.nodes, join_timeout)
                  for host in self.hosts if host.mesh in meshes}
        for mesh in sorted(meshes):
            self.actors[mesh] = [self._actor(host, node) for host, node in placed.items() if host.mesh == mesh]
        try:
            self._connect(sorted(meshes))
        except BaseException:
            for mesh in meshes:
                for actor in self.actors[mesh]:
                    ray.kill(actor)
            raise
        # The failed call's results: a survivor's stale step fails now that its mailbox
        # is aborted. Fetched (and dropped) here, Ray does not log each as an unhandled
        # error with its traceback.
        stale, self._calls = self._calls, []
        for ref in stale:
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=5.0)

    def _connect(self, meshes: Sequence[int] | range) -> None:
        """Join the process groups of ``meshes``, build their stages, then hand every
        actor every handle and layout (a new epoch)."""
        timeout = self.timeout
        firsts = [group[0] for group in self.actors]
        savers: list[str | None] = [None] * len(self.actors)
        if self.transport is Transport.COLLECTIVE:  # one group: every host of every mesh
            (job,) = gather([firsts[0].coordinator.remote()], timeout, "coordinator")
            addresses: list[str | None] = [job] * len(self.actors)
            if self.checkpoints:  # the checkpoint helpers: one group per mesh of several hosts
                wide = [mesh for mesh, group in enumerate(self.actors) if len(group) > 1]
                for mesh, address in zip(wide, gather([firsts[m].free_address.remote() for m in wide], timeout,
                                                      "coordinator"), strict=True):
                    savers[mesh] = address
        else:  # one group per mesh of several hosts
            addresses = [None] * len(self.actors)
            wide = [mesh for mesh in meshes if len(self.actors[mesh]) > 1]
            for mesh, address in zip(wide, gather([firsts[m].coordinator.remote() for m in wide], timeout,
                                                  "coordinator"), strict=True):
                addresses[mesh] = address
        gather([a.setup.remote(addresses[mesh], checkpoints=self.checkpoints, saver_coordinator=savers[mesh])
                for mesh in meshes for a in self.actors[mesh]], timeout, "setup")
        for mesh, layout in zip(meshes, gather([firsts[m].layout.remote() for m in meshes], timeout, "layout"),
                                strict=True):
            self.layouts[mesh] = layout
        self.epoch += 1
        placed = [(host, actor) for mesh in meshes
                  for host, actor in zip([h for h in self.hosts if h.mesh == mesh], self.actors[mesh], strict=True)]
        nodes = gather([a.node.remote() for _, a in placed], timeout, "node")
        for (host, _), node in zip(placed, nodes, strict=True):
            self.nodes[host.resource] = node
        gather([a.connect.remote(self.actors, self.layouts, self.epoch) for a in self.all], timeout, "connect")

    @property
    def all(self) -> list[Any]:
        return [a for group in self.actors for a in group]

    def step(self, step: int, scale: float | None = None) -> list[list[dict[str, Any]]]:
        """Run one step on every host (with loss ``scale``: float16); replies as
        ``[stage][host]``."""
        refs = [[a.step.remote(step, scale) for a in group] for group in self.actors]
        self._calls = [r for group in refs for r in group]
        flat = gather(self._calls, self.timeout, f"step {step + 1}", actors=self.all)
        out, k = [], 0
        for group in refs:
            out.append(flat[k:k + len(group)])
            k += len(group)
        return out

    def evaluate(self, batches: int) -> float:
        """The job's eval loss now: the mean loss of the eval batches, each evaluated by
        every stage together (forward only), one batch after another."""
        losses = []
        for index in range(batches):
            self._calls = [a.evaluate.remote(index) for a in self.all]
            replies = gather(self._calls, self.timeout, "evaluation", actors=self.all)
            losses += [loss for loss in replies if loss is not None]
        return float(np.mean(losses))

    def save(self, root: str, step: int, run: dict[str, Any], asynchronous: bool) -> None:
        """Checkpoint ``step``: every mesh saves its part (all its hosts at once)."""
        parts = [mesh_part(index) for index in range(len(self.actors))]
        gather([a.save.remote(root, step, parts, run, asynchronous) for a in self.all], self.timeout,
               "checkpoint")

    def wait_saved(self) -> None:
        """Block until every host's last save is finalized."""
        gather([a.wait_saved.remote() for a in self.all], self.timeout, "checkpoint")

    def restore(self, root: str, step: int) -> list[str]:
        """Every mesh restores checkpoint ``step``; what the hosts found damaged."""
        replies = gather([a.restore.remote(root, step) for a in self.all], self.timeout, "restore")
        return [reply for reply in replies if reply]

    def params(self) -> dict[str, np.ndarray]:
        """Every stage's parameters, assembled from every host's shards."""
        pieces: dict[str, Any] = {}
        for shards in gather([a.shards.remote() for a in self.all], self.timeout, "parameters"):
            for name, (shape, dtype, parts) in shards.items():
                if name.startswith("params/"):
                    pieces.setdefault(name[len("params/"):], (shape, dtype, []))[2].extend(parts)
        return {name: assemble_pieces(shape, dtype, parts)
                for name, (shape, dtype, parts) in pieces.items()}

    def release(self) -> None:
        """The job is done: every host's worker may stop Ray and exit 0."""
        gather([a.release.remote() for a in self.all], self.timeout, "release")

    def hold(self, timeout: float = 10.0) -> int:
        """The driver stops and saves: every host's worker keeps Ray up for it
        (``MeshHost.hold``). The calls run beside the step in flight (call this from a
        thread of its own); how many hosts' workers hold within ``timeout``."""
        import ray

        calls = [actor.hold.remote() for actor in self.all]
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout)
        return sum(1 for answer in ready if _answer(answer))

    def let_go(self, timeout: float = 5.0) -> None:
        """The driver is done after a stop: every held worker may stop Ray now
        (``MeshHost.let_go``). Hosts already gone are not waited for past ``timeout``."""
        import ray

        ray.wait([actor.let_go.remote() for actor in self.all], num_returns=len(self.all), timeout=timeout)

    def stop(self) -> None:
        import ray

        for actor in self.all:
            ray.kill(actor)


def _answer(ref: Any) -> bool:
    """A finished call's value; False where it failed (its host gone)."""
    import ray

    try:
        return bool(ray.get(ref))
    except Exception:  # noqa: BLE001 - a host that left cannot hold
        return False
