"""Explain your loop in TRL's terms: which TRL settings make TRL do what your loop does.

The harness cannot flip switches inside a user's loop, so attribution turns around: replaying the same lockstep
rollouts, it re-runs TRL with candidate `[trl]` settings and compares each run with your loop's log. It starts
from the spec's own translation, changes one field at a time in the lesson's order (loss_type, then advantage
scaling, KL, passes per generation, clip bounds, then the optimizer and schedule fields), and, when no single
change reaches parity, keeps the change that brought TRL closest and tries the others on top of it (a greedy
search, `MAX_DEPTH` fields at most).

Not searched: the batch mapping and steps_per_generation (a TRL run that asks for other prompts per round than
the recording holds breaks lockstep; the preflight and `--mode free` cover them), and what TRL has no setting
for (a population std, say): then the closest candidate is reported with the step and metric where it parts.

Closeness of a candidate: per compared metric and step, how far the difference is outside tolerance,
`log10(1 + |a - b| / (atol + rtol |b|))`, averaged over steps and metrics (0 = within tolerance everywhere).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from harness.diagnose.compare import load_tolerances, tolerance_for
from harness.diagnose.preflight import apply_alignment
from harness.runlog.atomic import atomic_write_text

MAX_DEPTH = 3
IMPROVES = 0.9  # a change is kept only if it cuts the distance by at least 10%
EXPLAIN_FILE = "your_loop_in_trl.toml"


def candidates(spec, trl_kwargs: dict, your_metrics: set[str]) -> list[tuple[str, object]]:
    """(GRPOConfig field, value) pairs to try, in the lesson's order, each different from what TRL does now."""
    from trl_runner.translate import LOSS_TYPES

    out = [("loss_type", lt) for lt in LOSS_TYPES.values()]
    out += [("scale_rewards", s) for s in ("group", "batch", "none")]
    if "kl" in your_metrics:  # a KL term only shows where the loop logs it
        out += [("beta", b) for b in (0.001, 0.01, 0.04, 0.1)]
    out += [("num_iterations", 2)]
    # clip bounds bind only where the ratio leaves 1 (several passes or steps per generation, an IS sampler)
    out += [("epsilon_high", e) for e in (0.2, 0.28)] + [("epsilon", e) for e in (0.1, 0.2)]
    out += [("lr_scheduler_type", s) for s in ("constant", "linear")]
    out += [("adam_beta2", b) for b in (0.999, 0.99, 0.98)]
    out += [("adam_beta1", 0.9)]
    out += [("weight_decay", w) for w in (0.0, 0.01, 0.1)]
    out += [("max_grad_norm", g) for g in (1.0, 0.0)]
    seen = set()
    kept = []
    for field, value in out:
        current = trl_kwargs.get(field)
        if field == "lr_scheduler_type":
            current = getattr(current, "value", current)
        if current == value or (field, value) in seen:
            continue
        seen.add((field, value))
        kept.append((field, value))
    return kept


def distance(yours, trl, dtype: str, tol: dict) -> float:
    """0 when every shared metric is within tolerance at every shared step; grows with how far outside."""
    shared = [c for c in yours.columns if c in trl.columns and c not in ("step", "wall_s")]
    steps = yours.index.intersection(trl.index)
    if not shared or not len(steps):
        return math.inf
    per_metric = []
    for m in shared:
        try:
            a, b = yours.loc[steps, m].astype(float), trl.loc[steps, m].astype(float)
        except (TypeError, ValueError):
            continue
        t = tolerance_for(tol, "lockstep", dtype, m)
        both = a.notna() & b.notna()
        if not both.any():
            continue
        diff = (a - b).abs()[both]
        denom = (t.get("atol", 0.0) + t.get("rtol", 0.0) * b.abs())[both]
        # exact fields (tolerance 0): equal is 0, any difference counts as a million tolerances
        excess = (diff / denom.where(denom > 0, 1e-6 * diff.where(diff > 0, 1.0))).fillna(0.0)
        per_metric.append(float((1 + excess).apply(math.log10).mean()))
    return float(sum(per_metric) / len(per_metric)) if per_metric else math.inf


