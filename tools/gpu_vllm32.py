"""Issue 48, item 1 on the GPU machine: TRL on vLLM as on the lesson's 32 GB card, in one process capped to it
(`bash tools/gpu_vllm.sh cap32`, after staging vLLM):

1. the IS cells at the lesson's shape (bench.toml: Qwen3-0.6B's shapes, random weights), lockstep, 6 steps, 128 tokens;
2. a 10-step lockstep pair at the lesson's config (512 tokens);
3. a free-run `matched` cell, 2 seeds a side, 4 steps, 128 tokens: TRL's generation on the same engine;
4. `lockstep_static`: the pair of 2. with `--tolerance static` (no noise twin), to see what the calibration costs.

Every part runs with GPU_MEMORY_GB (31.8 GiB, an RTX 5090: torch's allocator capped to it, vLLM's 0.30 share taken
of it), sampler.vllm_engine = "shared" (one engine for every side, TRL's free-run generation included) and
sampler.vllm_sleep (TRL's vllm_enable_sleep_mode). A thread reads the whole card's memory in use
(`nvidia-smi`, every process) every 0.2 s; each part's peak is printed beside torch's own peak. Each part's failure
is printed without stopping the next. After each part, where its time went: each run's steps from its metrics
log (`wall_s`, `gen_s`), and the rest (loads, set-up, comparison, report) as what is left of the part's wall; and
the vLLM engine's own seconds by phase (samplers.VLLM_SECONDS: building it, waking it, pushing the weights,
generating, putting it to sleep).
Usage: python3 tools/gpu_vllm32.py OUT_DIR; PARTS=is,lockstep,free (also lockstep_static, lockstep_again);
GIB=31.8; SLEEP=true; ENGINE=shared (or per_side); DRY=1: the same parts on CPU with the emulated sampler (a check of
this script, not of vLLM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from gpu_vllm_run import part  # noqa: E402 - the path above first

DRY = os.environ.get("DRY") == "1"
GIB = os.environ.get("GIB", "31.8")
SETS = ['sampler.kind="vllm"', f'sampler.vllm_engine="{os.environ.get("ENGINE", "shared")}"', f"GPU_MEMORY_GB={GIB}",
        f"sampler.vllm_sleep={os.environ.get('SLEEP', 'true')}"]
SPEC = ROOT / "harness/specs/bench.toml"
if DRY:  # the embedded default on CPU, the emulated sampler in vLLM's place
    SETS, SPEC = ['sampler.kind="emulated"'], ROOT / "harness/specs/default.toml"
PARTS = os.environ.get("PARTS", "is,lockstep,free").split(",")
RUNS = {
    "is": ["--cells", "is=sequence_mask,matched:is=sequence_mask", "--steps", "6", "--set", "MAX_TOKENS=128"],
    "lockstep": ["--matrix", "none", "--steps", "10"],
    "free": ["--mode", "free", "--cells", "matched", "--steps", "4", "--set", "MAX_TOKENS=128", "--set", "FREE_SEEDS=2"],
    "lockstep_static": ["--matrix", "none", "--steps", "10", "--tolerance", "static"],
}
VLLM_PHASES = ("build", "wake", "push", "generate", "sleep")  # samplers.VLLM_SECONDS: the engine's time, by phase
RUNS["lockstep_again"] = RUNS["lockstep"]  # the same pair once more in the process: everything built, caches warm


def breakdown(name: str, folder: Path, wall: float) -> list[str]:
    """Where a part's wall went: per run (every cell's metrics.jsonl under its folder) the steps' sum, step 1, the median
    of the later steps and their generation; the rest of the part's wall is loads, set-up, comparison and report."""
    import statistics

    from harness.runlog.log import read_metrics

    lines, spent = [], 0.0
    for log in sorted(folder.rglob("metrics.jsonl")):
        if "shared-scratch" in log.parts:  # the scratch store: each cell holds a copy of the run it took from it
            continue
        rows, _problems = read_metrics(log)
        walls = [float(r.get("wall_s") or 0.0) for r in rows]
        gens = [float(r.get("gen_s") or 0.0) for r in rows]
        if not walls:
            continue
        spent += sum(walls)
        later = walls[1:] or walls
        lines.append(f"| {name} | {log.parent.relative_to(folder)} | {len(walls)} | {sum(walls):.1f} | {walls[0]:.1f} "
                     f"| {statistics.median(later):.2f} | {statistics.median(gens[1:] or gens):.2f} |")
    lines.append(f"| {name} | (the rest: loads, set-up, comparison, report) | | {wall - spent:.1f} | | | |")
    return lines


class CardPeak:
    """The card's memory in use (MiB, every process, as nvidia-smi reads it), its peak since the last `take()`."""

    def __init__(self):
        self.peak, self.now, self._stop = 0, 0, False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while not self._stop:
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout.split()
                self.now = int(out[0]) if out else 0
                self.peak = max(self.peak, self.now)
            except (OSError, subprocess.SubprocessError, ValueError):
                return
            time.sleep(0.2)

    def take(self) -> int:
        peak, self.peak = self.peak, self.now
        return peak


def main(out: Path) -> int:
    import torch

    from harness.cli import main as cli
    from harness.rollouts.samplers import VLLM_SECONDS

    out.mkdir(parents=True, exist_ok=True)
    card = CardPeak()
    log: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "sets": SETS}
    rows, times, engine = [], [], []
    for name in PARTS:
        folder = Path(f"/tmp/v32{name}")
        args = ["parity", "--spec", str(SPEC), "--out", str(folder), "--force", *RUNS[name],
                *[a for s in SETS for a in ("--set", s)]]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        rc = part(f"{name}: {' '.join(args[1:])}", lambda: cli(args), log)
        torch_peak = torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0
        rows.append((name, rc, log[next(k for k in reversed(log) if k.startswith(name))]["s"], card.take() / 1024,
                     torch_peak))
        for kind in ("verdict.json", "summary.txt"):
            if (folder / kind).exists():
                (out / f"{name}_{kind}").write_bytes((folder / kind).read_bytes())
        times += breakdown(name, folder, rows[-1][2])
        engine.append(f"| {name} | " + " | ".join(f"{VLLM_SECONDS.pop(k, 0.0):.1f}" for k in VLLM_PHASES) + " |")
        print("\n".join(times[-4:] + engine[-1:]), flush=True)
    card._stop = True
    table = ["| part | exit | s | card peak (GiB, nvidia-smi) | torch reserved peak (GiB) |", "|---|---|---|---|---|"]
    table += [f"| {n} | {rc} | {s} | {c:.1f} | {t:.1f} |" for n, rc, s, c, t in rows]
    table += ["", "| part | run | steps | steps' s | step 1 s | later steps, median s | their generation, median s |",
              "|---|---|---|---|---|---|---|", *times,
              "", "| part | " + " | ".join(f"vLLM {k} s" for k in VLLM_PHASES) + " |",
              "|---|" + "---|" * len(VLLM_PHASES), *engine]
    print("\n".join(table), flush=True)
    (out / "cap32.md").write_text("\n".join(table) + "\n")
    (out / "cap32.json").write_text(json.dumps({**log, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_out")))
