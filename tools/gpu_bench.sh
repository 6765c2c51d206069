#!/usr/bin/env bash
# The GPU run of the benchmark issue, one command on the GPU test machine (trl/datasets carried as wheels in
# .whl, see ../shared/tools/device-wheels.sh): the decoder's GPU tests, the decode benchmark, the training-pass
# profile, a 10-step lockstep parity check at the lesson's config (bf16), then `harness bench` at that config.
# Each part has its own time limit; logs in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 GRPO_PARITY_CACHE=/tmp/gpc PYTHONUNBUFFERED=1
export TRL_EXPERIMENTAL_SILENCE=1
# The GPU test machine sets PYTHONDONTWRITEBYTECODE=1, so every process there compiled ~2,600 modules from source
# (imports 16-20 s against 8 s with .pyc files, measured 2026-12-06). A pip install writes .pyc files; so do these
# two lines, under /tmp/pyc, so that the timings are what a user's machine shows.
export PYTHONPYCACHEPREFIX=/tmp/pyc
python3 -m compileall -q -j 0 "$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')" /tmp/site harness scratch_grpo trl_runner reports >/dev/null 2>&1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)" | tee -a "$OUT/gpu.txt"
PARTS=${PARTS:-"tests decode profile lockstep bench"}  # which parts to run, in this order
has() { [[ " $PARTS " == *" $1 "* ]]; }
STEPS_LOCK=${STEPS_LOCK:-10}
STEPS_BENCH=${STEPS_BENCH:-5}
has tests && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_core.py tests/test_fastgen.py tests/test_gpu.py -k "gpu" 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
# build the 0.6B-shaped checkpoint once (the other parts use it)
[[ "$PARTS" == *decode* || "$PARTS" == *profile* || "$PARTS" == *lockstep* || "$PARTS" == *bench* ]] && timeout 120 python3 -c "from harness.experiment.spec import load_spec; from harness.experiment.models import checkpoint_dir; import time; t=time.time(); print(checkpoint_dir(load_spec('harness/specs/bench.toml')), f'{time.time()-t:.0f} s')" 2>&1 | tail -2 | tee "$OUT/build.log"
has decode && timeout "${DECODE_LIMIT:-300}" python3 tools/decode_bench.py --long 512 2>&1 | grep -v -i "futurewarn\|warnings.warn" | tee "$OUT/decode.log"
has profile && timeout 200 python3 tools/train_profile.py ${PROFILE_ARGS:-} 2>&1 | grep -v -i "futurewarn\|warnings.warn" | tee "$OUT/train_profile.log"
# LOCK_RUNS=2: the same lockstep pair again in a new process, its compiled kernels read back from the on-disk
# cache the first run filled (GRPO_PARITY_CACHE/inductor, the harness default): the second run's wall is what a user sees
# from then on
for run in $(seq 1 "${LOCK_RUNS:-1}"); do
  has lockstep || break
  t0=$(date +%s)
  # each line stamped with the seconds since the command started: where the wall goes before and after the cell
  timeout 260 python3 -m harness parity --spec harness/specs/bench.toml --matrix none --steps "$STEPS_LOCK" --out "/tmp/lock$run" \
    --verbose 2>&1 | grep --line-buffered -v -i warn | python3 -u -c "import sys, time; t = $t0; [print(f'{time.time() - t:7.1f} {l}', end='') for l in sys.stdin]" \
    > "$OUT/lockstep$run.log"
  grep -E "^ *[0-9.]+ (spec |\[cell|    as-given|parity |wrote|report)" "$OUT/lockstep$run.log"
  echo "lockstep run $run wall: $(( $(date +%s) - t0 )) s (compile caches: harness $(du -sh /tmp/gpc/inductor 2>/dev/null | cut -f1), torch default $(du -sh /tmp/torchinductor_$(whoami) 2>/dev/null | cut -f1))" \
    | tee -a "$OUT/lockstep$run.log"
done
cp /tmp/lock1/verdict.json "$OUT/lockstep_verdict.json" 2>/dev/null; cp /tmp/lock1/report.html "$OUT/lockstep_report.html" 2>/dev/null
has bench && timeout "${BENCH_LIMIT:-330}" python3 -m harness bench --spec harness/specs/bench.toml --steps "$STEPS_BENCH" --out /tmp/bench \
  2>&1 | grep -v -i warn | tail -30 | tee "$OUT/bench.log"
cp /tmp/bench/bench.json /tmp/bench/bench.md "$OUT/" 2>/dev/null
# every run's metric log and manifest, in one file (few files come back from the device)
logs=$(cd /tmp && ls -d lock*/*/*/metrics.jsonl lock*/*/*/manifest.json bench/*-*/metrics.jsonl bench/*-*/manifest.json 2>/dev/null)
[ -n "$logs" ] && (cd /tmp && tar czf "$OUT/logs.tgz" $logs)
true
