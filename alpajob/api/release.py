"""The release: one version, and the image references made from it.

Everything that names AlpaJob's version or one of its images reads it here:
``alpajob --version`` and the package's metadata (``pyproject.toml`` takes
:data:`VERSION` as its dynamic version), the operator's default trainer image, and
the release workflow (``.github/workflows/release.yml``), which builds and pushes the
images under these names and refuses a git tag that is not ``v`` + :data:`VERSION`.
The chart's ``appVersion``, the images of ``manifests/`` and every image named in the
docs are held to it by ``tests/test_release.py``.

Three images, from ``trainer_image/Dockerfile``:

- :data:`TRAINER_IMAGE`: every pod of a job; JAX with its CUDA 12 wheels (linux/amd64);
- :data:`CPU_TRAINER_IMAGE`: the same without CUDA, for CPU pools (``gpu: cpu``);
- :data:`OPERATOR_IMAGE`: ``alpajob operator`` with no JAX, Ray or NumPy.
"""

from __future__ import annotations

#: The version of the package, the chart's appVersion and the images' tag.
VERSION = "0.1.0"
#: Where the release workflow pushes the images and the chart (an OCI registry).
REGISTRY = "ghcr.io/alpajob"
TRAINER_REPOSITORY = f"{REGISTRY}/alpajob"
OPERATOR_REPOSITORY = f"{REGISTRY}/alpajob-operator"
#: The chart, as an OCI artifact: ``helm install alpajob oci://ghcr.io/alpajob/charts/alpajob``.
CHART_REPOSITORY = f"oci://{REGISTRY}/charts"
#: Suffix of the CPU trainer's tag.
CPU_SUFFIX = "-cpu"

TRAINER_IMAGE = f"{TRAINER_REPOSITORY}:{VERSION}"
CPU_TRAINER_IMAGE = f"{TRAINER_REPOSITORY}:{VERSION}{CPU_SUFFIX}"
OPERATOR_IMAGE = f"{OPERATOR_REPOSITORY}:{VERSION}"
