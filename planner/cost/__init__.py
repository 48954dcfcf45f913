"""What things cost: the cluster and its device presets (:mod:`.cluster`, ``data/presets.json``)
and the analytic, calibrated cost model (:mod:`.model`, ``data/calibration.json``):
logical meshes, alpha-beta collectives, roofline compute."""
