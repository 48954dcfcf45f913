"""Solving Alpa's sharding ILP (paper eq. 1) once it is plain arrays.

The problem: nodes ``v`` with ``k_v`` choices each, a cost ``d_v[i]`` (compute plus
communication, ``inf`` = forbidden) and a memory ``m_v[i]``; edges ``(u, v)`` with a
resharding cost ``R_uv[i, j]`` (``inf`` = forbidden pair). Choose one strategy per
node to minimise ``sum_v d_v[s_v] + sum_uv R_uv[s_u, s_v]`` subject to
``sum_v m_v[s_v] <= budget``. Eq. 1 writes it with one-hot vectors::

    min  sum_v s_v . d_v  +  sum_uv e_uv . R_uv
    s.t. s_v in {0,1}^k_v, sum_i s_v[i] = 1
         e_uv >= 0,  sum_j e_uv[i, j] = s_u[i],  sum_i e_uv[i, j] = s_v[j]
         sum_v s_v . m_v <= budget

(the equalities make ``e_uv`` the outer product ``s_u s_v^T`` at every integral
point, so ``e`` can stay continuous). An edge's matrix is stored over *classes*:
strategies of ``u`` that give the tensors on the edge the same specs share a row.
The row constraint then sums ``s_u`` over the class, which is exact and cuts the
``e`` variables by the number of strategies per class.

Presolve (exact) before the ILP:

- an edge whose one side has a single class is separable: its cost folds into the
  other node's ``d``;
- a node with one allowed choice is fixed and its edges fold into its neighbours;
- when the node's choice cannot change the memory (no budget, or constant ``m_v``)
  a node of degree 0 takes its argmin, a leaf (degree 1) folds
  ``min_j d_w[j] + R[i, j]`` into its neighbour's ``d``, and a node of degree 2 is
  replaced by an edge ``R'[a, b] = min_j R1[a, j] + d_w[j] + R2[j, b]`` when that
  does not grow the model (variable elimination, as in tree-structured models).
  The eliminated choices are recovered in reverse order.

For a chain or tree of layers without a budget presolve solves everything; the ILP
then has no variables. What is left goes to :func:`alpajob.planner.intra_op.milp.solve_milp`
(HiGHS, else CBC). :func:`brute_force` enumerates every combination with numpy, for
tests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from alpajob.planner.intra_op.milp import Milp, SolveStatus, resolve_solver, solve_milp

INF = math.inf


@dataclass(frozen=True, eq=False)
class Edge:
    """Pairwise cost between nodes ``u`` and ``v`` over classes of their strategies.

    Cost of ``(i, j)`` is ``matrix[u_class[i], v_class[j]]``; ``inf`` forbids the pair.
    """

    u: int
    v: int
    u_class: np.ndarray
    v_class: np.ndarray
    matrix: np.ndarray


@dataclass(frozen=True, eq=False)
class Problem:
    """The sharding ILP as arrays (see module docstring)."""

    costs: tuple[np.ndarray, ...]
    memory: tuple[np.ndarray, ...]
    edges: tuple[Edge, ...]
    budget: float | None = None


def merge_classes(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The product partition of several class labelings of the same strategies.

    Returns (per merged class, its class in each labeling: shape ``(n, len(columns))``;
    per strategy, its merged class). Merged classes are ordered lexicographically by
    their labels (as ``np.unique(..., axis=0)`` orders rows): the labels are mixed into
    one integer per strategy, in the radix of each column's largest label, so a 1-D
    ``np.unique`` does the work. One labeling: its classes as they are."""
    if len(columns) == 1:
        col = columns[0]
        n = int(col.max()) + 1 if col.size else 0
        return np.arange(n)[:, None], col
    key = np.zeros(columns[0].shape, dtype=np.int64)
    for col in columns:
        key = key * (int(col.max()) + 1) + col
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    rep = np.stack([col[first] for col in columns], axis=1)
    return rep, inverse.reshape(-1)


@dataclass(frozen=True)
class Solution:
    """A choice per node, its objective and memory, and solver statistics."""

    choice: tuple[int, ...]
    objective: float
    memory: float
    status: SolveStatus
    solver: str
    num_variables: int
    num_constraints: int
    solve_seconds: float
    nodes_left: int = 0


