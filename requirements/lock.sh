#!/usr/bin/env bash
# Regenerate the lock files: every package, direct and transitive, at one version with
# the sha256 of each of its files, for Linux x86_64 and Python 3.11 (what the images and
# CI run); then each image's SBOM (CycloneDX 1.6 JSON, requirements/sbom/), read from its
# lock. Run from anywhere after changing a pin in pyproject.toml or a *.in file:
#
#   python -m pip install uv==0.13.9 cyclonedx-bom==7.5.0 && requirements/lock.sh
#
# Versions already in a lock are kept (uv reads the old file back) unless a pin moved
# them; `requirements/lock.sh --upgrade` takes the newest everywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
compile() {
  local out=$1 python=$2; shift 2
  uv pip compile --quiet --generate-hashes --python-version "$python" --python-platform x86_64-manylinux_2_28 \
    --custom-compile-command "requirements/lock.sh" --output-file "requirements/$out" "$@" "${EXTRA[@]}"
}
EXTRA=("$@")
# CI first (.ci/run installs it, hashes checked, before the README's commands): it holds
# every package but the CUDA wheels, and the others are made under it as constraints, so
# that a package has one version everywhere. The docs' pymdown-extensions needs Python
# 3.11.5 or newer.
compile ci.txt 3.11.5 pyproject.toml requirements/build.in --extra test --extra docs
# The trainer images (trainer_image/Dockerfile): GPU, and the CPU image the tests run.
compile trainer-cuda.txt 3.11 pyproject.toml requirements/cuda.in requirements/build.in --extra cloud \
  --constraint requirements/ci.txt
compile trainer-cpu.txt 3.11 pyproject.toml requirements/build.in --extra cloud --constraint requirements/ci.txt
# The operator's image (trainer_image/Dockerfile, --target operator): no JAX, no Ray.
compile operator.txt 3.11 requirements/operator.in --constraint requirements/ci.txt

# What each image holds, as an SBOM from its lock (names, versions, purls, hashes); the
# images carry theirs at /opt/alpajob/sbom.cdx.json.
mkdir -p requirements/sbom
for lock in trainer-cuda trainer-cpu operator; do
  PYTHONWARNINGS=ignore cyclonedx-py requirements --pyproject pyproject.toml --output-reproducible \
    --of JSON -o "requirements/sbom/$lock.cdx.json" "requirements/$lock.txt"
done
