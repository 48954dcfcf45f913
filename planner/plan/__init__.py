"""From the search to the Plan document: :func:`.make.make_plan` (the planner's one
entry), the structured plans it is compared with (:mod:`.baselines`), and the Plan
read back out of the winning candidate (:mod:`.assemble`)."""