def evaluate(problem: Problem, choice: tuple[int, ...]) -> tuple[float, float]:
    """(objective, memory) of ``choice``; objective is ``inf`` if forbidden."""
    total = sum(float(problem.costs[v][i]) for v, i in enumerate(choice))
    for edge in problem.edges:
        total += float(edge.matrix[edge.u_class[choice[edge.u]], edge.v_class[choice[edge.v]]])
    memory = sum(float(problem.memory[v][i]) for v, i in enumerate(choice))
    return total, memory


@dataclass
class _Work:
    """Presolve state of one :func:`solve` call (local, mutated in place): node costs,
    the edges by node pair, which nodes are still alive, and how to undo eliminations."""

    costs: list[np.ndarray]
    memory: list[np.ndarray]
    edges: dict[tuple[int, int], Edge]
    adjacency: list[set[int]]
    alive: list[bool]
    records: list[tuple] = field(default_factory=list)
    const_memory: float = 0.0
    #: Edges a pass of :func:`_fold_separable` found not separable, with the cost
    #: arrays of their two nodes then (arrays are replaced, never written, when costs
    #: change): while all three are the same objects the edge still is not.
    settled: dict[tuple[int, int], tuple[Edge, np.ndarray, np.ndarray]] = field(default_factory=dict)

    def add_edge(self, edge: Edge) -> None:
        """Add an edge, merging it with an existing one between the same nodes."""
        if edge.u > edge.v:
            edge = Edge(edge.v, edge.u, edge.v_class, edge.u_class, edge.matrix.T)
        key = (edge.u, edge.v)
        old = self.edges.get(key)
        if old is not None:
            u_rep, u_new = merge_classes([old.u_class, edge.u_class])
            v_rep, v_new = merge_classes([old.v_class, edge.v_class])
            matrix = old.matrix[np.ix_(u_rep[:, 0], v_rep[:, 0])] + edge.matrix[
                np.ix_(u_rep[:, 1], v_rep[:, 1])
            ]
            edge = Edge(edge.u, edge.v, u_new.reshape(-1), v_new.reshape(-1), matrix)
        self.edges[key] = edge
        self.adjacency[edge.u].add(edge.v)
        self.adjacency[edge.v].add(edge.u)

    def pop_edge(self, a: int, b: int) -> Edge:
        """Remove the edge between ``a`` and ``b``, oriented so that ``u == a``."""
        edge = self.edges.pop((min(a, b), max(a, b)))
        self.adjacency[a].discard(b)
        self.adjacency[b].discard(a)
        if edge.u != a:
            edge = Edge(a, b, edge.v_class, edge.u_class, edge.matrix.T)
        return edge


def _single_class(classes: np.ndarray, allowed: np.ndarray) -> int | None:
    """The class of every allowed strategy, when they all share one; else None."""
    used = classes[allowed]
    if used.size == 0:
        return None
    first = used[0]
    return int(first) if bool((used == first).all()) else None


def _fold_separable(work: _Work) -> bool:
    """Fold edges with a single class on one side into the other node's costs."""
    folded = False
    finite: dict[int, np.ndarray] = {}  # allowed strategies per node, while unchanged

    def allowed(v: int) -> np.ndarray:
        mask = finite.get(v)
        if mask is None:
            mask = finite[v] = np.isfinite(work.costs[v])
        return mask

    for (u, v), edge in list(work.edges.items()):
        known = work.settled.get((u, v))
        if (known is not None and known[0] is edge and known[1] is work.costs[u]
                and known[2] is work.costs[v]):
            continue  # nothing it depends on has changed since it was found not separable
        u_class = _single_class(edge.u_class, allowed(u))
        if u_class is not None:
            work.pop_edge(u, v)
            work.costs[v] = work.costs[v] + edge.matrix[u_class, edge.v_class]
            finite.pop(v, None)
            folded = True
            continue
        v_class = _single_class(edge.v_class, allowed(v))
        if v_class is not None:
            work.pop_edge(u, v)
            work.costs[u] = work.costs[u] + edge.matrix[edge.u_class, v_class]
            finite.pop(u, None)
            folded = True
            continue
        work.settled[(u, v)] = (edge, work.costs[u], work.costs[v])
    return folded


