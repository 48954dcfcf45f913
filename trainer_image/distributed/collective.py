"""Cross-mesh transfers as XLA collectives over one JAX process group of every mesh host.

The alternative to the object store (:mod:`.transport`), behind the same
:class:`~alpajob.trainer_image.runtime.executor.StageLink` interface. With
``--transport collective`` every mesh host of the job joins **one**
``jax.distributed`` group (process ``k`` = the ``k``-th mesh host, meshes in order,
:func:`process_ids`). A message from mesh ``A`` to mesh ``B`` is a jitted
``shard_map`` of ``jax.lax.ppermute`` over a 1-D mesh of ``A``'s devices then
``B``'s; only the processes of ``A`` and ``B`` run it, every one supplying the
blocks of its own devices (receivers supply zeros). What each round carries is
:mod:`.crossing`'s plan. On CPU the collectives run on gloo (tested here); on GPU the
same code runs them on NCCL, which moves the bytes device to device. **This has not
been run on a GPU.**

**Ordering.** A collective is a rendezvous: it completes only once every process of
its mesh has dispatched it, and a process's devices run cross-process executables in
dispatch order (so each process dispatches from one thread: the stage's). Program
order does not agree between stages. 1F1B, 2 stages::

    stage 0: send act0, send act1, recv grad0, ...
    stage 1: recv act0, send grad0, recv act1, ...

As rendezvous, stage 0 waits in ``send act1`` for stage 1, which waits in ``send
grad0``: a deadlock that buffered sends (the object store) never see. So every
process performs its messages in one **global order** that every process computes
alike (:func:`global_order`): simulate all stages' programs
(:func:`~alpajob.trainer_image.runtime.messages.stage_messages`) with buffered sends and
Lamport clocks (every event ticks its stage's clock; a send stamps its message; a
receive sets ``clock = max(clock, stamp) + 1``) and sort the messages by ``(stamp,
sender)``. A stage's sends are stamped in program order, and anything it received
before a send has a smaller stamp, so :class:`CollectiveLink` can keep the program as
it is: before a send, it first performs (prefetches) every receive of its stage that
precedes the send in the global order; a receive performs the stage's receives in
global order up to the one asked for, keeping the others for later. Every process
then performs a subsequence of one total order, so the first pending message is
always next on both of its ends: no deadlock. In the example the stamps are act0 1,
act1 2 (stage 0), grad0 3 (stage 1: its receive of act0 set its clock to 2), so the
order is ``act0, act1, grad0``: stage 1 receives act1 ahead of its program (kept until
its forward asks for it) before it sends grad0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpajob.api.plan import Plan
from alpajob.trainer_image.distributed.crossing import Crossing, Tiles, plan_crossing
from alpajob.trainer_image.distributed.transport import local_slices, mesh_positions, position_tiles
from alpajob.trainer_image.runtime.executor import destination_sharding
from alpajob.trainer_image.runtime.messages import (
    Event,
    Key,
    Send,
    differentiable_inputs,
    layout_key,
)
from alpajob.trainer_image.runtime.split import SplitProgram
from alpajob.trainer_image.runtime.transfer import Box, box_of


class OrderError(RuntimeError):
    """The stages' programs cannot run, or a stage left the global order."""


def process_ids(plan: Plan) -> list[list[int]]:
    """``[mesh][host]`` -> the JAX process index of that mesh host in the job's group."""
    out, k = [], 0
    for stage in plan.stages:
        hosts = stage.submesh_shape[0]
        out.append(list(range(k, k + hosts)))
        k += hosts
    return out


def global_order(programs: Sequence[Sequence[Event]]) -> list[Send]:
    """Every message of the step in the order all processes perform them (see the
    module docstring); ``programs[s]``: stage ``s``'s events in program order."""
    clocks = [0] * len(programs)
    cursor = [0] * len(programs)
    stamps: dict[tuple[int, Key], tuple[int, Send]] = {}
    received: set[tuple[int, Key]] = set()
    while any(c < len(p) for c, p in zip(cursor, programs, strict=True)):
        moved = False
        for s, events in enumerate(programs):
            while cursor[s] < len(events):
                event = events[cursor[s]]
                address = (event.receiver, event.key)
                if isinstance(event, Send):
                    if address in stamps:
                        raise OrderError(f"{event} is sent twice")
                    clocks[s] += 1
                    stamps[address] = (clocks[s], event)
                elif address in stamps:
                    clocks[s] = max(clocks[s], stamps[address][0]) + 1
                    received.add(address)
                else:
                    break
                cursor[s] += 1
                moved = True
        if not moved:
            waiting = {s: p[cursor[s]] for s, p in enumerate(programs) if cursor[s] < len(p)}
            raise OrderError(f"the stages' programs deadlock even with buffered sends: {waiting}")
    lost = [event for address, (_, event) in stamps.items() if address not in received]
    if lost:
        raise OrderError(f"messages sent but never received: {lost}")
    return [event for _, event in sorted(stamps.values(), key=lambda t: (t[0], t[1].sender))]


