"""Why a toggle had no measured effect: when the harness can tell, a cell is "cannot show here", not a failure.

A cell that toggles a check on the TRL side is expected to diverge. When it does not, the toggle may be unable
to act at this configuration at all, and the harness can often tell from the run itself:
- every completion of every round has the same length: per-sequence and per-token means coincide, so TRL's
  loss types grpo, bnpo and dapo compute one loss (loss_type cells);
- the IS ratio TRL logged is exactly 1 at every step: sampler and trainer log-probs agree, so the correction
  multiplies by 1 (importance-sampling cells);
- the weights are bf16 and most updates rounded to nothing (an update below half a bf16 step of its weight is
  lost): the toggle changed updates that never reached the weights;
- the effect is below this run's floating-point noise: the calibrated envelope says how small a weight
  difference the run could have shown at all (k x the noise twin's distance at the last step).
"""

from __future__ import annotations

import numpy as np

LOST_UPDATES_WARN = 0.5  # above this fraction of unchanged coordinates per step, bf16 weights barely train
IS_RATIO_METRICS = ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max")
AGREE_WITHIN = "the preflight lists it, but the runs agree within tolerance"  # the attribution's, when it knows no more


def completion_lengths(records) -> list[list[int]]:
    """Per recorded round (the cell's lockstep records), the length of each completion (tokens)."""
    return [[len(c) for c in rec["completion_ids"]] for rec in records]


def equal_lengths(rounds: list[list[int]]) -> int | None:
    """The one length every completion of every round has, else None."""
    found = {n for r in rounds for n in r}
    return found.pop() if len(found) == 1 else None


def is_ratio_exactly_one(trl_metrics) -> bool:
    """True when TRL logged IS ratios and their min and max are 1 at every step."""
    cols = [c for c in IS_RATIO_METRICS if c in trl_metrics.columns]
    if not cols:
        return False
    values = trl_metrics[cols].to_numpy(dtype=float)
    return bool(len(values)) and bool((values == 1.0).all())


def update_summary(cell) -> dict:
    """Per side of the cell (CellData): the median over steps of the fraction of weights a step left unchanged, and of
    the median |update| / |weight| (from the parameter sketches; harness/runlog/params.update_stats_of)."""
    from harness.runlog.params import update_stats_of

    out = {}
    for side in cell.sides:
        sketch = cell.sketch(side)
        stats = update_stats_of(sketch.rows, sketch.init) if sketch is not None else None
        if stats:
            out[side] = {"unchanged": float(np.median([s["unchanged"] for s in stats])),
                        "median_rel": float(np.nanmedian([s["median_rel"] for s in stats])),
                        "per_step_unchanged": [round(s["unchanged"], 4) for s in stats]}
    return out


def lost_updates_warning(spec, summary: dict) -> str | None:
    """A warning when the weights are bf16 and a side's steps left most weights unchanged."""
    if getattr(spec, "MASTER_WEIGHTS", "float32") != "bfloat16":
        return None
    worst = {side: s for side, s in summary.items() if s["unchanged"] > LOST_UPDATES_WARN}
    if not worst:
        return None
    side, s = max(worst.items(), key=lambda kv: kv[1]["unchanged"])
    return (f"bf16 weights: a typical step left {100 * s['unchanged']:.0f}% of the weights unchanged on the {side} side "
            f"(median |update| / |weight| {s['median_rel']:.2g}; bf16 keeps 8 significant bits, so an update below "
            "~2^-9 of its weight rounds to nothing): raise the learning rate, or keep float32 master weights "
            "(MASTER_WEIGHTS = \"float32\", TRL's bf16=True on a float32-loaded model)")


def exact_reason(cause: str | None, cell, details=None) -> str | None:
    """A reason the toggle cannot act at this configuration at all, whatever the precision: the attribution's own
    (sampling settings in lockstep, clip bounds at a ratio of 1, ...), equal completion lengths for a loss_type, an
    IS ratio of exactly 1. `cell`: the CellData. None when there is none (the effect may only be small: see
    `why_no_effect`)."""
    said = [d.get("evidence") for d in details or [] if d.get("status") == "no measured effect"
            and d.get("evidence") and d["evidence"] != AGREE_WITHIN]
    if said:
        return said[0]
    if cause == "loss_type":
        length = equal_lengths(completion_lengths(cell.records))
        if length is not None:
            return (f"every completion is {length} tokens long, so per-sequence and per-token means coincide and the "
                    "loss types compute one loss; give MAX_TOKENS room for completions to end at different lengths "
                    "(an eos) to see this toggle")
    if cause == "importance_sampling" and cell.runs.get("trl") is not None:
        if is_ratio_exactly_one(cell.runs["trl"]):
            return ("the IS ratio is exactly 1 at every step (sampler and trainer log-probs agree), so the correction "
                    "multiplies by 1; it shows only with a sampler whose log-probs differ (vLLM, or sampler.kind = "
                    "\"emulated\")")
    return None


