"""The collective cross-mesh transport: its global message order, its rounds and its
moves in one process (training through it on a loopback Ray cluster, and recovery, are
in test_distributed.py)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpajob.api.spec import Schedule
from alpajob.trainer_image.distributed.collective import (
    CollectiveLink,
    CollectiveMover,
    OrderError,
    Source,
    global_order,
    own_messages,
    process_ids,
)
from alpajob.trainer_image.distributed.crossing import permutation_rounds, plan_crossing
from alpajob.trainer_image.distributed.transport import position_tiles
from alpajob.trainer_image.runtime.messages import Receive, Send, fuses_update, stage_messages
from alpajob.trainer_image.runtime.split import SplitProgram, StageProgram

# ----------------------------------------------------------------------------- order


def _chain(num_stages: int) -> SplitProgram:
    """A hand-made split of ``num_stages`` stages: stage ``s`` sends float activation
    ``100 + s`` to ``s + 1``; stage 0 also sends an integer one (no gradient) to stage
    1 and a skip connection to stage 2; parameter 0 (stage 0's) is tied into the last
    stage."""
    f32 = jax.ShapeDtypeStruct((2,), np.float32)
    i32 = jax.ShapeDtypeStruct((2,), np.int32)
    avals: list[Any] = [f32] * 300
    avals[200] = i32
    last = num_stages - 1
    consumers: dict[int, tuple[int, ...]] = {}
    for s in range(last):
        consumers[100 + s] = (s + 1, 2) if s == 0 and num_stages > 2 else (s + 1,)
    consumers[200] = (1,)
    producer = {vid: int(vid - 100) if vid < 200 else 0 for vid in consumers}
    stages = []
    for s in range(num_stages):
        inputs = tuple(v for v, readers in consumers.items() if s in readers)
        outputs = tuple(v for v in consumers if producer[v] == s)
        params = (s, 0) if s == last and s != 0 else (s,)
        stages.append(StageProgram(s, (), params, (), inputs, outputs, s == last))
    return SplitProgram(
        stages=tuple(stages), avals=tuple(avals), param_ids=tuple(range(num_stages)), batch_ids=(),
        consts={}, loss=299, home=tuple(range(num_stages)), consumers=consumers, producer=producer,
    )


def _rendezvous(sequences: dict[int, list[Send]]) -> bool:
    """Whether stages that each perform their messages in the given order, every
    message a rendezvous of its two ends, all finish."""
    heads = dict.fromkeys(sequences, 0)
    while True:
        ready = None
        for s, seq in sequences.items():
            if heads[s] < len(seq):
                m = seq[heads[s]]
                other = m.receiver if m.sender == s else m.sender
                if heads[other] < len(sequences[other]) and sequences[other][heads[other]] == m:
                    ready = (s, other)
                    break
        if ready is None:
            return all(heads[s] == len(seq) for s, seq in sequences.items())
        for s in ready:
            heads[s] += 1


class _Recorder:
    """A mover that records what it performs (no data)."""

    def __init__(self) -> None:
        self.done: list[Send] = []

    def send(self, message: Send, _value: Any) -> None:
        self.done.append(message)

    def receive(self, message: Send, _sharding: Any) -> Any:
        self.done.append(message)
        return message.key


def _performed(split: SplitProgram, programs: list[list[Any]], order: list[Send], s: int) -> list[Send]:
    """What :class:`CollectiveLink` performs when stage ``s``'s program calls it."""
    recorder = _Recorder()
    stage = type("Stage", (), {"index": s})()
    link = CollectiveLink(split, stage, own_messages(order, s), recorder)
    link._receive = lambda m: recorder.receive(m, None)  # type: ignore[method-assign]
    for event in programs[s]:
        if isinstance(event, Send):
            link.send(event.receiver, event.key, None)  # type: ignore[arg-type]
        else:
            assert link.receive(event.key) == event.key
    assert link.pending == 0
    return recorder.done


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_global_order_is_consistent_and_never_deadlocks(schedule: Schedule, num_stages: int, micro_batches: int) -> None:
    split = _chain(num_stages)
    programs = [stage_messages(split, s, schedule, num_stages, micro_batches) for s in range(num_stages)]
    order = global_order(programs)
    sends = [e for p in programs for e in p if isinstance(e, Send)]
    assert sorted(map(repr, order)) == sorted(map(repr, sends))  # every message once
    performed = {s: _performed(split, programs, order, s) for s in range(num_stages)}
    for a, b in itertools.combinations(range(num_stages), 2):
        shared_a = [m for m in performed[a] if {m.sender, m.receiver} == {a, b}]
        shared_b = [m for m in performed[b] if {m.sender, m.receiver} == {a, b}]
        assert shared_a == shared_b, (a, b)
    assert _rendezvous(performed)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_a_stage_that_updates_with_its_last_backward_receives_the_shared_sums_before_it(schedule: Schedule) -> None:
    """Stage 0 owns parameter 0, which the later stage 2 reads too: it receives
    stage 2's gradient sum before its last backward (they run with the update as one
    executable). Owned by stage 2 and read by the earlier stage 0, the sum can only
    come after stage 0's last backward, which waits for stage 2's: stage 2 receives it
    after its program. Either way the global order completes."""
    split = _chain(3)
    assert fuses_update(split, 0)
    program = stage_messages(split, 0, schedule, 3, 4)
    shared = [n for n, e in enumerate(program) if isinstance(e, Receive) and e.key[0] == "shared"]
    last_grads = [n for n, e in enumerate(program) if isinstance(e, Receive) and e.key[:2] == ("grad", 3)]
    assert len(shared) == 1 and max(last_grads) < shared[0]
    later_home = dataclasses.replace(split, home=(2, 1, 2))  # parameter 0: owned by 2, read by 0
    assert later_home.shared_params() == {0: (0,)} and not fuses_update(later_home, 2)
    assert stage_messages(later_home, 2, schedule, 3, 4)[-1] == Receive(2, ("shared", 0, 0))
    for each in (split, later_home):
        programs = [stage_messages(each, s, schedule, 3, 4) for s in range(3)]
        order = global_order(programs)
        assert _rendezvous({s: _performed(each, programs, order, s) for s in range(3)})


def test_program_order_deadlocks_as_rendezvous_but_the_global_order_does_not() -> None:
    """1F1B, 2 stages: stage 0 sends act0, act1 then receives grad0; stage 1 receives
    act0, sends grad0, receives act1."""
    split = _chain(2)
    programs = [stage_messages(split, s, Schedule.ONE_F_ONE_B, 2, 2) for s in range(2)]

    def as_message(event: Any) -> Send:
        if isinstance(event, Send):
            return event
        sender = next(e.sender for p in programs for e in p
                      if isinstance(e, Send) and (e.receiver, e.key) == (event.receiver, event.key))
        return Send(sender, event.receiver, event.key)

    naive = {s: [as_message(e) for e in programs[s]] for s in range(2)}
    assert not _rendezvous(naive)
    order = global_order(programs)
    assert _rendezvous({s: own_messages(order, s) for s in range(2)})
    # Stage 1 receives act1 ahead of its program, before it sends grad0.
    float_acts = [m.key for m in own_messages(order, 1) if m.key[0] in ("act", "grad") and m.key[2] == 100]
    assert float_acts[:3] == [("act", 0, 100), ("act", 1, 100), ("grad", 0, 100, 1)]


def test_programs_that_deadlock_even_buffered_are_refused() -> None:
    programs = [[Receive(0, ("x",)), Send(0, 1, ("y",))], [Receive(1, ("y",)), Send(1, 0, ("x",))]]
    with pytest.raises(OrderError, match="deadlock"):
        global_order(programs)
    with pytest.raises(OrderError, match="never received"):
        global_order([[Send(0, 1, ("x",))], []])


def test_process_ids_number_every_mesh_host_of_the_job() -> None:
    stages = [type("S", (), {"submesh_shape": shape})() for shape in [(1, 2), (2, 2), (1, 2)]]
    plan = type("Plan", (), {"stages": stages})()
    assert process_ids(plan) == [[0], [1, 2], [3]]  # type: ignore[arg-type]


def test_an_unknown_transport_is_refused_naming_the_flag_or_variable(capsys: pytest.CaptureFixture[str]) -> None:
    from alpajob.api.errors import ManifestError
    from alpajob.api.runtime import TrainerRuntime, Transport
    from alpajob.cli.main import main

    assert TrainerRuntime.from_env({"ALPAJOB_TRANSPORT": "collective"}).transport is Transport.COLLECTIVE
    with pytest.raises(ManifestError, match=r"ALPAJOB_TRANSPORT.*'object-store'.*'collective'.*'nccl'"):
        TrainerRuntime.from_env({"ALPAJOB_TRANSPORT": "nccl"})
    with pytest.raises(SystemExit) as exited:
        main(["driver", "job.yaml", "--transport", "nccl"])
    assert exited.value.code == 2 and "--transport" in capsys.readouterr().err


# ----------------------------------------------------------------------------- rounds


@pytest.mark.parametrize("seed", range(20))
def test_rounds_are_permutations_that_carry_every_pair_once(seed: int) -> None:
    rng = random.Random(seed)
    pairs = [(rng.randrange(6), rng.randrange(5)) for _ in range(rng.randrange(1, 30))]
    rounds = permutation_rounds(pairs)
    assert sorted(i for r in rounds for i in r) == list(range(len(pairs)))
    for members in rounds:
        assert len({pairs[i][0] for i in members}) == len(members)
        assert len({pairs[i][1] for i in members}) == len(members)
    degree = max(max(sum(p[0] == s for p in pairs) for s in range(6)), max(sum(p[1] == d for p in pairs) for d in range(5)))
    assert degree <= len(rounds) <= 2 * degree - 1


SPECS = [P(), P("x"), P(None, "y"), P("x", "y"), P("y", "x"), P(("x", "y"))]


def _meshes() -> tuple[Mesh, Mesh]:
    d = jax.devices()
    return (Mesh(np.array(d[:4]).reshape(2, 2), ("x", "y")),
            Mesh(np.array(d[4:8]).reshape(2, 2), ("x", "y")))


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(range(len(SPECS)), repeat=2)))
def test_crossing_gives_every_receiving_position_its_tile(src: int, dst: int) -> None:
    """Receiving positions 0, 1 are one process and 2, 3 another: copies stay inside
    a process, everything else arrives by a route; every element exactly once."""
    shape = (8, 12)
    a, b = _meshes()
    src_tiles = position_tiles(NamedSharding(a, SPECS[src]), shape)
    dst_tiles = position_tiles(NamedSharding(b, SPECS[dst]), shape)
    process = {p: p // 2 for p in dst_tiles}
    crossing = plan_crossing(shape, src_tiles, dst_tiles, process)
    got = {p: np.zeros(shape, int) for p in dst_tiles}
    for members, length in zip(crossing.rounds, crossing.lengths, strict=True):
        assert max(r.size for r in members) == length
        for route in members:
            got[route.dst][tuple(slice(*r) for r in route.box)] += 1
    for src_pos, dst_pos in crossing.copies:
        assert process[src_pos] == process[dst_pos]
        assert dst_tiles[src_pos] == dst_tiles[dst_pos]
        got[dst_pos] += got[src_pos]
    for p, tile in dst_tiles.items():
        want = np.zeros(shape, int)
        want[tuple(slice(*r) for r in tile)] = 1
        np.testing.assert_array_equal(got[p], want)


def test_mover_reshards_across_meshes_in_one_process() -> None:
    """The collective mechanism without a process group: both meshes are devices of
    this process, so one call sends and receives."""
    a, b = _meshes()
    data = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    for src, dst in itertools.product(SPECS, SPECS):
        source = NamedSharding(a, src)
        target = NamedSharding(b, dst)
        layouts = [{"sources": {("act", 7): Source(position_tiles(source, data.shape), data.shape, "float32")}},
                   {"tiles": {("act", 7): position_tiles(target, data.shape)}}]
        mover = CollectiveMover([list(a.devices.flat), list(b.devices.flat)], layouts)
        moved = mover.move(Send(0, 1, ("act", 0, 7)), jax.device_put(data, source), target)
        assert moved.sharding == target
        np.testing.assert_array_equal(np.asarray(moved), data, err_msg=f"{src} -> {dst}")


# The Ray-cluster tests of this transport (equality with single-device training, and
# recovery from a killed worker) are in test_distributed.py, on its loopback cluster.


# ----------------------------------------------------------------------------- checkpoints


def test_shards_are_handed_over_once_per_box_and_come_back_bit_exact(tmp_path) -> None:
    """:func:`write_shards` writes one file per distinct box (a replicated array once,
    not once per device); :func:`read_shards` rebuilds every array on another mesh of
    the same shape, position for position, with the same spec, dtype and bits."""
    from alpajob.trainer_image.distributed.saver import read_shards, write_shards

    devices = jax.devices()
    first = Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b"))
    second = Mesh(np.array(devices[4:8]).reshape(2, 2), ("a", "b"))
    rng = np.random.default_rng(0)
    arrays = {
        "rows": jax.device_put(rng.standard_normal((32, 6), dtype=np.float32), NamedSharding(first, P("a", None))),
        "both": jax.device_put(rng.standard_normal((8, 4), dtype=np.float32), NamedSharding(first, P("b", "a"))),
        "half": jax.device_put(jax.numpy.full((4, 4), 3.0, jax.numpy.bfloat16), NamedSharding(first, P())),
        "count": jax.device_put(np.int32(7), NamedSharding(first, P())),
    }
    layout = write_shards(arrays, tmp_path)
    assert len(list(tmp_path.iterdir())) == 2 + 4 + 1 + 1
    back = read_shards(layout, tmp_path, second)
    for name, value in arrays.items():
        assert back[name].sharding == NamedSharding(second, value.sharding.spec), name
        assert back[name].dtype == value.dtype, name
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(value), err_msg=name)


