"""Re-running in float32 what ran in bf16, shared by the float32 pair of your loop (precision.escalate_loop) and the
explanation's float32 search (explain.in_float32): the settings that make a spec float32, your loop again in
float32 on the cell's own rollouts (and whether it read DTYPE at all), and the float32 noise twin that gives such a
pair its tolerance."""

from __future__ import annotations

from pathlib import Path

FLOAT32 = {"DTYPE": "float32", "MASTER_WEIGHTS": "float32"}  # fp32 weights and arithmetic (torch leaves TF32 off)


def your_loop_in_float32(spec32, cell_dir: Path, root: Path, name: str = "yours"):
    """Your loop in float32 into root/name, on the cell's own loop rollouts: (its metric log, whether it logged
    exactly what its run in cell_dir/yours did, so that it does not read DTYPE). The second is None when nothing
    both log can tell: the step-1 loss is the same in any dtype (the ratio is 1 and the KL 0 there, so it is the
    advantages' mean), so one step needs grad_norm. LoopError when your loop fails."""
    from harness.diagnose.compare import load_any_run
    from harness.rollouts.lockstep import LOOP_ROLLOUTS_FILE
    from loop_runner.run import train as train_loop

    train_loop(spec32, root / name, rollouts=Path(cell_dir) / LOOP_ROLLOUTS_FILE, log=lambda *_: None)
    mine, before = load_any_run(root / name), load_any_run(Path(cell_dir) / "yours")
    steps = mine.index.intersection(before.index)
    cols = [c for c in ("grad_norm", "loss") if c in mine and c in before and (c != "loss" or len(steps) > 1)]
    return mine, (same_log(mine, before, cols) if cols else None)


def same_log(a, b, columns: list[str]) -> bool:
    """Two runs logged exactly the same values of `columns` at every step both logged."""
    steps = a.index.intersection(b.index)
    return bool(len(steps) and columns) and all(
        a.loc[steps, c].astype(float).equals(b.loc[steps, c].astype(float)) for c in columns)


def float32_twin(spec32, records, root: Path, plain: str = "scratch"):
    """The built-in loop on `records` in float32 (root/plain) and its noise twin (root/twin): their envelope,
    the tolerance of a float32 pair on those rollouts."""
    from harness.diagnose.pairs import twin_envelope
    from harness.rollouts.lockstep import ReplaySource
    from scratch_grpo.train import train as train_scratch

    for name, twin in ((plain, False), ("twin", True)):
        train_scratch(spec32, root / name, rollout_source=ReplaySource(records), progress=False, noise_twin=twin)
    return twin_envelope(root / plain, root / "twin")
