"""The inter-operator stage DP (Alpa eq. 3/4): layers -> pipeline stages on submeshes.

Given L layers, the per-micro-batch latency of every candidate stage (a layer range
on a submesh shape) and B micro-batches, choose contiguous layer ranges and a
submesh for each so that the submeshes use exactly the cluster's ``num_devices`` and
the pipeline latency (eq. 2)

    T = sum_i t_i + (B - 1) * max_i t_i

is minimal. The ``max`` makes T non-additive, so Alpa fixes a cap ``t_max`` on every
stage's latency and solves an additive DP under the cap (eq. 3/4)::

    F(s, k, d; t_max) = min over k <= i < L, submesh c with n_c <= d of
                        cost(k..i, c) + F(s - 1, i + 1, d - n_c; t_max)
                        over stages with cost(k..i, c) <= t_max
                        and (s - 1) <= max_n_succ_stages[k, i, c]     (memory, 1F1B)
    F(0, L, 0) = 0,  F(0, k, d) = inf otherwise
    T* = min over t_max of  min_s F(s, 0, N; t_max) + (B - 1) * t_max

``F(s, k, d)`` is the least sum of latencies of ``s`` stages covering layers
``k..L-1`` with exactly ``d`` devices. ``s - 1`` is the number of stages after the one
being placed: under 1F1B that stage holds ``s`` micro-batches of activations, which is
why memory feasibility depends on ``s`` (see :mod:`alpajob.planner.inter_op.schedules`).

Worked example: 2 layers, one submesh choice of 1 device, 2 devices, B = 4, cost
of layer 0 = 1, layer 1 = 1, both layers = 2. One stage cannot use 2 devices, so the
only plan is two stages (1 + 1) + 3 * 1 = 5 s.

Which caps are tried
--------------------
Only the distinct stage costs can be the optimum's bottleneck, so the candidates are
the sorted distinct finite costs. Each capped DP's plan is scored with its own
bottleneck (at most the cap), as Alpa does, so the cap whose value is the optimum's
bottleneck ``t*`` returns a plan at least as good as the optimum: the method is exact.
Values within a relative gap ``epsilon_tmax`` of a cluster's smallest value are
merged into one cap (the cluster's largest); the plan found then costs at most
``(B - 1) * epsilon_tmax * t*`` more than the optimum. (Alpa skips caps closer than
1e-6 to the last one tried, so plans whose bottleneck falls in the skipped gap are
only seen under a later, looser cap; ours tries each cluster's top, so every plan
stays reachable.) ``epsilon_tmax = 0`` tries every distinct cost.

Pruning is exact. A plan whose bottleneck stage costs ``t`` has ``sum >= t``, so
``T >= B * t``: once ``B * t >= best``, no larger cap can win (Alpa's stop rule).
Tighter: for caps ``t`` in a cluster range ``[a, b]``, every new plan has a bottleneck
``>= a`` and ``sum >= F(b)`` (F only falls as the cap rises), so
``T >= max(F(b), a) + (B - 1) * a``. The driver keeps ranges of untried caps in a
priority queue ordered by this bound, evaluates the middle cap of the most promising
range and splits it, and stops when the best bound reaches the best plan found:
best-first branch and bound over Alpa's cap list. It first solves with no cap (the
plan of least sum), which alone is optimal for B = 1 and seeds the bound.

Each DP is vectorised over the device count ``d`` and over all candidate stages: a
candidate is a triple (start k, end i, submesh c); for stage count s, every triple's
value row ``cost + F(s - 1, i + 1, . - n_c)`` is gathered at once and reduced by
start layer with ``np.minimum.reduceat``. The argmin is recovered afterwards by
re-matching values along the chosen path (exact float equality: the same sums).

Mixed pools
-----------
:func:`stage_dp_pools` runs the same search over several pools of devices (GPUs of
different types, :mod:`.pools`): submesh choice ``c`` lies in pool ``p(c)``, and the
device count becomes a vector ``d = (d_1 .. d_P)``, one entry per pool::

    F(s, k, d) = min over k <= i < L, c with n_c <= d_p(c) of
                 cost(k..i, c) + F(s - 1, i + 1, d - n_c e_p(c))
    T* = min over t_max, targets D of  min_s F(s, 0, D) + (B - 1) * t_max

``F`` is an array with one axis per pool; a stage shifts it along its own pool's
axis only. The targets ``D`` are the device counts per pool a plan may use (by
default each pool whole or unused, not all unused). With one pool and the target
``(N,)`` this is the recurrence above, step for step (tested).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageChoice:
    """One pipeline stage: layers ``start_layer .. end_layer - 1`` (``end_layer`` is
    exclusive) on submesh choice ``submesh_index`` (an index into ``submesh_devices``).
    """

    start_layer: int
    end_layer: int
    submesh_index: int

    @property
    def end_layer_exclusive(self) -> int:
        """Alias of ``end_layer``, spelling out that it is exclusive."""
        return self.end_layer


@dataclass(frozen=True)
class DPResult:
    """The stage DP's answer.

    ``stages``: in pipeline order, covering layers 0..L-1 exactly once.
    ``stage_costs``: per-micro-batch latency of each stage, seconds.
    ``total_seconds``: eq. 2, ``sum(stage_costs) + (B - 1) * t_max``.
    ``t_max``: the bottleneck, ``max(stage_costs)``.
    ``tmax_tried``: how many capped DPs ran (0 for the brute force).
    ``seconds``: wall time of the call.
    """

    stages: tuple[StageChoice, ...]
    stage_costs: tuple[float, ...]
    total_seconds: float
    t_max: float
    tmax_tried: int
    seconds: float


def submesh_choices(num_nodes: int, devices_per_node: int) -> list[tuple[int, int]]:
    """Alpa's submesh shapes: ``(1, 1), (1, 2), (1, 4) .. (1, M)``, then ``(n, M)`` for
    every ``n`` in ``2..N``. Together they always tile the N x M cluster.

    Example: 2 nodes x 4 devices -> [(1, 1), (1, 2), (1, 4), (2, 4)].
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be at least 1, got {num_nodes}")
    if devices_per_node < 1 or devices_per_node & (devices_per_node - 1):
        raise ValueError(
            f"devices_per_node must be a power of two (1, 2, 4, 8, ...), got {devices_per_node}"
        )
    shapes = []
    m = 1
    while m <= devices_per_node:
        shapes.append((1, m))
        m *= 2
    shapes += [(n, devices_per_node) for n in range(2, num_nodes + 1)]
    return shapes


