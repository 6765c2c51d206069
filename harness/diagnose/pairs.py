"""One pair of runs: two sides on one spec, then their comparison (lockstep or free).

The sides are `scratch` (the built-in loop), `trl` (TRL's GRPOTrainer) and `yours` (a user's loop, run through
`loop_runner`). Owns the order they run in. Lockstep: the scratch loop runs first and records every round's
rollouts (`RecordingSource`); TRL replays them (`ReplaySource`) and a user's loop reads them as
`rollouts.jsonl` (PARITY_ROLLOUTS); then `compare_runs`. Free: each side samples for itself, FREE_SEEDS seeds
each; then `compare_free`. The matrix and the attribution call `run_pair` for every cell and every re-run.
"""

from __future__ import annotations

from pathlib import Path

from harness.diagnose.compare import compare_runs
from harness.diagnose.freerun import compare_free
from harness.diagnose.preflight import apply_alignment

SIDES = ("scratch", "trl", "yours")


def _train(side: str, spec, run_dir: Path, progress: bool, rollouts=None, replay=None) -> None:
    """One side, one seed. `replay`: a ReplaySource (TRL in lockstep); `rollouts`: the loop's rollouts file."""
    if side == "scratch":
        from scratch_grpo.train import train

        train(spec, run_dir, rollout_source=replay, progress=progress)
    elif side == "trl" and spec.PROCESSES > 1:  # TRL under torchrun/accelerate, each process replaying its slice
        from trl_runner.launch import train_processes

        train_processes(spec, run_dir, rollouts if replay is not None else None, progress)
    elif side == "trl":
        from trl_runner.runner import train

        train(spec, run_dir, rollout_source=replay, progress=progress, lockstep=replay is not None)
    else:
        from loop_runner.run import train

        train(spec, run_dir, rollouts=rollouts, progress=progress)


def run_pair(spec, out_dir: Path, mode: str = "lockstep", progress: bool = False,
             sides: tuple[str, str] = ("scratch", "trl")) -> dict:
    """Both sides on `spec` into out_dir/<side>; returns the comparison of sides[0] with sides[1]."""
    from harness.experiment.models import checkpoint_dir, eos_token_ids, generation_config, load_tokenizer, resolve_device
    from harness.rollouts.lockstep import ROLLOUTS_FILE, RecordingSource, ReplaySource, write_loop_rollouts
    from scratch_grpo.train import train as train_scratch

    out_dir.mkdir(parents=True, exist_ok=True)
    if mode == "free":
        return run_free_pair(spec, out_dir, progress, sides=sides)
    ckpt = checkpoint_dir(spec)
    tok = load_tokenizer(ckpt)
    device = resolve_device(spec)
    eos = eos_token_ids(generation_config(ckpt), tok)  # no weights loaded just for this
    # the recorder: the scratch loop samples each round from its own weights (also when it is not compared)
    source = RecordingSource(spec, eos, tok.pad_token_id, device, out_dir / ROLLOUTS_FILE)
    train_scratch(spec, out_dir / "scratch", rollout_source=source, progress=progress)
    source.release()
    broken = []
    for side in sides:
        if side == "trl":
            replay = ReplaySource(source.records, fallback=RecordingSource(spec, eos, tok.pad_token_id, device))
            _train("trl", spec, out_dir / "trl", progress, rollouts=out_dir / ROLLOUTS_FILE, replay=replay)
            broken = replay.broken_rounds
        elif side == "yours":
            loop_rollouts = write_loop_rollouts(spec, source.records, out_dir / "loop_rollouts.jsonl")
            _train("yours", spec, out_dir / "yours", progress, rollouts=loop_rollouts)
    result = compare_sides(spec, out_dir / sides[0], out_dir / sides[1], "lockstep")
    if broken:
        result["notes"].append(f"lockstep broke at {len(broken)} round(s) (first: round {broken[0] + 1}): TRL asked "
                               "for prompts the scratch loop did not use, so it sampled them from its own weights")
    return result


def compare_sides(spec, a_dir: Path, b_dir: Path, mode: str) -> dict:
    """compare_runs, and for a user's loop: only the metrics both sides log are compared (the rest are listed as
    not compared), and the final weights it saved are held against the other side's at that step."""
    if "yours" not in (a_dir.name, b_dir.name):
        return compare_runs(a_dir, b_dir, mode=mode, dtype=spec.DTYPE)
    from harness.diagnose.compare import compare_frames, load_any_run, load_tolerances

    a, b = load_any_run(a_dir), load_any_run(b_dir)
    result = compare_frames(a, b, mode=mode, dtype=spec.DTYPE, tolerances=load_tolerances(), one_sided="not_compared")
    result["runs"] = [str(a_dir), str(b_dir)]
    not_compared = sorted(set(a.columns) ^ set(b.columns))
    if not_compared:
        result["notes"].append(f"not compared (logged by one side only): {', '.join(not_compared[:12])}"
                               + (" ..." if len(not_compared) > 12 else ""))
    yours, other = (a_dir, b_dir) if a_dir.name == "yours" else (b_dir, a_dir)
    from loop_runner.run import final_weights_distance

    found = final_weights_distance(yours, other, spec.SEED)
    if found is not None:
        step, dist = found
        limit = load_tolerances().get(mode, {}).get(spec.DTYPE, {}).get("param_rel_l2", {}).get("max", 1e-5)
        result["metrics"]["param_rel_l2"] = {"max_abs": dist, "step_max_abs": step, "max_rel": dist, "mean_delta": dist,
                                             "first_outside": step if dist > limit else None,
                                             "tolerance": {"max": limit}}
        result["notes"].append(f"final weights (step {step}): relative L2 distance {dist:.3g} (tolerance {limit:g})")
        if dist > limit and mode == "lockstep":
            if result["first_divergence"] is None or result["first_divergence"]["step"] > step:
                result["first_divergence"] = {"step": step, "metric": "param_rel_l2"}
            result["outside"] = sorted(set(result["outside"]) | {"param_rel_l2"})
    return result


def run_free_pair(spec, out_dir: Path, progress: bool = False, seeds: int | None = None,
                  sides: tuple[str, str] = ("scratch", "trl")) -> dict:
    """Both sides, `seeds` (default: the spec's FREE_SEEDS) seeds each (SEED, SEED+1, ...), each sampling for
    itself; then compare_free."""
    runs = {side: [] for side in sides}
    for i in range(seeds or spec.FREE_SEEDS):
        seeded = apply_alignment(spec, {"set": {"SEED": spec.SEED + i}})
        for side in sides:
            d = Path(out_dir) / side / f"seed-{spec.SEED + i}"
            _train(side, seeded, d, progress)
            runs[side].append(d)
    # a user's loop logs what it logs: metrics only one side has are listed, not counted as a divergence
    result = compare_free(runs[sides[0]], runs[sides[1]],
                          one_sided="not_compared" if "yours" in sides else "divergence")
    result["runs"] = {k: [str(p) for p in v] for k, v in runs.items()}
    return result
