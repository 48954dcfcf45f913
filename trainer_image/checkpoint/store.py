"""Save, find, restore and prune checkpoints (the layout is in the package docstring).

Writing: each part has a :class:`PartWriter` (one orbax ``CheckpointManager`` on
``<dir>/<part>``), called on every process of the part at once. Reading and pruning
are plain functions of the folder, done by the run that holds its lock:

- :func:`complete_steps`: the steps every named part has finalized, oldest first;
- :func:`restore`: arrays by name, each read from a part that holds it and placed with
  the sharding asked for, every fingerprint checked (:class:`DamagedCheckpoint`);
- :func:`tidy` removes incomplete steps (a crash mid-save) before a run writes again;
  :func:`set_aside` moves a damaged step to ``.damaged/``; :func:`prune` keeps the
  newest ``keep_last`` complete steps.
"""

from __future__ import annotations

import gc
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from alpajob.api.wording import counted
from alpajob.trainer_image.checkpoint.fingerprint import fingerprints, mismatches
from alpajob.trainer_image.checkpoint.lock import CheckpointError

ARRAYS = "arrays"
META = "meta"
LOCAL_PART = "local"
DAMAGED = ".damaged"


def mesh_part(index: int) -> str:
    """The part name of mesh ``index`` in the Ray runtime."""
    return f"mesh{index}"


class DamagedCheckpoint(CheckpointError):
    """A checkpoint that cannot be read back as it was written (missing or corrupted
    files, a fingerprint that does not match)."""


