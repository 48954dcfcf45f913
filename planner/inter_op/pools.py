"""Planning across pools of different GPUs: each pipeline stage on a submesh of one pool.

A mixed cluster is ``P`` pools, pool ``p`` being ``N_p`` nodes of ``M_p`` GPUs of one
product, and a link between pools (:func:`pool_link`: by default the slower pool's
inter-node link). Alpa assumes one device type; its DP (:mod:`.stage_dp`) generalises
by giving its state one device axis per pool::

    F(s, k, d_1..d_P) = min over k <= i < L, pool p, submesh c of pool p, n_c <= d_p of
                        cost_p(k..i, c) + F(s - 1, i + 1, d - n_c e_p)
                        over stages with cost_p(k..i, c) <= t_max that fit pool p's
                        memory with s - 1 stages after them (1F1B)
    F(0, L, 0..0) = 0
    T* = min over t_max, targets D of  min_s F(s, 0, D) + (B - 1) * t_max

``cost_p`` is a stage's latency costed with pool ``p``'s preset: its compute rates,
memory capacity, intra- and inter-node bandwidth and calibration, through a
:class:`~.search.CostContext` of its own (the intra-op ILPs of a layer differ by
device type: a slower link moves the optimum towards less communication). ``e_p``
is pool ``p``'s unit vector, so a stage takes its devices from its own pool only. The
targets ``D`` are the device counts per pool a plan may use: each pool whole or not
at all (:func:`~.stage_dp.stage_dp_pools`), so every single-pool plan is a candidate
too, and the slower type is given layers only where that shortens the step; the
DP then gives it fewer layers than the fast type, so that the stages' latencies,
not their layer counts, are even (Alpa's notes name this as the way to lift its
homogeneity assumption). The cap search, its pruning and the memory rule are Alpa's,
unchanged.

A stage receives its inputs from the stage before it, which may sit in another pool.
The DP does not know a stage's neighbour, so it costs every receive on the slower of
its pool's own link and the link between pools (an upper bound); the chosen stages
are then evaluated exactly, each receive on the link it actually crosses. Gradients
sent once per step (a tied embedding's) are costed on the slower link too. Because
that bound would also tax a plan that stays in one pool, each pool's own DP (Alpa's,
receives on its own link: :func:`~.search.dp_candidate`, and under the planner every
other candidate a single-pool plan considers) runs beside it on the same ILP
solutions, and the fastest of these plans, evaluated exactly, is the count's.

Worked example (``tests/test_stage_dp.py``): four equal layers, one device in each
of two pools, the second three times slower, 8 micro-batches: the fast device takes
three layers and the slow one one (3 + 3 + 7 x 3 = 27 s, against 2 + 6 + 7 x 6 = 50 s
for two layers each and 4 + 7 x 4 = 32 s on the fast device alone).

Not done here: a stage split unevenly across two types by data parallelism (each
stage's devices are of one product).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from alpajob.api.errors import ClusterError
from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.inter_op.search import (
    Candidate,
    CostContext,
    StageOption,
    best_of,
    dp_candidate,
    dp_tables,
)
from alpajob.planner.inter_op.stage_costs import Link, StageEval
from alpajob.planner.inter_op.stage_dp import DPResult, stage_dp_pools
from alpajob.planner.inter_op.step_time import pipeline_step_seconds
from alpajob.planner.intra_op.solve import ShardingMode


def pool_link(pools: Sequence[ClusterSpec], bandwidth: float | None = None) -> Link:
    """The link between pools: ``bandwidth`` (bytes/s) where given, else the slowest
    pool's inter-node bandwidth; the largest inter-node latency of the pools."""
    latency = max(p.inter_node_latency for p in pools)
    return latency, bandwidth if bandwidth is not None else min(p.inter_node_bandwidth for p in pools)


def _slower(a: Link, b: Link) -> Link:
    return max(a[0], b[0]), min(a[1], b[1])


@dataclass(frozen=True)
class PoolCandidate(Candidate):
    """A plan across pools: ``pools[q]`` is the pool of stage ``q``'s submesh."""

    pools: tuple[int, ...] = ()

    def devices_used(self, num_pools: int) -> tuple[int, ...]:
        """Devices the plan uses of each pool."""
        used = [0] * num_pools
        for pool, stage in zip(self.pools, self.stages, strict=True):
            used[pool] += stage.submesh[0] * stage.submesh[1]
        return tuple(used)