def assign_submeshes(
    shapes: list[tuple[int, int]], num_nodes: int, devices_per_node: int
) -> list[list[tuple[int, int]]]:
    """Place each stage's submesh on concrete ``(node, device)`` slots, without overlap.

    Largest first: ``(n, M)`` submeshes take ``n`` whole free nodes (lowest first);
    ``(1, m)`` ones (``m`` a power of two) take the first free, ``m``-aligned run of
    ``m`` devices inside one node. Because sizes are powers of two placed in
    decreasing order, this first fit succeeds whenever the total fits (buddy
    allocation), so the DP's plans, which use exactly N x M devices, always tile.
    Slots of a stage are listed row-major (node, then device). Devices left over are
    allowed; a shape that is not a submesh choice, or a total over N x M, raises.

    Example: shapes [(1, 2), (1, 4), (1, 2)] on 1 node x 8 ->
    [[(0, 4), (0, 5)], [(0, 0), (0, 1), (0, 2), (0, 3)], [(0, 6), (0, 7)]].
    """
    allowed = set(submesh_choices(num_nodes, devices_per_node))
    for shape in shapes:
        if tuple(shape) not in allowed:
            raise ValueError(
                f"submesh shape {shape} is not one of the choices for {num_nodes} x "
                f"{devices_per_node} devices: {sorted(allowed)}"
            )
    total = sum(n * m for n, m in shapes)
    if total > num_nodes * devices_per_node:
        raise ValueError(
            f"submesh shapes {shapes} need {total} devices but the cluster has "
            f"{num_nodes} x {devices_per_node} = {num_nodes * devices_per_node}"
        )
    used = np.zeros((num_nodes, devices_per_node), dtype=bool)
    placed: dict[int, list[tuple[int, int]]] = {}
    order = sorted(range(len(shapes)), key=lambda q: (-shapes[q][0] * shapes[q][1], q))
    for q in order:
        n, m = shapes[q]
        if m == devices_per_node:
            free_nodes = [node for node in range(num_nodes) if not used[node].any()]
            if len(free_nodes) < n:
                raise ValueError(f"no {n} free whole nodes left for submesh {shapes[q]}")
            nodes = free_nodes[:n]
            used[nodes] = True
            placed[q] = [(node, dev) for node in nodes for dev in range(m)]
            continue
        for node, offset in itertools.product(range(num_nodes), range(0, devices_per_node, m)):
            if not used[node, offset : offset + m].any():
                used[node, offset : offset + m] = True
                placed[q] = [(node, dev) for dev in range(offset, offset + m)]
                break
        else:
            raise ValueError(f"no free aligned run of {m} devices left for submesh {shapes[q]}")
    return [placed[q] for q in range(len(shapes))]


