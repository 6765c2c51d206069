"""Issue 41 on the GPU machine, in one process so that every part shares one vLLM engine (tools/gpu_vllm.sh run):

1. tests/test_vllm.py's GPU tests, called as functions (a seeded round's draws repeat whatever the engine drew
   before; a lockstep pair with the IS correction on both sides at parity);
2. the log-prob mismatch of vLLM and of the harness's own samplers against the trainer, on the same prompts and
   weights (tools/sampler_mismatch.py);
3. the default matrix with TRL on vLLM: `harness parity` on the embedded default, bf16, `sampler.kind = "vllm"`.

Each part is timed and its failure printed without stopping the next. Usage: python3 tools/gpu_vllm_run.py OUT_DIR;
PARTS=tests,mismatch (of tests, mismatch, matrix) runs only those.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]

# the embedded default on the GPU: head_dim 64 (vLLM's attention kernels take 32 and up; the default's is 16)
SETS = ['DEVICE="cuda"', 'DTYPE="bfloat16"', 'sampler.kind="vllm"', "model.head_dim=64"]
# DRY=1: the same parts on CPU with the emulated sampler in vLLM's place (a check of this script, not of vLLM)
DRY = os.environ.get("DRY") == "1"
if DRY:
    SETS = ['sampler.kind="emulated"', "model.head_dim=64"]
PARTS = os.environ.get("PARTS", "tests,mismatch,matrix").split(",")


def part(name: str, fn, log: dict):
    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        value = fn()
        log[name] = {"ok": True, "s": round(time.perf_counter() - t0, 1)}
        print(f"== {name}: ok ({log[name]['s']} s)", flush=True)
        return value
    except Exception as e:  # noqa: BLE001 - the next part runs whatever this one did
        log[name] = {"ok": False, "s": round(time.perf_counter() - t0, 1), "error": f"{type(e).__name__}: {e}"}
        traceback.print_exc()
        print(f"== {name}: FAILED ({log[name]['s']} s): {type(e).__name__}: {e}", flush=True)
        return None


def main(out: Path) -> int:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    log: dict = {}
    import test_vllm

    if not DRY and "tests" in PARTS:
        part("test: draws repeat per seeded round",
             test_vllm.test_vllm_draws_repeat_for_a_seeded_round_whatever_the_engine_drew_before, log)
        part("test: lockstep pair, IS on both sides",
             lambda: test_vllm.test_vllm_lockstep_pair_with_the_is_correction_on_both_sides_is_at_parity(
                 Path(tempfile.mkdtemp())), log)

    def mismatch():
        import sampler_mismatch

        from harness.experiment.spec import load_spec

        # the emulated samplers' decoder uncompiled (GENERATION "static": no Dynamo trace to wait for; the same
        # weights and arithmetic as the compiled step, whose fused kernels may round differently)
        spec = load_spec(ROOT / "harness/specs/default.toml", [*SETS, "STEPS=10", 'GENERATION="static"'])
        # ("policy" left out: on a GPU the decoder's bf16 copy is what "bfloat16" measures)
        results = sampler_mismatch.measure(spec, ["bfloat16", "noise"] + ([] if DRY else ["vllm"]), rounds=8)
        table = sampler_mismatch.table(results, spec)
        print(table, flush=True)
        (out / "mismatch_default.json").write_text(json.dumps(results, indent=1))
        (out / "mismatch_default.md").write_text(table + "\n")

    if "mismatch" in PARTS:
        part("mismatch: embedded default", mismatch, log)

    def matrix():
        from harness.cli import main as cli

        rc = cli(["parity", "--spec", str(ROOT / "harness/specs/default.toml"), "--steps", "10",
                  "--out", "/tmp/vmatrix", "--force", *[a for s in SETS for a in ("--set", s)]])
        for name in ("verdict.json", "report.html"):
            src = Path("/tmp/vmatrix") / name
            if src.exists():
                (out / f"matrix_{name}").write_bytes(src.read_bytes())
        return rc

    if "matrix" in PARTS:
        log["matrix_rc"] = part("matrix: default, TRL on vLLM, 10 steps, bf16", matrix, log)
    log["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2) if torch.cuda.is_available() else None
    (out / "run.json").write_text(json.dumps(log, indent=1))
    print(json.dumps(log, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_out")))
