#!/usr/bin/env bash
# On a GPU machine: `alpajob calibrate` (the device's rates and the
# fusion fit), then the held-out models' predicted steps against measured ones
# (benchmarks/gpu_prediction.py), each in its own process. Writes into $OUT (default
# ./gpu-calibration): calibration.json, calibrate.log, prediction.jsonl.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_calibration.sh
set -u
OUT=${OUT:-gpu-calibration}
mkdir -p "$OUT"
# rbg: the threefry PRNG makes XLA compile GPT-350M's init for minutes on a GPU.
export JAX_DEFAULT_PRNG_IMPL=rbg RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi -L
timeout "${CALIBRATE_TIMEOUT:-330}" python3 -m alpajob calibrate -o "$OUT/calibration.json" \
    2>&1 | tee "$OUT/calibrate.log"
for model in ${MODELS:-gpt-1024x8 gpt-350m moe-768x8 gpt-2048x6}; do
    timeout "${MODEL_TIMEOUT:-100}" python3 benchmarks/gpu_prediction.py --model "$model" \
        --calibration "$OUT/calibration.json" --json "$OUT/prediction.jsonl" 2>&1 | grep -v Warning
done