def _validate(
    compute_cost: np.ndarray,
    max_n_succ_stages: np.ndarray,
    submesh_devices: Sequence[int],
    num_devices: int,
    num_micro_batches: int,
    num_stages: int | None,
    pools: _Pools | None = None,
) -> None:
    if compute_cost.ndim != 3 or compute_cost.shape[0] != compute_cost.shape[1]:
        raise ValueError(f"compute_cost must have shape [L, L, S], got {compute_cost.shape}")
    if max_n_succ_stages.shape != compute_cost.shape:
        raise ValueError(
            f"max_n_succ_stages has shape {max_n_succ_stages.shape}, compute_cost "
            f"{compute_cost.shape}: they must match"
        )
    if len(submesh_devices) != compute_cost.shape[2]:
        raise ValueError(
            f"submesh_devices has {len(submesh_devices)} entries but compute_cost has "
            f"{compute_cost.shape[2]} submesh choices"
        )
    if any(int(n) < 1 for n in submesh_devices):
        raise ValueError(f"every submesh needs at least 1 device, got {list(submesh_devices)}")
    if np.any(compute_cost < 0):
        raise ValueError("compute_cost has negative latencies")
    if num_devices < 1:
        raise ValueError(f"num_devices must be at least 1, got {num_devices}")
    if pools is not None:
        pools.check(len(submesh_devices))
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be at least 1, got {num_micro_batches}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"num_stages must be at least 1 or None, got {num_stages}")


@dataclass(frozen=True)
class _Candidates:
    """Every stage that can appear at all, as parallel arrays sorted by start layer."""

    start: np.ndarray  # k
    end: np.ndarray  # i (inclusive)
    submesh: np.ndarray  # c
    cost: np.ndarray
    max_succ: np.ndarray
    devices: np.ndarray
    pool: np.ndarray  # the pool of each candidate's submesh (all 0 in one pool)


@dataclass(frozen=True)
class _Pools:
    """Several pools of devices (module docstring, "Mixed pools"): ``of[c]`` is the
    pool of submesh choice ``c``, ``sizes[p]`` the devices of pool ``p``, and
    ``targets`` the device counts per pool that a plan may use in all."""

    of: tuple[int, ...]
    sizes: tuple[int, ...]
    targets: tuple[tuple[int, ...], ...]

    @classmethod
    def one(cls, num_choices: int, num_devices: int) -> _Pools:
        """One pool of ``num_devices``, every one of them used (Alpa's DP)."""
        return cls((0,) * num_choices, (num_devices,), ((num_devices,),))

    def check(self, num_choices: int) -> None:
        if len(self.of) != num_choices:
            raise ValueError(f"submesh_pools has {len(self.of)} entries for {num_choices} submesh choices")
        if any(not 0 <= p < len(self.sizes) for p in self.of):
            raise ValueError(f"submesh_pools names pools outside 0..{len(self.sizes) - 1}: {list(self.of)}")
        if any(n < 0 for n in self.sizes) or not self.targets:
            raise ValueError(f"pool sizes must be >= 0 with at least one target, got {self.sizes}")
        for target in self.targets:
            if len(target) != len(self.sizes) or any(not 0 <= t <= n for t, n in zip(target, self.sizes,
                                                                                      strict=True)):
                raise ValueError(f"target {target} is not a device count per pool within {self.sizes}")


def _candidates(
    compute_cost: np.ndarray,
    max_n_succ_stages: np.ndarray,
    submesh_devices: np.ndarray,
    pools: _Pools,
) -> _Candidates:
    num_layers = compute_cost.shape[0]
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))[:, :, None]
    of = np.asarray(pools.of, dtype=np.int64)
    ok = (
        upper
        & np.isfinite(compute_cost)
        & (max_n_succ_stages >= 0)
        & (submesh_devices <= np.asarray(pools.sizes)[of])[None, None, :]
    )
    k, i, c = np.nonzero(ok)  # row-major, so already sorted by k
    return _Candidates(
        start=k,
        end=i,
        submesh=c,
        cost=compute_cost[k, i, c].astype(np.float64),
        max_succ=max_n_succ_stages[k, i, c].astype(np.int64),
        devices=submesh_devices[c],
        pool=of[c],
    )


