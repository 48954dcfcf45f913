"""The distributed runtime: the plan's meshes as actors of the job's Ray cluster.

- :mod:`.cluster`: resource names, the entry points' ``ray start`` commands, waiting
  for every mesh host to join;
- :mod:`.transport`: the transfer plan over mesh positions, parcels through the object store;
- :mod:`.mesh_host`: the actor that owns one mesh host's devices and runs its stage;
- :mod:`.driver`: ``alpajob driver``, the step loop across the actors.
"""
