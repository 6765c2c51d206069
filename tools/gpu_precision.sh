#!/usr/bin/env bash
# Issue 28 on the GPU: settings that bf16 hides, each run as a one-cell parity (--matrix none) on the Qwen3-0.6B-shaped
# model (harness/specs/gpu-qwen3-lengths.toml: bf16 autocast over fp32 masters, lr 1e-6, adam_beta2 0.98), with
# FLOAT32_CHECK = "on" (the default `auto` does the same since this ran on an H100), so that the cell escalates to a float32 pair (harness/diagnose/precision.py) and says what float32 found and after how many
# steps the difference would leave the bf16 bound. Wheels from ../shared/tools/device-wheels.sh in .whl (carried).
#   bash tools/gpu_precision.sh                                   # CASES below, STEPS=6 each
#   CASES="beta2-30|trl.adam_beta2=0.9" STEPS=30 bash tools/gpu_precision.sh   # a longer bf16 run: checks an estimate
# Logs and verdicts go to $OUT (one .log and one .verdict.json per case); a table of the cases at the end.
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
# name|--set overrides (space-separated)
CASES=${CASES:-"beta2|trl.adam_beta2=0.9;lr|trl.learning_rate=1.02e-6;wd|trl.weight_decay=0.01"}
IFS=';' read -ra list <<< "$CASES"
for case in "${list[@]}"; do
  name=${case%%|*}; sets=()
  for s in ${case#*|}; do sets+=(--set "$s"); done
  start=$(date +%s)
  timeout "${LIMIT:-540}" python3 -m harness parity --spec harness/specs/gpu-qwen3-lengths.toml --matrix none \
    --out "/tmp/runs/precision-$name" --force --steps "$STEPS" --set MAX_TOKENS="$TOKENS" --set 'FLOAT32_CHECK="on"' \
    "${sets[@]}" 2>&1 \
    | grep -v -i warn | tee "$OUT/precision-$name.log"
  echo "wall: $(( $(date +%s) - start )) s ($name: ${case#*|}; STEPS=$STEPS MAX_TOKENS=$TOKENS)" | tee -a "$OUT/precision-$name.log"
  cp "/tmp/runs/precision-$name/verdict.json" "$OUT/precision-$name.verdict.json" 2>/dev/null
done
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
print(f"{'case':10s} {'bf16':8s} {'float32':24s} estimate (steps)  wall")
for f in sorted(Path(sys.argv[1]).glob("precision-*.verdict.json")):
    c = json.loads(f.read_text())["cells"][0]
    p = c.get("precision") or {}
    fd, fd32 = c.get("first_divergence"), p.get("first_divergence")
    est = (p.get("estimate") or {}).get("step"), (p.get("estimate_float32") or {}).get("step")
    bf16 = f"{fd['step']}:{fd['metric']}" if fd else c["verdict"]
    f32 = f"{fd32['step']}:{fd32['metric']} {'+'.join(p.get('confirmed', []))}" if fd32 else ("parity" if p else "-")
    print(f"{f.name[10:-13]:10s} {bf16:8s} {f32:24s} bf16 {est[0]} fp32 {est[1]}  {c.get('wall_s')} s")
EOF
exit 0
