"""The planner (``alpajob.planner``): Alpa's two-level automatic parallelization.

Plain data in, plain data out; it imports the contracts (:mod:`alpajob.api`) and
nothing else of ours. One subpackage per phase of Alpa's search::

    graph/     a traced training step -> OpGraph          (the only JAX: reading jaxprs)
    cost/      cluster presets and the calibrated analytic cost model
    intra_op/  one layer or stage on a logical mesh -> the sharding ILP (Alpa eq. 1)
    inter_op/  layer clustering (eq. 6), the stage/submesh DP (eq. 3/4), pipeline
               schedules, the search over micro-batch counts
    plan/      make_plan (the one entry), the baselines, assembling the Plan document

:func:`alpajob.planner.plan.make.make_plan` drives them; the trainer hands it the
traced step (:func:`alpajob.trainer_image.planning.plan_job`).
"""