def _capped_dp(
    cand: _Candidates,
    t_max: float,
    num_layers: int,
    pools: _Pools,
    max_stages: int,
    num_stages: int | None,
) -> tuple[float, list[int]] | None:
    """Solve eq. 3 under cap ``t_max``; return (least sum, chosen candidate ids) or None.

    ``F`` has one axis for the layer and one per pool (the devices used of it); a
    stage of ``n`` devices of pool ``p`` shifts ``F`` by ``n`` along pool ``p``'s axis."""
    keep = cand.cost <= t_max
    start, end, cost = cand.start[keep], cand.end[keep], cand.cost[keep]
    max_succ, devices, ids = cand.max_succ[keep], cand.devices[keep], np.flatnonzero(keep)
    pool = cand.pool[keep]
    if start.size == 0:
        return None
    dims = tuple(n + 1 for n in pools.sizes)
    # One shift per distinct (pool, device count) among the candidates.
    shifts, shift_index = np.unique(np.stack([pool, devices], axis=1), axis=0, return_inverse=True)
    shift_index = shift_index.reshape(-1)
    f_prev = np.full((num_layers + 1, *dims), np.inf)
    f_prev[(num_layers,) + (0,) * len(dims)] = 0.0
    tables = [f_prev]
    targets = [(0, *t) for t in pools.targets]
    best_value, best_s, best_target = np.inf, 0, targets[0]
    devices_axes = tuple(range(1, 1 + len(dims)))
    for s in range(1, max_stages + 1):
        row_ok = np.isfinite(f_prev).any(axis=devices_axes)
        active = (max_succ >= s - 1) & (end <= num_layers - s) & row_ok[end + 1]
        f_s = np.full_like(f_prev, np.inf)
        if active.any():
            a_start, a_end = start[active], end[active]
            # shifted[x, r, d...] = F(s - 1, r, d - shift x (n devices along pool p))
            shifted = np.full((len(shifts), num_layers + 1, *dims), np.inf)
            for x, (p, n) in enumerate(shifts):
                to: list[slice | int] = [x] + [slice(None)] * (1 + len(dims))
                source = [slice(None)] * (1 + len(dims))
                to[2 + p], source[1 + p] = slice(n, None), slice(0, dims[p] - n)
                shifted[tuple(to)] = f_prev[tuple(source)]
            values = shifted[shift_index[active], a_end + 1] + cost[active].reshape((-1,) + (1,) * len(dims))
            seg = np.flatnonzero(np.r_[True, a_start[1:] != a_start[:-1]])
            f_s[a_start[seg]] = np.minimum.reduceat(values, seg, axis=0)
        tables.append(f_s)
        if num_stages is None or s == num_stages:
            for target in targets:
                if f_s[target] < best_value:
                    best_value, best_s, best_target = f_s[target], s, target
        if not np.isfinite(f_s).any():
            break
        f_prev = f_s
    if not np.isfinite(best_value):
        return None
    chosen = []
    k, d = 0, list(best_target[1:])
    for s in range(best_s, 0, -1):
        value = tables[s][(k, *d)]
        match = (start == k) & (max_succ >= s - 1) & (end <= num_layers - s)
        match &= devices <= np.asarray(d)[pool]
        for e in np.flatnonzero(match):
            rest = list(d)
            rest[pool[e]] -= int(devices[e])
            if cost[e] + tables[s - 1][(int(end[e]) + 1, *rest)] == value:
                chosen.append(int(ids[e]))
                k, d = int(end[e]) + 1, rest
                break
        else:  # pragma: no cover - the tables were built from these very sums
            raise RuntimeError("stage DP backtracking lost its path")
    return float(best_value), chosen


