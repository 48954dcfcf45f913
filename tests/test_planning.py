"""End-to-end planning on small zoo models: every method, the Plan document, errors,
and how many devices of a shared host a plan uses."""

import dataclasses
import json

import pytest

from alpajob.api.errors import InfeasibleError, ManifestError, PlanFormatError
from alpajob.api.plan import (
    PLAN_VERSION,
    plan_from_json,
    plan_json_schema,
    read_plan,
    write_plan,
)
from alpajob.api.spec import Method, Schedule
from alpajob.cli.main import main
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.cost.model import host_utilization, load_calibration
from alpajob.planner.plan.make import ManualStageOption, SearchOptions, make_plan
from alpajob.trainer_image.step import graph_of
from alpajob.trainer_image.zoo import resolve_model


@pytest.fixture(scope="module")
def gpt_graph():
    return graph_of(resolve_model("gpt", "tiny"), 32)


@pytest.fixture(scope="module")
def cpu8():
    return cluster_from_preset("cpu", 1, 8)


@pytest.fixture(scope="module")
def auto_result(gpt_graph, cpu8):
    return make_plan(gpt_graph, cpu8, SearchOptions(baselines=True))


def _check_plan_shape(plan, cluster):
    layers = len(plan.layers)
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == layers
    for before, after in zip(plan.stages, plan.stages[1:], strict=False):
        assert before.layers[1] == after.layers[0]
    used = [slot for stage in plan.stages for slot in stage.device_slots]
    assert len(used) == len(set(used)) <= cluster.num_devices
    for stage in plan.stages:
        n, m = stage.submesh_shape
        a, b = stage.logical_mesh_shape
        assert a * b == n * m == len(stage.device_slots)
        assert stage.peak_memory_bytes <= cluster.device.memory_bytes
        assert stage.predicted_seconds > 0
    assert plan.predicted_step_seconds > 0 and plan.predicted_pflops > 0


def test_auto_plan(auto_result, cpu8, gpt_graph):
    plan = auto_result.plan
    _check_plan_shape(plan, cpu8)
    assert plan.version == PLAN_VERSION
    assert plan.model.fingerprint == gpt_graph.fingerprint()
    assert plan.model.num_parameters == gpt_graph.num_parameters
    # Every parameter of the model has a sharding in exactly the stages that use it.
    names = {name for stage in plan.stages for name in stage.param_shardings}
    assert names == set(gpt_graph.param_names)


def test_plan_is_at_least_as_fast_as_every_baseline(auto_result):
    plan = auto_result.plan
    assert set(plan.baselines) == {
        "data-parallel", "zero2", "megatron-3d", "equal-layer", "equal-operator"}
    for name, seconds in plan.baselines.items():
        if seconds is not None:
            assert plan.predicted_step_seconds <= seconds * (1 + 1e-9), name


@pytest.mark.parametrize("batch", [8, pytest.param(32, marks=pytest.mark.slow)])
def test_comparing_with_baselines_never_changes_the_plan(gpt_graph, cpu8, batch):
    """The plan is the search's own: costing the baselines only reports them (at
    batch 8 the search once found 2 micro-batches at 45.4 ms while the equal-layer
    baseline had a 37.2 ms pipeline, and --baselines silently swapped it in)."""
    graph = gpt_graph if batch == 32 else graph_of(resolve_model("gpt", "tiny"), batch)
    plain = make_plan(graph, cpu8, SearchOptions()).plan
    compared = make_plan(graph, cpu8, SearchOptions(baselines=True)).plan
    assert compared.content_hash() == plain.content_hash()  # hashed without baselines
    for name, seconds in compared.baselines.items():
        if seconds is not None:
            assert plain.predicted_step_seconds <= seconds * (1 + 1e-9), name


