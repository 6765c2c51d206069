"""What GPU determinism costs: both loops with and without DETERMINISTIC, interleaved, in one process.

    python tools/determinism_bench.py [--steps 8]

Prints the median step time (steps 2..N) of each loop in each setting and the ratio. Meant for the GPU test
machine; the model is a mid-sized embedded Qwen3 (8 layers, hidden 512) so that kernels, not Python, dominate.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    from harness.runlog.log import read_run
    from harness.experiment.spec import load_spec
    from scratch_grpo.train import train as train_scratch
    from trl_runner.runner import train as train_trl

    root = Path(__file__).resolve().parent.parent
    base = ["DEVICE=\"cuda\"", "DTYPE=\"bfloat16\"", "GRADIENT_CHECKPOINTING=true", f"STEPS={args.steps}",
            "PROMPTS_PER_STEP=8", "GROUP_SIZE=8", "GRAD_ACCUM=4", "MAX_TOKENS=64", "model.layers=8", "model.hidden=512",
            "model.heads=8", "model.kv_heads=4", "model.intermediate=1536"]
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(2):
            for det in (False, True):
                for side, fn in (("scratch", train_scratch), ("trl", train_trl)):
                    spec = load_spec(root / "harness/specs/default.toml", base + [f"DETERMINISTIC={str(det).lower()}"])
                    out = Path(tmp) / f"{side}-{det}-{rep}"
                    fn(spec, out, progress=False)
                    walls = list(read_run(out)["wall_s"])[1:]
                    times.setdefault((side, det), []).extend(walls)
    print(f"{'loop':8s} {'deterministic':>14s} {'median step s':>14s}")
    for (side, det), walls in sorted(times.items()):
        print(f"{side:8s} {str(det):>14s} {statistics.median(walls):>14.4f}")
    for side in ("scratch", "trl"):
        print(f"{side}: deterministic / default = "
              f"{statistics.median(times[(side, True)]) / statistics.median(times[(side, False)]):.3f}")


if __name__ == "__main__":
    main()