def test_a_checkpoint_helper_saves_a_part_any_reader_restores(tmp_path) -> None:
    """A one-host mesh's helper (its own process, CPU devices, stock orbax) saves the
    mesh's arrays in the background as part ``mesh0`` of a checkpoint; this process
    reads that part back with the object store transport's reader, and the helper
    restores it, both bit for bit. A step it does not have is a clear error."""
    import types

    from alpajob.trainer_image.checkpoint.store import complete_steps, restore
    from alpajob.trainer_image.distributed.saver import HelperError, SaverProcess

    stage = types.SimpleNamespace(index=0, submesh_shape=(1, 4), logical_mesh_shape=(2, 2), axis_names=("x", "y"))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    rng = np.random.default_rng(1)
    arrays = {"params/w": jax.device_put(rng.standard_normal((16, 8), dtype=np.float32), NamedSharding(mesh, P("x", "y"))),
              "opt/0/count": jax.device_put(np.int32(3), NamedSharding(mesh, P()))}
    helper = SaverProcess(stage, 0, None)
    try:
        helper.save(arrays, str(tmp_path), 2, ["mesh0"], {"model": "test"}, True)
        helper.wait()
        assert complete_steps(tmp_path) == [2]
        targets = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for n, a in arrays.items()}
        read = restore(tmp_path, 2, targets)
        back = helper.restore(str(tmp_path), 2, arrays)
        assert not isinstance(back, str)
        for name, value in arrays.items():
            np.testing.assert_array_equal(np.asarray(read.arrays[name]), np.asarray(value), err_msg=name)
            np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(value), err_msg=name)
            assert back[name].sharding == value.sharding
        with pytest.raises(HelperError, match="no checkpoint of step 5"):
            helper.restore(str(tmp_path), 5, arrays)
    finally:
        helper.close()
    assert helper.process.returncode == 0 and not helper.staging.exists()