def test_round_trip_and_hash(auto_result):
    plan = auto_result.plan
    text = plan.to_json()
    again = plan_from_json(text)
    assert again == plan
    assert again.content_hash() == plan.content_hash()
    data = json.loads(text)
    for key in ("stages", "num_micro_batches", "predicted_step_seconds", "predicted_pflops"):
        assert key in data
    for stage in data["stages"]:
        for key in ("layers", "submesh_shape", "logical_mesh_shape", "predicted_seconds",
                    "peak_memory_bytes"):
            assert key in stage
    # An edited document is refused.
    data["num_micro_batches"] += 1
    with pytest.raises(PlanFormatError, match="does not match"):
        plan_from_json(json.dumps(data))
    with pytest.raises(PlanFormatError, match="version"):
        plan_from_json(json.dumps({"version": "v0"}))
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        plan_from_json("{")


def test_write_and_read_plan_file(auto_result, tmp_path):
    path = tmp_path / "plan.json"
    write_plan(auto_result.plan, path)
    assert read_plan(path) == auto_result.plan
    path.write_text(path.read_text()[:100])
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        read_plan(path)
    with pytest.raises(PlanFormatError, match="cannot read"):
        read_plan(tmp_path / "missing.json")


def test_schema_describes_plan(auto_result):
    schema = plan_json_schema()
    assert set(schema["required"]) >= {"stages", "num_micro_batches", "predicted_step_seconds"}
    assert "StagePlan" in json.dumps(schema)


def test_determinism(gpt_graph, cpu8, auto_result):
    again = make_plan(gpt_graph, cpu8, SearchOptions(baselines=True)).plan
    assert again.content_hash() == auto_result.plan.content_hash()
    regraph = graph_of(resolve_model("gpt", "tiny"), 32)
    assert regraph.fingerprint() == gpt_graph.fingerprint()


@pytest.mark.parametrize("method", [Method.DATA, Method.ZERO2, Method.SHARD])
def test_single_stage_methods(gpt_graph, cpu8, method):
    plan = make_plan(gpt_graph, cpu8, SearchOptions(method=method)).plan
    _check_plan_shape(plan, cpu8)
    assert len(plan.stages) == 1 and plan.stages[0].submesh_shape == (1, 8)
    if method is Method.DATA:
        assert not plan.stages[0].weight_update_sharded


def test_zero2_shards_optimizer_state(gpt_graph, cpu8):
    data = make_plan(gpt_graph, cpu8, SearchOptions(method=Method.DATA, num_micro_batches=1)).plan
    zero2 = make_plan(gpt_graph, cpu8, SearchOptions(method=Method.ZERO2, num_micro_batches=1)).plan
    assert zero2.stages[0].weight_bytes < data.stages[0].weight_bytes
    assert zero2.stages[0].weight_update_sharded


def test_pipeshard_has_stages(gpt_graph, cpu8):
    plan = make_plan(gpt_graph, cpu8, SearchOptions(method=Method.PIPESHARD)).plan
    _check_plan_shape(plan, cpu8)
    assert len(plan.stages) >= 2
    assert plan.resharding, "stages exchange activations and gradients"
    directions = {task.direction for task in plan.resharding}
    assert directions == {"forward", "backward"}


def test_fixed_micro_batches_and_gpipe(gpt_graph, cpu8):
    options = SearchOptions(method=Method.PIPESHARD, num_micro_batches=4, schedule=Schedule.GPIPE)
    plan = make_plan(gpt_graph, cpu8, options).plan
    assert plan.num_micro_batches == 4 and plan.schedule == "gpipe"
    assert all(stage.in_flight_micro_batches == 4 for stage in plan.stages)


def test_manual_stages(gpt_graph, cpu8):
    stages = (ManualStageOption(0, 2, (1, 4)), ManualStageOption(2, 4, (1, 4), (2, 2)))
    options = SearchOptions(method=Method.MANUAL, num_layers=4, manual_stages=stages,
                          num_micro_batches=4)
    plan = make_plan(gpt_graph, cpu8, options).plan
    assert [s.layers for s in plan.stages] == [(0, 2), (2, 4)]
    assert [s.submesh_shape for s in plan.stages] == [(1, 4), (1, 4)]
    assert plan.stages[1].logical_mesh_shape == (2, 2)


