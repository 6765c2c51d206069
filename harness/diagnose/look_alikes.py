"""What else reproduces a confirmed explanation as well: other clipping thresholds, each field's look-alike values
(fields.LOOK_ALIKE), and on bf16 weights a beta2 paired with the other AdamW kernel. Each is said as what the run
could not tell (a verdict claims only what the run shows)."""

from __future__ import annotations

from harness.diagnose.as_trl import trl_fields
from harness.diagnose.explain_words import clip_alike_words
from harness.diagnose.fields import CLIP_NORMS, FIELDS, LOOK_ALIKE, toml_value
from harness.diagnose.preflight import apply_alignment
from harness.diagnose.search import Search, Trial


def look_alikes(search: Search, state: Trial, yours) -> tuple[list[str], dict]:
    """Where the kept set agrees at every step, what else does as well: other clipping thresholds (with your loop's
    logged norms, `yours`) and the look-alike settings, each said as what the run could not tell. With the search's
    cost, the look-alikes' runs counted apart."""
    notes = []
    changes = state.changes
    if "MAX_GRAD_NORM" in changes and state.agree >= search.steps:  # which other thresholds do as well?
        found_at = changes["MAX_GRAD_NORM"]
        alike = [v for v in CLIP_NORMS if v != found_at
                 and search.whole({**changes, "MAX_GRAD_NORM": v}).agree >= search.steps]
        if alike:
            norms = yours["grad_norm"].dropna().astype(float).tolist() if "grad_norm" in yours.columns else []
            notes.append(clip_alike_words(found_at, alike, norms, search.steps))
    runs, steps_run, seconds = search.runs, search.steps_run, search.seconds
    if state.agree >= search.steps:  # what else reproduces it as well: the run cannot tell those apart
        notes += untold_words(search, changes)
    cost = {"runs": runs, "steps": steps_run, "seconds": round(seconds, 1),
            "look_alike_runs": search.runs - runs, "look_alike_seconds": round(search.seconds - seconds, 1)}
    return notes, cost


# what follows the setting in each look-alike note (the answer on the first screen shows the setting alone)
UNTOLD_TAIL = ", the built-in loop reproduces your loop over all "


def untold_words(search, changes: dict) -> list[str]:
    """For a confirmed explanation: the look-alike settings (LOOK_ALIKE) that reproduce your loop over every step as
    well, each said as what this run could not tell (a verdict claims only what the run shows)."""
    base = apply_alignment(search.base, {"set": changes})
    out = []
    for key, values in LOOK_ALIKE.items():
        if key == "KL_IS_CORRECTION" and not base.BETA or key in search.settled:
            continue  # no KL term: nothing for its ratio factor to act on (a field your tensors settled: not a guess)
        if key == "IS_CORRECTION" and base.sampler.kind == "policy" or key == "IS_MODE" and not base.IS_CORRECTION:
            continue  # no separate sampler: no weight to apply; no correction: no mode
        if key == "OPTIM" and base.MASTER_WEIGHTS == "float32":
            continue  # the AdamW kernels part on low-precision weights only
        have = getattr(base, key)
        alike = [v for v in values if v != have and search.whole({**changes, key: v}).agree >= search.steps]
        if key in KERNEL_PAIRED and base.MASTER_WEIGHTS != "float32" and "OPTIM" not in search.settled:
            out += _with_other_kernel(search, base, changes, key, [v for v in values if v != have and v not in alike])
        if alike:
            out.append(_untold(search, {key: alike[0]}, alike[1:], toml_value(have), "the effect stays under the "
                               "tolerance here"))
    return out


def _untold(search, setting: dict, others: list, instead: str, why: str) -> str:
    """One look-alike note: `setting` (and the same field at `others`) reproduces your loop over every step as well,
    in place of `instead`, for the reason `why`; the setting named as its TRL fields where it has them."""
    named = ", ".join(f"{k} = {toml_value(v)}" for k, v in (trl_fields(search.base, setting) or setting).items())
    return (f"this run could not tell: with {named}" + (f" (or {', '.join(map(str, others))})" if others else "")
            + f" instead of {instead}{UNTOLD_TAIL}{search.steps} steps as well ({why})")


# the Adam setting whose effect the AdamW kernel's rounding trades against on bf16 weights (the for-loop kernel rounds
# the second moment's decay op by op: beta2 x v rounds back to v where 1 - beta2 is below half a bf16 spacing)
KERNEL_PAIRED = ("ADAM_BETA2",)


def _with_other_kernel(search, base, changes: dict, key: str, values: list) -> list[str]:
    """On low-precision weights with the AdamW kernel untold: the values of `key` that reproduce your loop with the
    other kernel (optim), said as what the run could not tell beside the kept set (`base`: the spec it stands for)."""
    other = next(k for k in FIELDS["OPTIM"].values if k != base.OPTIM)
    alike = [v for v in values if search.whole({**changes, key: v, "OPTIM": other}).agree >= search.steps]
    if not alike:
        return []
    return [_untold(search, {key: alike[0], "OPTIM": other}, alike[1:],
                    f"{toml_value(getattr(base, key))} and {toml_value(base.OPTIM)}",
                    "the kernels round bf16 weights apart; the effect stays under the tolerance here")]
