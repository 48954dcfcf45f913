"""A node pool of one GPU type among several (``spec.cluster.pools``), and the rule
every GPU count per node follows.

Its own module, below :mod:`.spec`, so that the runtime contract
(:mod:`.runtime`: the planner pod is told each type's usable nodes) and the planning
options (:mod:`.options`) name the same type without importing the whole spec.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from alpajob.api.catalog import DevicePreset
from alpajob.api.limits import GPUS_PER_NODE, NODES
from alpajob.api.schema import INT32, Contract, cel, k8s

#: GPUs a node may give a job: submeshes tile a node, so a power of two.
POWERS_OF_TWO = (1, 2, 4, 8, 16)


def _tiles_a_node(value: int) -> int:
    """GPUs per node are a power of two, so that submeshes tile a node."""
    if value not in POWERS_OF_TWO:
        raise ValueError(f"must be a power of two (1, 2, 4, 8 or 16) so submeshes tile a node, got {value}")
    return value


#: GPUs per node: within :data:`GPUS_PER_NODE`, a power of two.
GpusPerNode = Annotated[int, GPUS_PER_NODE.validator, GPUS_PER_NODE.schema, AfterValidator(_tiles_a_node)]

#: The most pools of different GPU types one job may name.
MAX_POOLS = 4


class GpuPool(Contract):
    """``spec.cluster.pools[i]``: one pool of a cluster of several GPU types."""

    gpu: DevicePreset = Field(description="The pool's device preset (a GPU preset).", json_schema_extra=k8s(cel(
        "self != 'cpu'", "spec.cluster.pools[].gpu is a GPU preset: cpu devices share one host "
        "(use spec.cluster.gpu: cpu alone)")))
    nodes: Annotated[int, NODES.validator, NODES.schema] = Field(
        1, ge=1, json_schema_extra=INT32, description="Nodes of this pool the job may use.")
    gpus_per_node: GpusPerNode = Field(
        8, ge=1, json_schema_extra=INT32 | k8s(cel(
            f"self in {list(POWERS_OF_TWO)}",
            "spec.cluster.pools[].gpusPerNode must be a power of two (1, 2, 4, 8 or 16) so submeshes tile a node")),
        description="GPUs of each node: 1, 2, 4, 8 or 16.")

    @field_validator("gpu")
    @classmethod
    def _a_gpu(cls, value: DevicePreset) -> DevicePreset:
        if value is DevicePreset.CPU:
            raise ValueError("a pool is of GPUs (cpu devices share one host: use spec.cluster.gpu: cpu alone)")
        return value