def test_a_manual_plan_of_one_count_starts_no_worker_processes(gpt_graph, cpu8, monkeypatch):
    """One micro-batch count of a manual plan is one task: it is costed in this
    process (a pool of a worker per core took seconds to start on a 16-core machine,
    for a plan that costs in 0.1 s); two counts get a pool again."""
    from alpajob.planner.plan import workers

    stages = (ManualStageOption(0, 2, (1, 4)), ManualStageOption(2, 4, (1, 4)))
    options = SearchOptions(method=Method.MANUAL, num_layers=4, manual_stages=stages,
                            num_micro_batches=4)
    started = []
    real = workers.multiprocessing.get_context

    def spy(method):
        started.append(method)
        return real(method)

    monkeypatch.setattr(workers.multiprocessing, "get_context", spy)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 4)
    assert make_plan(gpt_graph, cpu8, options).plan.num_micro_batches == 4
    assert started == []
    # Two counts left to the search (1 and 2): two tasks, a pool of two workers.
    two = dataclasses.replace(options, num_micro_batches=None, max_micro_batches=2)
    assert make_plan(gpt_graph, cpu8, two).plan.num_micro_batches == 2
    assert started == ["forkserver"]


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ((ManualStageOption(0, 2, (1, 4)), ManualStageOption(3, 4, (1, 4))), "contiguously"),
        ((ManualStageOption(0, 4, (1, 3)),), "not a submesh"),
        ((ManualStageOption(0, 2, (1, 8)), ManualStageOption(2, 4, (1, 8))), "use 16 devices"),
        ((ManualStageOption(0, 2, (1, 8)),), "cover layers 0..1"),
        ((ManualStageOption(0, 4, (1, 4), (2, 4)),), "logicalMeshShape"),
    ],
)
def test_manual_errors(gpt_graph, cpu8, stages, match):
    options = SearchOptions(method=Method.MANUAL, num_layers=4, manual_stages=stages)
    with pytest.raises(ManifestError, match=match):
        make_plan(gpt_graph, cpu8, options)


def test_infeasible_memory(gpt_graph, cpu8):
    tiny_device = dataclasses.replace(cpu8.device, memory_bytes=64 * 1024)
    cluster = dataclasses.replace(cpu8, device=tiny_device)
    with pytest.raises(InfeasibleError) as info:
        make_plan(gpt_graph, cluster, SearchOptions())
    error = info.value
    assert error.required_bytes > error.available_bytes
    assert "MiB per device" in str(error) and "does not fit" in str(error)
    assert "0.00" not in str(error)  # a tiny device in a unit that shows it


def test_manual_stage_that_does_not_fit_is_named(gpt_graph, cpu8):
    """A manual plan whose stage does not fit names that stage: its index, layers,
    submesh and memory need (split into weights and activations), not a whole-cluster
    figure. Stage 0 (one layer on 4 devices) is given just enough memory; stage 1
    (three layers on one device) then is the one named."""
    stages = (ManualStageOption(0, 1, (1, 4)), ManualStageOption(1, 4, (1, 1)))
    options = SearchOptions(method=Method.MANUAL, num_layers=4, manual_stages=stages)

    def fail(memory_bytes):
        device = dataclasses.replace(cpu8.device, memory_bytes=memory_bytes)
        with pytest.raises(InfeasibleError) as info:
            make_plan(gpt_graph, dataclasses.replace(cpu8, device=device), options)
        return info.value

    tiny = fail(64 * 1024)
    assert str(tiny).startswith("spec.parallelism.stages[0]: layers [0, 1) on submesh 1x4")
    fraction = tiny.available_bytes / (64 * 1024)
    second = fail(int(tiny.required_bytes * 1.05 / fraction))
    text = str(second)
    assert text.startswith("spec.parallelism.stages[1]: layers [1, 4) on submesh 1x1 "
                           "(logical mesh 1x1) need at least")
    assert second.required_bytes > second.available_bytes > tiny.required_bytes
    assert "weights and optimizer state" in text and "in-flight micro-batches" in text
    assert "backward working set" in text and "submeshShape" in text
    assert "0.00" not in str(tiny) and "KiB" in str(tiny)  # tiny sizes in a unit that shows them


