"""The Ray actor of one mesh host: it owns the host's devices and runs its stage.

A driver creates one :class:`MeshHost` per mesh host of the plan, pinned to that host
by the host's custom resource (:func:`~.cluster.host_resource`). In its own process
(its own JAX runtime, with the devices the host was started with) the actor:

1. on :meth:`setup`, when its mesh spans several hosts, joins the mesh's JAX process
   group (``jax.distributed.initialize``; host 0's actor runs the coordinator at the
   address :meth:`coordinator` picked, every host is process ``host``), so the
   stage's SPMD executables run across the mesh's hosts (gloo collectives on CPU,
   NCCL on GPU). With the ``collective`` :class:`Transport` it instead joins one
   group of every mesh host of the job (process ids from
   :func:`~.collective.process_ids`, the coordinator on mesh 0 host 0). The mesh is
   the first ``m`` devices of each host, hosts in order, reshaped to the plan's
   logical mesh;
2. loads the manifest's model and traces its loss at the plan's micro-batch size,
   cutting it into the plan's stages exactly as the local runtime does (every actor
   makes the same cut, so value ids agree without any exchange), builds its stage on
   the mesh and places its own parameters, initialised from the run's seed, then
   opens the data for what the host reads of every batch (:mod:`.rows`: its stage's
   leaves, its devices' rows; a middle stage reads nothing);
3. publishes its :meth:`layout`: the tiles of everything it receives, per message
   address, and which host owns each mesh position, so senders can plan transfers
   onto it;
4. per :meth:`step`, runs its stage's instruction list
   (:func:`~alpajob.trainer_image.runtime.executor.run_stage_program`) with a
   :class:`RayLink`: sends are parcels of the transfer plan put into the object store
   and delivered to the receiving hosts' actors; receives wait on the actor's
   mailbox, fed by :meth:`deliver` (the actor runs several calls at once:
   ``max_concurrency``). Every host of a mesh runs the same program in the same
   order, as SPMD requires. With the ``collective`` transport the link is a
   :class:`~.collective.CollectiveLink` instead (collectives between the meshes'
   devices, in the job's global message order);
5. saves the stage's state as its mesh's part of a checkpoint, all hosts of the mesh
   together through orbax (:meth:`save`, in the background until :meth:`wait_saved`),
   and restores it from one, whichever meshes saved each array (:meth:`restore`).
   With the ``collective`` transport each host does so through its checkpoint helper
   (:mod:`.saver`: orbax cannot save one mesh's part in the job-wide group).

Each :meth:`connect` opens a new *epoch*: a fresh mailbox, and every message is
delivered with its sender's epoch, those of an older one dropped. After a mesh
failed, the driver replaces that mesh's actors and connects the survivors again
(:meth:`~.group.MeshGroup.repair`): a survivor keeps its built stage and compiled
executables, and a step of its still waiting on the failed peer fails at its next
wait (the old mailbox is aborted) without stealing or sending a message of the new
epoch.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import ray
import yaml

from alpajob.api.plan import plan_from_json
from alpajob.api.resource import parse_job
from alpajob.api.runtime import HOLD_FILE_ENV, RELEASE_FILE_ENV, TrainerRuntime, Transport
from alpajob.api.spec import Schedule
from alpajob.api.timeline import Span, SpanKind
from alpajob.api.wording import counted
from alpajob.trainer_image.checkpoint.names import load_stage, stage_arrays, targets
from alpajob.trainer_image.checkpoint.store import DamagedCheckpoint, PartWriter, mesh_part, restore
from alpajob.trainer_image.data.feed import open_feed
from alpajob.trainer_image.data.loader import EVERYTHING
from alpajob.trainer_image.distributed.collective import (
    CollectiveLink,
    CollectiveMover,
    OrderError,
    global_order,
    own_messages,
    process_ids,
    source_layout,
)
from alpajob.trainer_image.distributed.pieces import local_pieces
from alpajob.trainer_image.distributed.rows import host_need
from alpajob.trainer_image.distributed.saver import SaverProcess
from alpajob.trainer_image.distributed.transport import (
    assemble,
    cut_for_hosts,
    merge,
    position_tiles,
)
from alpajob.trainer_image.entrypoint import load_model
from alpajob.trainer_image.runtime.build import place_stage, split_for_plan
from alpajob.trainer_image.runtime.executor import (
    Key,
    Mailbox,
    StageTimes,
    destination_sharding,
    loss_seed,
    run_stage_eval,
    run_stage_program,
    split_micro_batches,
)
from alpajob.trainer_image.runtime.fused import FusedRunner
from alpajob.trainer_image.runtime.messages import layout_key, stage_messages
from alpajob.trainer_image.runtime.split import SplitProgram
from alpajob.trainer_image.step import training_optimizer


def addresses(split: SplitProgram, index: int) -> Iterator[tuple[Key, tuple[int, ...]]]:
    """One representative key (any micro-batch, any reader) per address stage ``index``
    receives on, with the shape of its value."""
    program = split.stages[index]
    for leaf in program.params:
        shape = tuple(split.avals[split.param_ids[leaf]].shape)
        yield ("param", leaf), shape
        yield ("shared", leaf, -1), shape
    for vid in program.inputs:
        yield ("act", -1, vid), tuple(split.avals[vid].shape)
    for vid in program.outputs:
        yield ("grad", -1, vid, -1), tuple(split.avals[vid].shape)


def sender_stage(split: SplitProgram, receiver: int, key: Key) -> int:
    """The stage that sends the message ``key`` to stage ``receiver``."""
    kind = key[0]
    if kind == "act":
        return split.producer[key[2]]
    if kind == "param":
        return split.home[key[1]]
    if kind in ("grad", "shared"):
        return int(key[-1])
    raise ValueError(f"unknown message kind {kind!r} (to stage {receiver})")


def mesh_devices(stage: Any, devices: Sequence[Any], processes: Sequence[int] | None = None) -> np.ndarray:
    """The stage's device grid: the first ``m`` devices of each of its ``n`` hosts
    (host ``j`` is JAX process ``processes[j]``, default ``j``), hosts in order, in
    its logical mesh shape."""
    hosts, per_host = stage.submesh_shape
    processes = list(range(hosts)) if processes is None else list(processes)
    chosen = []
    for host in range(hosts):
        own = sorted((d for d in devices if d.process_index == processes[host]), key=lambda d: d.id)
        if len(own) < per_host:
            raise RuntimeError(
                f"mesh {stage.index} host {host} has {len(own)} devices but the plan needs "
                f"{per_host} per host; start the mesh worker with --devices {per_host}"
            )
        chosen.extend(own[:per_host])
    return np.array(chosen, dtype=object).reshape(stage.logical_mesh_shape)


class RayLink:
    """A mesh host's link to the other stages' actors through the Ray object store.

    ``peers[stage][host]`` is an actor handle; ``layouts[stage]`` that stage's
    :meth:`MeshHost.layout`. Messages are delivered under ``(key, sending host)``.
    """

    def __init__(self, split: Any, stage: Any, host: int, peers: Sequence[Sequence[Any]], layouts: Sequence[dict],
                 mailbox: Any, timeout: float, epoch: int) -> None:
        self.split, self.stage, self.host, self.peers, self.layouts = split, stage, host, peers, layouts
        self.mailbox, self.timeout, self.epoch = mailbox, timeout, epoch
        self.sent_bytes = 0

    def send(self, stage: int, key: Key, value: Any) -> None:
        layout = self.layouts[stage]
        hosts = self.peers[stage]
        parcels = cut_for_hosts(value, layout["tiles"][layout_key(key)], layout["owners"], len(hosts))
        for peer, parcel in zip(hosts, parcels, strict=True):
            self.sent_bytes += parcel.nbytes
            peer.deliver.remote((key, self.host), ray.put(parcel), self.epoch)

    def send_all(self, sends: Sequence[tuple[int, Key, Any]]) -> None:
        for stage, key, value in sends:
            self.send(stage, key, value)

    def receive(self, key: Key) -> Any:
        senders = len(self.peers[sender_stage(self.split, self.stage.index, key)])
        parcels = [self.mailbox.get((key, h), timeout=self.timeout) for h in range(senders)]
        return assemble(merge(parcels), destination_sharding(self.split, self.stage, key))


def contract_coordinator(env: Mapping[str, str], transport: Transport, mesh: int, host: int) -> str | None:
    """The JAX coordinator the operator gave this pod (``ALPAJOB_COORDINATOR``: host 0's
    name under the job's headless Service, and the port its pod declares), if this
    actor is the one it is meant for: host 0 of the pod's own mesh, each mesh in its own
    process group (the object store transport). The collective transport's job-wide
    group has no address in the contract (its coordinator is mesh 0 host 0's, chosen
    at run time), and an actor placed outside such a pod (a local run) chooses too."""
    if Transport(transport) is not Transport.OBJECT_STORE or host != 0:
        return None
    runtime = TrainerRuntime.from_env(env)
    if runtime.coordinator and runtime.mesh == mesh and runtime.host == 0:
        return runtime.coordinator
    return None


class MeshHost:
    """One mesh host's actor (see the module docstring). Plain class: the driver wraps
    it with ``ray.remote``; tests may also drive it in-process."""

    def __init__(self, manifest_yaml: str, plan_json: str, mesh: int, host: int, seed: int,
                 receive_timeout: float = 300.0, transport: str = Transport.OBJECT_STORE) -> None:
        self.manifest_yaml = manifest_yaml
        self.plan = plan_from_json(plan_json)
        self.index, self.host, self.seed = mesh, host, seed
        self.hosts = self.plan.stages[mesh].submesh_shape[0]
        self.transport = Transport(transport)
        #: Per mesh, its hosts' JAX processes: one group per mesh, or one for the job.
        self.processes = (process_ids(self.plan) if self.transport is Transport.COLLECTIVE
                          else [list(range(s.submesh_shape[0])) for s in self.plan.stages])
        self.mover: CollectiveMover | None = None
        self.mine: list[Any] = []
        self.timeout = receive_timeout
        self._abort = threading.Event()
        self.mailbox = Mailbox(self._abort)
        self.peers: list[list[Any]] = []
        self.layouts: list[dict] = []
        self.epoch = 0  # of the last connect(): messages of another are dropped
        self.writer: PartWriter | None = None
        self.saver: SaverProcess | None = None  # the collective transport's checkpoint helper
        self._fused: FusedRunner | None = None  # a one-stage plan's steps (setup)

    def coordinator(self) -> str:
        """An address for this mesh's JAX coordinator (called on host 0 only; with the
        collective transport, on mesh 0 host 0 only, for the job's group): the runtime
        contract's when this actor runs in the pod it names (:func:`contract_coordinator`),
        else a free port of this node, chosen now."""
        given = contract_coordinator(os.environ, self.transport, self.index, self.host)
        if given is not None:
            return given
        return self.free_address()

    def release(self) -> bool:
        """The job is done: tell this host's ``alpajob mesh-worker`` to stop Ray and exit
        0, by writing the file it named in :data:`~alpajob.api.runtime.RELEASE_FILE_ENV`
        (a worker the driver did not start through a pod names none: False)."""
        return _tell_worker(RELEASE_FILE_ENV, "released by the driver")

    def hold(self) -> bool:
        """The driver got SIGTERM and saves the step it is at: tell this host's
        ``alpajob mesh-worker``, which may have got SIGTERM too (every pod of the attempt
        deleted at once), to keep Ray, and so this actor, up until the head is done, by
        writing the file it named in :data:`~alpajob.api.runtime.HOLD_FILE_ENV` (False
        where it named none). Runs beside a step (the actor is threaded)."""
        return _tell_worker(HOLD_FILE_ENV, "held by the driver: it saves the step it is at")

    def let_go(self) -> bool:
        """The driver saved and stops: a worker held after its SIGTERM may stop Ray now
        (the hold file removed; False where there was none)."""
        path = os.environ.get(HOLD_FILE_ENV)
        if not path or not os.path.exists(path):
            return False
        os.unlink(path)
        return True

    def free_address(self) -> str:
        """A free port of this node, chosen now, as ``ip:port``."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def setup(self, coordinator: str | None, init_timeout: int = 120, checkpoints: bool = False,
              saver_coordinator: str | None = None) -> dict[str, Any]:
        """Join the mesh's process group (several hosts) or the job's (collective
        transport), build the stage; who we are. With the collective transport and
        ``checkpoints``, also start the host's checkpoint helper (:mod:`.saver`; its
        mesh's helpers group at ``saver_coordinator`` when the mesh has several hosts)."""
        if self.transport is Transport.COLLECTIVE and checkpoints:
            self.saver = SaverProcess(self.plan.stages[self.index], self.host, saver_coordinator)
        if self.transport is Transport.COLLECTIVE:
            jax.distributed.initialize(coordinator, num_processes=sum(map(len, self.processes)),
                                       process_id=self.processes[self.index][self.host],
                                       initialization_timeout=init_timeout)
        elif self.hosts > 1:
            jax.distributed.initialize(coordinator, num_processes=self.hosts, process_id=self.host,
                                       initialization_timeout=init_timeout)
        manifest = parse_job(yaml.safe_load(self.manifest_yaml))
        training = manifest.spec.training
        self.model = load_model(manifest.spec.model, training.dtype)
        self.batch_size = training.global_batch_size
        optimizer = training_optimizer(training)
        params = self.model.init(jax.random.key(self.seed))
        self.split, names = split_for_plan(self.plan, self.model.loss, params, self.model.batch_shapes)
        plan_stage = self.plan.stages[self.index]
        grid = mesh_devices(plan_stage, jax.devices(), self.processes[self.index])
        mesh_obj = jax.sharding.Mesh(grid, tuple(plan_stage.axis_names))
        self.stage = place_stage(self.plan, self.split, names, self.index, mesh_obj, jax.tree.leaves(params), optimizer)
        del params
        self._loss_seed = loss_seed(self.plan.num_micro_batches, mesh_obj)
        # Every host reads a step's batch directly (batch_at), so a restart from any
        # checkpoint needs only the step number; and only what its devices take.
        self.need = (host_need(self.split, self.stage, self.plan.num_micro_batches)
                     if manifest.spec.data is not None else EVERYTHING)
        self.feed = open_feed(manifest, self.model, seed=self.seed, need=self.need, prefetch=0)
        self.evaluations = self.feed.eval_batches(training.eval_steps, self.need)  # none without spec.data.eval
        if len(self.plan.stages) == 1:
            self._fused = FusedRunner(self.split, self.stage, self.plan.num_micro_batches, self._loss_seed)
        return {"mesh": self.index, "host": self.host, "devices": len(jax.local_devices()),
                "platform": jax.devices()[0].platform, "pid": os.getpid(),
                "reads": sorted(self.need.leaves), "rows": None if self.need.rows is None else list(self.need.rows)}

    def layout(self) -> dict[str, Any]:
        """Per message address, the tiles (by mesh position) this stage receives into,
        and the host that owns each position. The same on every host of the mesh."""
        processes = self.processes[self.index]
        owners = {p: processes.index(d.process_index) for p, d in enumerate(self.stage.mesh.devices.flat)}
        tiles = {
            layout_key(key): position_tiles(destination_sharding(self.split, self.stage, key), shape)
            for key, shape in addresses(self.split, self.index)
        }
        if self.transport is Transport.COLLECTIVE:
            return {"tiles": tiles, "owners": owners, "sources": source_layout(self.split, self.stage)}
        return {"tiles": tiles, "owners": owners}

    def alive(self) -> bool:
        """Answers while the actor lives (the driver asks which meshes survived)."""
        return True

    def node(self) -> str:
        """The Ray node this actor runs on (the driver places a replacement elsewhere
        once this node is lost)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def connect(self, peers: list[list[Any]], layouts: list[dict], epoch: int = 0) -> None:
        """Learn every stage's actor handles (by host) and layout (index = stage); with
        the collective transport, also every stage's devices and the global order.
        Opens ``epoch`` (module docstring): a new mailbox; the old one is aborted, so a
        step still waiting there fails."""
        stale = self._abort
        self._abort = threading.Event()
        self.mailbox = Mailbox(self._abort)
        self.epoch = epoch
        stale.set()
        self.peers, self.layouts = peers, layouts
        if self.transport is Transport.COLLECTIVE:
            stages = self.plan.stages
            grids = [list(mesh_devices(stage, jax.devices(), self.processes[i]).flat)
                     for i, stage in enumerate(stages)]
            self.mover = CollectiveMover(grids, layouts)
            schedule, m = Schedule(self.plan.schedule), self.plan.num_micro_batches
            order = global_order([stage_messages(self.split, i, schedule, len(stages), m)
                                  for i in range(len(stages))])
            self.mine = own_messages(order, self.index)

    def deliver(self, key: Any, parcel: Any, epoch: int = 0) -> None:
        """A peer's message (Ray has fetched the parcel from the object store); one sent
        in another epoch than this host's is dropped."""
        if epoch == self.epoch:
            self.mailbox.put(key, parcel)

    def _agree(self, step: int) -> Callable[[jax.Array], bool]:
        """The verdict exchange of a loss-scaled step: host 0 of each stage sends its
        stage's verdict (all gradients finite?) to every host of every other stage;
        every host then has all of them and the same answer, with no driver round trip."""

        mailbox, peers, epoch = self.mailbox, self.peers, self.epoch  # this step's epoch

        def agree(finite: jax.Array) -> bool:
            mine = bool(np.asarray(finite.addressable_data(0)))
            if self.host == 0:
                for stage, hosts in enumerate(peers):
                    if stage != self.index:
                        for peer in hosts:
                            peer.deliver.remote(("finite", step, self.index), mine, epoch)
            others = [mailbox.get(("finite", step, stage), timeout=self.timeout)
                      for stage in range(len(peers)) if stage != self.index]
            return mine and all(others)

        return agree

    def step(self, step: int, scale: float | None = None) -> dict[str, Any]:
        """Run training step ``step`` (0-based) of this stage, with loss ``scale``
        (float16) if given; its times, losses (from host 0 only: every host of the mesh
        holds the same) and whether the update was applied."""
        read_before = self.feed.read_bytes
        batch = self.feed.batch_at(step)
        read = self.feed.read_bytes - read_before
        if self._fused is not None:
            return {**self._fused_step(batch, scale), "read_bytes": read}
        micro = split_micro_batches(batch, self.plan.num_micro_batches)
        link: RayLink | CollectiveLink
        if self.mover is not None:
            link = CollectiveLink(self.split, self.stage, self.mine, self.mover)
            before = self.mover.sent_bytes
        else:
            link = RayLink(self.split, self.stage, self.host, self.peers, self.layouts, self.mailbox, self.timeout,
                           self.epoch)
        times, losses, applied = run_stage_program(
            self.split, self.stage, Schedule(self.plan.schedule), len(self.plan.stages), micro, link,
            self._loss_seed, scale, self._agree(step),
        )
        if isinstance(link, CollectiveLink):
            if link.pending:
                raise OrderError(f"stage {self.index} ended its step with {counted(link.pending, 'message')} of "
                                 f"the global order not performed")
            sent = self.mover.sent_bytes - before  # type: ignore[union-attr]
        else:
            sent = link.sent_bytes
        own = [float(np.asarray(x.addressable_data(0))) for x in losses if x is not None]
        return {
            "times": dataclasses.asdict(times),
            "losses": own if self.host == 0 else [],
            "sent_bytes": sent,
            "read_bytes": read,
            "applied": applied,
        }

    def _fused_step(self, batch: Sequence[np.ndarray], scale: float | None) -> dict[str, Any]:
        """A one-stage plan's step as one executable (:mod:`~.runtime.fused`), every
        host of the mesh calling it together; :meth:`step`'s reply, the stage computing
        for the whole step."""
        assert self._fused is not None
        begin = time.perf_counter()
        losses, finite = self._fused.step(batch, scale)
        own = [float(x) for x in np.asarray(losses.addressable_data(0))]
        applied = bool(np.asarray(finite.addressable_data(0)))
        seconds = time.perf_counter() - begin
        times = StageTimes(seconds, 0.0, 0.0, (), (), 0.0, (Span(0, SpanKind.STEP, None, 0.0, seconds),))
        return {"times": dataclasses.asdict(times), "losses": own if self.host == 0 else [],
                "sent_bytes": 0, "applied": applied}

    def evaluate(self, index: int) -> float | None:
        """This stage's part of the evaluation of eval batch ``index`` (every stage of
        every mesh at once: :func:`run_stage_eval`); the batch's mean loss from host 0
        of the stage that computes the loss, None from the others. One batch per call:
        the next batch's messages have the same addresses, so a stage must not send
        them before every stage has taken this batch's."""
        micro = split_micro_batches(self.evaluations[index], self.plan.num_micro_batches)
        link = RayLink(self.split, self.stage, self.host, self.peers, self.layouts, self.mailbox, self.timeout,
                       self.epoch)
        losses = run_stage_eval(self.split, self.stage, micro, link)
        if not losses or self.host != 0:
            return None
        return float(np.mean([float(np.asarray(x.addressable_data(0))) for x in losses]))

    def arrays(self) -> dict[str, Any]:
        """This stage's parameters and optimizer state (global arrays), by checkpoint name."""
        return stage_arrays(self.stage)

    def shards(self) -> dict[str, Any]:
        """This host's distinct shards of :meth:`arrays`: name -> (shape, dtype, pieces)."""
        return {
            name: (tuple(value.shape), str(value.dtype), local_pieces(value))
            for name, value in self.arrays().items()
        }

    def save(self, root: str, step: int, parts: list[str], run: dict[str, Any], asynchronous: bool) -> None:
        """Save this mesh's part of checkpoint ``step`` (every host of the mesh at once;
        with ``asynchronous`` the write goes on in the background: :meth:`wait_saved`).
        With the collective transport the host's helper writes it (:mod:`.saver`)."""
        if self.saver is not None:
            arrays = jax.block_until_ready(self.arrays())
            self.saver.save(arrays, root, step, parts, run, asynchronous)
            return
        if self.writer is None:
            self.writer = PartWriter(root, mesh_part(self.index), asynchronous)
        # The last step's update may still run (JAX dispatches asynchronously) on another
        # of the actor's threads; the save's own collectives (a sharded array's
        # fingerprint) must not interleave with it on the mesh's devices, or each device
        # waits in a different collective (seen on CPU: XLA aborts the rendezvous).
        arrays = jax.block_until_ready(self.arrays())
        self.writer.save(step, arrays, parts, run)

    def wait_saved(self) -> None:
        """Block until this host's last save is finalized."""
        if self.saver is not None:
            self.saver.wait()
        if self.writer is not None:
            self.writer.wait()

    def restore(self, root: str, step: int) -> str | None:
        """Replace the stage's parameters and optimizer state with checkpoint ``step``'s
        (read from whichever meshes saved them); why not, if it is damaged."""
        if self.saver is not None:
            got = self.saver.restore(root, step, self.arrays())
            if isinstance(got, str):
                return got
            load_stage(self.stage, got)
            return None
        try:
            restored = restore(root, step, targets(self.arrays()))
        except DamagedCheckpoint as error:
            return str(error)
        load_stage(self.stage, restored.arrays)
        return None


def stage_times(reply: dict[str, Any]) -> StageTimes:
    """The :class:`StageTimes` of a :meth:`MeshHost.step` reply."""
    times = reply["times"]
    spans = tuple(Span(**{**span, "kind": SpanKind(span["kind"])}) for span in times.get("spans", ()))
    return StageTimes(**{**times, "forward": tuple(times["forward"]), "backward": tuple(times["backward"]),
                         "spans": spans})


def _tell_worker(variable: str, words: str) -> bool:
    """Write ``words`` to the file this host's ``alpajob mesh-worker`` named in the
    environment variable ``variable``; False where it named none (a worker not started
    through a pod)."""
    path = os.environ.get(variable)
    if not path:
        return False
    with open(path, "w") as marker:
        marker.write(words + "\n")
    return True