def _memory_fixed(work: _Work, w: int, budget: float | None) -> bool:
    if budget is None:
        return True
    allowed = work.memory[w][np.isfinite(work.costs[w])]
    return allowed.size == 0 or bool(np.ptp(allowed) <= 1e-9 * max(1.0, float(np.max(allowed))))


def _eliminate(work: _Work, w: int) -> None:
    """Eliminate node ``w`` (degree <= 2) into its neighbours, recording how to undo."""
    neighbours = sorted(work.adjacency[w])
    cost = work.costs[w]
    allowed = np.isfinite(cost)
    if allowed.any():
        work.const_memory += float(work.memory[w][allowed][0])
    work.alive[w] = False
    if not neighbours:
        work.records.append(("fix", w, int(np.argmin(cost))))
        return
    if len(neighbours) == 1:
        (a,) = neighbours
        edge = work.pop_edge(a, w)
        # table[ca, j] = R[ca, class(j)] + d_w[j]
        table = edge.matrix[:, edge.v_class] + cost[None, :]
        best = np.argmin(table, axis=1)
        work.costs[a] = work.costs[a] + table[np.arange(table.shape[0]), best][edge.u_class]
        work.records.append(("leaf", w, a, edge.u_class, best))
        return
    a, b = neighbours
    ea = work.pop_edge(a, w)
    eb = work.pop_edge(w, b)
    # cube[ra, j, cb] = R1[ra, class(j)] + d_w[j] + R2[class(j), cb]
    cube = (
        ea.matrix[:, ea.v_class][:, :, None]
        + cost[None, :, None]
        + eb.matrix[eb.u_class, :][None, :, :]
    )
    best = np.argmin(cube, axis=1)
    matrix = np.take_along_axis(cube, best[:, None, :], axis=1)[:, 0, :]
    work.records.append(("series", w, a, b, ea.u_class, eb.v_class, best))
    work.add_edge(Edge(a, b, ea.u_class, eb.v_class, matrix))


def _presolve(work: _Work, budget: float | None) -> None:
    """Fixed nodes, separable edges, then degree <= 2 elimination until none applies."""
    changed = True
    while changed:
        changed = _fold_separable(work)
        for w, alive in enumerate(work.alive):
            if not alive:
                continue
            allowed = int(np.isfinite(work.costs[w]).sum())
            if allowed == 0:
                continue
            degree = len(work.adjacency[w])
            if allowed == 1 and degree > 0:
                continue  # its edges are separable; folded on the next pass
            if not _memory_fixed(work, w, budget):
                continue
            if degree <= 1 or allowed == 1:
                _eliminate(work, w)
                changed = True
            elif degree == 2:
                a, b = sorted(work.adjacency[w])
                ea = work.edges[(min(a, w), max(a, w))]
                eb = work.edges[(min(b, w), max(b, w))]
                rows = ea.matrix.shape[0] if ea.u == a else ea.matrix.shape[1]
                cols = eb.matrix.shape[1] if eb.v == b else eb.matrix.shape[0]
                existing = work.edges.get((a, b))
                grown = rows * cols - ea.matrix.size - eb.matrix.size - allowed
                if existing is not None:
                    grown -= existing.matrix.size
                if grown <= 0:
                    _eliminate(work, w)
                    changed = True


