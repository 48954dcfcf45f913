"""A mesh host's checkpoint helper: orbax in a process whose JAX group is the mesh's own.

With the ``collective`` transport every mesh host is one process of a job-wide JAX
group, and orbax (0.12) cannot save one mesh's part in such a group: it refuses any
``jax.Array`` that one process holds whole while the group has other processes
(``ArrayHandler.serialize``: a one-host mesh's arrays are exactly that), and writes
numpy arrays from process 0 alone. The object store transport has no such problem:
there each mesh is its own group, which is what orbax expects.

So under the collective transport each mesh host starts a **helper** process
(:class:`SaverProcess`) that recreates the object store transport's situation on the
CPU: it imports JAX with ``JAX_PLATFORMS=cpu`` and as many forced host devices as the
host uses, joins a JAX group of its mesh's helpers only (one process per host of the
mesh; none for a one-host mesh), and lays those devices out in the stage's logical
mesh, position for position. Checkpoints then go through the same
:class:`~alpajob.trainer_image.checkpoint.store.PartWriter` and
:func:`~alpajob.trainer_image.checkpoint.store.restore` as the object store's, and the
folder they write is the same: a checkpoint crosses between the two transports.

Hand-over (:func:`write_shards`, :func:`read_shards`): for a save, the mesh host copies
the distinct shards of its arrays (one per box, not one per replica) into raw files of
a staging folder on local disk (not ``/dev/shm``, 64 MiB in a container); the helper
reads them onto the devices at the same mesh positions and hands the arrays to orbax,
which writes them in the background (its memory, not the trainer's). A restore runs
the other way. Requests and replies are pickled tuples over a socket pair; the helper
ends when its mesh host does (its socket closes, or its parent process changes).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from alpajob.trainer_image.distributed.transport import mesh_positions
from alpajob.trainer_image.runtime.transfer import Box, box_of

#: Per array name: shape, dtype, partition spec, and per mesh position the file of its shard.
Layout = dict[str, tuple[tuple[int, ...], str, tuple[Any, ...], dict[int, str]]]

#: Seconds a helper may take to start (imports, its mesh's group).
START_TIMEOUT = 180.0


def _spec(array: Any) -> tuple[Any, ...]:
    from jax.sharding import NamedSharding

    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"a checkpoint helper hands over named shardings only, not {type(sharding).__name__}")
    return tuple(sharding.spec)


def write_shards(arrays: Mapping[str, Any], folder: Path) -> Layout:
    """Write the distinct shards this process holds of ``arrays`` (one file per box)
    into ``folder``; the layout that :func:`read_shards` needs (each shard's file by
    its device's position in the array's mesh)."""
    folder.mkdir(parents=True, exist_ok=True)
    layout: Layout = {}
    for i, (name, array) in enumerate(sorted(arrays.items())):
        files: dict[Box, str] = {}
        where: dict[int, str] = {}
        positions = mesh_positions(array.sharding)
        for shard in array.addressable_shards:
            box = box_of(shard.index, array.shape)
            if box not in files:
                files[box] = f"a{i}-{len(files)}.bin"
                np.ascontiguousarray(np.asarray(shard.data)).tofile(folder / files[box])
            where[positions[shard.device.id]] = files[box]
        layout[name] = (tuple(array.shape), str(array.dtype), _spec(array), where)
    return layout


def read_shards(layout: Layout, folder: Path, mesh: Any) -> dict[str, Any]:
    """The arrays of :func:`write_shards`'s ``layout`` on ``mesh`` (this process's
    devices at the same positions), each with the partition spec it had."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    out = {}
    for name, (shape, dtype, spec, where) in layout.items():
        sharding = NamedSharding(mesh, PartitionSpec(*spec))
        position = mesh_positions(sharding)
        loaded: dict[str, Any] = {}
        pieces = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            file = where[position[device.id]]  # type: ignore[attr-defined]
            if file not in loaded:
                box = box_of(index or (), shape)
                loaded[file] = np.fromfile(folder / file, dtype=jnp.dtype(dtype)).reshape(
                    [hi - lo for lo, hi in box])
            pieces.append(jax.device_put(loaded[file], device))
        out[name] = jax.make_array_from_single_device_arrays(shape, sharding, pieces)
    return out


class HelperError(RuntimeError):
    """The checkpoint helper failed, or gave no answer in time."""


