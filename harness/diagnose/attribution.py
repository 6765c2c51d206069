"""Attribution: name the cause of a divergence, and confirm it by a re-run with only that difference aligned.

The preflight lists what differs between the sides; `attribute` walks those differences in the
lesson's order (batch, loss_type, importance_sampling, then any other field), re-runs the pair with one
difference aligned, and calls the cause confirmed when the divergence disappears; otherwise it stays a
suspicion worded from the curves (`_evidence`). A difference that the runs show no effect of says why
when the harness can tell (`NO_EFFECT_WHY`).
"""

from __future__ import annotations

from pathlib import Path

from harness.diagnose import pairs
from harness.diagnose.preflight import CHECK_ORDER, alignment_for, apply_alignment, fix_for, preflight

MAX_CONFIRMATIONS = 3
_SAMPLING_ONLY = "in lockstep TRL does not sample (the shared sampler does): sampling settings act only in free runs"
_CLIP_ONLY = ("clipping binds only where the policy ratio leaves 1: NUM_ITERATIONS > 1, or an IS sampler; with one "
              "pass per generation the ratio is exactly 1")
FREE_NO_EFFECT = ("free run: the two sides differ by less than the seed-to-seed noise allows at this many seeds and "
                  "steps; run --mode lockstep (same rollouts on both sides), or more seeds or steps")
NO_EFFECT_WHY = {"other:top_k": _SAMPLING_ONLY, "other:top_p": _SAMPLING_ONLY, "other:min_p": _SAMPLING_ONLY,
                 "other:repetition_penalty": _SAMPLING_ONLY, "other:epsilon_high": _CLIP_ONLY,
                 "other:epsilon": _CLIP_ONLY, "other:delta": _CLIP_ONLY}


# ---------------------------------------------------------------------------------------------
def _evidence(check: str, result: dict) -> str | None:
    """What in the curves points at a check (used to word suspicions; confirmation decides)."""
    m = result["metrics"]
    outside = set(result["outside"])
    fd = result["first_divergence"] or {}
    if check == "batch":
        hit = [k for k in ("prompts_in_step", "sequences_in_step", "prompt_ids_hash", "epoch") if k in outside]
        return f"{', '.join(hit)} differ from step {min(m[k]['first_outside'] for k in hit)}" if hit else None
    if check == "loss_type":
        if fd and fd.get("metric") in ("loss", "grad_norm", "param_rel_l2") and "reward" not in outside:
            return f"{fd['metric']} parts at step {fd['step']} while the rewards agree"
        return None
    if check == "importance_sampling":
        one_sided = [k for k in result["only_in_a"] + result["only_in_b"] if k.startswith("sampling/")]
        if one_sided:
            return f"IS ratio statistics on one side only ({one_sided[0]}, ...)"
        hit = [k for k in outside if k.startswith("sampling/")]
        return f"IS ratio statistics differ ({hit[0]})" if hit else None
    return None


def attribute(cell, result: dict, cell_dir: Path, mode: str, progress: bool, log) -> list[dict]:
    """Name the cause of a divergence and confirm it by re-running with only that difference aligned."""
    if "yours" in getattr(cell, "sides", ()):
        return _attribute_your_loop(cell, result, cell_dir, mode, log)
    _tr, diffs, _facts = preflight(cell.spec)
    checks = []
    for d in diffs:
        if d.check not in checks:
            checks.append(d.check)
    rank = {c: i for i, c in enumerate(CHECK_ORDER)}
    checks.sort(key=lambda c: rank.get(c, len(rank)))
    diverged = result["first_divergence"] is not None
    out = []
    if not diverged:
        why = (lambda c: NO_EFFECT_WHY.get(c, "the preflight lists it, but the runs agree within tolerance")) \
            if mode == "lockstep" else (lambda c: FREE_NO_EFFECT)
        return [{"cause": c, "status": "no measured effect", "evidence": why(c),
                 "fields": sorted({f for d in diffs if d.check == c for f in d.fields})} for c in checks]
    confirmations = 0
    for check in checks:
        entry = {"cause": check, "fields": sorted({f for d in diffs if d.check == check for f in d.fields}),
                 "evidence": _evidence(check, result), "fix": fix_for(cell.spec, diffs, check)}
        if confirmations < MAX_CONFIRMATIONS and not any(e["status"] == "confirmed" for e in out):
            confirmations += 1
            aligned = apply_alignment(cell.spec, alignment_for(diffs, check))
            log(f"    confirming {check}: re-run with only it aligned")
            try:
                again = pairs.run_pair(aligned, cell_dir / f"confirm-{check.replace(':', '-')}", mode, progress)
                entry["rerun_first_divergence"] = again["first_divergence"]
                entry["status"] = "confirmed" if again["first_divergence"] is None else "suspected"
            except Exception as e:  # a failing confirmation must not sink the cell
                entry["status"] = "suspected"
                entry["rerun_error"] = f"{type(e).__name__}: {e}"
        else:
            entry["status"] = "suspected"
        out.append(entry)
    if not out:
        out.append({"cause": "unexplained", "status": "suspected", "fields": [],
                    "evidence": "the preflight shows no difference: a bug on one side, or nondeterminism"})
    out.sort(key=lambda e: e["status"] != "confirmed")
    return out


def _attribute_your_loop(cell, result: dict, cell_dir: Path, mode: str, log) -> list[dict]:
    """Your loop against TRL: the preflight cannot see inside your loop, so search TRL's settings for it instead."""
    if result["first_divergence"] is None:
        return []
    if mode != "lockstep" or "trl" not in cell.sides:
        hint = [f"{c}: {e}" for c in CHECK_ORDER if (e := _evidence(c, result))]
        text = ("the explanation search needs lockstep mode against TRL (the same rollouts on both sides); "
                + ("; ".join(hint) if hint else "run --mode lockstep --against trl"))
        return [{"cause": "your loop", "status": "suspected", "fields": [], "evidence": text,
                 "fix": {"trl": {}, "scratch": {}, "sentence": text}}]
    from harness.diagnose.explain import explain

    log("    explaining your loop in TRL's terms (re-running TRL on the same rollouts)")
    return [explain(cell.spec, cell_dir, result, log)]
