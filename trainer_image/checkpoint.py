"""Sharded checkpoints: every array saved shard by shard, restored onto any sharding.

Layout of one checkpoint (``<dir>/step_00000010/``)::

    index.json      {"step": 10, "plan_hash": ..., "arrays": {name: {shape, dtype,
                     shards: [{file, box}]}}}
    a0_s0.npy ...   one file per distinct shard (replicas are written once)

Names are stage-independent (``params/layers/0/attn/q/kernel``,
``opt/0/mu/layers/0/attn/q/kernel``), so a checkpoint written under one plan restores
under another, or in a serial run.

Completeness: a checkpoint is written into ``step_N.tmp`` and renamed into place
only when complete, so an interrupted save never leaves a checkpoint that looks
valid; :func:`latest_step` only sees complete ones. In one process :func:`save` does
all of it. Across processes (the Ray runtime) the steps are split:

1. the driver calls :func:`begin` (a fresh ``step_N.tmp``);
2. every mesh host writes its own shards into a folder of its own with
   :func:`save_part` and returns that part's index;
3. once **every** host has answered, the driver merges the parts' indexes with
   :func:`commit`, which writes ``index.json`` and renames the folder. A host that
   dies mid-save leaves only a ``.tmp`` folder, which the next :func:`begin` of that
   step clears.
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

from alpajob.api.errors import AlpaJobError
from alpajob.api.plan import path_name
from alpajob.trainer_image.runtime.meshes import place


class CheckpointError(AlpaJobError):
    """A checkpoint directory that cannot be used."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _tmp_dir(root: Path, step: int) -> Path:
    final = _step_dir(root, step)
    return final.with_name(final.name + ".tmp")


Box = list[list[int]]


def local_pieces(array: jax.Array) -> list[tuple[Box, np.ndarray]]:
    """The distinct shards this process holds (replica 0 only), each with its box
    ``[[lo, hi], ...]`` in the global array. Over every process of the array's mesh
    these cover the array exactly once."""
    pieces = []
    for shard in array.addressable_shards:
        if shard.replica_id == 0:
            box = [list(sl.indices(n)[:2]) for sl, n in zip(shard.index, array.shape, strict=True)]
            pieces.append((box, np.asarray(shard.data)))
    return pieces


def assemble_pieces(shape: list[int] | tuple[int, ...], dtype: str, pieces: list[tuple[Box, Any]]) -> np.ndarray:
    """The host array of ``shape`` filled from ``pieces`` (box, data)."""
    data = np.empty(shape, dtype=dtype)
    for box, piece in pieces:
        data[tuple(slice(lo, hi) for lo, hi in box)] = piece
    return data


def _write(folder: Path, prefix: str, arrays: Mapping[str, jax.Array]) -> dict[str, Any]:
    """Write this process's shards of ``arrays`` into ``folder``; their index entries,
    with file names relative to the step folder (``prefix`` + file)."""
    entries: dict[str, Any] = {}
    for a, (name, array) in enumerate(sorted(arrays.items())):
        shards = []
        for s, (box, data) in enumerate(local_pieces(array)):
            file = f"a{a}_s{s}.npy"
            np.save(folder / file, data)
            shards.append({"file": prefix + file, "box": box})
        entries[name] = {"shape": list(array.shape), "dtype": str(array.dtype), "shards": shards}
    return entries


def begin(root: str | Path, step: int) -> Path:
    """A fresh, empty ``step_N.tmp`` under ``root`` (any earlier attempt cleared)."""
    tmp = _tmp_dir(Path(root), step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def save_part(root: str | Path, step: int, part: str, arrays: Mapping[str, jax.Array]) -> dict[str, Any]:
    """Write this process's shards of ``arrays`` as part ``part`` of checkpoint
    ``step`` (after :func:`begin`); the part's index entries, for :func:`commit`."""
    tmp = _tmp_dir(Path(root), step)
    if not tmp.is_dir():
        raise CheckpointError(f"{tmp}: no checkpoint in progress (call begin first)")
    folder = tmp / part
    folder.mkdir()
    entries = _write(folder, f"{part}/", arrays)
    for file in folder.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    return entries


def commit(root: str | Path, step: int, parts: list[dict[str, Any]], meta: Mapping[str, Any]) -> Path:
    """Merge the parts' entries into ``index.json`` and move the checkpoint into place.

    Shards of one name from several parts are concatenated (two hosts of a mesh hold
    different shards); a box already present is skipped (a replicated scalar such as
    an optimizer's step count is written by every stage).
    """
    root = Path(root)
    tmp, final = _tmp_dir(root, step), _step_dir(root, step)
    arrays: dict[str, Any] = {}
    for entries in parts:
        for name, entry in entries.items():
            merged = arrays.setdefault(name, {**entry, "shards": []})
            if merged["shape"] != entry["shape"] or merged["dtype"] != entry["dtype"]:
                raise CheckpointError(f"{tmp}: parts disagree on the shape or dtype of {name!r}")
            boxes = [shard["box"] for shard in merged["shards"]]
            merged["shards"].extend(x for x in entry["shards"] if x["box"] not in boxes)
    index = {"step": step, **meta, "arrays": arrays}
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    with open(tmp / "index.json") as handle:
        os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def save(root: str | Path, step: int, arrays: Mapping[str, jax.Array], meta: Mapping[str, Any]) -> Path:
    """Write ``arrays`` (name -> global array) as checkpoint ``step`` under ``root``,
    from one process."""
    tmp = begin(root, step)
    return commit(root, step, [_write(tmp, "", arrays)], meta)


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
    pieces = [(shard["box"], np.load(folder / shard["file"])) for shard in entry["shards"]]
    return place(assemble_pieces(entry["shape"], entry["dtype"], pieces), sharding)


def named_leaves(prefix: str, tree: Any) -> dict[str, Any]:
    """``{prefix/path: leaf}`` for every leaf of ``tree`` (checkpoint names)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {f"{prefix}/{path_name(path)}": leaf for path, leaf in leaves}


def restore_tree(root: str | Path, step: int, prefix: str, tree: Any, sharding: Any = None) -> Any:
    """``tree`` with every leaf restored from checkpoint ``step`` (by its name under
    ``prefix``), placed with ``sharding`` or else the leaf's own sharding."""
    def load(path: Any, leaf: Any) -> Any:
        target = sharding if sharding is not None else leaf.sharding
        return restore(root, step, f"{prefix}/{path_name(path)}", target)

    return jax.tree_util.tree_map_with_path(load, tree)


def stage_arrays(stage: Any) -> dict[str, Any]:
    """A pipeline stage's parameters and optimizer state (``stage.params``,
    ``stage.opt_state``), by checkpoint name."""
    out = {f"params/{name}": value for name, value in stage.params.items()}
    out.update(named_leaves("opt", stage.opt_state))
    return out


def restore_stage(root: str | Path, step: int, stage: Any) -> None:
    """Replace a stage's parameters and optimizer state with checkpoint ``step``'s,
    each placed with its current sharding."""
    stage.params = {
        name: restore(root, step, f"params/{name}", value.sharding) for name, value in stage.params.items()
    }
    stage.opt_state = restore_tree(root, step, "opt", stage.opt_state)
