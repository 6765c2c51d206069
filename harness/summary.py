"""A plain-text side-by-side of two runs' metric logs (the comparator and HTML report build on this)."""

from __future__ import annotations

import math
from pathlib import Path

from harness.runlog import TIMING_FIELDS, read_run

KEY_METRICS = ("loss", "grad_norm", "entropy", "reward", "reward_std", "completions/mean_length", "learning_rate",
               "clip_ratio/region_mean", "kl", "sampling/importance_sampling_ratio/mean")
HARNESS_FIELDS = ("prompts_in_step", "sequences_in_step", "tokens_in_step", "prompt_ids_hash", "epoch")


def metric_deltas(a, b) -> list[dict]:
    """Per shared numeric metric: max |delta| and max relative delta with their steps, and the mean delta."""
    steps = a.index.intersection(b.index)
    out = []
    for col in [c for c in a.columns if c in b.columns and c != "step" and c not in TIMING_FIELDS]:
        if col == "prompt_ids_hash":
            same = (a.loc[steps, col] == b.loc[steps, col])
            first = None if same.all() else int(same[~same].index[0])
            out.append({"metric": col, "max_abs": 0.0 if first is None else math.inf, "max_rel": 0.0 if first is None
                        else math.inf, "step_abs": first, "step_rel": first, "mean_delta": 0.0})
            continue
        x = a.loc[steps, col].astype(float)
        y = b.loc[steps, col].astype(float)
        d = (x - y).abs()
        if d.dropna().empty:
            continue
        rel = d / y.abs().where(y.abs() > 0, other=math.nan)
        rel = rel.where(d > 0, other=0.0)
        out.append({"metric": col, "max_abs": float(d.max()), "step_abs": int(d.idxmax()),
                    "max_rel": float(rel.max()) if not rel.dropna().empty else 0.0,
                    "step_rel": int(rel.idxmax()) if not rel.dropna().empty else None,
                    "mean_delta": float((x - y).mean())})
    return out


def side_by_side(dir_a: str | Path, dir_b: str | Path, timings: dict | None = None, names=("scratch", "trl")) -> str:
    a, b = read_run(dir_a), read_run(dir_b)
    deltas = {d["metric"]: d for d in metric_deltas(a, b)}
    lines = []
    mode = a.attrs["manifest"].get("rollouts", "own")
    lines.append(f"{names[0]} vs {names[1]}: {len(a)} and {len(b)} steps; rollouts: "
                 f"{'shared (lockstep)' if 'lockstep' in mode else 'each its own (free run)'}")
    if timings:
        lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    lines.append("")
    lines.append(f"{'metric':34s} {names[0] + ' (last)':>16s} {names[1] + ' (last)':>16s} {'max |delta|':>12s} "
                 f"{'max rel':>10s} {'at step':>8s}")
    for m in (*KEY_METRICS, *HARNESS_FIELDS):
        if m not in deltas:
            continue
        d = deltas[m]
        last_a, last_b = a[m].iloc[-1], b[m].iloc[-1]
        fmt = (lambda v: f"{v:>16.6g}") if m != "prompt_ids_hash" else (lambda v: f"{str(v):>16s}")
        lines.append(f"{m:34s} {fmt(last_a)} {fmt(last_b)} {d['max_abs']:>12.3g} {d['max_rel']:>10.3g} "
                     f"{str(d['step_rel'] if d['step_rel'] is not None and d['max_abs'] > 0 else '-'):>8s}")
    return "\n".join(lines)