@pytest.mark.parametrize("family", ["mlp", "moe", pytest.param("wresnet", marks=pytest.mark.slow)])
def test_other_families_plan(family, cpu8):
    model = resolve_model(family, "tiny")
    batch = 32
    graph = graph_of(model, batch)
    plan = make_plan(graph, cpu8, SearchOptions(baselines=True)).plan
    _check_plan_shape(plan, cpu8)
    for seconds in plan.baselines.values():
        if seconds is not None:
            assert plan.predicted_step_seconds <= seconds * (1 + 1e-9)


@pytest.mark.parametrize(("devices", "micro_batches"), [(8, 1), (2, 4)])
def test_kernel_overhead_is_charged_per_kernel_per_device(gpt_graph, cpu8, devices, micro_batches):
    """On a shared host every kernel-launching op costs d of host time on each device
    that runs it, once per micro-batch (forward, backward) or per step (update), at
    the share of the host the stage's devices reach; the calibration passed in the
    options replaces the stored one."""
    from alpajob.planner.cost.model import launches_kernel
    from alpajob.planner.graph.opgraph import Phase

    stored = load_calibration("cpu")

    def predicted(d):
        calibration = dataclasses.replace(stored, instruction_overhead_seconds=0.0,
                                          kernel_overhead_seconds=d)
        options = SearchOptions(method=Method.MANUAL, num_layers=1, num_micro_batches=micro_batches,
                              manual_stages=(ManualStageOption(0, 1, (1, devices)),),
                              calibration=calibration)
        return make_plan(gpt_graph, cpu8, options).plan.predicted_step_seconds

    kernels = [op for op in gpt_graph.ops
               if launches_kernel(op.primitive) and op.primitive not in stored.free_primitives]
    per_batch = sum(op.multiplier for op in kernels if op.phase is not Phase.UPDATE)
    per_step = sum(op.multiplier for op in kernels if op.phase is Phase.UPDATE)
    assert per_batch > 50  # GPT-tiny's matmuls, reductions and gathers
    d = 1e-5
    # Host time, spread over the devices busy meanwhile (the stage's own: one stage).
    busy = host_utilization(cpu8, stored, devices)
    expected = d * devices * (micro_batches * per_batch + per_step) / busy
    assert predicted(d) - predicted(0.0) == pytest.approx(expected, rel=1e-6)


def test_micro_batch_counts_are_every_divisor_of_the_batch():
    """Not only powers of two: a batch of 48 can be cut into 3, 6, 12 or 24 micro-
    batches (Wide-ResNet's 1520 into 19, 20, 38 or 40). The search tries the powers of
    two coarse to fine, then the divisors between the best power's neighbours; on a
    step time that is least at B = 6 it finds 6 without trying every count."""
    from alpajob.planner.inter_op.search import Candidate, micro_batch_candidates
    from alpajob.planner.plan import make

    graph = graph_of(resolve_model("gpt", "tiny"), 48)
    counts = micro_batch_candidates(graph, None)
    assert counts == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert micro_batch_candidates(graph, 5) == []
    searched: list[int] = []

    class FakeSearch:
        workers = 2

        def run(self, micro_batches, likely_next=None):
            searched.extend(micro_batches)
            return [Candidate("fake", None, b, (), abs(b - 6) + 1.0) for b in micro_batches]

    best = make.best_of(make.coarse_to_fine(FakeSearch(), counts))
    assert best.num_micro_batches == 6
    assert len(searched) == len(set(searched)) < len(counts)