def why_no_effect(cause: str | None, result: dict, cell, spec=None, details=None,
                  updates: dict | None = None) -> str | None:
    """The reason a toggle of `cause` could not show at this configuration, or None when the harness cannot tell:
    an exact reason first (`exact_reason`), then the inexact ones (`small_effect_reason`). `cell`: the CellData;
    `details`: the attribution's. `updates`: the cell's `update_summary`, when the caller has it."""
    return exact_reason(cause, cell, details) or small_effect_reason(result, cell, spec, details, updates)


def small_effect_reason(result: dict, cell, spec=None, details=None, updates: dict | None = None) -> str | None:
    """Why an effect may be too small to show: bf16 weights that lost most updates, then the run's noise floor, then
    the attribution's plain "agree within tolerance"."""
    if updates is None and spec is not None:
        updates = update_summary(cell)
    lost = lost_updates_warning(spec, updates) if spec is not None else None
    if lost:
        return f"most updates never reached the weights ({lost})"
    weights = result.get("metrics", {}).get("param_rel_l2", {})
    if result.get("tolerance_mode") == "calibrated" and weights.get("noise_last") is not None:
        smallest = weights["noise_last"] * result.get("k_noise", 10.0)
        return (f"its effect, if any, is below this run's floating-point noise: the smallest weight difference the run "
                f"could have shown is {smallest:.2g} (relative L2; {result.get('k_noise', 10.0):g}x the noise twin's); "
                "more steps or a larger learning rate would show a larger effect")
    if any(d.get("evidence") == AGREE_WITHIN for d in details or []):
        return AGREE_WITHIN
    return None


# the settings whose effect needs a policy ratio other than 1 (spec field, TRL's name): the clip bounds
NEEDS_RATIO = (("CLIP_LOW", "epsilon"), ("CLIP_HIGH", "epsilon_high"), ("DELTA", "delta"))


def ratio_one_throughout(spec) -> bool:
    """Whether the policy ratio is exactly 1 at every step of the run as the spec sets TRL up: one optimizer step per
    generation round and one pass over it (the old log-probs are the policy's own, detached), or the old log-probs
    taken again before every step (LOGP_OLD = "current")."""
    one_pass = getattr(spec, "NUM_ITERATIONS", 1) == 1 and getattr(spec, "STEPS_PER_GENERATION", 1) == 1
    return one_pass or getattr(spec, "LOGP_OLD", "auto") == "current"


def loop_ratio_one(tensors: dict) -> bool | None:
    """Whether your loop's saved old log-probs equal its log-probs (to 1e-6) at every step that saved both: True,
    False where some step's differ (its ratio leaves 1 there), None where no step saved both."""
    seen = False
    for t in tensors.values():
        old, lp = t.get("old_logps"), t.get("logps")
        if old is None or lp is None:
            continue
        try:
            a = np.concatenate([np.asarray(r, dtype=np.float64).reshape(-1) for r in old])
            b = np.concatenate([np.asarray(r, dtype=np.float64).reshape(-1) for r in lp])
        except (TypeError, ValueError):
            continue
        if a.shape != b.shape:
            continue
        seen = True
        both = np.isfinite(a) & np.isfinite(b)
        if np.any(np.abs(a[both] - b[both]) > 1e-6):
            return False
    return True if seen else None


def ratio_one_words(spec, tensors: dict) -> str | None:
    """What a run whose policy ratio is exactly 1 at every step cannot tell: any setting whose effect needs a ratio
    other than 1 (NEEDS_RATIO: the clip bounds), said with TRL's names and the spec's values; None where the ratio
    can leave 1 (several passes or steps per round, or your loop's saved old log-probs apart from its own)."""
    if not ratio_one_throughout(spec) or loop_ratio_one(tensors or {}) is False:
        return None
    named = ", ".join(f"{trl} = {getattr(spec, key):g}" for key, trl in NEEDS_RATIO if key != "DELTA"
                      or getattr(spec, "DELTA", 0.0))
    saved = ", and your loop's saved old log-probs are its log-probs" if loop_ratio_one(tensors or {}) else ""
    return (f"this run could not tell your loop's clip bounds (TRL's {named}): the policy ratio is exactly 1 at every "
            f"step (one pass over each round on the policy that generated it{saved}), and a clip bound acts only where "
            "the ratio leaves 1; a bound of your own shows only with several passes per round (num_iterations > 1)")