def nest(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a/b/c": x}`` as ``{"a": {"b": {"c": x}}}``: the tree orbax saves."""
    tree: dict[str, Any] = {}
    for name, value in arrays.items():
        *folders, leaf = name.split("/")
        node = tree
        for folder in folders:
            node = node.setdefault(folder, {})
        node[leaf] = value
    return tree


def _processes() -> ocp.options.MultiprocessingOptions:
    """Orbax's options for this JAX process group. With several processes every one is
    named active, which makes orbax wait at the distributed client's barriers instead
    of its default all-gather over every device (that one assumes each host has as many
    devices as the others)."""
    count = jax.process_count()
    return ocp.options.MultiprocessingOptions(active_processes=set(range(count)) if count > 1 else None)


class PartWriter:
    """Writes one part's steps; every process of the part calls it at once.

    Orbax's manager is made at the first save, not before: a new manager starts a
    background clean-up of temporary folders that only a save waits for, so a run
    that ends before it saves (``--resume`` of an empty folder, a bad flag, a stop)
    would leave that thread running into interpreter shutdown, which then logs a
    page of orbax tracebacks on the way out."""

    def __init__(self, root: str | Path, part: str, asynchronous: bool = True) -> None:
        self.part = part
        self._folder = Path(root).absolute() / part
        self._asynchronous = asynchronous
        self._manager: ocp.CheckpointManager | None = None

    def _opened(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._folder.mkdir(parents=True, exist_ok=True)  # orbax creates it only without active_processes
            options = ocp.CheckpointManagerOptions(max_to_keep=None, create=False, cleanup_tmp_directories=True,
                                                   enable_async_checkpointing=self._asynchronous,
                                                   multiprocessing_options=_processes())
            self._manager = ocp.CheckpointManager(self._folder, options=options, item_names=(ARRAYS, META))
        return self._manager

    def save(self, step: int, arrays: Mapping[str, jax.Array], parts: Sequence[str],
             run: Mapping[str, Any]) -> None:
        """Save ``arrays`` as this part's step ``step``; ``parts`` names every part of
        the checkpoint, ``run`` is the run's own meta (model, plan hash, data). Returns
        once the arrays are in host memory; async writers finish in the background."""
        manager = self._opened()
        manager.wait_until_finished()
        manager.reload()
        if step in manager.all_steps():
            manager.delete(step)  # an incomplete earlier attempt at this step
        prints = fingerprints(arrays)
        meta = {
            "step": step, "parts": list(parts), "run": dict(run),
            "arrays": {name: {"shape": list(a.shape), "dtype": str(a.dtype), "fingerprint": prints[name]}
                       for name, a in arrays.items()},
        }
        manager.save(step, force=True, args=ocp.args.Composite(
            **{ARRAYS: ocp.args.PyTreeSave(nest(arrays)), META: ocp.args.JsonSave(meta)}))

    def saving(self) -> bool:
        """Whether a background save is still being written."""
        return self._manager is not None and bool(self._manager.is_saving_in_progress())

    def wait(self) -> None:
        """Block until the last save is finalized (and raise its error, if any)."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None


def _parts(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _steps(root: Path, part: str) -> list[int]:
    return sorted(ocp.utils.checkpoint_steps(root / part))


def _step_folder(root: Path, part: str, step: int) -> Path:
    return root / part / str(step)


def read_meta(root: str | Path, part: str, step: int) -> dict[str, Any]:
    """Part ``part``'s meta of step ``step`` (:class:`DamagedCheckpoint` if unreadable)."""
    try:
        processes = _processes()
        with ocp.Checkpointer(ocp.JsonCheckpointHandler(multiprocessing_options=processes),
                              multiprocessing_options=processes) as reader:
            meta = reader.restore(_step_folder(Path(root).absolute(), part, step) / META, args=ocp.args.JsonRestore())
        if not isinstance(meta, dict) or not isinstance(meta.get("arrays"), dict):
            raise ValueError("not an AlpaJob checkpoint")
        return meta
    except Exception as error:  # noqa: BLE001 - orbax raises many kinds; all mean unreadable
        raise DamagedCheckpoint(f"{_step_folder(Path(root).absolute(), part, step)}: cannot read its meta "
                                f"({_first_line(error)})") from None


def _drop_leftovers() -> None:
    """Collect what a failed orbax read left behind (coroutines of the other arrays'
    reads, cancelled mid-way) now and quietly, instead of as "Exception ignored"
    tracebacks at some later garbage collection."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def complete_steps(root: str | Path) -> list[int]:
    """Steps that every part named in their meta has finalized, oldest first. A step
    whose meta cannot be read counts as complete (so that :func:`restore` reports it
    damaged rather than it silently vanishing)."""
    root = Path(root).absolute()
    held = {part: set(_steps(root, part)) for part in _parts(root)}
    complete = []
    for step in sorted(set().union(*held.values()) if held else ()):
        holder = next(part for part in sorted(held) if step in held[part])
        try:
            parts = read_meta(root, holder, step)["parts"]
        except DamagedCheckpoint:
            complete.append(step)
            continue
        if all(step in held.get(part, ()) for part in parts):
            complete.append(step)
    return complete


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` read: the step, the arrays asked for, the run's meta."""

    step: int
    arrays: dict[str, jax.Array]
    run: dict[str, Any]


def _locate(root: Path, step: int, targets: Mapping[str, jax.ShapeDtypeStruct]) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """For each part, the target names it holds; and the run meta. Refuses a checkpoint
    of another model (a name missing, or another shape or dtype)."""
    metas = {part: read_meta(root, part, step) for part in _parts(root) if step in _steps(root, part)}
    if not metas:
        raise CheckpointError(f"{root}: has no checkpoint of step {step}")
    first = next(iter(metas.values()))
    missing = [part for part in first["parts"] if part not in metas]
    if missing:
        raise DamagedCheckpoint(f"{root}: step {step} lacks {'part' if len(missing) == 1 else 'parts'} {', '.join(missing)}")
    wanted: dict[str, list[str]] = {}
    for name, target in sorted(targets.items()):
        part = next((p for p in first["parts"] if name in metas[p]["arrays"]), None)
        if part is None:
            raise CheckpointError(f"{root}: step {step} has no array {name!r}; it was written for a "
                                  "different model (give this run another --checkpoint-dir)")
        saved = metas[part]["arrays"][name]
        if tuple(saved["shape"]) != tuple(target.shape) or saved["dtype"] != str(target.dtype):
            raise CheckpointError(
                f"{root}: step {step} holds {name!r} as {saved['dtype']}{saved['shape']} but this "
                f"run's model has {target.dtype}{list(target.shape)}; it was written for a different "
                "model (give this run another --checkpoint-dir)")
        wanted.setdefault(part, []).append(name)
    expected = {name: metas[part]["arrays"][name]["fingerprint"] for part, names in wanted.items() for name in names}
    return wanted, {"run": first.get("run", {}), "fingerprints": expected}


def restore(root: str | Path, step: int, targets: Mapping[str, jax.ShapeDtypeStruct]) -> Restored:
    """Arrays ``targets`` (name -> shape, dtype and sharding) of checkpoint ``step``.

    Each array is read from the first part that holds it (orbax restores just those
    arrays of the part, onto the target sharding), then every fingerprint is checked.
    Raises :class:`DamagedCheckpoint` for anything unreadable or altered, and
    :class:`CheckpointError` for a checkpoint of another model."""
    root = Path(root).absolute()
    wanted, meta = _locate(root, step, targets)
    arrays: dict[str, jax.Array] = {}
    for part, names in wanted.items():
        item = nest({name: targets[name] for name in names})
        args = jax.tree.map(
            lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype), item)
        try:
            processes = _processes()
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=processes),
                                  multiprocessing_options=processes) as reader:
                restored = reader.restore(_step_folder(root, part, step) / ARRAYS, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=args, partial_restore=True))
        except Exception as error:  # noqa: BLE001 - any failure to read means damaged
            _drop_leftovers()
            raise DamagedCheckpoint(f"{_step_folder(root, part, step)}: cannot read its arrays "
                                    f"({_first_line(error)})") from None
        for name in names:
            node = restored
            for key in name.split("/"):
                node = node[key]
            arrays[name] = node
    bad = mismatches(meta["fingerprints"], arrays)
    if bad:
        raise DamagedCheckpoint(f"{root}: step {step} is corrupted: {counted(len(bad), 'array')} differ from what "
                                f"was saved ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    return Restored(step=step, arrays=arrays, run=meta["run"])


def set_aside(root: str | Path, step: int) -> Path:
    """Move every part's step ``step`` into ``<dir>/.damaged/<step>-<time>/`` (kept for
    a post-mortem, out of the way of the steps to come); the folder it went to."""
    root = Path(root).absolute()
    target = root / DAMAGED / f"{step}-{time.strftime('%Y%m%dT%H%M%S')}"
    for part in _parts(root):
        if _step_folder(root, part, step).exists():
            target.mkdir(parents=True, exist_ok=True)
            shutil.move(str(_step_folder(root, part, step)), str(target / part))
    return target


def tidy(root: str | Path) -> list[int]:
    """Delete every step that is not complete (a save cut short: some part finalized,
    another not); the steps deleted. Only the lock holder, before it writes."""
    root = Path(root).absolute()
    complete = set(complete_steps(root))
    gone = set()
    for part in _parts(root):
        for step in _steps(root, part):
            if step not in complete:
                shutil.rmtree(_step_folder(root, part, step))
                gone.add(step)
    return sorted(gone)


def prune(root: str | Path, keep_last: int) -> list[int]:
    """Delete every step older than the newest ``keep_last`` complete ones (never a
    step being written: those are newer); the steps deleted."""
    root = Path(root).absolute()
    kept = complete_steps(root)[-keep_last:]
    if not kept:
        return []
    gone = set()
    for part in _parts(root):
        for step in _steps(root, part):
            if step < kept[0]:
                shutil.rmtree(_step_folder(root, part, step))
                gone.add(step)
    return sorted(gone)


def restore_newest(root: str | Path, targets: Mapping[str, jax.ShapeDtypeStruct],
                   say: Callable[[str], None]) -> Restored | None:
    """The newest complete checkpoint that reads back intact, or None if there is none.

    A damaged one is set aside (:func:`set_aside`, reported through ``say``) and the
    one before it tried; if every one was damaged the run must not start from nothing
    unasked, so that is a :class:`CheckpointError`."""
    damaged = []
    for step in reversed(complete_steps(root)):
        try:
            return restore(root, step, targets)
        except DamagedCheckpoint as error:
            where = set_aside(root, step)
            damaged.append(step)
            say(f"checkpoint {step} is damaged ({error}); moved it to {where}, trying the one before")
    if damaged:
        raise CheckpointError(
            f"{root}: every checkpoint ({', '.join(map(str, damaged))}) is damaged; they are kept in "
            f"{Path(root).absolute() / DAMAGED}. Run again with --resume=auto to start from scratch")
    return None
