"""The runtime that executes a Plan: stage programs, meshes, schedule, transfers.

Modules, in the order a step uses them: :mod:`.split` (cut the traced loss into
stages), :mod:`.meshes` (a ``jax.sharding.Mesh`` per stage and its shardings),
:mod:`.stage` (each stage's forward, backward and update executables),
:mod:`.transfer` (which tile goes from which device to which, pure) and
:mod:`.transport` (moving the bytes on local devices), :mod:`.executor` (running the
schedule's instruction lists, one worker per stage).
"""
