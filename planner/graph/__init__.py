"""The planner's view of a training step: the op graph (:mod:`.opgraph`), read from a
traced step (:mod:`.extract`, with per-equation costs from :mod:`.jaxpr_costs`), each
op's phase and anchor (:mod:`.attribution`), what an op subset reads, writes and keeps
alive (:mod:`.subset`), and which dimensions index a mixture's experts (:mod:`.experts`)."""
