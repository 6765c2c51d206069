#!/usr/bin/env bash
# One GPU check on the GPU test machine (torch, transformers, accelerate present; trl and datasets carried as
# wheels in .whl, see ../shared/tools/device-wheels.sh): the gpu-marked tests, then a bf16 lockstep pair of the
# embedded default, whose per-metric differences set the bf16 tolerances. Results go to $OUT.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 GRPO_PARITY_CACHE=/tmp/gpc PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" || true
python3 -m harness parity --spec harness/specs/default.toml --matrix none --quiet --out /tmp/bf16 \
  --set 'DEVICE="cuda"' --set 'DTYPE="bfloat16"' --set GRADIENT_CHECKPOINTING=true --set STEPS=30 \
  2>&1 | tee "$OUT/bf16_parity.log" || true
cp /tmp/bf16/verdict.json "$OUT/bf16_verdict.json" 2>/dev/null || true
cp /tmp/bf16/report.html "$OUT/bf16_report.html" 2>/dev/null || true
python3 tools/determinism_bench.py --steps 8 2>&1 | grep -v -i warn | tee "$OUT/determinism.txt" || true
