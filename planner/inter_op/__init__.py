"""The inter-operator pass (Alpa section 5): layers, stages, submeshes, micro-batches.

Layer clustering (:mod:`.clustering`, eq. 6), stage costs composed from per-layer ILP
solutions (:mod:`.stage_costs`), the stage/submesh DP (:mod:`.stage_dp`, eq. 3/4),
pipeline schedules (:mod:`.schedules`), and the search over micro-batch counts that
drives them (:mod:`.search`)."""