class SaverProcess:
    """The mesh host's side of its checkpoint helper (module docstring)."""

    def __init__(self, stage: Any, host: int, coordinator: str | None, timeout: float = START_TIMEOUT) -> None:
        """``stage``: the plan's stage of this mesh; ``host``: this host's index in it;
        ``coordinator``: the helpers' group coordinator (host 0's helper runs it), for a
        mesh of several hosts. Starts the helper; it imports and joins in the background."""
        hosts, per_host = stage.submesh_shape
        self.timeout = timeout
        self.staging = Path(tempfile.mkdtemp(prefix=f"alpajob-saver-{os.getpid()}-"))
        ours, theirs = socket.socketpair()
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={per_host}"}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        setup = {"hosts": hosts, "host": host, "coordinator": coordinator,
                 "logical": tuple(stage.logical_mesh_shape), "axes": tuple(stage.axis_names),
                 "per_host": per_host, "index": stage.index, "staging": str(self.staging),
                 "parent": os.getpid()}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "alpajob.trainer_image.distributed.saver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.connection = Connection(ours.detach())
        self.connection.send(setup)
        self._ready = False
        self._lock = threading.Lock()

    def _ask(self, request: tuple[Any, ...]) -> Any:
        """The helper's answer to ``request``. Its start (imports, its mesh's group) may
        take ``timeout`` seconds; a request as long as it needs (the driver's step
        timeout bounds it), unless the helper ends."""
        with self._lock:
            if not self._ready:
                self._reply(self.timeout, "start")
                self._ready = True
            self.connection.send(request)
            return self._reply(None, request[0])

    def _reply(self, timeout: float | None, what: str) -> Any:
        try:
            if not self.connection.poll(timeout):
                raise HelperError(f"the checkpoint helper (pid {self.process.pid}) gave no answer to {what} "
                                  f"within {timeout:g} s")
            status, value = self.connection.recv()
        except (EOFError, OSError):
            code = self.process.poll()
            raise HelperError(f"the checkpoint helper (pid {self.process.pid}) ended during {what} "
                              f"(exit code {code})") from None
        if status == "error":
            raise HelperError(f"the checkpoint helper's {what} failed: {value}")
        return value

    def save(self, arrays: Mapping[str, Any], root: str, step: int, parts: list[str], run: dict[str, Any],
             asynchronous: bool) -> None:
        """Hand ``arrays`` over and start the save; returns once the helper holds them."""
        folder = self.staging / f"save-{step}"
        shutil.rmtree(folder, ignore_errors=True)
        layout = write_shards(arrays, folder)
        try:
            self._ask(("save", root, step, parts, run, asynchronous, str(folder), layout))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def wait(self) -> None:
        """Block until the helper's last save is finalized."""
        self._ask(("wait",))

    def restore(self, root: str, step: int, arrays: Mapping[str, Any]) -> dict[str, Any] | str:
        """Checkpoint ``step``'s arrays named and placed as ``arrays`` (all on one mesh),
        or why not, if it is damaged."""
        layout: Layout = {name: (tuple(a.shape), str(a.dtype), _spec(a), {}) for name, a in arrays.items()}
        folder = self.staging / f"restore-{step}"
        shutil.rmtree(folder, ignore_errors=True)
        try:
            reply = self._ask(("restore", root, step, str(folder), layout))
            if isinstance(reply, str):
                return reply
            return read_shards(reply, folder, next(iter(arrays.values())).sharding.mesh)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """End the helper (after its save in flight) and remove its staging folder."""
        try:
            self.connection.close()
            self.process.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self.staging, ignore_errors=True)


# ------------------------------------------------------------------ the helper's side


def _watch_parent(parent: int, staging: str) -> None:
    """End this helper as soon as its mesh host's process is gone (killed, say): the
    helper must not outlive it, holding memory or its mesh group's port, nor leave the
    staging folder behind."""
    while os.getppid() == parent:
        time.sleep(0.5)
    shutil.rmtree(staging, ignore_errors=True)
    os._exit(1)


class _Helper:
    """The helper process: its mesh, its part's writer, its requests."""

    def __init__(self, setup: Mapping[str, Any]) -> None:
        import jax
        from jax.sharding import Mesh

        from alpajob.trainer_image.distributed.mesh_host import mesh_devices

        if setup["hosts"] > 1:
            jax.distributed.initialize(setup["coordinator"], num_processes=setup["hosts"],
                                       process_id=setup["host"], initialization_timeout=int(START_TIMEOUT))

        stage = SimpleNamespace(index=setup["index"], submesh_shape=(setup["hosts"], setup["per_host"]),
                                logical_mesh_shape=setup["logical"])  # what mesh_devices reads of a stage
        self.mesh = Mesh(mesh_devices(stage, jax.devices()), setup["axes"])
        self.index = setup["index"]
        self.writer: Any = None

    def save(self, root: str, step: int, parts: list[str], run: dict[str, Any], asynchronous: bool,
             folder: str, layout: Layout) -> None:
        from alpajob.trainer_image.checkpoint.store import PartWriter, mesh_part

        arrays = read_shards(layout, Path(folder), self.mesh)
        if self.writer is None:
            self.writer = PartWriter(root, mesh_part(self.index), asynchronous)
        self.writer.save(step, arrays, parts, run)

    def wait(self) -> None:
        if self.writer is not None:
            self.writer.wait()

    def restore(self, root: str, step: int, folder: str, layout: Layout) -> Layout | str:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from alpajob.trainer_image.checkpoint.store import DamagedCheckpoint, restore

        targets = {name: jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype),
                                              sharding=NamedSharding(self.mesh, PartitionSpec(*spec)))
                   for name, (shape, dtype, spec, _) in layout.items()}
        try:
            restored = restore(root, step, targets)
        except DamagedCheckpoint as error:
            return str(error)
        return write_shards(restored.arrays, Path(folder))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.wait()
            self.writer.close()


def serve(connection: Connection) -> None:
    """Answer the mesh host's requests until it closes the connection."""
    setup = connection.recv()
    threading.Thread(target=_watch_parent, args=(setup["parent"], setup["staging"]), daemon=True).start()
    try:
        helper = _Helper(setup)
    except Exception as error:  # noqa: BLE001 - reported to the mesh host, which raises it
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ok", None))
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            break
        verb, args = request[0], request[1:]
        try:
            connection.send(("ok", getattr(helper, verb)(*args)))
        except Exception as error:  # noqa: BLE001 - reported to the mesh host, which raises it
            connection.send(("error", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"))
    helper.close()


def main(argv: Sequence[str]) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the trainer, which saves
    serve(Connection(int(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])

