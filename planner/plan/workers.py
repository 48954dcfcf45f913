"""The plan search's candidates per micro-batch count, their ILPs solved on every core.

A plan search costs several micro-batch counts, and each count needs hundreds of
intra-op ILPs: the DP's tables for every submesh, logical mesh and memory level, then
the other candidates (Megatron grid, data parallel, ZeRO-2, the single-stage ILP).
The DP's tables of different submeshes are independent, so :class:`SearchPool`
splits each count's submeshes among the cores (:func:`split_tasks`); worker processes
solve them and send back only the solutions (:class:`CosterCaches`), which the parent
merges into its costers before building each count's candidates, now from caches.
Counts go largest first, and a count where nothing fits memory ends the round: no
smaller count can fit (:func:`fits_nowhere`), so their tasks are dropped. A task
whose count is only needed if a larger one fits somewhere waits, while the search's
likely next counts (``likely_next``) have tasks to give the free workers
(:meth:`SearchPool._next_task`).

The workers are ``forkserver`` processes (clean processes, never forks of this
multithreaded one, which has JAX loaded) that live for the whole search; the fork
server itself can be started early, while the model is traced
(:func:`start_fork_server`). Each gets
the cost context once, when it starts: the graph is megabytes, too big to send with
every task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.pool import Pool
from types import TracebackType

from alpajob.api.spec import Method
from alpajob.planner.inter_op.search import (
    Candidate,
    CostContext,
    StageRequest,
    dp_candidate,
    evaluate_stages,
    warm_submeshes,
)
from alpajob.planner.inter_op.stage_costs import CosterCaches, SolveCounter, Submesh
from alpajob.planner.intra_op.solve import ShardingMode
from alpajob.planner.plan.baselines import (
    Baseline,
    data_parallel,
    megatron_grid,
    megatron_grids,
    megatron_own_grids,
    whole_cluster,
)
from alpajob.planner.plan.collection import fewer_collections, settle_worker
from alpajob.planner.plan.processes import main_module_hidden

#: One process's share of the search: a micro-batch count and the submeshes whose DP
#: tables it solves, or no submeshes: all the count's candidates but the DP's.
Task = tuple[int, tuple[Submesh, ...]]

#: What a task sends back: its micro-batch count, the solutions per (micro-batch count,
#: sharding mode), the solver's tally, the block-part cuts its process has chosen, and
#: whether one of the whole-model plans it costed fits memory (so the count fits).
TaskResult = tuple[int, dict[tuple[int, ShardingMode], CosterCaches], SolveCounter,
                   dict[tuple[int, int], tuple[int, ...]], bool]

#: The counts a search will likely cost next, given the candidates found so far in a
#: round (:meth:`SearchPool.run`); a guess that only decides what idle workers do.
LikelyNext = Callable[[Sequence[Candidate | None]], Sequence[int]]


def candidates_at(
    context: CostContext,
    count: int,
    method: Method,
    manual: Sequence[StageRequest],
    *,
    dp: bool = True,
) -> list[Candidate | None]:
    """Every candidate ``method`` considers with ``count`` micro-batches (``dp``
    False: all but the inter-op DP's)."""
    found: list[Candidate | None] = []
    last = len(context.layers) - 1
    if dp and method in (Method.AUTO, Method.PIPESHARD):
        found.append(
            dp_candidate(context, count, min_stages=2 if method is Method.PIPESHARD else 1)
        )
    if method is Method.AUTO:
        found.append(megatron_grid(context, [count]))
        found.append(data_parallel(context, [count], ShardingMode.DATA))
        found.append(data_parallel(context, [count], ShardingMode.ZERO2))
    if method in (Method.AUTO, Method.SHARD):
        submesh, _ = whole_cluster(context)
        found.append(evaluate_stages(context, [StageRequest(0, last, submesh)], count,
                                     ShardingMode.AUTO, "shard"))
    if method is Method.DATA:
        found.append(data_parallel(context, [count], ShardingMode.DATA))
    if method is Method.ZERO2:
        found.append(data_parallel(context, [count], ShardingMode.ZERO2))
    if method is Method.MANUAL and (count >= len(manual) or len(manual) == 1):
        found.append(evaluate_stages(context, manual, count, ShardingMode.AUTO, "manual"))
    return found


def split_tasks(context: CostContext, counts: Sequence[int], method: Method) -> list[Task]:
    """The ILPs of ``counts`` as tasks for the worker processes, in the order given.

    With a DP, each (count, submesh) is a task: a count's tasks together, the long
    ones first, so the free workers take them early and the short ones even out the
    end of each count (even a single count keeps every core busy).
    The other candidates mostly reuse those solutions (the single-stage plan is the
    whole-cluster submesh's, Megatron's grids mostly the DP's meshes), so a submesh's
    task costs them too where they run on it (their stages of many layers need memory
    levels the DP's single layers do not: GPT-39B's grids took 42 ILPs, 4 s, in the
    parent, while the workers waited), and the parent builds them from the caches; the
    data-parallel and ZeRO-2 baselines (other sharding modes) and
    Megatron's grids on meshes the DP does not try have ILPs of their own: one more
    task per count ``(count, ())`` under ``auto``, so the parent solves none. It
    goes first: it is often a count's longest (GPT-2.6B on 8 V100s: 0.6 s against
    0.5 s for the largest submesh; last, it alone ended each count). Then the
    submeshes, largest first. Without a DP a count is one task. Example: 8 x 8 GPUs,
    counts 8 and 4, auto -> (8, ()), (8, 8x8), (8, 4x8), ..., (8, 1x1), (4, ()),
    (4, 8x8), ...
    """
    if method not in (Method.AUTO, Method.PIPESHARD):
        return [(count, ()) for count in counts]
    submeshes = sorted(context.submeshes(), key=lambda s: -s[0] * s[1])
    own = [()] if method is Method.AUTO else []  # the data-parallel baselines' ILPs
    return [(count, group) for count in counts
            for group in [*own, *((s,) for s in submeshes)]]


def fits_nowhere(candidates: Sequence[Candidate | None]) -> bool:
    """True when no candidate of a micro-batch count fits memory: then no smaller
    count fits either, and :meth:`SearchPool.run` skips them.

    Why: a stage's weights (parameters, gradients, optimizer state) do not depend on
    the count B, and its activations per in-flight micro-batch are 1/B of the batch's:
    1F1B holds ``min(k + 1, B)`` micro-batches on a stage with k followers, so
    ``min(k + 1, B) / B`` of the batch's activations, which does not grow with B;
    GPipe holds all B, the whole batch's, whatever B; a rematerialised stage's
    recomputed residuals are one micro-batch's. Fewer, larger micro-batches therefore
    never need less memory under the same shardings, and the leanest shardings (the
    memory-minimising ILP) are what decides that nothing fits.
    """
    return all(candidate is None for candidate in candidates)


class SearchPool:
    """Candidates of micro-batch counts, for one plan search (a context manager).

    Usage: ``with SearchPool(context, method, manual, counts) as search:
    search.run(counts)``. The pool has a worker per core; a manual plan's search
    (one task per micro-batch count of ``counts``) has no more workers than counts.
    With one worker everything runs in this process: starting a pool costs seconds
    on a many-core host, more than a manual plan of one count takes to cost. So does
    a search in a daemonic process (a worker of a pool that plans whole searches side
    by side, :mod:`~alpajob.trainer_image.what_if_pool`), which may start none.
    """

    def __init__(
        self, context: CostContext, method: Method, manual: Sequence[StageRequest],
        counts: Sequence[int] | None = None,
    ) -> None:
        self.context = context
        self.method = method
        self.manual = manual
        self.workers = 1 if multiprocessing.current_process().daemon else os.cpu_count() or 1
        if counts is not None and method is Method.MANUAL:
            self.workers = min(self.workers, len(split_tasks(context, counts, method)))
        self._pool: Pool | None = None
        #: Every task started in the pool, and what came back from those of counts
        #: not built yet (a later round's, or still to be taken), by count.
        self._started: set[Task] = set()
        self._arrived: dict[int, list[TaskResult]] = {}
        #: Counts for which some task found a fitting whole-model plan, and those
        #: built (their results taken).
        self._fits: set[int] = set()
        self._built: set[int] = set()
        self._results: queue.SimpleQueue[TaskResult | BaseException] = queue.SimpleQueue()
        self._in_flight = 0

    def __enter__(self) -> SearchPool:
        if self.workers >= 2:
            quiet = dataclasses.replace(self.context, progress=None, counter=SolveCounter(),
                                        _table_root=None)
            quiet.reset_costers()
            try:
                with signals_held(), main_module_hidden():
                    self._pool = multiprocessing.get_context("forkserver").Pool(
                        self.workers, initializer=_start_worker,
                        initargs=(pickle.dumps((quiet, self.method, self.manual),
                                               protocol=pickle.HIGHEST_PROTOCOL),)
                    )
            except BaseException:  # stopped as it started: the with block is never entered
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def run(self, counts: Sequence[int],
            likely_next: LikelyNext | None = None) -> list[Candidate | None]:
        """Every candidate of every count in ``counts``, costed largest count first.

        A count where nothing fits makes the smaller ones moot (:func:`fits_nowhere`):
        they are skipped, so a large model whose usual counts are all too big costs
        one of them, not all. With workers, the ILPs are solved in the pool (merged
        into this context) and each count's candidates are built here once its tasks
        and those of every larger count are back, while the workers go on; the
        results, and the ILPs counted, are those of the search in one process.
        ``likely_next`` (of the candidates found so far) names the counts the search
        will probably ask for next: their tasks fill workers that would otherwise
        solve a count that may turn out moot, and a later ``run`` takes their results.
        """
        order = sorted(set(counts), reverse=True)
        if self._pool is not None:
            built = self._run_pool(order, likely_next)
        else:
            built = {}
            for count in order:
                built[count] = self._candidates(count)
                if fits_nowhere(built[count]):
                    break
        found: list[Candidate | None] = []
        for count in counts:
            found += built.get(count, [])
        return found

    def _run_pool(self, order: Sequence[int],
                  likely_next: LikelyNext | None) -> dict[int, list[Candidate | None]]:
        """The candidates of the counts in ``order`` (largest first) from the pool's
        ILPs: tasks go out as workers free up (never more than one per worker, so the
        tasks of moot counts can still be dropped; :meth:`_next_task` picks which),
        and results are taken count by count in ``order``. Results of tasks still
        running when the round ends, or of counts it did not need, stay in the pool
        for a later round (:attr:`_arrived`)."""
        assert self._pool is not None
        # A count built in an earlier round took its results: asked again, it is
        # solved again (the search asks each count once; this keeps a repeat whole).
        self._started -= {t for t in self._started if t[0] in order and t[0] in self._built}
        self._built -= set(order)
        everything = split_tasks(self.context, order, self.method)
        tasks = deque(t for t in everything if t not in self._started)
        expected = Counter(count for count, _ in everything)
        pending = deque(order)  # counts still to build, largest first
        built: dict[int, list[Candidate | None]] = {}

        def likely(found: Sequence[Candidate | None]) -> deque[Task]:
            counts = [c for c in likely_next(found) if c not in order] if likely_next else []
            return deque(split_tasks(self.context, counts, self.method))

        guesses = likely([])
        progress = self.context.progress
        while True:
            # First the counts whose results are all in: an earlier round may have
            # taken every result of a count it guessed, and none may be on the way.
            while pending and len(self._arrived.get(pending[0], ())) == expected[pending[0]]:
                count = pending.popleft()
                for _, caches, counter, cuts, _fits in self._arrived.pop(count):
                    self.context.adopt(caches, counter, cuts)
                built[count] = self._candidates(count)
                self._built.add(count)
                if fits_nowhere(built[count]):
                    pending.clear()
                else:
                    guesses = likely([c for done in built.values() for c in done])
            while self._in_flight < self.workers:
                task = self._next_task(tasks, pending, guesses)
                if task is None:
                    break
                self._started.add(task)
                self._pool.apply_async(_solve_task, (task,), callback=self._results.put,
                                       error_callback=self._results.put)
                self._in_flight += 1
            if not pending:
                return built  # tasks still running report to a later round
            result = self._results.get()
            self._in_flight -= 1
            if isinstance(result, BaseException):
                raise result
            self._arrived.setdefault(result[0], []).append(result)
            if result[4]:
                self._fits.add(result[0])
            if progress is not None:
                done = sum(len(self._arrived.get(c, ())) for c in pending) + sum(
                    expected[c] for c in built)
                total = sum(expected[c] for c in (*built, *pending))
                progress(f"planned {done}/{total} parts of {len(order)} micro-batch counts",
                         self.context.counter.solves, None)

    def _next_task(self, tasks: deque[Task], pending: Sequence[int],
                   guesses: deque[Task]) -> Task | None:
        """The task a free worker takes: the round's next task if its count is surely
        needed (every larger count still pending has a task that found a fitting
        plan, :data:`TaskResult`); else a task of the likely next counts; else the
        round's next task anyway (its count is needed unless a larger one fits
        nowhere). None when there is nothing left to start. Tasks of moot counts
        (no longer pending) are dropped.

        Why: a count where nothing fits costs all of its ILPs before it is known
        (GPT-2.6B on 8 V100s: count 4), and the tasks of the count below it that
        workers start meanwhile are lost, while the next round's count (the
        descent's 512) waits."""
        while tasks and tasks[0][0] not in pending:
            tasks.popleft()
        while guesses and guesses[0] in self._started:
            guesses.popleft()
        if tasks and all(c in self._fits for c in pending if c > tasks[0][0]):
            return tasks.popleft()
        if guesses:
            return guesses.popleft()
        return tasks.popleft() if tasks else None

    def _candidates(self, count: int) -> list[Candidate | None]:
        return candidates_at(self.context, count, self.method, self.manual)


def start_fork_server() -> None:
    """Start the fork server the pool's workers are forked from, with this module (and
    so the planner) imported in it, without waiting for it: called before the model is
    traced, the server's start and imports (0.7 s) overlap the tracing on another
    core, and each worker then starts as a fork of an interpreter that has them. Does
    nothing where the search would not start a pool (one core), or once the server
    runs."""
    if (os.cpu_count() or 1) < 2:
        return
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with signals_held():  # started whole, as a pool is
        forkserver.ensure_running()


#: A worker process's search, set once when it starts (see :func:`_start_worker`).
_WORKER: dict[str, tuple[CostContext, Method, Sequence[StageRequest]]] = {}


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM and Ctrl-C that arrive inside the block are handled as it ends (in the
    main thread, where Python handles signals; elsewhere the block does nothing).
    Starting a worker writes its arguments to the fork server; a stop signal raised in
    the middle of that write would leave the forked worker reading half of them (a
    traceback in the command's output)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    stops = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, lambda signum, _frame: held.append(signum)) for s in stops}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for signum in held:
            signal.raise_signal(signum)


def _start_worker(search: bytes) -> None:
    """Pool initializer: keep the search this worker process serves (its only state:
    the cost context, method and manual stages, pickled once by the parent).
    Ctrl-C reaches every process of the terminal's group: a worker ignores it and is
    terminated by the parent, which stops cleanly (no traceback per worker).

    The context is read with fewer garbage collections (GPT-2.6B's: 0.17 s, 0.06 s
    so; :mod:`.collection`), and lives as long as the worker: it is then frozen out
    of the collector's passes (:func:`~.collection.settle_worker`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with fewer_collections():
        _WORKER["search"] = pickle.loads(search)
    settle_worker()


def _warm_candidates_on(context: CostContext, count: int,
                        submeshes: Sequence[Submesh]) -> list[Candidate | None]:
    """Solve the ILPs of auto's other candidates on ``submeshes`` (:func:`split_tasks`):
    the Megatron grids the DP's meshes hold, and the single-stage plan where one of
    them is the whole cluster. Returns those candidates."""
    found = []
    own = megatron_own_grids(context)
    for requests in megatron_grids(context):
        if requests[0].submesh in submeshes and requests not in own and (
            len(requests) == 1 or count >= len(requests)
        ):
            found.append(evaluate_stages(context, requests, count, ShardingMode.AUTO,
                                         Baseline.MEGATRON.value))
    whole, _ = whole_cluster(context)
    if whole in submeshes:
        found.append(evaluate_stages(context, [StageRequest(0, len(context.layers) - 1, whole)],
                                     count, ShardingMode.AUTO, "shard"))
    return found


def _solve_task(task: Task) -> TaskResult:
    """Solve one task's ILPs in a worker; return their solutions and tally, and
    forget them (each task starts from empty caches, so memory stays bounded).
    The whole-model plans it costs (the parent builds the same ones from these
    solutions) say whether the count fits somewhere."""
    context, method, manual = _WORKER["search"]
    context.counter = SolveCounter()
    count, submeshes = task
    found: list[Candidate | None] = []
    if submeshes:
        warm_submeshes(context, count, submeshes)
        if method is Method.AUTO:
            found += _warm_candidates_on(context, count, submeshes)
    elif method is Method.AUTO:  # auto's own baselines' ILPs (see split_tasks)
        for baseline in (Method.DATA, Method.ZERO2):
            found += candidates_at(context, count, baseline, manual)
        for requests in megatron_own_grids(context):
            if len(requests) == 1 or count >= len(requests):
                found.append(evaluate_stages(context, requests, count, ShardingMode.AUTO,
                                             Baseline.MEGATRON.value))
    else:
        found += candidates_at(context, count, method, manual, dp=False)
    caches = {key: coster.caches() for key, coster in context.costers().items()}
    counter = context.counter
    context.reset_costers()  # the cutter stays: its cuts are the same for every count
    return count, caches, counter, context.piece_cuts(), not fits_nowhere(found)
