#!/usr/bin/env bash
# Issue 27 on the GPU: a loop of yours that differs from TRL in two settings, explained on the Qwen3-0.6B-shaped
# model whose completion lengths vary (harness/specs/gpu-qwen3-lengths.toml), bf16 autocast over fp32 masters,
# with the search's wall time. Wheels from ../shared/tools/device-wheels.sh in .whl (carried).
#   bash tools/gpu_explain.sh            # CASES below, one parity --loop run each
# Logs and verdicts go to $OUT (one .log and one .verdict.json per case).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 GRPO_PARITY_CACHE=/tmp/gpc PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
[ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)" | tee -a "$OUT/gpu.txt"
STEPS=${STEPS:-6}
TOKENS=${TOKENS:-128}
LR=${LR:-1e-5}
# name|flags of examples/my_grpo.py
CASES=${CASES:-"two|--adv-scale none --adam-beta2 0.9"}
IFS=';' read -ra list <<< "$CASES"
for case in "${list[@]}"; do
  name=${case%%|*}; flags=${case#*|}
  start=$(date +%s)
  timeout "${LIMIT:-480}" python3 -m harness parity --spec harness/specs/gpu-qwen3-lengths.toml --loop \
    "python examples/my_grpo.py $flags" --out "/tmp/runs/explain-$name" --force --set STEPS="$STEPS" \
    --set MAX_TOKENS="$TOKENS" --set LR="$LR" --set 'GENERATION="static"' 2>&1 | grep -v -i warn | tee "$OUT/explain-$name.log"
  echo "wall: $(( $(date +%s) - start )) s ($name: $flags; STEPS=$STEPS MAX_TOKENS=$TOKENS LR=$LR)" | tee -a "$OUT/explain-$name.log"
  cp "/tmp/runs/explain-$name/verdict.json" "$OUT/explain-$name.verdict.json" 2>/dev/null
done
exit 0
