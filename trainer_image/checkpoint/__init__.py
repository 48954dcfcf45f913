"""Checkpoints on orbax-checkpoint: async, atomic, verified, one writer at a time.

Layout of a checkpoint folder::

    <dir>/
      .alpajob.lock         held by the one run writing here (lock.py)
      .damaged/             checkpoints that failed their check, set aside, never deleted
      <part>/<step>/        one orbax checkpoint per part and step:
          arrays/           the part's arrays, as one orbax PyTree (OCDBT)
          meta/             JSON: the step, every part's name, this part's arrays (shape,
                            dtype, fingerprint) and the run's own (model, plan hash,
                            the loader's position)

A *part* is what one group of processes writes together: ``local`` for ``alpajob
run`` (one process, every stage), ``mesh<i>`` for mesh ``i`` of the Ray runtime (all of
the mesh's hosts, through orbax's multi-process save; under the collective transport
through each host's checkpoint helper, :mod:`alpajob.trainer_image.distributed.saver`,
which writes the same part).

Atomic
    orbax writes a step into a temporary folder and renames it when finished; a crash
    mid-save leaves no finalized step. Step ``N`` is *complete* when every part its meta
    names has a finalized step ``N`` (store.complete_steps), so a crash after one mesh
    saved and before another did leaves ``N`` incomplete and the one before it in use.
Async
    orbax copies the arrays to host memory and writes them on a background thread
    while training goes on (``spec.checkpoint.asyncSave``); the next save, the end of the
    run and SIGTERM wait for it.
Verified
    orbax checks its index (CRC-32C) but not the array data: a flipped bit restores as
    a wrong number. Every array's fingerprint (fingerprint.py) is saved with it and
    recomputed on restore; a checkpoint that fails is set aside and the one before it
    used, and a run whose every checkpoint fails refuses to start.
Any plan
    arrays are saved under stage-independent names (``params/layers/0/attn/q/kernel``),
    so a checkpoint written under one plan restores under another (other stages, other
    mesh shapes) or in a serial run: every array is read from whichever part holds it
    and placed with the sharding the reader asks for.
"""