def explain(spec, cell_dir: Path, result: dict, log=print) -> dict:
    """Search TRL's settings for your loop's behaviour on the rollouts of `cell_dir`. Returns the attribution entry:
    cause, status (`confirmed`: TRL with these fields reaches parity with your loop; `suspected`: the closest
    candidate), fix (the `[trl]` fields and a sentence) and the number of TRL runs it took."""
    from harness.diagnose.compare import load_any_run
    from harness.diagnose.pairs import compare_sides
    from harness.rollouts.lockstep import ROLLOUTS_FILE, ReplaySource
    from trl_runner.runner import train as train_trl
    from trl_runner.translate import translate

    cell_dir = Path(cell_dir)
    yours_dir = cell_dir / "yours"
    yours = load_any_run(yours_dir)
    tol = load_tolerances()
    base_kwargs = translate(spec).kwargs
    records = ReplaySource.from_file(cell_dir / ROLLOUTS_FILE).records
    root = cell_dir / "explain"
    if root.exists():
        shutil.rmtree(root)
    cache: dict[tuple, tuple[float, dict | None]] = {}

    def trial(changes: dict) -> tuple[float, dict | None]:
        key = tuple(sorted((k, json.dumps(v)) for k, v in changes.items()))
        if key in cache:
            return cache[key]
        name = "+".join(f"{k}={v}" for k, v in sorted(changes.items())).replace("/", "_") or "base"
        run_dir = root / name / "trl"
        try:
            candidate = apply_alignment(spec, {"set_trl": changes})
            train_trl(candidate, run_dir, rollout_source=ReplaySource(records), progress=False, lockstep=True)
            comparison = compare_sides(spec, yours_dir, run_dir, "lockstep")
            d = 0.0 if comparison["first_divergence"] is None else max(  # diverged is never distance 0
                distance(yours, load_any_run(run_dir), spec.DTYPE, tol), 1e-12)
            cache[key] = (d, comparison)
        except Exception as e:  # a candidate TRL refuses, or that breaks lockstep: not an explanation
            log(f"      {name}: not applicable ({type(e).__name__}: {str(e)[:80]})")
            cache[key] = (math.inf, None)
        return cache[key]

    base_d = distance(yours, load_any_run(cell_dir / "trl"), spec.DTYPE, tol)
    cache[()] = (base_d, result)
    chosen: dict = {}
    best_d = base_d
    options = candidates(spec, base_kwargs, set(yours.columns))
    for depth in range(1, MAX_DEPTH + 1):
        tried = []
        for field, value in options:
            if field in chosen:
                continue
            changes = {**chosen, field: value}
            d, comparison = trial(changes)
            log(f"    explain: TRL with {_words(changes)}: " + ("parity" if d == 0.0 else f"distance {d:.3g}"))
            if d == 0.0:
                return _entry(changes, comparison, len(cache) - 1, cell_dir, spec)
            tried.append((d, field, value))
        if not tried:
            break
        d, field, value = min(tried, key=lambda t: t[0])
        if not d < best_d * IMPROVES:
            break
        chosen, best_d = {**chosen, field: value}, d
    closest = cache[tuple(sorted((k, json.dumps(v)) for k, v in chosen.items()))][1] if chosen else result
    fd = (closest or {}).get("first_divergence") or result.get("first_divergence") or {}
    where = f"; even it parts at step {fd.get('step')} on {fd.get('metric')}" if fd else ""
    text = (f"no TRL setting tried matches your loop (closest: TRL with {_words(chosen)}{where}); the difference is "
            "outside what TRL can be set to, or in a field the search does not try") if chosen else \
        f"no single TRL setting tried brings TRL closer to your loop{where}"
    return {"cause": "your loop vs TRL", "status": "suspected", "fields": sorted(chosen), "evidence": text,
            "fix": {"trl": chosen, "scratch": {}, "sentence": text}, "runs": len(cache) - 1}


def _words(changes: dict) -> str:
    return ", ".join(f"{k}={_toml(v)}" for k, v in changes.items()) or "the spec's own settings"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _entry(changes: dict, comparison: dict, runs: int, cell_dir: Path, spec) -> dict:
    steps = comparison.get("steps", [spec.STEPS])[0] if comparison else spec.STEPS
    path = cell_dir.parent / EXPLAIN_FILE
    lines = ["# Your loop, in TRL's terms: TRL with these [trl] fields on top of the spec's own translation matched",
             f"# your loop on the same rollouts at every step (cell {cell_dir.name}, {runs} TRL runs searched).",
             "[trl]"] + [f"{k} = {_toml(v)}" for k, v in changes.items()]
    atomic_write_text(path, "\n".join(lines) + "\n")
    sentence = (f"your loop matches TRL with {_words(changes)} (steps 1-{steps} within tolerance): set "
                f"{'them' if len(changes) > 1 else 'it'} in [trl] to match (written to {path})")
    return {"cause": "+".join(changes), "status": "confirmed", "fields": sorted(changes), "evidence": sentence,
            "fix": {"trl": changes, "scratch": {}, "sentence": sentence}, "runs": runs, "written": str(path)}
