#!/usr/bin/env bash
# Wheels a lent GPU machine lacks, for benchmarks/gpu_step.py there (it has no network).
# Its image holds JAX (with CUDA), optax, orbax-checkpoint, numpy, scipy, pyyaml, rich,
# prometheus-client and tokenizers already; the planner and the trainer also import
# these. Run here, from the repository root; .whl/ is git-ignored locally and carried:
#
#     bash benchmarks/gpu_wheels.sh            # then, on the GPU machine:
#     python3 -m pip install --no-index --find-links .whl --no-deps .whl/*.whl
#     python3 -m pip install --no-deps --no-build-isolation -e . && python3 benchmarks/gpu_step.py
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    pulp==3.3.2 highspy==1.15.1 grain==0.2.18 array-record==0.8.6 filelock==4.2.12
ls .whl
