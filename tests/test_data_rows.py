"""What a mesh host reads of every batch: its stage's leaves and its devices' rows, from
the real shardings of a mesh of forced CPU devices split into hosts."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpajob.trainer_image.data.loader import Need
from alpajob.trainer_image.distributed.rows import host_need, rows_of


def stage_of(index: int, leaves: tuple[int, ...], sharding: NamedSharding, micro: int = 4) -> tuple:
    """A split of three stages whose stage ``index`` reads batch ``leaves``, each of
    micro-batch shape [micro, 16], placed by ``sharding``."""
    aval = SimpleNamespace(shape=(micro, 16))
    split = SimpleNamespace(stages={index: SimpleNamespace(batch=leaves)}, avals={10: aval, 11: aval},
                            batch_ids=(10, 11))
    return split, SimpleNamespace(index=index, batch_sharding=[sharding] * len(leaves))


def test_data_parallel_hosts_read_disjoint_rows_that_make_up_the_batch() -> None:
    devices = np.array(jax.devices()[:4])
    rows = NamedSharding(Mesh(devices, ("data",)), P("data"))
    hosts = [devices[:2], devices[2:]]  # two hosts of two devices each
    assert [rows_of(rows, (4, 16), h) for h in hosts] == [{0, 1}, {2, 3}]
    # The module docstring's example: batch 8 in 2 micro-batches of 4.
    split, stage = stage_of(0, (0,), rows)
    needs = [host_need(split, stage, 2, h) for h in hosts]
    assert needs == [Need(frozenset({"input_ids"}), (0, 1, 4, 5)), Need(frozenset({"input_ids"}), (2, 3, 6, 7))]
    # A 2-D mesh, data parallel over its first axis and model parallel over the second:
    # the two devices of a host hold the same rows.
    grid = NamedSharding(Mesh(devices.reshape(2, 2), ("data", "model")), P("data", None))
    assert [rows_of(grid, (4, 16), h) for h in hosts] == [{0, 1}, {2, 3}]


def test_the_last_stage_reads_labels_a_middle_stage_nothing_a_whole_mesh_every_row() -> None:
    devices = np.array(jax.devices()[:4])
    replicated = NamedSharding(Mesh(devices, ("data",)), P())
    split, stage = stage_of(2, (1,), replicated)
    assert host_need(split, stage, 3, devices[:2]) == Need(frozenset({"labels"}), None)  # every row: all
    split, stage = stage_of(1, (), replicated)
    assert host_need(split, stage, 3, devices[:2]) == Need(frozenset(), ())  # reads no data at all
    both = NamedSharding(Mesh(devices, ("data",)), P("data"))
    split, stage = stage_of(0, (0, 1), both)
    assert host_need(split, stage, 1, devices) == Need(frozenset({"input_ids", "labels"}), None)