def _arrays(
    work: _Work, budget: float | None
) -> tuple[Milp, dict[int, np.ndarray], dict[int, int]]:
    """The ILP left after presolve as a :class:`Milp`, plus, per live node, the
    strategy of each of its ``s`` columns and the first column's index.

    Columns: the ``s`` binaries of the live nodes' allowed strategies, then the
    continuous ``e`` of every usable class pair. Rows: one-hot per node; per edge,
    per side, per class ``c`` used (ascending) the tie ``sum e[c, .] - sum s[class
    c] = 0``, listing its ``e`` columns then its ``s`` columns in column order; and
    the memory row. The tie rows of all edges are laid out with one stable sort of
    their entries by row.
    """
    live = [v for v, alive in enumerate(work.alive) if alive]
    cost_parts: list[np.ndarray] = []
    s_columns: dict[int, np.ndarray] = {}
    s_offset: dict[int, int] = {}
    s_ids: dict[int, np.ndarray] = {}
    column = 0
    for v in live:
        allowed = np.flatnonzero(np.isfinite(work.costs[v]))
        s_columns[v], s_offset[v] = allowed, column
        s_ids[v] = np.arange(column, column + len(allowed))
        cost_parts.append(work.costs[v][allowed])
        column += len(allowed)
    num_s = column
    # Tie rows, entry by entry: (row, column) in the order the rows list them.
    tie_rows: list[np.ndarray] = []
    tie_cols: list[np.ndarray] = []
    num_tie_rows = 0
    for (u, v), edge in work.edges.items():
        u_cls = edge.u_class[s_columns[u]]
        v_cls = edge.v_class[s_columns[v]]
        rows_used = np.zeros(edge.matrix.shape[0], dtype=bool)
        rows_used[u_cls] = True
        cols_used = np.zeros(edge.matrix.shape[1], dtype=bool)
        cols_used[v_cls] = True
        usable = np.isfinite(edge.matrix) & rows_used[:, None] & cols_used[None, :]
        a_idx, b_idx = np.nonzero(usable)
        e_cols = np.arange(column, column + len(a_idx))
        cost_parts.append(edge.matrix[a_idx, b_idx])
        column += len(a_idx)
        for side, cls, used, pair_cls in ((u, u_cls, rows_used, a_idx),
                                          (v, v_cls, cols_used, b_idx)):
            row_of = np.cumsum(used) + (num_tie_rows - 1)  # class -> its row
            tie_rows += [row_of[pair_cls], row_of[cls]]
            tie_cols += [e_cols, s_ids[side]]
            num_tie_rows = int(row_of[-1]) + 1
    rows = np.concatenate(tie_rows) if tie_rows else np.zeros(0, np.int64)
    order = np.argsort(rows, kind="stable")  # per row: e before s, each in order
    tie_index = np.concatenate(tie_cols)[order] if tie_cols else np.zeros(0, np.int64)
    index_parts = [np.arange(num_s), tie_index]
    value_parts = [np.ones(num_s), np.where(tie_index >= num_s, 1.0, -1.0)]
    size_parts = [
        np.array([len(s_columns[v]) for v in live], dtype=np.int64),
        np.bincount(rows, minlength=num_tie_rows),
    ]
    lower = [np.ones(len(live)), np.zeros(num_tie_rows)]
    upper = [np.ones(len(live)), np.zeros(num_tie_rows)]
    if budget is not None:
        index_parts.append(np.arange(num_s))
        value_parts.append(
            np.concatenate([work.memory[v][s_columns[v]] for v in live])
            if live else np.zeros(0)
        )
        size_parts.append(np.array([num_s], dtype=np.int64))
        lower.append(np.array([-INF]))
        upper.append(np.array([budget - work.const_memory]))
    integer = np.zeros(column, dtype=bool)
    integer[:num_s] = True
    lengths = np.concatenate(size_parts).astype(np.int64)
    milp = Milp(
        cost=np.concatenate(cost_parts) if cost_parts else np.zeros(0),
        integer=integer,
        row_lower=np.concatenate(lower),
        row_upper=np.concatenate(upper),
        starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        index=np.concatenate(index_parts).astype(np.int32),
        value=np.concatenate(value_parts).astype(float),
    )
    return milp, s_columns, s_offset


def _ilp(
    work: _Work, budget: float | None, time_limit_s: float, solver: str
) -> tuple[dict[int, int], SolveStatus, str, int, int]:
    """Solve what presolve left; returns the choices of the live nodes."""
    if not any(work.alive):
        return {}, SolveStatus.PRESOLVED, "none", 0, 0
    milp, s_columns, s_offset = _arrays(work, budget)
    values, status, name = solve_milp(milp, time_limit_s=time_limit_s, solver=solver)
    sizes = (milp.num_columns, milp.num_rows)
    if values is None:
        return {}, status, name, *sizes
    choice = {}
    for v, strategies in s_columns.items():
        picked = values[s_offset[v] : s_offset[v] + len(strategies)]
        choice[v] = int(strategies[int(np.argmax(picked))])
    return choice, status, name, *sizes


