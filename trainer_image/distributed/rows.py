"""What one mesh host reads of every global batch: its stage's leaves, its devices' rows.

A stage reads only the batch leaves its program takes (``split.stages[i].batch``): in
a GPT pipeline the first stage ``input_ids``, the last ``labels``, a middle stage
none, so a middle stage's hosts read no data at all. A micro-batch ``j`` is rows
``[j * mb, (j + 1) * mb)`` of the global batch (:func:`~..runtime.executor.split_micro_batches`),
placed on the stage's mesh by the leaf's sharding; a host places only the tiles of
its own devices (:func:`~..runtime.meshes.place`), so it needs only their rows:
with the batch split over the mesh's hosts (data parallelism across hosts), each host
reads a disjoint share of every batch. Example: global batch 8, 2 micro-batches of 4,
rows sharded over two hosts of one device each: host 0 reads rows 0, 1, 4, 5 and
host 1 rows 2, 3, 6, 7.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alpajob.trainer_image.data.loader import TOKEN_KEYS, Need


def rows_of(sharding: Any, shape: Sequence[int], devices: Sequence[Any] | None = None) -> set[int]:
    """Rows (leading index) of an array of ``shape`` that ``devices`` hold under
    ``sharding`` (default: this process' devices)."""
    indices = sharding.devices_indices_map(tuple(shape))
    mine = set(devices) if devices is not None else {d for d in indices if d.process_index == _process()}
    rows: set[int] = set()
    for device, index in indices.items():
        if device in mine:
            first = index[0] if index else slice(None)
            rows.update(range(*first.indices(shape[0])))
    return rows


def _process() -> int:
    import jax

    return jax.process_index()


def host_need(split: Any, stage: Any, num_micro_batches: int, devices: Sequence[Any] | None = None) -> Need:
    """The :class:`~..data.loader.Need` of the host holding ``devices`` (default this
    process') of ``stage`` (a placed :class:`~..runtime.stage.StageRuntime`): the
    leaves its program reads, and the rows of every micro-batch its devices hold
    (None: every row, when they hold all of them)."""
    program = split.stages[stage.index]
    if not program.batch:
        return Need(frozenset(), ())
    leaves = frozenset(TOKEN_KEYS[leaf] for leaf in program.batch)
    micro = split.avals[split.batch_ids[program.batch[0]]].shape[0]
    rows: set[int] = set()
    for leaf, sharding in zip(program.batch, stage.batch_sharding, strict=True):
        shape = split.avals[split.batch_ids[leaf]].shape
        rows |= rows_of(sharding, shape, devices)
    if len(rows) == micro:
        return Need(leaves, None)
    return Need(leaves, tuple(j * micro + r for j in range(num_micro_batches) for r in sorted(rows)))