@pytest.mark.parametrize("least, fits_from, expected", [
    (512, 256, [512, 256]),  # the optimum below the largest count: descend to it
    (1024, 128, [512]),  # the largest is best: one count more shows it
    (None, None, []),  # the largest does not fit: nothing does, stop
])
def test_when_no_usual_count_fits_the_largest_is_the_way_down(least, fits_from, expected):
    """Memory so tight that no count up to 64 fits: the largest count, costed with the
    usual ones, is the best, and the search descends from it while smaller counts do
    better, instead of climbing from 128."""
    from alpajob.planner.inter_op.search import Candidate
    from alpajob.planner.plan import make

    counts = [2**k for k in range(11)]  # 1 ... 1024
    searched: list[int] = []

    class FakeSearch:
        workers = 2

        def run(self, micro_batches, likely_next=None):
            searched.extend(micro_batches)
            found = [Candidate("fake", None, b, (), abs(b - least) + 1.0)
                     if fits_from is not None and b >= fits_from else None
                     for b in micro_batches]
            guesses.append(list(likely_next(found)) if likely_next else [])
            return found

    guesses: list[list[int]] = []
    best = make.best_of(make.coarse_to_fine(FakeSearch(), counts))
    assert searched[:5] == [1, 4, 16, 64, 1024]  # the usual counts and the largest
    assert searched[5:] == expected
    # Each round's guess of what comes next (the pool starts it early) is, on the
    # round's results, what the search costs next: all but the last round's.
    rounds = [searched[:5], *([count] for count in searched[5:])]
    assert [guess for guess in guesses[:-1]] == rounds[1:]
    assert (best.num_micro_batches if best else None) == least


def test_a_pipeline_at_the_largest_count_is_found_past_a_local_optimum():
    """Step time need not be unimodal over every count: one stage is best at 64 (128 is
    worse), a pipeline better still at 1024 (GPT-1.3B on 4 V100s: 74.5 s with 64
    micro-batches, 60.7 s with 1,024). The first round looks at both ends."""
    from alpajob.planner.inter_op.search import Candidate
    from alpajob.planner.plan import make

    counts = [2**k for k in range(11)]
    searched: list[int] = []

    def seconds(b: int) -> float:
        one_stage = 74.5 + abs(b - 64) / 64  # least at 64
        pipeline = 60.7 + 3000 / b  # the bubble shrinks with more micro-batches
        return min(one_stage, pipeline)

    class FakeSearch:
        workers = 2

        def run(self, micro_batches, likely_next=None):
            searched.extend(micro_batches)
            return [Candidate("fake", None, b, (), seconds(b)) for b in micro_batches]

    best = make.best_of(make.coarse_to_fine(FakeSearch(), counts))
    assert best.num_micro_batches == 1024
    assert searched == [1, 4, 16, 64, 1024, 512]


@pytest.mark.parametrize("memory_fraction", [0.9, pytest.param(3e-4, marks=pytest.mark.slow)])
def test_search_split_among_processes_equals_one_process(
    gpt_graph, cpu8, monkeypatch, memory_fraction
):
    """The search's ILPs are shared among worker processes by micro-batch count and
    submesh, and the parent builds the candidates from the merged solutions: the plan,
    and the number of ILPs solved, are those of the search in one process. Also when
    memory is so tight (3e-4 of 2 GiB) that the smaller counts do not fit and are
    skipped once a larger one does not."""
    from alpajob.planner.plan import workers

    options = SearchOptions(memory_fraction=memory_fraction)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 2)
    shared = make_plan(gpt_graph, cpu8, options)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 1)
    alone = make_plan(gpt_graph, cpu8, options)
    assert shared.plan.content_hash() == alone.plan.content_hash()
    assert shared.plan.solver.ilp_solves == alone.plan.solver.ilp_solves
    assert shared.plan.solver.dp_calls == alone.plan.solver.dp_calls
    if memory_fraction < 0.01:
        assert min(alone.plan.solver.micro_batch_candidates) > 1