def solve(
    problem: Problem,
    *,
    time_limit_s: float = 10.0,
    solver: str = "auto",
    presolve: bool = True,
) -> Solution:
    """Minimise the problem's objective (see module docstring).

    Returns a :class:`Solution` with status ``INFEASIBLE`` (and an empty choice) when
    no choice fits; raises :class:`SolverError` when the solver fails or finds nothing
    within ``time_limit_s``.
    """
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s}")
    resolve_solver(solver)
    start = time.perf_counter()
    n = len(problem.costs)
    work = _Work(
        costs=[np.asarray(c, dtype=float).copy() for c in problem.costs],
        memory=[np.asarray(m, dtype=float) for m in problem.memory],
        edges={},
        adjacency=[set() for _ in range(n)],
        alive=[True] * n,
    )
    for edge in problem.edges:
        key = (edge.u, edge.v)
        if edge.u < edge.v and key not in work.edges:  # as a model's edges come: one per pair
            work.edges[key] = edge
            work.adjacency[edge.u].add(edge.v)
            work.adjacency[edge.v].add(edge.u)
        else:
            work.add_edge(edge)
    if presolve:
        _presolve(work, problem.budget)
    else:
        _fold_separable(work)
    infeasible = Solution((), INF, INF, SolveStatus.INFEASIBLE, "none", 0, 0, 0.0)
    if any(not np.isfinite(work.costs[v]).any() for v in range(n) if work.alive[v]):
        return infeasible
    choice, status, name, num_vars, num_cons = _ilp(
        work, problem.budget, time_limit_s, solver
    )
    if status is SolveStatus.INFEASIBLE:
        return Solution((), INF, INF, status, name, num_vars, num_cons, time.perf_counter() - start)
    full = [0] * n
    for v, i in choice.items():
        full[v] = i
    for record in reversed(work.records):
        kind, w = record[0], record[1]
        if kind == "fix":
            full[w] = record[2]
        elif kind == "leaf":
            _, _, a, a_class, best = record
            full[w] = int(best[a_class[full[a]]])
        else:
            _, _, a, b, a_class, b_class, best = record
            full[w] = int(best[a_class[full[a]], b_class[full[b]]])
    objective, memory = evaluate(problem, tuple(full))
    if not math.isfinite(objective) or (
        problem.budget is not None and memory > problem.budget * (1 + 1e-9) + 1e-6
    ):
        return Solution((), INF, INF, SolveStatus.INFEASIBLE, name, num_vars, num_cons,
                        time.perf_counter() - start)
    return Solution(
        tuple(full),
        objective,
        memory,
        status,
        name,
        num_vars,
        num_cons,
        time.perf_counter() - start,
        nodes_left=sum(work.alive),
    )


def brute_force(problem: Problem, max_combinations: int = 5_000_000) -> Solution:
    """Enumerate every combination (tests only); same result type as :func:`solve`."""
    start = time.perf_counter()
    sizes = [len(c) for c in problem.costs]
    if math.prod(sizes) > max_combinations:
        raise ValueError(
            f"brute force over {math.prod(sizes)} combinations exceeds {max_combinations}"
        )
    n = len(sizes)

    def along(values: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        shape = [1] * n
        for axis, size in zip(axes, values.shape, strict=True):
            shape[axis] = size
        return values.reshape(shape)

    total = np.zeros(sizes)
    memory = np.zeros(sizes)
    for v in range(n):
        total = total + along(np.asarray(problem.costs[v], dtype=float), (v,))
        memory = memory + along(np.asarray(problem.memory[v], dtype=float), (v,))
    for edge in problem.edges:
        pair = edge.matrix[np.ix_(edge.u_class, edge.v_class)]
        if edge.u > edge.v:
            total = total + along(pair.T, (edge.v, edge.u))
        else:
            total = total + along(pair, (edge.u, edge.v))
    if problem.budget is not None:
        total = np.where(memory <= problem.budget * (1 + 1e-9) + 1e-6, total, INF)
    flat = int(np.argmin(total))
    best = float(total.reshape(-1)[flat])
    elapsed = time.perf_counter() - start
    if not math.isfinite(best):
        return Solution((), INF, INF, SolveStatus.INFEASIBLE, "brute_force", 0, 0, elapsed)
    choice = tuple(int(i) for i in np.unravel_index(flat, sizes))
    return Solution(
        choice, best, float(memory[choice]), SolveStatus.OPTIMAL, "brute_force", 0, 0, elapsed
    )
