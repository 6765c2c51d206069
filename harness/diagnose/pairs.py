"""One pair of runs: both sides on one spec, then their comparison (lockstep or free).

Owns the order the sides run in. Lockstep: the scratch loop runs first and records every round's
rollouts (`RecordingSource`), TRL replays them (`ReplaySource`); then `compare_runs`. Free: each side
samples for itself, FREE_SEEDS seeds each; then `compare_free`. The matrix and the attribution call
`run_pair` for every cell and every re-run.
"""

from __future__ import annotations

from pathlib import Path

from harness.diagnose.compare import compare_runs
from harness.diagnose.freerun import compare_free
from harness.diagnose.preflight import apply_alignment


def run_pair(spec, out_dir: Path, mode: str = "lockstep", progress: bool = False) -> dict:
    """Both loops on `spec` into out_dir/{scratch,trl}; returns the comparison."""
    from harness.experiment.models import checkpoint_dir, eos_token_ids, generation_config, load_tokenizer, resolve_device
    from harness.rollouts.lockstep import ROLLOUTS_FILE, RecordingSource, ReplaySource
    from scratch_grpo.train import train as train_scratch
    from trl_runner.runner import train as train_trl

    out_dir.mkdir(parents=True, exist_ok=True)
    if mode == "free":
        return run_free_pair(spec, out_dir, progress)
    ckpt = checkpoint_dir(spec)
    tok = load_tokenizer(ckpt)
    device = resolve_device(spec)
    eos = eos_token_ids(generation_config(ckpt), tok)  # no weights loaded just for this
    source = RecordingSource(spec, eos, tok.pad_token_id, device, out_dir / ROLLOUTS_FILE)
    train_scratch(spec, out_dir / "scratch", rollout_source=source, progress=progress)
    source.release()
    broken = []
    if spec.PROCESSES > 1:  # TRL under torchrun/accelerate, each process replaying its slice of the rollouts
        from trl_runner.launch import train_processes

        train_processes(spec, out_dir / "trl", out_dir / ROLLOUTS_FILE, progress)
    else:
        replay = ReplaySource(source.records, fallback=RecordingSource(spec, eos, tok.pad_token_id, device))
        train_trl(spec, out_dir / "trl", rollout_source=replay, progress=progress, lockstep=True)
        broken = replay.broken_rounds
    result = compare_runs(out_dir / "scratch", out_dir / "trl", mode="lockstep", dtype=spec.DTYPE)
    if broken:
        result["notes"].append(f"lockstep broke at {len(broken)} round(s) (first: round {broken[0] + 1}): TRL asked "
                               "for prompts the scratch loop did not use, so it sampled them from its own weights")
    return result


def run_free_pair(spec, out_dir: Path, progress: bool = False, seeds: int | None = None) -> dict:
    """Both loops, `seeds` (default: the spec's FREE_SEEDS) seeds each (SEED, SEED+1, ...), each sampling for
    itself; then compare_free."""
    from scratch_grpo.train import train as train_scratch
    from trl_runner.runner import train as train_trl

    runs = {"scratch": [], "trl": []}
    for i in range(seeds or spec.FREE_SEEDS):
        seeded = apply_alignment(spec, {"set": {"SEED": spec.SEED + i}})
        for side, fn in (("scratch", train_scratch), ("trl", train_trl)):
            d = Path(out_dir) / side / f"seed-{spec.SEED + i}"
            if side == "trl" and spec.PROCESSES > 1:
                from trl_runner.launch import train_processes

                train_processes(seeded, d, None, progress)
            else:
                fn(seeded, d, progress=progress)
            runs[side].append(d)
    result = compare_free(runs["scratch"], runs["trl"])
    result["runs"] = {k: [str(p) for p in v] for k, v in runs.items()}
    return result
