"""Checkpoints on orbax: fingerprints, parts, completeness, damage and fallback, the lock, pruning."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpajob.trainer_image.checkpoint.fingerprint import fingerprints, mismatches
from alpajob.trainer_image.checkpoint.local import LocalCheckpoints
from alpajob.trainer_image.checkpoint.lock import CheckpointError, FolderBusy, FolderLock
from alpajob.trainer_image.checkpoint.names import targets
from alpajob.trainer_image.checkpoint.store import (
    DAMAGED,
    DamagedCheckpoint,
    PartWriter,
    complete_steps,
    prune,
    restore,
    restore_newest,
    tidy,
)


def _meshes() -> tuple[Mesh, Mesh]:
    devices = np.array(jax.devices()[:8])
    return Mesh(devices[:4].reshape(2, 2), ("x", "y")), Mesh(devices[4:], ("z",))


def _arrays(scale: float = 1.0) -> dict[str, jax.Array]:
    """A two-stage model's state: a sharded matrix on one mesh, a bf16 one on the other,
    and the optimizer's step count."""
    first, second = _meshes()
    w = jnp.sin(jnp.arange(128 * 64, dtype=jnp.float32)).reshape(128, 64) * scale
    return {
        "params/w": jax.device_put(w, NamedSharding(first, P("x", "y"))),
        "params/layers/0/k": jax.device_put(jnp.full((8, 4), scale, jnp.bfloat16), NamedSharding(second, P("z"))),
        "opt/0/count": jax.device_put(jnp.int32(int(scale)), NamedSharding(second, P())),
    }


def _equal(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def _largest_data_file(folder: Path) -> Path:
    files = [p for p in folder.rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _say() -> tuple[list[str], object]:
    heard: list[str] = []
    return heard, heard.append


# ------------------------------------------------------------------ fingerprints


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32, np.bool_])
def test_a_fingerprint_changes_with_any_one_element(dtype: type) -> None:
    """Brute force over every element and several of its bits: each change is seen."""
    base = (np.arange(24).reshape(4, 6) % 3).astype(dtype)
    reference = fingerprints({"x": jnp.asarray(base)})["x"]
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[base.itemsize]
    bits = [0] if dtype is np.bool_ else [0, 3, base.itemsize * 8 - 1]
    for index in np.ndindex(base.shape):
        for bit in bits:
            words = base.view(unsigned).copy()
            words[index] ^= unsigned(1 << bit)
            changed = words.view(base.dtype)
            assert fingerprints({"x": jnp.asarray(changed)})["x"] != reference, (index, bit)


def test_a_fingerprint_sees_swapped_elements_and_not_the_sharding() -> None:
    first, second = _meshes()
    data = jnp.arange(64, dtype=jnp.float32).reshape(8, 8)
    swapped = data.at[0, 0].set(data[0, 1]).at[0, 1].set(data[0, 0])
    placed = jax.device_put(data, NamedSharding(first, P("x", "y")))
    other = jax.device_put(data, NamedSharding(second, P(None, "z")))
    prints = fingerprints({"a": placed, "b": other, "c": swapped})
    assert prints["a"] == prints["b"] != prints["c"]
    assert mismatches({"a": prints["a"]}, {"a": swapped}) == ["a"]


def _definition(x: np.ndarray) -> int:
    """``F`` as the module docstring defines it, in NumPy."""
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.itemsize]
    words = x.view(unsigned).astype(np.uint64).reshape(-1)
    weights = (np.arange(words.size, dtype=np.uint64) * 2 + 1) * 2654435761 % 2**32
    return int((words * weights).sum() % 2**32)


@pytest.mark.parametrize("spec", [P("x", "y"), P(None, "z"), P("z", None), P()])
def test_a_sharded_arrays_fingerprint_is_its_definition_shard_by_shard(spec: P) -> None:
    """Each distinct shard is summed on its own device with its elements' global
    weights (no collective: a save's fingerprints never wait in a rendezvous beside a
    step's collectives), replicated shards counted once."""
    first, second = _meshes()
    mesh = second if "z" in str(spec) else first
    data = (np.arange(12 * 8, dtype=np.float32).reshape(12, 8) * 1.37).astype(np.float32)
    placed = jax.device_put(jnp.asarray(data), NamedSharding(mesh, spec))
    assert fingerprints({"a": placed})["a"] == _definition(data)
    halves = np.arange(48, dtype=np.float32).astype(jnp.bfloat16).reshape(8, 6)
    assert fingerprints({"b": jax.device_put(jnp.asarray(halves), NamedSharding(first, P("x")))})["b"] == \
        _definition(halves)


