"""Mixed-integer linear programs as sparse arrays, and the solvers that take them.

The sharding ILP (:mod:`alpajob.planner.intra_op.ilp`) hands over a :class:`Milp`: costs,
integrality, row bounds and a row-wise sparse matrix. :func:`solve_milp` runs

- HiGHS through ``highspy``, the whole model passed in one call (building it through
  pulp cost about 0.5 s of Python per 10,000 variables, more than the solve). The LP
  relaxation runs first: the sharding ILP's relaxation is usually integral, and an
  integral LP optimum is the ILP optimum; only a fractional one (typically with a
  memory budget) goes to branch-and-bound;
- CBC through pulp (its bundled binary), the fallback when ``highspy`` is missing.

Both always run under a time limit.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import pulp

from alpajob.api.errors import SolverError

#: HiGHS's ``mip_pool_soft_limit`` for the sharding ILPs (:func:`_solve_highs`).
MIP_POOL_SOFT_LIMIT = 100

#: Solver names :func:`solve_milp` accepts.
SOLVERS = ("auto", "highs", "cbc")


class SolveStatus(StrEnum):
    """How a solution was found."""

    OPTIMAL = "optimal"  # the ILP solver proved optimality
    FEASIBLE = "feasible"  # the time limit stopped the solver with a solution
    PRESOLVED = "presolved"  # exact presolve left nothing for the ILP
    INFEASIBLE = "infeasible"  # no choice satisfies the constraints


@dataclass(frozen=True, eq=False)
class Milp:
    """``min cost . x`` s.t. ``row_lower <= A x <= row_upper``, ``0 <= x <= 1``,
    ``x[integer]`` integral; ``A`` row-wise (``starts``, ``index``, ``value``)."""

    cost: np.ndarray
    integer: np.ndarray  # bool per column
    row_lower: np.ndarray
    row_upper: np.ndarray
    starts: np.ndarray
    index: np.ndarray
    value: np.ndarray

    @property
    def num_columns(self) -> int:
        return len(self.cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)


def resolve_solver(solver: str) -> str:
    """"auto" -> "highs" when highspy imports, else "cbc"; validates the name."""
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    if solver == "cbc":
        return solver
    try:
        import highspy  # noqa: F401
    except ImportError as err:
        if solver == "highs":
            raise SolverError("solver 'highs' needs the highspy package") from err
        return "cbc"
    return "highs"


def solve_milp(
    milp: Milp, *, time_limit_s: float, solver: str = "auto"
) -> tuple[np.ndarray | None, SolveStatus, str]:
    """(column values or None if infeasible, status, solver used).

    Raises :class:`SolverError` when the solver fails or finds no solution in time.
    """
    name = resolve_solver(solver)
    run = _solve_highs if name == "highs" else _solve_cbc
    values, status = run(milp, time_limit_s)
    return values, status, name


def _cost_scale(cost: np.ndarray) -> float:
    """Factor that brings the largest cost to 1e4: costs are seconds (often 1e-6),
    below the solvers' absolute optimality tolerances."""
    finite = np.abs(cost[np.isfinite(cost)])
    return 1e4 / float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _solve_highs(arrays: Milp, time_limit_s: float) -> tuple[np.ndarray | None, SolveStatus]:
    """Solve with HiGHS through highspy, passing the arrays in one call.

    The LP relaxation runs first: the local-consistency relaxation of these models is
    usually integral, and an integral LP optimum is the ILP optimum. Only when it is
    fractional (typically with a memory budget) does the branch-and-bound run.
    """
    import highspy

    deadline = time.perf_counter() + time_limit_s
    num_col = len(arrays.cost)
    cost = arrays.cost * _cost_scale(arrays.cost)
    row_lower = np.where(np.isfinite(arrays.row_lower), arrays.row_lower, -highspy.kHighsInf)
    infeasible = (
        highspy.HighsModelStatus.kInfeasible,
        highspy.HighsModelStatus.kUnboundedOrInfeasible,
    )

    def run(integer: bool) -> highspy.Highs:
        # The whole model in one call over the numpy buffers (filling a HighsLp field
        # by field converts each array element by element: 5x slower).
        kinds = (highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous)
        integrality = np.where(
            arrays.integer & integer, int(kinds[0]), int(kinds[1])
        ).astype(np.int32)
        highs = highspy.Highs()
        highs.setOptionValue("output_flag", False)
        highs.setOptionValue("time_limit", max(1e-3, deadline - time.perf_counter()))
        # Our own presolve (ilp._presolve) has already eliminated what HiGHS's would:
        # on these models its MIP presolve only costs time (GPT-39B on 64 V100: 3-7 s
        # per hard layer ILP, solved at the root node either way; half without it).
        highs.setOptionValue("presolve", "off")
        if integer:
            # These models' hard cases are settled at the root node by cuts and
            # branching; HiGHS's large-neighbourhood and reduced-cost heuristics
            # (sub-MIPs) only find incumbents the search finds anyway. Without them
            # GPT-39B on 64 V100 plans in 50 s instead of 66; the optima are the same.
            # The feasibility-jump heuristic likewise: without it the 20 hardest ILPs of
            # GPT-39B on 64 V100 (all settled at the root) take 15.6-16.7 s instead of
            # 19.0-20.2, the same optima.
            for heuristic in ("rins", "rens", "root_reduced_cost", "feasibility_jump"):
                highs.setOptionValue(f"mip_heuristic_run_{heuristic}", False)
            # A small pool of feasible solutions: HiGHS keeps up to 10,000 by
            # default, and on these models maintaining it is a third of the hard
            # ILPs' time (GPT-39B on 64 V100, its 8 hardest: 17.1 s, 11.8 s with
            # 100, the same optima).
            highs.setOptionValue("mip_pool_soft_limit", MIP_POOL_SOFT_LIMIT)
        status = highs.passModel(
            num_col, len(row_lower), len(arrays.index), int(highspy.MatrixFormat.kRowwise),
            int(highspy.ObjSense.kMinimize), 0.0, cost, np.zeros(num_col), np.ones(num_col),
            row_lower, np.asarray(arrays.row_upper, dtype=float),
            np.asarray(arrays.starts, dtype=np.int32), np.asarray(arrays.index, dtype=np.int32),
            np.asarray(arrays.value, dtype=float), integrality,
        )
        if status == highspy.HighsStatus.kError:
            raise SolverError("HiGHS refused the ILP's arrays; this is a planner bug")
        highs.run()
        return highs

    relaxed = run(integer=False)
    status = relaxed.getModelStatus()
    if status in infeasible:
        return None, SolveStatus.INFEASIBLE
    if status == highspy.HighsModelStatus.kOptimal:
        values = np.asarray(relaxed.getSolution().col_value)
        s_values = values[arrays.integer]
        if np.all(np.minimum(s_values, 1.0 - s_values) <= 1e-6):
            return values, SolveStatus.OPTIMAL
    highs = run(integer=True)
    status = highs.getModelStatus()
    if status in infeasible:
        return None, SolveStatus.INFEASIBLE
    if highs.getInfo().primal_solution_status != 2:
        raise SolverError(
            f"ILP solver HiGHS found no solution within {time_limit_s} s "
            f"({highs.modelStatusToString(status)}); allow it more time (alpajob plan/run --ilp-time-limit)"
        )
    values = np.asarray(highs.getSolution().col_value)
    optimal = status == highspy.HighsModelStatus.kOptimal
    return values, SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE


