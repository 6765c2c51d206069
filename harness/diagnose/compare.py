"""The comparator: two metric logs in, per-metric differences and the first divergence out.

`python -m harness compare RUN_A RUN_B --out DIR` works on any two runs the harness wrote, and on a
TRL `trainer_state.json` (its `log_history`) produced elsewhere. Steps are aligned by number; per
metric it reports the max |delta| and max relative delta with the step of each, the mean delta
(one-sided drift, as TRL's tests/invariant checks) and the first step outside tolerance.
Tolerances come from a TOML file (default: harness/diagnose/tolerances.toml): lockstep defaults are
torch.testing's per-dtype rtol/atol.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
from pandas.api.types import is_numeric_dtype

DEFAULT_TOLERANCES = Path(__file__).with_name("tolerances.toml")
# when several metrics leave tolerance at the same step, report them in the lesson's order
PRIORITY = ("prompts_in_step", "sequences_in_step", "prompt_ids_hash", "epoch", "tokens_in_step", "num_tokens",
            "reward", "reward_std", "loss", "grad_norm", "completions/mean_length", "entropy", "learning_rate",
            "sampling/importance_sampling_ratio/mean", "param_rel_l2")


class CompareInputError(ValueError):
    """A run that cannot be compared; the message says which and why."""


def load_tolerances(path: str | Path | None = None) -> dict:
    path = Path(path) if path else DEFAULT_TOLERANCES
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CompareInputError(f"tolerance file {path}: {e}") from None


def load_any_run(path: str | Path) -> pd.DataFrame:
    """A harness run folder, a metrics.jsonl, or a TRL trainer_state.json (or its folder)."""
    from harness.runlog.log import METRICS_FILE, read_run

    path = Path(path)
    if path.is_dir() and (path / METRICS_FILE).exists():
        df = read_run(path)
    elif path.is_file() and path.suffix == ".jsonl":
        df = read_run(path.parent) if path.name == METRICS_FILE else None
        if df is None:
            raise CompareInputError(f"{path}: expected a harness metrics.jsonl")
    else:
        state = path / "trainer_state.json" if path.is_dir() else path
        if not state.exists():
            raise CompareInputError(f"{path}: neither a harness run (metrics.jsonl) nor a TRL trainer_state.json")
        try:
            history = json.loads(state.read_text())["log_history"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CompareInputError(f"{state}: not a trainer_state.json with log_history ({e})") from None
        rows = [h for h in history if "loss" in h and "step" in h]
        df = pd.DataFrame(rows)
        if not df.empty:
            df = df.rename(columns={"epoch": "trl/epoch"}).set_index("step", drop=False).sort_index()
        df.attrs["manifest"] = {"side": "trl", "source": str(state)}
        df.attrs["problems"] = []
    if df.empty:
        raise CompareInputError(f"{path}: the run has no logged steps")
    return df


def tolerance_for(tol: dict, mode: str, dtype: str, metric: str) -> dict:
    """A metric's {rtol, atol} from a tolerance table: exact metrics 0/0, else its own entry or the default."""
    table = tol.get(mode, {}).get(dtype, {})
    if metric in tol.get("exact", {}).get("metrics", []):
        return {"rtol": 0.0, "atol": 0.0}
    return table.get(metric, table.get("default", {"rtol": 1.3e-6, "atol": 1e-5}))


