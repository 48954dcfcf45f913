"""What-if options planned side by side: a worker process per core, each planning whole options.

A plan search splits its ILPs among the cores (:class:`~alpajob.planner.plan.workers.SearchPool`),
and every task of it starts from empty caches: GPT-2.6B's search on 8 V100s solves the
same 468 ILPs in 8.5 CPU-seconds in one process and in 11.7 split between two (fresh op
tables and models per task, each worker choosing the block-part cuts again). A what-if
with at least as many options as cores keeps each search whole instead: a pool of
``forkserver`` workers, given the graph once, plans one option at a time each, every
search in its own process (its :class:`SearchPool` has one worker there: a daemonic
process starts none).

**Sharing.** The parent keeps the what-if's
:class:`~alpajob.planner.inter_op.shared_solutions.SharedSolutions`. An option goes out
with the solutions found so far on its GPU types (pickled without the graph; the worker
has its own copy) and comes back with its row and those solutions grown by its search,
which the parent merges. A free worker takes the first option left, in the order given,
none of whose GPU types is being planned, so that the options of one type follow one
another and each starts from the solutions of those before; only where every option
left shares a type with a running one does it take the first of them anyway (a core is
never left idle while options wait). The rows are those of the options planned one by
one (the same plans: :mod:`~alpajob.planner.inter_op.shared_solutions`), in the order
given; their warnings are printed as each option ends.

Ctrl-C and SIGTERM reach the parent, which terminates the workers (they ignore
Ctrl-C); an error in an option ends the what-if with that error, as it would one by one.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal
from collections.abc import Callable, Sequence
from typing import Any

from alpajob.api.what_if import Choice, WhatIfMix, WhatIfRow
from alpajob.planner.cost.cluster import DeviceSpec, cluster_from_preset
from alpajob.planner.inter_op.shared_solutions import SharedSolutions
from alpajob.planner.plan.collection import fewer_collections, settle_worker
from alpajob.planner.plan.processes import main_module_hidden
from alpajob.planner.plan.workers import signals_held

#: Plans one option in a worker: ``(state, choice, warn, shared) -> row``, where
#: ``state`` is what every option shares (the job, options, graph, tokens, prices), sent
#: to each worker once.
RowPlanner = Callable[[Any, Choice, Callable[[str], None], SharedSolutions], WhatIfRow]

#: What an option's task sends back: its position, its row, the solutions its search
#: started from and found, and its warnings.
Done = tuple[int, WhatIfRow, SharedSolutions, list[str]]

#: A worker process' planner and state, set once when it starts (:func:`_start_worker`).
_WORKER: dict[str, tuple[RowPlanner, Any]] = {}


def devices_of(choice: Choice) -> list[DeviceSpec]:
    """The GPU types an option plans on (a mix: each of its parts')."""
    parts = choice.parts if isinstance(choice, WhatIfMix) else (choice,)
    return [cluster_from_preset(p.gpu, p.nodes, p.gpus_per_node).device for p in parts]


def next_option(left: Sequence[int], running: Sequence[int], types: Callable[[int], set[str]]) -> int:
    """The option a free worker takes (module docstring): the first of ``left`` none of
    whose ``types`` a ``running`` option has, else the first of ``left``."""
    busy = set().union(*(types(i) for i in running))
    return next((i for i in left if not types(i) & busy), left[0])


def side_by_side(planner: RowPlanner, state: Any, choices: Sequence[Choice], shared: SharedSolutions,
                 workers: int, started: Callable[[Choice, int], None],
                 warn: Callable[[str], None]) -> list[WhatIfRow]:
    """Every option's row, planned in ``workers`` processes (module docstring);
    ``started(choice, done)`` hears of each option as a worker takes it, with how many
    have ended."""
    devices = [devices_of(choice) for choice in choices]

    def types(index: int) -> set[str]:
        return {device.name for device in devices[index]}

    left: list[int] = list(range(len(choices)))
    running: list[int] = []
    rows: dict[int, WhatIfRow] = {}
    arrived: queue.SimpleQueue[Done | BaseException] = queue.SimpleQueue()
    context = multiprocessing.get_context("forkserver")
    with signals_held(), main_module_hidden():
        pool = context.Pool(workers, initializer=_start_worker,
                            initargs=(pickle.dumps((planner, state), protocol=pickle.HIGHEST_PROTOCOL),))
    try:
        while left or running:
            while left and len(running) < workers:
                index = next_option(left, running, types)
                left.remove(index)
                running.append(index)
                started(choices[index], len(rows))
                pool.apply_async(_plan_option, ((index, choices[index], shared.matching(devices[index])),),
                                 callback=arrived.put, error_callback=arrived.put)
            done = arrived.get()
            if isinstance(done, BaseException):
                raise done
            index, row, found, warnings = done
            running.remove(index)
            rows[index] = row
            shared.merge(found)
            for line in warnings:
                warn(line)
    finally:
        pool.terminate()
        pool.join()
    return [rows[index] for index in range(len(choices))]


def _start_worker(sent: bytes) -> None:
    """Pool initializer: keep the planner and the state every option shares (the graph
    among it: read with fewer collections, then frozen out of them, as a search
    worker's context is). Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with fewer_collections():
        _WORKER["planner"] = pickle.loads(sent)
    settle_worker()


def _plan_option(task: tuple[int, Choice, SharedSolutions]) -> Done:
    """Plan one option in a worker, from the solutions sent with it."""
    index, choice, shared = task
    planner, state = _WORKER["planner"]
    warnings: list[str] = []
    row = planner(state, choice, warnings.append, shared)
    return index, row, shared, warnings