# ------------------------------------------------------------------ parts and completeness


def test_two_parts_make_one_checkpoint_that_restores_onto_any_sharding(tmp_path: Path) -> None:
    """Two meshes save their own parts; the step is complete only once both are, and
    restores onto other shardings and another split of the arrays."""
    arrays = _arrays()
    parts = ["mesh0", "mesh1"]
    first = PartWriter(tmp_path, "mesh0", asynchronous=True)
    first.save(4, {"params/w": arrays["params/w"]}, parts, {"model": "m"})
    first.wait()
    assert complete_steps(tmp_path) == []  # mesh1 has not saved yet
    second = PartWriter(tmp_path, "mesh1", asynchronous=False)
    second.save(4, {k: v for k, v in arrays.items() if k != "params/w"}, parts, {"model": "m"})
    assert complete_steps(tmp_path) == [4]
    one, two = _meshes()
    wanted = {  # another plan: the matrix split the other way, on the other mesh
        "params/w": jax.ShapeDtypeStruct((128, 64), jnp.float32, sharding=NamedSharding(two, P(None, "z"))),
        "params/layers/0/k": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=NamedSharding(one, P())),
        "opt/0/count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(one, P())),
    }
    restored = restore(tmp_path, 4, wanted)
    _equal(restored.arrays, arrays)
    assert restored.arrays["params/w"].sharding == wanted["params/w"].sharding
    assert restored.run == {"model": "m"}
    first.close()
    second.close()


def test_a_crash_mid_save_leaves_the_previous_checkpoint_in_use(tmp_path: Path) -> None:
    """Step 2 is complete; of step 4 one part finalized and the other never did (its
    process died): step 4 does not count, tidy removes it, step 2 restores."""
    arrays = _arrays()
    parts = ["mesh0", "mesh1"]
    writers = [PartWriter(tmp_path, part, asynchronous=False) for part in parts]
    for writer in writers:
        writer.save(2, arrays, parts, {})
    writers[0].save(4, _arrays(2.0), parts, {})
    (tmp_path / "mesh1" / "4.orbax-checkpoint-tmp-123").mkdir()  # what a killed writer leaves
    assert complete_steps(tmp_path) == [2]
    assert tidy(tmp_path) == [4]
    assert not (tmp_path / "mesh0" / "4").exists()
    _equal(restore(tmp_path, 2, targets(arrays)).arrays, arrays)
    for writer in writers:
        writer.close()


# ------------------------------------------------------------------ damage


def _two_steps(root: Path) -> dict[str, jax.Array]:
    """Steps 1 and 2 of one local part; the arrays of step 1."""
    checkpoints = LocalCheckpoints(root, keep_last=5, asynchronous=True)
    checkpoints.save(1, _arrays(), {"data": {"position": 1}})
    checkpoints.save(2, _arrays(3.0), {"data": {"position": 2}})
    assert checkpoints.finish() == 2
    checkpoints.close()
    return _arrays()