def own_messages(order: Sequence[Send], s: int) -> list[Send]:
    """The messages stage ``s`` sends or receives, in the global order."""
    return [m for m in order if s in (m.sender, m.receiver)]


@dataclass(frozen=True)
class Source:
    """How a stage holds a value it sends: tiles by mesh position, shape, dtype."""

    tiles: Tiles
    shape: tuple[int, ...]
    dtype: str


def source_layout(split: SplitProgram, stage: Any) -> dict[tuple[str, int], Source]:
    """Per layout key (:func:`~alpajob.trainer_image.runtime.messages.layout_key`), the
    sharding a stage sends that value in: what its executables return (shared
    parameters as placed, activations as the forward's outputs, input gradients as
    the backward's, gradient sums as the float32 accumulators)."""
    s = stage.index
    program = split.stages[s]
    out: dict[tuple[str, int], Source] = {}

    def add(key: tuple[str, int], sharding: Any, aval: Any, dtype: Any = None) -> None:
        shape = tuple(aval.shape)
        out[key] = Source(position_tiles(sharding, shape), shape, str(np.dtype(dtype or aval.dtype)))

    for leaf in program.params:
        aval = split.avals[split.param_ids[leaf]]
        if split.home[leaf] == s:
            add(("param", leaf), stage.param_sharding[leaf], aval)
        else:
            add(("shared", leaf), stage.acc_sharding[leaf], aval, np.float32)
    for pos, vid in enumerate(program.outputs):
        add(("act", vid), stage.output_sharding[pos], split.avals[vid])
    for pos in differentiable_inputs(split, s):
        vid = program.inputs[pos]
        add(("grad", vid), stage.input_sharding[pos], split.avals[vid])
    return out


@dataclass
class _Compiled:
    """One message layout's crossing and its executables (cached per layout): the
    rounds' ``ppermute``, and per mesh position one that cuts a sender's blocks out of
    its shard and one that builds a receiver's tile from its blocks (one dispatch per
    device and message, where slicing, padding and placing piece by piece would take
    several, each a copy)."""

    crossing: Crossing
    dtype: str
    mesh: Mesh
    offset: int  # union index of the receiving mesh's position 0
    local: list[Any]  # this process's devices in the union, in union order
    run: Any
    sends: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)  # src position -> (round, route)
    receives: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)  # dst position -> (round, route)
    cutters: dict[int, Any] = field(default_factory=dict)
    builders: dict[int, Any] = field(default_factory=dict)

    def cutter(self, position: int, shard_box: Box) -> Any:
        """Sending position ``position``'s blocks of every round it sends in, flat and
        padded to the round's length, from its shard (box ``shard_box``)."""
        if position not in self.cutters:
            cuts = [(local_slices(route.box, shard_box), route.size, self.crossing.lengths[r])
                    for r, route in self.sends[position]]

            def cut(shard: jax.Array) -> tuple[jax.Array, ...]:
                return tuple(jnp.pad(shard[sl].reshape(-1), (0, length - size)) for sl, size, length in cuts)

            whole = len(cuts) == 1 and cuts[0][1] == cuts[0][2] == int(np.prod([hi - lo for lo, hi in shard_box]))
            # The whole shard as one block: a reshape, which needs no executable of its own.
            self.cutters[position] = (lambda shard: (shard.reshape(-1),)) if whole else jax.jit(cut)
        return self.cutters[position]

    def builder(self, position: int) -> Any:
        """Receiving position ``position``'s tile from the blocks it received (one per
        round it receives in, in round order)."""
        if position not in self.builders:
            tile = self.crossing.dst_tiles[position]
            shape = [hi - lo for lo, hi in tile]
            routes = [route for _, route in self.receives[position]]
            dtype = self.dtype

            def build(*blocks: jax.Array) -> jax.Array:
                pieces = [b[: r.size].reshape([hi - lo for lo, hi in r.box]) for b, r in zip(blocks, routes, strict=True)]
                if len(routes) == 1 and routes[0].box == tile:
                    return pieces[0]
                whole = jnp.zeros(shape, dtype)
                for piece, route in zip(pieces, routes, strict=True):
                    start = [lo - o for (lo, _), (o, _) in zip(route.box, tile, strict=True)]
                    whole = jax.lax.dynamic_update_slice(whole, piece, start)
                return whole

            self.builders[position] = jax.jit(build)
        return self.builders[position]


