"""The plan search's candidates per micro-batch count, their ILPs solved on every core.

A plan search costs several micro-batch counts, and each count needs hundreds of
intra-op ILPs: the DP's tables for every submesh, logical mesh and memory level, then
the other candidates (Megatron grid, data parallel, ZeRO-2, the single-stage ILP).
The DP's tables of different submeshes are independent, so :class:`SearchPool`
splits each count's submeshes among the cores (:func:`split_tasks`); worker processes
solve them and send back only the solutions (:class:`CosterCaches`), which the parent
merges into its costers before building each count's candidates, now from caches.

The workers are ``forkserver`` processes (clean processes, never forks of this
multithreaded one, which has JAX loaded) that live for the whole search. Each gets
the cost context once, when it starts: the graph is megabytes, too big to send with
every task.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Sequence
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
from alpajob.planner.plan.baselines import data_parallel, megatron_grid, whole_cluster

#: One process's share of the search: a micro-batch count and the submeshes whose DP
#: tables it solves, or no submeshes: all the count's candidates but the DP's.
Task = tuple[int, tuple[Submesh, ...]]

#: What a task sends back: its micro-batch count, the solutions per (micro-batch count,
#: sharding mode), and the solver's tally.
TaskResult = tuple[int, dict[tuple[int, ShardingMode], CosterCaches], SolveCounter]


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
    """The ILPs of ``counts`` as tasks for the worker processes.

    With a DP, each (count, submesh) is a task, the largest submeshes of every count
    first, so the pool's free workers take the long tasks early and the short ones
    even out the end: even a single count keeps every core busy. The other candidates
    mostly reuse those solutions (the single-stage plan is the whole-cluster
    submesh's), so the parent builds them. Without a DP a count is one task.
    Example: 8 x 8 GPUs, counts 4 and 8 -> (4, 8x8), (8, 8x8), (4, 4x8), (8, 4x8), ...
    """
    if method not in (Method.AUTO, Method.PIPESHARD):
        return [(count, ()) for count in counts]
    submeshes = sorted(context.submeshes(), key=lambda s: -s[0] * s[1])
    return [(count, (submesh,)) for submesh in submeshes for count in counts]


class SearchPool:
    """Candidates of micro-batch counts, for one plan search (a context manager).

    Usage: ``with SearchPool(context, method, manual) as search: search.run([4, 8])``.
    With one core everything runs in this process.
    """

    def __init__(
        self, context: CostContext, method: Method, manual: Sequence[StageRequest]
    ) -> None:
        self.context = context
        self.method = method
        self.manual = manual
        self.workers = os.cpu_count() or 1
        self._pool: Pool | None = None

    def __enter__(self) -> SearchPool:
        if self.workers >= 2:
            quiet = dataclasses.replace(self.context, progress=None, counter=SolveCounter())
            quiet.reset_costers()
            self._pool = multiprocessing.get_context("forkserver").Pool(
                self.workers, initializer=_start_worker, initargs=(quiet, self.method, self.manual)
            )
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

    def run(self, counts: Sequence[int]) -> list[Candidate | None]:
        """Every candidate of every count in ``counts``: the ILPs solved by the
        workers (merged into this context), each count's candidates built here from
        them as soon as its last task is back, while the workers go on."""
        built: dict[int, list[Candidate | None]] = {}
        if self._pool is not None and counts:
            tasks = split_tasks(self.context, counts, self.method)
            waiting = {count: sum(1 for c, _ in tasks if c == count) for count in counts}
            progress = self.context.progress
            for done, (count, caches, counter) in enumerate(
                self._pool.imap_unordered(_solve_task, tasks), start=1
            ):
                self.context.adopt(caches, counter)
                waiting[count] -= 1
                if not waiting[count]:
                    built[count] = self._candidates(count)
                if progress is not None:
                    progress(f"planned {done}/{len(tasks)} parts of {len(counts)} "
                             "micro-batch counts", self.context.counter.solves, None)
        found: list[Candidate | None] = []
        for count in counts:
            found += built[count] if count in built else self._candidates(count)
        return found

    def _candidates(self, count: int) -> list[Candidate | None]:
        return candidates_at(self.context, count, self.method, self.manual)


#: A worker process's search, set once when it starts (see :func:`_start_worker`).
_WORKER: dict[str, tuple[CostContext, Method, Sequence[StageRequest]]] = {}


def _start_worker(
    context: CostContext, method: Method, manual: Sequence[StageRequest]
) -> None:
    """Pool initializer: keep the search this worker process serves (its only state)."""
    _WORKER["search"] = (context, method, manual)


def _solve_task(task: Task) -> TaskResult:
    """Solve one task's ILPs in a worker; return their solutions and tally, and
    forget them (each task starts from empty caches, so memory stays bounded)."""
    context, method, manual = _WORKER["search"]
    context.counter = SolveCounter()
    count, submeshes = task
    if submeshes:
        warm_submeshes(context, count, submeshes)
    else:
        candidates_at(context, count, method, manual, dp=False)
    caches = {key: coster.caches() for key, coster in context.costers().items()}
    counter = context.counter
    context.reset_costers()
    return count, caches, counter