@pytest.mark.parametrize("damage", ["flip a bit", "truncate", "delete", "garble the meta"])
def test_a_damaged_checkpoint_is_set_aside_and_the_one_before_used(tmp_path: Path, damage: str) -> None:
    good = _two_steps(tmp_path)
    step = tmp_path / "local" / "2"
    if damage == "garble the meta":
        meta = next(p for p in (step / "meta").iterdir() if p.is_file() and "commit" not in p.name)
        meta.write_text("{not json")
    else:
        data = _largest_data_file(step / "arrays")
        raw = bytearray(data.read_bytes())
        if damage == "flip a bit":
            raw[len(raw) // 2] ^= 0x04
            data.write_bytes(bytes(raw))
        elif damage == "truncate":
            data.write_bytes(bytes(raw[: len(raw) // 3]))
        else:
            data.unlink()
    with pytest.raises(DamagedCheckpoint):
        restore(tmp_path, 2, targets(good))
    heard, say = _say()
    restored = restore_newest(tmp_path, targets(good), say)  # type: ignore[arg-type]
    assert restored is not None and restored.step == 1
    _equal(restored.arrays, good)
    assert restored.run == {"data": {"position": 1}}
    assert len(heard) == 1 and "checkpoint 2 is damaged" in heard[0]
    assert [p.name for p in (tmp_path / DAMAGED).iterdir()][0].startswith("2-")  # kept, not deleted
    assert complete_steps(tmp_path) == [1]


def test_a_run_whose_every_checkpoint_is_damaged_is_refused(tmp_path: Path) -> None:
    good = _two_steps(tmp_path)
    for step in ("1", "2"):
        data = _largest_data_file(tmp_path / "local" / step / "arrays")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    _heard, say = _say()
    with pytest.raises(CheckpointError, match="every checkpoint .* is damaged.*--resume=auto"):
        restore_newest(tmp_path, targets(good), say)  # type: ignore[arg-type]
    assert complete_steps(tmp_path) == []  # set aside: a new run starts clean


def test_a_stray_folder_counts_as_damaged_not_as_a_traceback(tmp_path: Path) -> None:
    good = _two_steps(tmp_path)
    (tmp_path / "local" / "7").mkdir()  # not an orbax checkpoint
    (tmp_path / "notes").mkdir()
    _heard, say = _say()
    restored = restore_newest(tmp_path, targets(good), say)  # type: ignore[arg-type]
    assert restored is not None and restored.step == 2


def test_a_checkpoint_of_another_model_is_refused_not_set_aside(tmp_path: Path) -> None:
    good = _two_steps(tmp_path)
    other = dict(targets(good))
    other["params/w"] = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=good["params/w"].sharding)
    _heard, say = _say()
    with pytest.raises(CheckpointError, match="different model"):
        restore_newest(tmp_path, other, say)  # type: ignore[arg-type]
    missing = {**targets(good), "params/extra": other["params/w"]}
    with pytest.raises(CheckpointError, match="no array 'params/extra'"):
        restore(tmp_path, 2, missing)
    assert not (tmp_path / DAMAGED).exists()


# ------------------------------------------------------------------ lock and pruning


def test_two_runs_cannot_write_one_folder(tmp_path: Path) -> None:
    """The second run is refused at once, naming the first; exit 3 (a restart may find
    the folder free), never 2, which the operator reads as a configuration error."""
    first = LocalCheckpoints(tmp_path, keep_last=2, asynchronous=True)
    with pytest.raises(FolderBusy, match=f"another run \\(pid {os.getpid()} on .*\\) is writing") as busy:
        LocalCheckpoints(tmp_path, keep_last=2, asynchronous=True)
    assert busy.value.exit_code == 3
    first.close()
    with FolderLock(tmp_path):  # free again once the first run is done
        pass


_HOLD = """
import sys, time
from alpajob.trainer_image.checkpoint.lock import FolderLock
lock = FolderLock(sys.argv[1], job=sys.argv[2], attempt=int(sys.argv[3]))
lock.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[4]))
lock.release()
"""


def _holder(folder: Path, job: str, attempt: int, seconds: float) -> subprocess.Popen:
    """A process (an old head pod) holding ``folder`` for ``seconds``."""
    process = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder), job, str(attempt), str(seconds)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_new_attempt_takes_the_folder_over_once_the_old_attempt_lets_go(tmp_path: Path) -> None:
    """Attempt 0's head still terminates (saving its last checkpoint) when attempt 1's
    driver starts: attempt 1 waits for the lock, says so, and takes it over; a run of
    another job is refused at once, naming the holder's job and attempt."""
    old = _holder(tmp_path, "gpt", 0, 2.0)
    said: list[str] = []
    began = time.monotonic()
    with pytest.raises(FolderBusy, match="job gpt attempt 0, pid"):
        FolderLock(tmp_path, job="other", attempt=1).acquire()
    assert time.monotonic() - began < 1.0  # not this job's: no wait
    with FolderLock(tmp_path, job="gpt", attempt=1, wait_for_older=30, say=said.append) as lock:
        waited = time.monotonic() - began
        assert lock.holder() == lock.me and lock.me.attempt == 1
    assert old.wait(10) == 0
    assert 1.0 < waited < 10.0
    assert "waiting up to 30 s for job gpt attempt 0" in said[0] and said[1].startswith("took over")


def test_an_old_attempt_that_outlasts_the_wait_is_a_transient_failure(tmp_path: Path) -> None:
    old = _holder(tmp_path, "gpt", 0, 30.0)
    try:
        with pytest.raises(FolderBusy, match="still holds the checkpoint folder after 1 s") as busy:
            FolderLock(tmp_path, job="gpt", attempt=1, wait_for_older=1.0).acquire()
        assert busy.value.exit_code == 3
        with pytest.raises(FolderBusy, match="another run"):  # a later attempt is never waited for
            FolderLock(tmp_path, job="gpt", attempt=0, wait_for_older=30.0).acquire()
    finally:
        old.kill()
        old.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as uid 1000")
def test_a_folder_uid_1000_cannot_write_fails_in_one_line_naming_it(tmp_path: Path) -> None:
    """A volume owned by root (mode 0755), the pod running as uid 1000 without fsGroup:
    one line naming the folder, the volume and the uid, exit 2 (no restart fixes it)."""
    volume = tmp_path / "volume"
    volume.mkdir(mode=0o755)
    tmp_path.chmod(0o755)
    read, write = os.pipe()
    child = os.fork()  # as uid 1000, without exec (the interpreter lives under /root)
    if child == 0:
        os.close(read)
        os.setgroups([])
        os.setgid(1000)
        os.setuid(1000)
        try:
            FolderLock(volume / "job", volume="PersistentVolumeClaim ckpt at /checkpoints").acquire()
            message, code = "acquired", 0
        except CheckpointError as error:
            message, code = str(error), error.exit_code
        os.write(write, message.encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        line = pipe.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 2, line
    assert "\n" not in line
    assert f"checkpoint folder {volume}/job (PersistentVolumeClaim ckpt at /checkpoints) is not writable " \
           "by uid 1000 gid 1000" in line
    assert "fsGroup" in line


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    checkpoints = LocalCheckpoints(tmp_path, keep_last=2, asynchronous=True)
    for step in range(1, 6):
        checkpoints.save(step, _arrays(float(step)), {})
        checkpoints.poll()
    assert checkpoints.finish() == 5
    checkpoints.close()
    assert complete_steps(tmp_path) == [4, 5]
    assert prune(tmp_path, 1) == [4]
    _equal(restore(tmp_path, 5, targets(_arrays())).arrays, _arrays(5.0))


def test_a_relative_folder_saves_and_restores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--checkpoint-dir ck`` from the working directory: orbax refuses relative
    paths, so the store resolves the folder (it was a traceback)."""
    monkeypatch.chdir(tmp_path)
    checkpoints = LocalCheckpoints("ck", keep_last=2, asynchronous=True)
    checkpoints.save(1, _arrays(3.0), {})
    assert checkpoints.finish() == 1
    checkpoints.close()
    assert complete_steps("ck") == [1]
    _equal(restore("ck", 1, targets(_arrays())).arrays, _arrays(3.0))
    assert (tmp_path / "ck").is_dir()


OPEN_AND_LEAVE = """
import sys
from alpajob.trainer_image.checkpoint.local import LocalCheckpoints
LocalCheckpoints(sys.argv[1], keep_last=3, asynchronous=True).close()
"""


def test_a_folder_opened_and_left_without_a_save_says_nothing_on_the_way_out(tmp_path: Path) -> None:
    """``--resume`` of an empty folder ends at once; orbax's manager, had it been made,
    would still be cleaning temporary folders in a thread as the interpreter shuts down
    and log a page of tracebacks (three runs in four did)."""
    folders = [tmp_path / str(i) for i in range(3)]
    runs = [subprocess.Popen([sys.executable, "-c", OPEN_AND_LEAVE, str(folder)], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for folder in folders]
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0 and err == "" and out == "", err
