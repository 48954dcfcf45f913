#!/usr/bin/env bash
# Regenerate the lock files: every package, direct and transitive, at one version with
# the sha256 of each of its files, for Linux (x86_64 and arm64) and Python 3.11 (what
# the images and CI run); then each image's SBOM (CycloneDX 1.6 JSON, requirements/sbom/), read from its
# lock. Run from anywhere after changing a pin in pyproject.toml or a *.in file:
#
#   python -m pip install uv==0.13.9 cyclonedx-bom==7.5.0 && requirements/lock.sh
#
# Versions already in a lock are kept (uv reads the old file back) unless a pin moved
# them; `requirements/lock.sh --upgrade` takes the newest everywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each lock holds the hash of every file of each pinned version, wheels of every
# platform included, so an image's lock serves linux/arm64 as well (the release
# workflow builds the images for both): with ARM64=1, resolved again for aarch64,
# starting from the lock just made, it must come out the same, or the script stops.
# (CI's lock is for x86_64 runners only: helm-python-sdk has x86_64 wheels only.)
ARM=$(mktemp -d)
trap 'rm -rf "$ARM"' EXIT
compile() {
  local out=$1 python=$2; shift 2
  uv pip compile --quiet --generate-hashes --python-version "$python" --python-platform x86_64-manylinux_2_28 \
    --custom-compile-command "requirements/lock.sh" --output-file "requirements/$out" "$@" "${EXTRA[@]}"
  [ "${ARM64:-0}" = 1 ] || return 0
  cp "requirements/$out" "$ARM/$out"
  uv pip compile --quiet --generate-hashes --python-version "$python" --python-platform aarch64-manylinux_2_28 \
    --custom-compile-command "requirements/lock.sh" --output-file "$ARM/$out" "$@"
  if ! diff -q <(grep -v '^#' "requirements/$out") <(grep -v '^#' "$ARM/$out") >/dev/null; then
    echo "error: requirements/$out resolves differently for linux/arm64; pin what differs" >&2
    diff <(grep -v '^#' "requirements/$out") <(grep -v '^#' "$ARM/$out") | head -20 >&2
    exit 1
  fi
}
EXTRA=("$@")
# CI first (.ci/run installs it, hashes checked, before the README's commands): it holds
# every package but the CUDA wheels, and the others are made under it as constraints, so
# that a package has one version everywhere. The docs' pymdown-extensions needs Python
# 3.11.5 or newer.
compile ci.txt 3.11.5 pyproject.toml requirements/build.in --extra test --extra docs
# The trainer images (trainer_image/Dockerfile): GPU, and the CPU image the tests run.
ARM64=1 compile trainer-cuda.txt 3.11 pyproject.toml requirements/cuda.in requirements/build.in --extra cloud \
  --constraint requirements/ci.txt
ARM64=1 compile trainer-cpu.txt 3.11 pyproject.toml requirements/build.in --extra cloud --constraint requirements/ci.txt
# The operator's image (trainer_image/Dockerfile, --target operator): no JAX, no Ray.
ARM64=1 compile operator.txt 3.11 requirements/operator.in --constraint requirements/ci.txt

# What each image holds, as an SBOM from its lock (names, versions, purls, hashes); the
# images carry theirs at /opt/alpajob/sbom.cdx.json.
mkdir -p requirements/sbom
for lock in trainer-cuda trainer-cpu operator; do
  PYTHONWARNINGS=ignore cyclonedx-py requirements --pyproject pyproject.toml --output-reproducible \
    --of JSON -o "requirements/sbom/$lock.cdx.json" "requirements/$lock.txt"
  # pyproject.toml's version is dynamic (alpajob/api/release.py), which cyclonedx-py does
  # not read: the SBOM's own component gets it here.
  python3 - "requirements/sbom/$lock.cdx.json" <<'PY'
import json, sys
sys.path.insert(0, ".")
from alpajob.api.release import VERSION
path = sys.argv[1]
with open(path) as file:
    bom = json.load(file)
bom["metadata"]["component"]["version"] = VERSION
with open(path, "w") as file:
    file.write(json.dumps(bom, indent=2))
PY
done