def test_counts_below_one_where_nothing_fits_are_skipped(cpu8, gpt_graph, monkeypatch):
    """Fewer, larger micro-batches never need less memory (``fits_nowhere``): the
    search costs counts largest first and stops at the first where nothing fits."""
    from alpajob.planner.inter_op.clustering import cluster_layers
    from alpajob.planner.inter_op.search import Candidate, CostContext
    from alpajob.planner.plan import workers

    costed: list[int] = []

    def fake(context, count, method, manual, *, dp=True):
        costed.append(count)
        return [None, Candidate("fake", None, count, (), 1.0 / count) if count >= 8 else None]

    monkeypatch.setattr(workers, "candidates_at", fake)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 1)
    context = CostContext(graph=gpt_graph, layers=cluster_layers(gpt_graph, 4), cluster=cpu8,
                          calibration=load_calibration("cpu"), schedule=Schedule.ONE_F_ONE_B,
                          memory_budget=1e12, time_limit_s=10.0)
    with workers.SearchPool(context, Method.AUTO, ()) as search:
        found = search.run([1, 4, 16, 32])
    assert costed == [32, 16, 4]
    assert sorted(c.num_micro_batches for c in found if c is not None) == [16, 32]


def test_idle_workers_take_the_likely_next_count_before_one_that_may_be_moot(cpu8, gpt_graph):
    """A count's tasks are surely needed once every larger pending count has a task
    that found a fitting plan; until then a free worker takes the search's likely next
    count instead (GPT-2.6B on 8 V100s: count 4 fits nowhere, so count 1 would be
    lost, and 512 comes next), and only without one the count that may be moot."""
    from collections import deque

    from alpajob.planner.inter_op.clustering import cluster_layers
    from alpajob.planner.inter_op.search import CostContext
    from alpajob.planner.plan import workers

    context = CostContext(graph=gpt_graph, layers=cluster_layers(gpt_graph, 4), cluster=cpu8,
                          calibration=load_calibration("cpu"), schedule=Schedule.ONE_F_ONE_B,
                          memory_budget=1e12, time_limit_s=10.0)
    search = workers.SearchPool(context, Method.AUTO, ())  # never entered: no processes
    tasks = deque(workers.split_tasks(context, [4, 1], Method.AUTO))
    guesses = deque(workers.split_tasks(context, [512], Method.AUTO))
    first_of_1 = tasks[[count for count, _ in tasks].index(1)]
    assert search._next_task(tasks, [4, 1], guesses) == (4, ())  # the largest: needed
    while tasks[0][0] == 4:
        tasks.popleft()
    assert search._next_task(tasks, [4, 1], guesses) == (512, ())  # 4 may fit nowhere
    search._fits.add(4)  # a task of count 4 found a plan that fits: 1 is needed
    assert search._next_task(tasks, [4, 1], guesses) == first_of_1
    search._fits.clear()
    guesses.clear()
    head = tasks[0]
    assert search._next_task(tasks, [4, 1], guesses) == head  # nothing better to do
    assert search._next_task(tasks, [4], deque([(512, ())])) == (512, ())  # 1 is moot
    assert not tasks and search._next_task(tasks, [4], deque()) is None