def _solve_cbc(arrays: Milp, time_limit_s: float) -> tuple[np.ndarray | None, SolveStatus]:
    """Solve with CBC through pulp (its bundled binary)."""
    prob = pulp.LpProblem("alpa_intra_op", pulp.LpMinimize)
    columns = [
        prob.add_variable(
            f"x{i}", lowBound=0, upBound=1, cat=pulp.LpBinary if flag else pulp.LpContinuous
        )
        for i, flag in enumerate(arrays.integer)
    ]
    for r in range(len(arrays.row_lower)):
        lo, hi = arrays.starts[r], arrays.starts[r + 1]
        expr = pulp.LpAffineExpression(
            (columns[int(i)], float(x))
            for i, x in zip(arrays.index[lo:hi], arrays.value[lo:hi], strict=True)
        )
        if arrays.row_lower[r] == arrays.row_upper[r]:
            prob += expr == float(arrays.row_upper[r]), f"r{r}"
        else:
            prob += expr <= float(arrays.row_upper[r]), f"r{r}"
    scale = _cost_scale(arrays.cost)  # seconds are tiny next to CBC's tolerances
    prob += pulp.LpAffineExpression(
        zip(columns, (float(c) * scale for c in arrays.cost), strict=True)
    )
    with warnings.catch_warnings():
        # PuLP 3.3 announces PULP_CBC_CMD's removal in 4.0; it is the bundled CBC.
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=1e-9)
    try:
        prob.solve(solver)
    except pulp.PulpSolverError as err:
        raise SolverError(f"ILP solver CBC failed: {err}") from err
    if prob.status == pulp.LpStatusInfeasible:
        return None, SolveStatus.INFEASIBLE
    if prob.status != pulp.LpStatusOptimal:
        raise SolverError(
            f"ILP solver CBC found no solution within {time_limit_s} s "
            f"(status {pulp.LpStatus[prob.status]}); allow it more time (alpajob plan/run --ilp-time-limit)"
        )
    values = np.array([c.varValue or 0.0 for c in columns])
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    return values, SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE
