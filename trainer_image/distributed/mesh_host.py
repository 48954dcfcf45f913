"""The Ray actor of one mesh host: it owns the host's devices and runs its stage.

A driver creates one :class:`MeshHost` per mesh host of the plan, pinned to that host
by the host's custom resource (:func:`~.cluster.host_resource`). In its own process
(its own JAX runtime, with the devices the host was started with) the actor:

1. loads the manifest's model and traces its loss at the plan's micro-batch size,
   cutting it into the plan's stages exactly as the local runtime does (every actor
   makes the same cut, so value ids agree without any exchange);
2. builds its stage on its devices (the plan's logical mesh over the host's first
   ``n x m`` devices) and places its own parameters, initialised from the run's seed;
3. publishes its :func:`layout`: the tiles of everything it receives, per message
   address, so senders can plan transfers onto it;
4. per :meth:`step`, runs its stage's instruction list
   (:func:`~alpajob.trainer.runtime.executor.run_stage_program`) with a
   :class:`RayLink`: sends are parcels of the transfer plan put into the object store
   and delivered to the peer actor; receives wait on the actor's mailbox, fed by
   :meth:`deliver` (the actor runs several calls at once: ``max_concurrency``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
import ray
import yaml

from alpajob.planner.extract import make_optimizer, path_name
from alpajob.planner.manifest import parse_manifest
from alpajob.planner.plan import plan_from_json
from alpajob.planner.schedules import Schedule
from alpajob.trainer.distributed.transport import assemble, cut, position_tiles
from alpajob.trainer.entrypoint import load_model
from alpajob.trainer.runtime.build import place_stage, split_for_plan
from alpajob.trainer.runtime.executor import (
    Key,
    Mailbox,
    destination_sharding,
    loss_seed,
    run_stage_program,
    split_micro_batches,
)
from alpajob.trainer.runtime.split import SplitProgram
from alpajob.trainer.zoo.model import synthetic_batch


def layout_key(key: Key) -> tuple[str, int]:
    """A message key without its micro-batch and reader: what fixes its tiles."""
    kind = key[0]
    return (kind, key[2]) if kind in ("act", "grad") else (kind, key[1])


def addresses(split: SplitProgram, index: int) -> Iterator[tuple[Key, tuple[int, ...]]]:
    """One representative key (any micro-batch, any reader) per address stage ``index``
    receives on, with the shape of its value."""
    program = split.stages[index]
    for leaf in program.params:
        shape = tuple(split.avals[split.param_ids[leaf]].shape)
        yield ("param", leaf), shape
        yield ("shared", leaf, -1), shape
    for vid in program.inputs:
        yield ("act", -1, vid), tuple(split.avals[vid].shape)
    for vid in program.outputs:
        yield ("grad", -1, vid, -1), tuple(split.avals[vid].shape)


class RayLink:
    """A stage's link to the other stages' actors through the Ray object store."""

    def __init__(self, split: Any, stage: Any, peers: Sequence[Any], layouts: Sequence[dict], mailbox: Any, timeout: float) -> None:
        self.split, self.stage, self.peers, self.layouts = split, stage, peers, layouts
        self.mailbox, self.timeout = mailbox, timeout
        self.sent_bytes = 0

    def send(self, stage: int, key: Key, value: Any) -> None:
        parcel = cut(value, self.layouts[stage][layout_key(key)])
        self.sent_bytes += parcel.nbytes
        self.peers[stage].deliver.remote(key, ray.put(parcel))

    def receive(self, key: Key) -> Any:
        parcel = self.mailbox.get(key, timeout=self.timeout)
        return assemble(parcel, destination_sharding(self.split, self.stage, key))


class MeshHost:
    """One mesh host's actor (see the module docstring). Plain class: the driver wraps
    it with ``ray.remote``; tests may also drive it in-process."""

    def __init__(self, manifest_yaml: str, plan_json: str, mesh: int, seed: int, receive_timeout: float = 300.0) -> None:
        manifest = parse_manifest(yaml.safe_load(manifest_yaml))
        training = manifest.spec.training
        self.plan = plan_from_json(plan_json)
        self.index = mesh
        self.seed = seed
        self.timeout = receive_timeout
        self.model = load_model(manifest.spec.model, training.dtype)
        self.batch_size = training.global_batch_size
        optimizer = make_optimizer(training.optimizer, training.learning_rate)
        params = self.model.init(jax.random.key(seed))
        self.split, names = split_for_plan(self.plan, self.model.loss, params, self.model.batch_shapes)
        plan_stage = self.plan.stages[mesh]
        devices = jax.devices()
        size = int(np.prod(plan_stage.logical_mesh_shape))
        if len(devices) < size:
            raise RuntimeError(
                f"mesh {mesh} needs {size} devices but its host has {len(devices)} "
                f"({devices[0].platform}); start the mesh worker with --devices {size}"
            )
        grid = np.array(devices[:size], dtype=object).reshape(plan_stage.logical_mesh_shape)
        mesh_obj = jax.sharding.Mesh(grid, tuple(plan_stage.axis_names))
        self.stage = place_stage(self.plan, self.split, names, mesh, mesh_obj, jax.tree.leaves(params), optimizer)
        del params
        self._abort = threading.Event()
        self.mailbox = Mailbox(self._abort)
        self._loss_seed = loss_seed(self.plan.num_micro_batches, mesh_obj)
        self.peers: list[Any] = []
        self.layouts: list[dict] = []

    def ready(self) -> dict[str, Any]:
        """Who this actor is: mesh, devices, process."""
        return {"mesh": self.index, "devices": len(jax.devices()), "platform": jax.devices()[0].platform,
                "pid": os.getpid()}

    def layout(self) -> dict[tuple[str, int], dict[int, Any]]:
        """Per message address, the tiles (by mesh position) this stage receives into."""
        return {
            layout_key(key): position_tiles(destination_sharding(self.split, self.stage, key), shape)
            for key, shape in addresses(self.split, self.index)
        }

    def connect(self, peers: list[Any], layouts: list[dict]) -> None:
        """Learn every stage's actor handle and layout (index = stage)."""
        self.peers, self.layouts = peers, layouts

    def deliver(self, key: Key, parcel: Any) -> None:
        """A peer's message (Ray has fetched the parcel from the object store)."""
        self.mailbox.put(key, parcel)

    def step(self, step: int) -> dict[str, Any]:
        """Run training step ``step`` (0-based) of this stage; its times and losses."""
        batch = jax.tree.leaves(synthetic_batch(self.model, self.batch_size, seed=self.seed + step))
        micro = split_micro_batches(batch, self.plan.num_micro_batches)
        link = RayLink(self.split, self.stage, self.peers, self.layouts, self.mailbox, self.timeout)
        times, losses = run_stage_program(
            self.split, self.stage, Schedule(self.plan.schedule), len(self.plan.stages), micro, link,
            self._loss_seed,
        )
        return {
            "times": dataclasses.asdict(times),
            "losses": [float(x) for x in losses if x is not None],
            "sent_bytes": link.sent_bytes,
        }

    def named_arrays(self) -> dict[str, Any]:
        """This stage's own parameters and optimizer state as host arrays, by name."""
        out = {f"params/{name}": np.asarray(value) for name, value in self.stage.params.items()}
        leaves, _ = jax.tree_util.tree_flatten_with_path(self.stage.opt_state)
        for path, leaf in leaves:
            out[f"opt/{path_name(path)}"] = np.asarray(leaf)
        return out