def test_a_round_takes_the_results_an_earlier_round_guessed(cpu8, gpt_graph, monkeypatch):
    """Every result of a guessed count may be taken while an earlier round waits for
    its own last (long) task: the round that needs the count then builds it from
    them, without waiting for results that will never come, and its candidates are
    those of the search in one process."""
    import dataclasses
    import threading

    from alpajob.planner.inter_op.clustering import cluster_layers
    from alpajob.planner.inter_op.search import CostContext
    from alpajob.planner.inter_op.stage_costs import SolveCounter
    from alpajob.planner.plan import workers

    def context() -> CostContext:
        return CostContext(graph=gpt_graph, layers=cluster_layers(gpt_graph, 2), cluster=cpu8,
                           calibration=load_calibration("cpu"), schedule=Schedule.ONE_F_ONE_B,
                           memory_budget=1e12, time_limit_s=10.0)

    guessed = len(workers.split_tasks(context(), [1], Method.AUTO))

    class Holding:
        """A pool that runs each task as it is given and hands its result back at
        once, but the first task's (a long one) only after every task of count 1."""

        def __init__(self) -> None:
            self.held: list = []
            self.delivered = 0

        def apply_async(self, func, args, callback, error_callback):
            result = func(*args)
            if not self.held and self.delivered == 0:
                self.held.append((callback, result))
                return
            callback(result)
            self.delivered += result[0] == 1
            if self.held and self.delivered == guessed:
                hold_back, first = self.held.pop()
                hold_back(first)

    parent = context()
    worker = dataclasses.replace(context(), counter=SolveCounter())
    monkeypatch.setitem(workers._WORKER, "search", (worker, Method.AUTO, ()))
    search = workers.SearchPool(parent, Method.AUTO, ())
    search.workers = 2
    search._pool = Holding()
    search.run([2], likely_next=lambda _found: [1])
    assert len(search._arrived[1]) == guessed and search._in_flight == 0
    def within_two_minutes(counts: list[int]) -> list:
        found: list = []
        thread = threading.Thread(target=lambda: found.extend(search.run(counts)), daemon=True)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), "the round waited for results that never come"
        return found

    found = within_two_minutes([1])
    assert within_two_minutes([1]) == found  # asked again: solved again, the same
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 1)
    with workers.SearchPool(context(), Method.AUTO, ()) as alone:
        assert found == alone.run([1])


def test_search_tasks_cover_every_submesh_once(cpu8, gpt_graph):
    from alpajob.planner.cost.model import load_calibration
    from alpajob.planner.inter_op.clustering import cluster_layers
    from alpajob.planner.inter_op.search import CostContext
    from alpajob.planner.plan.workers import split_tasks

    context = CostContext(graph=gpt_graph, layers=cluster_layers(gpt_graph, 4), cluster=cpu8,
                          calibration=load_calibration("cpu"), schedule=Schedule.ONE_F_ONE_B,
                          memory_budget=1e12, time_limit_s=10.0)
    tasks = split_tasks(context, [1, 4], Method.AUTO)
    for count in (1, 4):
        covered = [s for c, group in tasks if c == count for s in group]
        assert sorted(covered) == sorted(context.submeshes())
    assert {c for c, _ in tasks} == {1, 4}
    # auto's data-parallel baselines are one more task per count; a DP-only search has none
    assert [task for task in tasks if not task[1]] == [(1, ()), (4, ())]
    assert all(group for _, group in split_tasks(context, [1, 4], Method.PIPESHARD))
    assert split_tasks(context, [1, 4], Method.DATA) == [(1, ()), (4, ())]

# One host's forced CPU devices share its cores: the planner may plan on one of them
# when that is predicted faster, by the host share one device reaches alone
# (``lone_device_share``); GPU clusters and ``--all-devices`` use every device.


def _options(share: float, **fields) -> SearchOptions:
    calibration = dataclasses.replace(load_calibration("cpu"), lone_device_share=share)
    return SearchOptions(calibration=calibration, **fields)