def compare_frames(a: pd.DataFrame, b: pd.DataFrame, *, mode: str = "lockstep", dtype: str = "float32",
                   tolerances: dict | None = None, param_rel_l2: list[float] | None = None) -> dict:
    """Per-metric differences of two runs and the first step where any leaves tolerance."""
    tol = tolerances or load_tolerances()
    procs = [int((df.attrs.get("manifest") or {}).get("processes", 1)) for df in (a, b)]
    not_decisive = set(tol.get("aggregation", {}).get("per_micro_step", [])) if procs[0] != procs[1] else set()
    ignore = set(tol.get("ignore", {}).get("metrics", [])) | {"step"}
    steps = a.index.intersection(b.index)
    notes = []
    if len(a) != len(b):
        notes.append(f"runs of different lengths: {len(a)} and {len(b)} steps; compared on the {len(steps)} shared")
    by_design = tuple(tol.get("ignore", {}).get("one_sided_prefixes", []))
    only_a = sorted(c for c in set(a.columns) - set(b.columns) - ignore if not c.startswith(by_design))
    only_b = sorted(c for c in set(b.columns) - set(a.columns) - ignore if not c.startswith(by_design))
    metrics, failures = {}, []
    # a metric one side logs and the other never does (e.g. TRL's IS ratios with the correction on one side only)
    for df, names in ((a, only_a), (b, only_b)):
        for name in names:
            logged = df[name].dropna()
            failures.append((int(logged.index[0]) if len(logged) else int(df.index[0]), name))
    for col in sorted((set(a.columns) & set(b.columns)) - ignore):
        x, y = a.loc[steps, col], b.loc[steps, col]
        if col == "prompt_ids_hash" or not (is_numeric_dtype(x) and is_numeric_dtype(y)):
            same = x.astype(str) == y.astype(str)
            bad = [int(s) for s in steps[~same.to_numpy()]]
            metrics[col] = {"max_abs": 0.0 if not bad else math.inf, "max_rel": 0.0 if not bad else math.inf,
                            "mean_delta": 0.0, "step_max_abs": bad[0] if bad else None, "first_outside": bad[0]
                            if bad else None, "tolerance": "equal"}
            if bad:
                failures.append((bad[0], col))
            continue
        x, y = pd.to_numeric(x, errors="coerce").astype(float), pd.to_numeric(y, errors="coerce").astype(float)
        both = x.notna() & y.notna()
        if not both.any():
            continue
        d = (x - y).abs()[both]
        rel = (d / y.abs()[both]).replace([np.inf], np.nan).where(d > 0, 0.0)
        t = tolerance_for(tol, mode, dtype, col)
        outside = d > t.get("atol", 0.0) + t.get("rtol", 0.0) * y.abs()[both]
        # a metric missing on one side at a step where the other has a number is a divergence too
        one_sided = (x.isna() ^ y.isna())
        bad_steps = sorted([int(s) for s in d.index[outside.to_numpy()]] +
                           [int(s) for s in steps[one_sided.to_numpy()]])
        metrics[col] = {
            "max_abs": float(d.max()), "step_max_abs": int(d.idxmax()),
            "max_rel": float(rel.max()) if rel.notna().any() else 0.0,
            "step_max_rel": int(rel.idxmax()) if rel.notna().any() and rel.max() > 0 else None,
            "mean_delta": float((x - y)[both].mean()),
            "first_outside": bad_steps[0] if bad_steps else None, "tolerance": t,
        }
        if bad_steps and col in not_decisive:
            metrics[col]["decisive"] = False
        elif bad_steps:
            failures.append((bad_steps[0], col))
    if not_decisive:
        notes.append(f"{procs[0]} vs {procs[1]} processes: {', '.join(sorted(not_decisive & set(metrics)))} are "
                     "averaged per micro-step across processes on one side and per micro-batch on the other; "
                     "reported, not decisive")
    if param_rel_l2 is not None:
        limit = tol.get(mode, {}).get(dtype, {}).get("param_rel_l2", {}).get("max", 1e-5)
        arr = np.asarray(param_rel_l2, dtype=float)
        over = np.nonzero(arr > limit)[0]
        metrics["param_rel_l2"] = {"max_abs": float(arr.max()), "step_max_abs": int(arr.argmax()) + 1,
                                   "max_rel": float(arr.max()), "mean_delta": float(arr.mean()),
                                   "first_outside": int(over[0]) + 1 if len(over) else None,
                                   "tolerance": {"max": limit}}
        if len(over):
            failures.append((int(over[0]) + 1, "param_rel_l2"))
    rank = {m: i for i, m in enumerate(PRIORITY)}
    failures.sort(key=lambda f: (f[0], rank.get(f[1], len(rank)), f[1]))
    first = {"step": failures[0][0], "metric": failures[0][1]} if failures else None
    return {"mode": mode, "dtype": dtype, "steps": [len(a), len(b)], "first_divergence": first,
            "outside": sorted({m for _, m in failures}), "only_in_a": only_a, "only_in_b": only_b,
            "metrics": metrics, "notes": notes + [p for p in a.attrs.get("problems", []) + b.attrs.get("problems", [])]}


def compare_runs(run_a, run_b, *, mode: str = "lockstep", dtype: str | None = None,
                 tolerance_file: str | Path | None = None) -> dict:
    from harness.runlog.params import relative_l2

    a, b = load_any_run(run_a), load_any_run(run_b)
    if dtype is None:
        dtype = (a.attrs.get("manifest", {}).get("spec") or {}).get("DTYPE", "float32")
    rel = relative_l2(run_a, run_b) if Path(run_a).is_dir() and Path(run_b).is_dir() else None
    out = compare_frames(a, b, mode=mode, dtype=dtype, tolerances=load_tolerances(tolerance_file), param_rel_l2=rel)
    out["runs"] = [str(run_a), str(run_b)]
    return out


def format_comparison(result: dict, names=("A", "B"), top: int = 15) -> str:
    lines = []
    fd = result["first_divergence"]
    lines.append(f"verdict: {'parity' if fd is None else 'diverged'} ({result['mode']}, {result['dtype']}; "
                 f"{result['steps'][0]} vs {result['steps'][1]} steps)")
    if fd:
        lines.append(f"first divergence: step {fd['step']}, {fd['metric']}")
    for n in result["notes"]:
        lines.append(f"note: {n}")
    if result["only_in_a"] or result["only_in_b"]:
        lines.append(f"only in {names[0]}: {', '.join(result['only_in_a']) or '-'}")
        lines.append(f"only in {names[1]}: {', '.join(result['only_in_b']) or '-'}")
    lines.append(f"{'metric':42s} {'max |delta|':>12s} {'at step':>8s} {'max rel':>10s} {'mean delta':>12s} "
                 f"{'first outside':>14s}")
    ordered = sorted(result["metrics"].items(), key=lambda kv: (kv[1]["first_outside"] is None,
                                                                 kv[1]["first_outside"] or 0, kv[0]))
    for name, m in ordered[:top] if top else ordered:
        fo = m["first_outside"]
        lines.append(f"{name:42s} {m['max_abs']:>12.3g} {str(m.get('step_max_abs') or '-'):>8s} "
                     f"{m['max_rel']:>10.3g} {m['mean_delta']:>12.3g} {str(fo) if fo else '-':>14s}")
    return "\n".join(lines)