def _cap_clusters(costs: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct costs merged into clusters ``[low, low * (1 + epsilon)]``;
    returns each cluster's (smallest, largest) value."""
    values = np.unique(costs)
    lows, highs = [], []
    q = 0
    while q < values.size:
        r = int(np.searchsorted(values, values[q] * (1 + epsilon), side="right")) - 1
        r = max(r, q)
        lows.append(values[q])
        highs.append(values[r])
        q = r + 1
    return np.asarray(lows), np.asarray(highs)


def stage_dp(
    compute_cost: np.ndarray,
    max_n_succ_stages: np.ndarray,
    submesh_devices: Sequence[int],
    num_devices: int,
    num_micro_batches: int,
    *,
    num_stages: int | None = None,
    epsilon_tmax: float = 1e-6,
) -> DPResult | None:
    """Best stages and submeshes by Alpa's eq. 3/4; None when no plan exists.

    ``compute_cost[i, j, s]``: per-micro-batch forward+backward latency of layers
    ``i..j`` (inclusive) on submesh choice ``s`` (inf where impossible or ``j < i``).
    ``max_n_succ_stages[i, j, s]``: most stages that may follow this one for it to fit
    memory (-1: never fits). ``submesh_devices[s]``: devices of choice ``s``; the
    stages use exactly ``num_devices``. ``num_stages`` forces the stage count.
    See the module docstring for the recurrence, the caps tried and the pruning.
    """
    return _search(compute_cost, max_n_succ_stages, submesh_devices,
                   _Pools.one(len(submesh_devices), num_devices), num_micro_batches,
                   num_stages, epsilon_tmax)


def stage_dp_pools(
    compute_cost: np.ndarray,
    max_n_succ_stages: np.ndarray,
    submesh_devices: Sequence[int],
    submesh_pools: Sequence[int],
    pool_devices: Sequence[int],
    num_micro_batches: int,
    *,
    targets: Sequence[Sequence[int]] | None = None,
    num_stages: int | None = None,
    epsilon_tmax: float = 1e-6,
) -> DPResult | None:
    """:func:`stage_dp` over several pools of devices (module docstring, "Mixed
    pools"): submesh choice ``c`` lies in pool ``submesh_pools[c]``, which has
    ``pool_devices[p]`` devices. ``targets``: the device counts per pool a plan may
    use; by default every pool is used whole or not at all (not none of them), so
    every single-pool plan is a candidate too."""
    sizes = tuple(int(n) for n in pool_devices)
    if targets is None:
        targets = [t for t in itertools.product(*[(0, n) if n else (0,) for n in sizes]) if any(t)]
    pools = _Pools(tuple(int(p) for p in submesh_pools), sizes, tuple(tuple(int(x) for x in t) for t in targets))
    return _search(compute_cost, max_n_succ_stages, submesh_devices, pools, num_micro_batches,
                   num_stages, epsilon_tmax)


def _search(
    compute_cost: np.ndarray,
    max_n_succ_stages: np.ndarray,
    submesh_devices: Sequence[int],
    pools: _Pools,
    num_micro_batches: int,
    num_stages: int | None,
    epsilon_tmax: float,
) -> DPResult | None:
    """The caps' best-first search (module docstring) of either entry point."""
    began = time.perf_counter()
    compute_cost = np.asarray(compute_cost, dtype=np.float64)
    max_n_succ_stages = np.asarray(max_n_succ_stages)
    num_devices = max(sum(t) for t in pools.targets) if pools.targets else 0
    _validate(
        compute_cost,
        max_n_succ_stages,
        submesh_devices,
        num_devices,
        num_micro_batches,
        num_stages,
        pools,
    )
    if epsilon_tmax < 0:
        raise ValueError(f"epsilon_tmax must be >= 0, got {epsilon_tmax}")
    num_layers = compute_cost.shape[0]
    devices = np.asarray(submesh_devices, dtype=np.int64)
    cand = _candidates(compute_cost, max_n_succ_stages, devices, pools)
    if cand.cost.size == 0:
        return None
    max_stages = min(
        num_layers,
        num_devices // int(devices.min()),
        int(cand.max_succ.max()) + 1,
    )
    if num_stages is not None:
        if num_stages > max_stages:
            return None
        max_stages = num_stages
    b = num_micro_batches
    tried = 0
    best: tuple[float, list[int]] | None = None

    def evaluate(cap: float) -> float:
        """Run one capped DP; keep its plan if it beats the best; return F(cap)."""
        nonlocal tried, best
        tried += 1
        solved = _capped_dp(cand, cap, num_layers, pools, max_stages, num_stages)
        if solved is None:
            return np.inf
        value, chosen = solved
        total = value + (b - 1) * float(cand.cost[chosen].max())
        if best is None or total < best[0]:
            best = (total, chosen)
        return value

    lows, highs = _cap_clusters(cand.cost, epsilon_tmax)
    f_top = evaluate(float(highs[-1]))
    if best is not None and b > 1 and lows.size > 1:
        # Each heap entry: (lower bound, lo, hi, F at the cluster right of hi).
        def bound(lo: int, f_right: float) -> float:
            return max(f_right, lows[lo]) + (b - 1) * lows[lo]

        heap = [(bound(0, f_top), 0, lows.size - 2, f_top)]
        while heap:
            lower, lo, hi, f_right = heapq.heappop(heap)
            if best is None or lower >= best[0] or not np.isfinite(lower):
                break
            mid = (lo + hi) // 2
            f_mid = evaluate(float(highs[mid]))
            if lo <= mid - 1 and np.isfinite(f_mid):
                heapq.heappush(heap, (bound(lo, f_mid), lo, mid - 1, f_mid))
            if mid + 1 <= hi:
                heapq.heappush(heap, (bound(mid + 1, f_right), mid + 1, hi, f_right))
    if best is None:
        return None
    total, chosen = best
    stages = tuple(
        StageChoice(int(cand.start[e]), int(cand.end[e]) + 1, int(cand.submesh[e])) for e in chosen
    )
    costs = tuple(float(cand.cost[e]) for e in chosen)
    return DPResult(
        stages=stages,
        stage_costs=costs,
        total_seconds=float(total),
        t_max=max(costs),
        tmax_tried=tried,
        seconds=time.perf_counter() - began,
    )


def stage_dp_brute_force(
    compute_cost: np.ndarray,
    max_n_succ_stages: np.ndarray,
    submesh_devices: Sequence[int],
    num_devices: int,
    num_micro_batches: int,
    *,
    num_stages: int | None = None,
    epsilon_tmax: float = 1e-6,
    submesh_pools: Sequence[int] | None = None,
    targets: Sequence[Sequence[int]] | None = None,
) -> DPResult | None:
    """Exhaustive reference for :func:`stage_dp` and :func:`stage_dp_pools` (tiny
    cases only).

    Tries every split of the layers into contiguous stages and every submesh per
    stage; keeps plans that use exactly ``num_devices`` (with ``submesh_pools``: a
    plan's devices per pool are one of ``targets``) and where stage ``q`` of ``p``
    satisfies ``p - 1 - q <= max_n_succ_stages``; minimises eq. 2.
    ``epsilon_tmax`` is accepted for a common signature and ignored.
    """
    num_choices = np.asarray(compute_cost).shape[2]
    of = list(submesh_pools) if submesh_pools is not None else [0] * num_choices
    wanted = {tuple(t) for t in targets} if targets is not None else {(num_devices,)}

    def uses(subs: Sequence[int]) -> tuple[int, ...]:
        used = [0] * len(next(iter(wanted)))
        for c in subs:
            used[of[c]] += int(submesh_devices[c])
        return tuple(used)

    began = time.perf_counter()
    compute_cost = np.asarray(compute_cost, dtype=np.float64)
    max_n_succ_stages = np.asarray(max_n_succ_stages)
    _validate(
        compute_cost,
        max_n_succ_stages,
        submesh_devices,
        num_devices,
        num_micro_batches,
        num_stages,
    )
    num_layers, _, num_choices = compute_cost.shape
    best: tuple[float, list[tuple[int, int, int]]] | None = None
    for p in range(1, num_layers + 1):
        if num_stages is not None and p != num_stages:
            continue
        for cuts in itertools.combinations(range(1, num_layers), p - 1):
            bounds = (0, *cuts, num_layers)
            for subs in itertools.product(range(num_choices), repeat=p):
                if uses(subs) not in wanted:
                    continue
                plan = [(bounds[q], bounds[q + 1] - 1, subs[q]) for q in range(p)]
                if any(p - 1 - q > max_n_succ_stages[k, i, c] for q, (k, i, c) in enumerate(plan)):
                    continue
                costs = [float(compute_cost[k, i, c]) for k, i, c in plan]
                if not np.isfinite(costs).all():
                    continue
                total = sum(costs) + (num_micro_batches - 1) * max(costs)
                if best is None or total < best[0]:
                    best = (float(total), plan)
    if best is None:
        return None
    total, plan = best
    plan_costs = tuple(float(compute_cost[k, i, c]) for k, i, c in plan)
    return DPResult(
        stages=tuple(StageChoice(k, i + 1, c) for k, i, c in plan),
        stage_costs=plan_costs,
        total_seconds=total,
        t_max=max(plan_costs),
        tmax_tried=0,
        seconds=time.perf_counter() - began,
    )
