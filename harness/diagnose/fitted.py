"""The one gate every fitted value passes before the explanation builds a spec from it: what your loop's log and
tensors state (a warmup, an epsilon, a weight) is kept where the spec check and TRL's translation take it, and
otherwise becomes "this run could not tell", with the check's reason; the explanation goes on without it."""

from __future__ import annotations

import re


def admissible(base, changes: dict) -> tuple[dict, dict[str, str]]:
    """`changes` split into those the built-in loop's spec and TRL's translation take on `base` (all together), and
    those refused: {field: the reason, in words}. A refusal names its field where the check does; where it names
    another (a cross-check of two fields), the fitted field whose removal makes the rest valid is refused. Never
    raises: the kept part always builds a spec."""
    kept, refused = dict(changes), {}
    while kept:
        error = _refusal(base, kept)
        if error is None:
            return kept, refused
        key = _culprit(base, kept, error)
        refused[key] = f"the fit gave {key} = {_shown(kept[key])}, which {_reason(error)}"
        del kept[key]
    return kept, refused


def _refusal(base, changes: dict) -> Exception | None:
    """Why the spec with `changes` cannot run (the spec check's or the translation's error), or None."""
    from harness.diagnose.preflight import apply_alignment
    from harness.diagnose.search import trl_moves

    try:
        trl_moves(base, changes)  # (builds the spec with `changes` and translates it for TRL)
        apply_alignment(base, {"set": changes})
    except Exception as e:  # noqa: BLE001 - any refusal (a SpecError, a value of another type) is a refused fit
        return e
    return None


def _culprit(base, kept: dict, error: Exception) -> str:
    """The fitted field a refusal is about: the one its key names (LR_SCHEDULER_KWARGS.lr_end, LR_STEPS[3]), else
    the first whose removal lets the rest run, else the last fitted."""
    named = re.split(r"[\[]", getattr(error, "key", "") or "")[0]
    for key in kept:
        if named and (named == key or named.startswith(key + ".") or key.startswith(named + ".")):
            return key
    for key in kept:
        if _refusal(base, {k: v for k, v in kept.items() if k != key}) is None:
            return key
    return list(kept)[-1]


def _reason(error: Exception) -> str:
    text = str(error).removeprefix("spec error: ")
    return f"the spec check refuses ({text})" if type(error).__name__ == "SpecError" else \
        f"the built-in loop cannot take ({type(error).__name__}: {text[:200]})"


def _shown(value) -> str:
    from harness.diagnose.fields import toml_value

    return toml_value(value)


def refused_words(refused: dict[str, str]) -> list[str]:
    """Each refused fit as what this run could not tell."""
    return [f"this run could not tell {key}: {why}; the explanation goes on without it" for key, why in refused.items()]