def test_host_utilization_model(cpu8):
    """k busy devices reach 1 - (1 - u)^k of a shared host; independent devices 1."""
    calibration = dataclasses.replace(load_calibration("cpu"), lone_device_share=0.78)
    assert host_utilization(cpu8, calibration, 1) == pytest.approx(0.78)
    assert host_utilization(cpu8, calibration, 2) == pytest.approx(1 - 0.22**2)
    assert host_utilization(cpu8, calibration, 8) == pytest.approx(1 - 0.22**8)
    gpus = cluster_from_preset("h100-80gb", 1, 8)
    assert host_utilization(gpus, calibration, 1) == 1.0
    with pytest.raises(ValueError, match="lone_device_share must be in"):
        dataclasses.replace(calibration, lone_device_share=0.0)


def test_one_device_that_reaches_the_whole_host_wins(gpt_graph, cpu8):
    """If one device used every core (u = 1), more devices would only add
    collectives and per-device kernel costs: the plan is one device, and it is
    predicted faster than the best plan on all 8."""
    free = make_plan(gpt_graph, cpu8, _options(1.0)).plan
    every = make_plan(gpt_graph, cpu8, _options(1.0, all_devices=True)).plan
    assert free.devices_used() == 1 and len(free.stages) == 1
    assert every.devices_used() == 8
    assert free.predicted_step_seconds < every.predicted_step_seconds


def test_the_plan_is_the_fastest_over_device_counts(gpt_graph, cpu8):
    """With a lone device reaching a fifth of the host, the search over device counts
    keeps the fastest: never slower than the plan on every device, nor than the
    one-device plan (a manual one-stage plan on a 1x1 submesh, priced the same way)."""
    options = _options(0.2)
    free = make_plan(gpt_graph, cpu8, options).plan
    every = make_plan(gpt_graph, cpu8, dataclasses.replace(options, all_devices=True)).plan
    lone = make_plan(gpt_graph, cpu8, dataclasses.replace(
        options, method=Method.MANUAL, num_layers=1, num_micro_batches=1,
        manual_stages=(ManualStageOption(0, 1, (1, 1)),))).plan
    assert free.devices_used() > 1
    assert free.predicted_step_seconds <= every.predicted_step_seconds * (1 + 1e-9)
    assert free.predicted_step_seconds < lone.predicted_step_seconds
    # The lone device's work is priced at u of the host: 1/u times its work at the
    # whole host's rate (u = 1), its instruction overheads unchanged.
    whole = make_plan(gpt_graph, cpu8, dataclasses.replace(
        _options(1.0), method=Method.MANUAL, num_layers=1, num_micro_batches=1,
        manual_stages=(ManualStageOption(0, 1, (1, 1)),))).plan
    overhead = 3 * load_calibration("cpu").instruction_overhead_seconds
    assert lone.predicted_step_seconds - overhead == pytest.approx(
        (whole.predicted_step_seconds - overhead) / 0.2, rel=1e-9)


def test_gpu_plans_use_every_device(gpt_graph):
    """Devices that do not share a host are independent: Alpa's rule, every device."""
    gpus = cluster_from_preset("v100-16gb", 1, 8)
    plan = make_plan(gpt_graph, gpus, SearchOptions()).plan
    assert plan.devices_used() == 8


def test_plan_says_how_many_devices_it_uses(capsys, tmp_path):
    """The CLI's table names a plan on fewer devices than offered; --all-devices
    plans on every one."""
    calibration = tmp_path / "cal.json"
    from alpajob.planner.cost.measured import Machine, MeasuredConstants

    machine = Machine(host="test", processor="a CPU", backend="cpu", device_kind="cpu",
                      devices=8, jax="0", measured_at="2026-11-26T00:00:00Z")
    calibration.write_text(MeasuredConstants(
        machine=machine, preset="cpu", calibration={"lone_device_share": 1.0}).to_json())
    manifest = "manifests/examples/local-gpt.yaml"
    assert main(["plan", manifest, "--calibration", str(calibration)]) == 0
    assert "(uses 1 of 8 devices)" in capsys.readouterr().out
    assert main(["plan", manifest, "--calibration", str(calibration), "--all-devices"]) == 0
    assert "of 8 devices" not in capsys.readouterr().out
