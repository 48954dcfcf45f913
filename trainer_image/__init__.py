"""The trainer (``alpajob.trainer_image``): everything the trainer image runs.

- :mod:`.zoo`: the Alpa paper's models in pure JAX, and a user's entrypoint (:mod:`.entrypoint`);
- :mod:`.step`: the training step (loss, gradients, optax update) and its trace for the planner;
- :mod:`.planning`: a job's plan (trace, then the planner);
- :mod:`.local_run`: ``alpajob run`` on this machine's devices, through :mod:`.runtime`
  (stages, schedules, cross-mesh transfers);
- :mod:`.distributed`: the Ray runtime of a job's pods (mesh hosts, the driver);
- :mod:`.checkpoint`, :mod:`.metrics`, :mod:`.publish`: what a run leaves behind.

The image itself is ``trainer_image/Dockerfile``.
"""
