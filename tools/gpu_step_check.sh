#!/usr/bin/env bash
# The scratch loop's unified step (GRPO_PARITY_SCRATCH_STEP=unified: prepare/optimizer_step over a gathered batch, the
# path a loop's selection replays through) against the round loop a GPU run last checked, on the GPU at the lesson's
# config (harness/specs/bench.toml, bf16): the 10-step lockstep pair once per step, then the two scratch runs' metric
# logs side by side. Wheels from ../shared/tools/device-wheels.sh in .whl (carried).
#   bash tools/gpu_step_check.sh        # logs and verdicts in $OUT
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 GRPO_PARITY_CACHE=/tmp/gpc PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
[ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
STEPS=${STEPS:-10}
for step in ${VARIANTS:-round unified}; do
  t0=$(date +%s)
  flag=""; [ "$step" = unified ] && flag=unified
  GRPO_PARITY_SCRATCH_STEP=$flag timeout "${LIMIT:-250}" python3 -m harness parity --spec harness/specs/bench.toml \
    --matrix none --steps "$STEPS" --out "/tmp/step-$step" --force 2>&1 | grep -v -i warn | tail -8 | tee "$OUT/step-$step.log"
  echo "wall: $(( $(date +%s) - t0 )) s (scratch step: $step)" | tee -a "$OUT/step-$step.log"
  cp "/tmp/step-$step/verdict.json" "$OUT/step-$step.verdict.json" 2>/dev/null
  cp "/tmp/step-$step/as-given/scratch/metrics.jsonl" "$OUT/step-$step.scratch.jsonl" 2>/dev/null
done
python3 - "$OUT" <<'PY' | tee "$OUT/step-compare.txt"
# every numeric field of the two scratch runs, step by step: the largest difference, and the verdicts against TRL
import json, math, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for step in ("round", "unified"):
    p = out / f"step-{step}.scratch.jsonl"
    rows[step] = [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
    v = out / f"step-{step}.verdict.json"
    if v.exists():
        cell = json.loads(v.read_text())["cells"][0]
        worst = max(((m.get("ratio_to_bound") or 0.0, k) for k, m in cell["metrics"].items()), default=(0.0, "-"))
        print(f"{step}: verdict {cell['verdict']} against TRL; worst metric {worst[1]} at {worst[0]:.3g} of its bound")
a, b = rows["round"], rows["unified"]
print(f"steps: round {len(a)}, unified {len(b)}")
worst = {}
for x, y in zip(a, b):
    for k, u in x.items():
        w = y.get(k)
        if isinstance(u, (int, float)) and isinstance(w, (int, float)) and k != "step":
            d = abs(u - w) if math.isfinite(u) and math.isfinite(w) else (0.0 if str(u) == str(w) else math.inf)
            if d > worst.get(k, (-1, 0))[0]:
                worst[k] = (d, x["step"])
same = [k for k, (d, _) in worst.items() if d == 0]
print(f"identical in every step: {len(same)} of {len(worst)} fields")
for k, (d, s) in sorted(worst.items(), key=lambda kv: -kv[1][0]):
    if d:
        print(f"  {k}: max |round - unified| {d:.3g} (step {s})")
PY
exit 0
