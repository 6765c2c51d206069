#!/usr/bin/env bash
# Issue 41, step 1: vLLM 0.24 on the GPU machine, against the image's own torch 2.11 (no network there).
# The wheel (279 MB) and its missing dependencies travel in parts of at most 56 MiB, one `run` call each, while the
# machine stays warm; each call copies what it carried to /tmp/vparts:
#   PART=.vparts/vllm.part00 bash tools/gpu_vllm.sh stage      # one call per part (and per deps group folder)
#   bash tools/gpu_vllm.sh check                               # reassemble, install to /tmp/vsite, import, generate
#   BENCH_LIMIT=150 bash tools/gpu_vllm.sh run                 # the vLLM matrix, the mismatch figures (gpu_vllm_run.py)
#   bash tools/gpu_vllm.sh cap32                               # issue 48: the lesson's runs capped to 31.8 GiB (gpu_vllm32.py)
# Here, once (git-ignored: echo /.vparts/ >> .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d /tmp/w vllm==0.24.0 && mkdir -p .vparts && split -b 56m -d /tmp/w/vllm-*.whl .vparts/vllm.part
#   the dependencies: the pip download in tools/gpu_vllm_wheels.txt's header, into .vparts/deps1 and .vparts/deps2 (each
#   under 56 MiB; xgrammar alone is 43 MB). Left out on purpose: torch and its kernels' packages, flashinfer, tilelang,
#   cutlass-dsl, fastsafetensors (the offline LLM path ran without them, VLLM_USE_FLASHINFER_SAMPLER=0 below).
# Logs in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT" /tmp/vparts
install() {  # vLLM from its parts and its dependencies to /tmp/vsite; trl and datasets (.whl, carried) to /tmp/site
  t0=$(date +%s)
  if [ ! -d /tmp/vsite/vllm ]; then
    cat /tmp/vparts/vllm.part* > /tmp/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
    sha256sum /tmp/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl | tee "$OUT/sha256.txt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite \
      /tmp/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl /tmp/vparts/deps*/*.whl 2>&1 | tail -5 | tee "$OUT/install.log"
  fi
  if [ -d .whl ] && [ ! -d /tmp/site/trl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  echo "install: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/install.log"
  # flashinfer is not carried (447 MB of kernels): its top-p/top-k sampler off, so vLLM samples with its own
  # (harness/rollouts/samplers.py: vllm_environment() does the same where flashinfer is missing)
  export PYTHONPATH=/tmp/vsite:/tmp/site:$PWD HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 GRPO_PARITY_CACHE=/tmp/gpc
}

case "${1:-check}" in
stage)
  cp -r ${PART:?name the carried part} /tmp/vparts/ && ls -la /tmp/vparts | tail -n +2 | tee "$OUT/staged.txt"
  ;;
check)
  install
  # import errors name the next missing package, one at a time: print the first few
  python3 - <<'PY' 2>&1 | tail -40 | tee "$OUT/import.log"
import importlib, time, traceback
t = time.time()
for mod in ("vllm", "vllm.entrypoints.llm"):
    try:
        importlib.import_module(mod)
        print(f"import {mod}: ok ({time.time() - t:.1f} s)")
    except Exception as e:
        print(f"import {mod}: {type(e).__name__}: {e}")
        traceback.print_exc(limit=3)
        break
PY
  timeout "${GEN_LIMIT:-300}" python3 - <<'PY' 2>&1 | grep -v -i "warn" | tail -40 | tee "$OUT/generate.log"
# vLLM's offline LLM on the harness's Qwen3-0.6B-shaped checkpoint, bf16, as TRL's colocate mode builds it
import time
from harness.experiment.spec import load_spec
from harness.experiment.models import checkpoint_dir
t = time.time()
path = str(checkpoint_dir(load_spec("harness/specs/bench.toml")))
print("checkpoint", path, f"{time.time() - t:.0f} s")
from vllm import LLM, SamplingParams
t = time.time()
llm = LLM(model=path, dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024, enforce_eager=True, seed=0)
print(f"LLM built: {time.time() - t:.1f} s")
params = SamplingParams(n=4, temperature=1.0, max_tokens=64, logprobs=0, seed=0)
t = time.time()
outs = llm.generate(["What is 12 + 30?", "Name a prime above 10."], params)
print(f"generated {sum(len(o.token_ids) for r in outs for o in r.outputs)} tokens in {time.time() - t:.2f} s")
o = outs[0].outputs[0]
print("first completion ids", o.token_ids[:12], "logprobs", [round(next(iter(d.values())).logprob, 4) for d in (o.logprobs or [])[:6]])
PY
  nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee -a "$OUT/generate.log"
  ;;
run)  # issue 41's checks in one process (tools/gpu_vllm_run.py), then the mismatch at the lesson's shape if time is left
  install
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import torch, transformers, trl, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'vllm', vllm.__version__)" 2>/dev/null | tee -a "$OUT/gpu.txt"
  timeout "${RUN_LIMIT:-420}" python3 tools/gpu_vllm_run.py "$OUT" > "$OUT/run_full.log" 2>&1
  echo "gpu_vllm_run: exit $?" | tee -a "$OUT/run_full.log"
  grep -v -i "warn" "$OUT/run_full.log" | grep -E "^==|^\||passed|FAILED|Error|parity|cell|mismatch|exit" | tail -80
  if [ "${BENCH_LIMIT:-0}" -gt 0 ]; then
    timeout "$BENCH_LIMIT" python3 tools/sampler_mismatch.py --spec harness/specs/bench.toml --rounds 1 \
      --samplers bfloat16,noise,vllm --json "$OUT/mismatch_bench.json" > "$OUT/mismatch_bench.log" 2>&1
    echo "bench mismatch: exit $?" >> "$OUT/mismatch_bench.log"; grep -E "^\||exit|Error" "$OUT/mismatch_bench.log" | tail -12
  fi
  ;;
mismatch)  # issue 48 item 2: vLLM's log-prob mismatch at the lesson's shape beside the stand-ins (SAMPLERS, noise@SCALE)
  install
  timeout "${BENCH_LIMIT:-300}" python3 tools/sampler_mismatch.py --spec harness/specs/bench.toml --rounds 1 \
    --samplers "${SAMPLERS:-bfloat16,noise,vllm}" --json "$OUT/mismatch_bench.json" > "$OUT/mismatch_bench.log" 2>&1
  echo "bench mismatch: exit $?" >> "$OUT/mismatch_bench.log"; grep -E "^\||exit|Error" "$OUT/mismatch_bench.log" | tail -12
  ;;
cap32)  # issue 48: the IS cells, a 10-step lockstep pair and a free-run cell on vLLM, one process capped to 31.8 GiB
  install
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  timeout "${RUN_LIMIT:-540}" python3 tools/gpu_vllm32.py "$OUT" > "$OUT/cap32_full.log" 2>&1
  echo "gpu_vllm32: exit $?" | tee -a "$OUT/cap32_full.log"
  grep -v -i "warn" "$OUT/cap32_full.log" | grep -E "^==|^\||parity|cell|Error|exit|memory" | tail -60
  ;;
esac
exit 0
