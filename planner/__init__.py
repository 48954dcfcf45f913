"""The planner (``alpajob.planner``): Alpa's two-level automatic parallelization.

Plain data in, plain data out. Only :mod:`alpajob.planner.extract` imports JAX.

Pipeline of passes (one module each)::

    extract      JAX training step  -> OpGraph            (graph.py holds the types)
    clustering   OpGraph forward ops -> L layers           (Alpa eq. 6)
    intra_op     layers x logical mesh -> sharding ILP     (Alpa eq. 1, pulp)
    stage_dp     per-stage costs -> stages and submeshes   (Alpa eq. 3/4)
    inter_op     drives the above, picks micro-batches     -> Plan (plan.py)
    baselines    data parallel, ZeRO-2, Megatron grid, equal-layer/operator slicing
"""
