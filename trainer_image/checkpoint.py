"""Sharded checkpoints: every array saved shard by shard, restored onto any sharding.

Layout of one checkpoint (``<dir>/step_00000010/``)::

    index.json      {"step": 10, "plan_hash": ..., "arrays": {name: {shape, dtype,
                     shards: [{file, box}]}}}
    a0_s0.npy ...   one file per distinct shard (replicas are written once)

Names are stage-independent (``params/layers/0/attn/q/kernel``,
``opt/0/mu/layers/0/attn/q/kernel``), so a checkpoint written under one plan restores
under another, or in a serial run. A checkpoint is written into ``step_N.tmp`` and
renamed into place when complete, so an interrupted save never leaves a checkpoint
that looks valid; :func:`latest_step` only sees complete ones.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from alpajob.planner.errors import AlpaJobError


class CheckpointError(AlpaJobError):
    """A checkpoint directory that cannot be used."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def save(root: str | Path, step: int, arrays: Mapping[str, jax.Array], meta: Mapping[str, Any]) -> Path:
    """Write ``arrays`` (name -> global array) as checkpoint ``step`` under ``root``."""
    root = Path(root)
    final = _step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    index: dict[str, Any] = {"step": step, **meta, "arrays": {}}
    for a, (name, array) in enumerate(sorted(arrays.items())):
        shards = []
        for s, shard in enumerate(x for x in array.addressable_shards if x.replica_id == 0):
            file = f"a{a}_s{s}.npy"
            np.save(tmp / file, np.asarray(shard.data))
            box = [list(sl.indices(n)[:2]) for sl, n in zip(shard.index, array.shape, strict=True)]
            shards.append({"file": file, "box": box})
        index["arrays"][name] = {"shape": list(array.shape), "dtype": str(array.dtype), "shards": shards}
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    with open(tmp / "index.json") as handle:
        os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def latest_step(root: str | Path) -> int | None:
    """The newest complete checkpoint's step under ``root``, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [
        int(p.name.split("_")[1])
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")
        and (p / "index.json").exists()
    ]
    return max(steps) if steps else None


def load_index(root: str | Path, step: int) -> dict[str, Any]:
    """The index of checkpoint ``step``."""
    path = _step_dir(Path(root), step) / "index.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: cannot read the checkpoint index ({error})") from None


def restore(root: str | Path, step: int, name: str, sharding: Any) -> jax.Array:
    """Array ``name`` of checkpoint ``step``, placed with ``sharding``."""
    folder = _step_dir(Path(root), step)
    entry = load_index(root, step)["arrays"].get(name)
    if entry is None:
        raise CheckpointError(
            f"{folder}: has no array {name!r}; it was written for a different model"
        )
    data = np.empty(entry["shape"], dtype=entry["dtype"])
    for shard in entry["shards"]:
        region = tuple(slice(lo, hi) for lo, hi in shard["box"])
        data[region] = np.load(folder / shard["file"])
    return jax.device_put(data, sharding)