class PoolSearch:
    """The DP across pools for each micro-batch count (module docstring); one
    :class:`~.search.CostContext` per pool. ``run`` has
    :class:`~..plan.workers.SearchPool`'s signature, so the planner's micro-batch
    search (coarse to fine) drives it the same way."""

    def __init__(self, contexts: Sequence[CostContext], link: Link,
                 alone: Callable[[CostContext, int], Sequence[Candidate | None]] | None = None,
                 min_stages: int = 1) -> None:
        """``alone(context, count)``: the plans of one pool that compete with the DP
        across pools (default: that pool's own DP; the planner passes every
        candidate a single-pool plan considers); ``min_stages`` = 2 forbids the
        single-stage plan (pipeshard)."""
        if len(contexts) < 2:
            raise ValueError("a mixed cluster needs at least two pools")
        for context in contexts:
            if context.cluster.shared_host:
                raise ClusterError("spec.cluster.pools",
                                   "a mixed cluster is of GPU pools; cpu devices share one host")
        self.contexts, self.link, self.min_stages = list(contexts), link, min_stages
        self.alone = alone or (lambda context, count: [dp_candidate(context, count, min_stages=min_stages)])

    def run(self, counts: Sequence[int],
            likely_next: Callable[[Sequence[Candidate | None]], Sequence[int]] | None = None
            ) -> list[Candidate | None]:
        """The best plan for each of ``counts`` (None: none fits); one process, so
        ``likely_next`` (what a pool of workers would start early) is unused."""
        return [self.candidate(count) for count in counts]

    def candidate(self, num_micro_batches: int) -> PoolCandidate | None:
        """The best of the DP across pools (receives costed on the slower link) and
        each pool's own DP (receives on its own link), each evaluated exactly, for
        ``num_micro_batches``."""
        mixed = []
        found: list[Candidate | None] = []
        for pool, context in enumerate(self.contexts):
            coster = context.coster(num_micro_batches, ShardingMode.AUTO)
            mixed.append(dp_tables(context, coster, num_micro_batches, context.submeshes(),
                                   _slower(coster.own_link(), self.link)))
            for alone in self.alone(context, num_micro_batches):
                if alone is not None:
                    found.append(PoolCandidate(**{f.name: getattr(alone, f.name) for f in dataclasses.fields(alone)},
                                               pools=(pool,) * len(alone.stages)))
        where = [(p, c) for p, t in enumerate(mixed) for c in range(len(t[3]))]
        cost = np.concatenate([t[0] for t in mixed], axis=2)
        if self.min_stages > 1:
            cost[0, cost.shape[1] - 1, :] = np.inf  # no stage of every layer
        across = self._dp(lambda: stage_dp_pools(
            cost, np.concatenate([t[1] for t in mixed], axis=2),
            [size for t in mixed for size in t[3]], [p for p, _ in where],
            [c.cluster.num_devices for c in self.contexts], num_micro_batches))
        if across is not None:
            chosen = []
            for stage in across.stages:
                pool, local = where[stage.submesh_index]
                chosen.append((pool, mixed[pool][2][stage.start_layer][stage.end_layer - 1][local],
                               stage.start_layer, stage.end_layer - 1))
            found.append(self.evaluate(chosen, num_micro_batches))
        best = best_of(found)
        return best if isinstance(best, PoolCandidate) else None

    def _dp(self, solve: Callable[[], DPResult | None]) -> DPResult | None:
        counter = self.contexts[0].counter
        result = solve()
        counter.dp_calls += 1
        counter.dp_seconds += result.seconds if result is not None else 0.0
        return result

    def evaluate(self, chosen: Sequence[tuple[int, StageOption | None, int, int]], num_micro_batches: int
                 ) -> PoolCandidate | None:
        """Exact figures of stages ``(pool, option, first, last)``, each receiving on
        the link it crosses (gradients sent once per step on the slower link where the
        plan spans pools); None where a stage does not fit its pool's memory."""
        spans = len({pool for pool, *_ in chosen}) > 1
        stages: list[StageEval] = []
        for q, (pool, option, first, last) in enumerate(chosen):
            assert option is not None, "the DP chose a range with no costed option"
            context = self.contexts[pool]
            coster = context.coster(num_micro_batches, ShardingMode.AUTO)
            own = coster.own_link()
            link = own if q == 0 or chosen[q - 1][0] == pool else _slower(own, self.link)
            if spans:  # the step's once-per-step gradients may cross pools
                stage = coster.evaluate_stage(first, last, option.submesh, option.shape, option.level,
                                              context.in_flight(q, len(chosen), num_micro_batches),
                                              _slower(own, self.link))
                received = coster.transfer_seconds(coster.boundary_bytes()[first], link) if first else 0.0
                stage = dataclasses.replace(stage, transfer=received,
                                            seconds=stage.seconds - stage.transfer + received)
            else:
                stage = coster.evaluate_stage(first, last, option.submesh, option.shape, option.level,
                                              context.in_flight(q, len(chosen), num_micro_batches))
            if stage.peak_memory > context.memory_budget:
                return None
            stages.append(stage)
        slowest = max(self.contexts, key=lambda c: c.calibration.instruction_overhead_seconds)
        step = pipeline_step_seconds(self.contexts[chosen[0][0]].cluster, stages, num_micro_batches,
                                     slowest.calibration)
        return PoolCandidate("alpajob-pools", ShardingMode.AUTO, num_micro_batches, tuple(stages), step,
                             pools=tuple(pool for pool, *_ in chosen))