class CollectiveMover:
    """Moves messages between meshes with one ``ppermute`` per round (see the module
    docstring). ``grids[stage]``: that stage's devices by mesh position (global
    device objects, the same in every process); ``layouts[stage]``: its
    ``{"tiles": receive tiles, "sources": source_layout}`` by layout key."""

    def __init__(self, grids: Sequence[Sequence[Any]], layouts: Sequence[Mapping[str, Any]]) -> None:
        self.grids = [list(g) for g in grids]
        self.layouts = layouts
        self.me = jax.process_index()
        self._cache: dict[tuple[int, int, tuple[str, int]], _Compiled] = {}
        self.sent_bytes = 0

    def compiled(self, message: Send) -> _Compiled:
        """The crossing and the executable of ``message``'s layout (built once)."""
        lkey = layout_key(message.key)
        cached = self._cache.get((message.sender, message.receiver, lkey))
        if cached is not None:
            return cached
        source: Source = self.layouts[message.sender]["sources"][lkey]
        sending, receiving = self.grids[message.sender], self.grids[message.receiver]
        crossing = plan_crossing(source.shape, source.tiles, self.layouts[message.receiver]["tiles"][lkey],
                                 {p: d.process_index for p, d in enumerate(receiving)})
        union = sending + receiving
        mesh = Mesh(np.array(union, dtype=object), ("x",))
        offset = len(sending)
        perms = [[(r.src, offset + r.dst) for r in members] for members in crossing.rounds]

        def permute(blocks: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(jax.lax.ppermute(b, "x", perm) for b, perm in zip(blocks, perms, strict=True))

        run = jax.jit(jax.shard_map(permute, mesh=mesh, in_specs=(PartitionSpec("x"),),
                                    out_specs=PartitionSpec("x")))
        local = [d for d in union if d.process_index == self.me]
        compiled = _Compiled(crossing, source.dtype, mesh, offset, local, run)
        for r, members in enumerate(crossing.rounds):
            for route in members:
                compiled.sends.setdefault(route.src, []).append((r, route))
                compiled.receives.setdefault(route.dst, []).append((r, route))
        self._cache[(message.sender, message.receiver, lkey)] = compiled
        return compiled

    def exchange(self, c: _Compiled, pieces: Mapping[tuple[int, Any], Any]) -> tuple[Any, ...]:
        """Run the rounds (the collective); ``pieces[(round, device)]``: the flat padded
        block a local device sends in that round (zeros for every other local device).
        Every process of both meshes calls it; each gets its devices' received blocks."""
        blocks = []
        for r, length in enumerate(c.crossing.lengths):
            arrays = [pieces[r, d] if (r, d) in pieces else jnp.zeros((length,), c.dtype, device=d)
                      for d in c.local]
            sharding = NamedSharding(c.mesh, PartitionSpec("x"))
            shape = (len(c.mesh.devices.flat) * length,)
            blocks.append(jax.make_array_from_single_device_arrays(shape, sharding, arrays))
        return c.run(tuple(blocks))

    def pieces(self, message: Send, value: jax.Array) -> dict[tuple[int, Any], Any]:
        """The blocks this process's devices send for ``message``: per (round, device),
        its piece of ``value``, flattened and padded (sliced on the device)."""
        c = self.compiled(message)
        if tuple(value.shape) != c.crossing.shape or str(value.dtype) != c.dtype:
            raise OrderError(f"{message}: a {value.dtype}{list(value.shape)} value, but the layout says "
                             f"{c.dtype}{list(c.crossing.shape)}")
        shards = {s.device: s for s in value.addressable_shards}
        out = {}
        for position, device in enumerate(self.grids[message.sender]):
            shard = shards.get(device)
            if shard is None or position not in c.sends:  # another host holds it, or it sends nothing
                continue
            blocks = c.cutter(position, box_of(shard.index, value.shape))(shard.data)
            for (r, route), block in zip(c.sends[position], blocks, strict=True):
                out[r, device] = block
                self.sent_bytes += route.size * value.dtype.itemsize
        return out

    def assemble(self, message: Send, received: Sequence[Any], sharding: Any) -> jax.Array:
        """The value of ``message`` on ``sharding`` (the receiver's) from the blocks
        :meth:`exchange` returned: each receiving device's tile from its pieces, then
        the plan's copies inside the process."""
        c = self.compiled(message)
        receiving = self.grids[message.receiver]
        blocks = [{shard.device: shard.data for shard in out.addressable_shards} for out in received]
        placed = {}
        for position, routes in c.receives.items():
            device = receiving[position]
            if device.process_index == self.me:
                placed[position] = c.builder(position)(*(blocks[r][device] for r, _ in routes))
        for src, dst in c.crossing.copies:
            if src in placed:
                placed[dst] = jax.device_put(placed[src], receiving[dst])
        where = mesh_positions(sharding)
        ordered = [placed[where[d.id]] for d in sharding.addressable_devices_indices_map(c.crossing.shape)]
        return jax.make_array_from_single_device_arrays(c.crossing.shape, sharding, ordered)

    def send(self, message: Send, value: jax.Array) -> None:
        """Perform ``message`` on a process of the sending mesh."""
        self.exchange(self.compiled(message), self.pieces(message, value))

    def receive(self, message: Send, sharding: Any) -> jax.Array:
        """Perform ``message`` on a process of the receiving mesh; the value on ``sharding``."""
        return self.assemble(message, self.exchange(self.compiled(message), {}), sharding)

    def move(self, message: Send, value: jax.Array, sharding: Any) -> jax.Array:
        """Both ends at once, when both meshes are devices of this process (tests)."""
        c = self.compiled(message)
        return self.assemble(message, self.exchange(c, self.pieces(message, value)), sharding)


class CollectiveLink:
    """A mesh host's :class:`~alpajob.trainer_image.runtime.executor.StageLink` over
    collectives: performs its stage's messages in the global order (``mine``,
    :func:`own_messages`) through ``mover``, prefetching receives (module docstring)."""

    def __init__(self, split: SplitProgram, stage: Any, mine: Sequence[Send], mover: Any) -> None:
        self.split, self.stage, self.mover = split, stage, mover
        self.index = stage.index
        self._todo = deque(mine)
        self._senders = {m.key: m.sender for m in mine if m.receiver == self.index}
        self._inbox: dict[Key, Any] = {}

    @property
    def pending(self) -> int:
        """Messages of the step not performed yet (0 once the program has ended)."""
        return len(self._todo) + len(self._inbox)

    def _receive_until(self, message: Send) -> None:
        """Perform this stage's receives that precede ``message`` in the global order."""
        while self._todo and self._todo[0] != message:
            head = self._todo.popleft()
            if head.sender == self.index:
                raise OrderError(f"stage {self.index} reached {message} before sending {head}: its "
                                 f"program does not follow the global order")
            self._inbox[head.key] = self._receive(head)
        if not self._todo:
            raise OrderError(f"{message} is not in stage {self.index}'s part of the global order")

    def _receive(self, message: Send) -> Any:
        return self.mover.receive(message, destination_sharding(self.split, self.stage, message.key))

    def send(self, stage: int, key: Key, value: jax.Array) -> None:
        message = Send(self.index, stage, key)
        self._receive_until(message)
        self._todo.popleft()
        self.mover.send(message, value)

    def send_all(self, sends: Sequence[tuple[int, Key, Any]]) -> None:
        for stage, key, value in sends:
            self.send(stage, key, value)

    def receive(self, key: Key) -> jax.Array:
        if key in self._inbox:
            return self._inbox.pop(key)
        if key not in self._senders:
            raise OrderError(f"stage {self.index} receives {key!r}, which no stage sends it")
        message = Send(self._senders[key], self.index, key)
        self._receive_until(message)
        self._todo.popleft()
        return self._receive(message)
