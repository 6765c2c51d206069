"""What your loop's log states, read rather than searched: the explanation's first facts about your loop.

- `settings_from_log`: the peak learning rate, the schedule and the warmup your logged `learning_rate` states (or,
  where no named schedule fits, the rates step by step), and whether it is logged a step ahead;
- `reward_weights_from_log`: the reward functions' weights your logged `reward` states.
"""

from __future__ import annotations

import math
import statistics

from harness.diagnose.fields import words


def settings_from_log(yours, spec, rates: list | None = None) -> tuple[dict, list[str], bool]:
    """Spec changes your loop's logged `learning_rate` states (peak rate, schedule, warmup), and sentences saying
    what was read. The logged rate is the step's own, or (read after the scheduler stepped, as many loops log it) the
    next step's: both are tried, the step's own first. A series no named schedule fits (a warmup from a fraction of
    the rate, a cosine to a floor, a decay over a horizon other than STEPS) is replayed as it is: LR_STEPS, one rate
    per step. `rates`: the rate of each step your weights show (the optimizer stage's reading, None where a step had
    no gradient): they tell a log a step ahead from the step's own, and the first step's rate the log does not show."""
    from scratch_grpo.core import lr_multiplier

    if "learning_rate" not in yours.columns:
        return {}, [], False
    lr = yours["learning_rate"].dropna().astype(float)
    if lr.empty:
        return {}, [], False
    steps = [int(s) for s in lr.index]
    fits = []
    for ahead in (0, 1):  # the step's own rate, or the next step's (logged after the scheduler stepped)
        for schedule in ("constant", "linear"):
            rising = lr.iloc[0] < lr.max() or ahead  # (a log a step ahead hides the warmup's first step)
            for warmup in sorted({0, spec.WARMUP_STEPS} | ({int(s) for s in steps[:12]} if rising else set())):
                mult = [lr_multiplier(s - 1 + ahead, schedule, spec.STEPS, warmup) for s in steps]
                peak_at = max(range(len(mult)), key=lambda i: mult[i])
                if mult[peak_at] <= 0:
                    continue
                peak = float(lr.iloc[peak_at]) / mult[peak_at]
                if peak > 0 and all(math.isclose(peak * m, float(v), rel_tol=1e-5, abs_tol=1e-12)
                                    for m, v in zip(mult, lr)):
                    fits.append((schedule, warmup, peak, ahead))
        if ahead and rates and rates[0] is not None:  # the first step's rate, which a log a step ahead never shows
            first = [f for f in fits if _near(f[2] * lr_multiplier(0, f[0], spec.STEPS, f[1]), rates[0], f[2])]
            fits = first or fits
        if fits and (ahead or not _ahead(list(lr), rates)):
            break
        fits = []
    if not fits:
        if steps != list(range(1, len(steps) + 1)):
            shown = ", ".join(f"{v:.3g}" for v in lr.iloc[:4])
            return {}, [f"your loop's logged learning_rate ({shown}, ...) follows no schedule the harness knows "
                        "(constant or linear to 0 at STEPS, with a linear warmup) and skips steps: the search leaves "
                        "the schedule as the spec has it"], False
        per_step = [float(f"{v:.6g}") for v in lr]
        said = []
        if _ahead(per_step, rates):  # the weights show each logged rate at the next step
            first = rates[0] if rates[0] is not None else 0.0
            first = 0.0 if abs(first) < 1e-3 * max(per_step) else float(f"{first:.4g}")
            per_step = [first, *per_step[:-1]]
            said.append("your loop logs each step's learning_rate after its scheduler stepped (its weights show the "
                        "rate it logs at a step used at the next): the rates per step are the log's a step later, the "
                        f"first ({first:.4g}) read from its weights")
        return {"LR_STEPS": per_step}, ["read from your loop's logged learning_rate: " + words("LR_STEPS", per_step)
                                        .removeprefix("your loop ") + " (no constant or linear schedule with a warmup "
                                        "fits it: the built-in loop replays it step by step)", *said], bool(said)
    prefer = [f for f in fits if f[0] == spec.LR_SCHEDULE and f[1] == spec.WARMUP_STEPS] or fits
    schedule, warmup, peak, ahead = prefer[0]
    changes = {}
    if not math.isclose(peak, spec.LR, rel_tol=1e-6):
        changes["LR"] = float(f"{peak:.6g}")
    if schedule != spec.LR_SCHEDULE and not (len(set(round(v, 15) for v in lr)) == 1 and schedule == "linear"):
        changes["LR_SCHEDULE"] = schedule
    if warmup != spec.WARMUP_STEPS:
        changes["WARMUP_STEPS"] = warmup
    said = []
    if changes:
        said.append("read from your loop's logged learning_rate: " + ", ".join(
            words(k, v).removeprefix("your loop ") for k, v in changes.items())
            + f" (the spec: {spec.LR:g}, {spec.LR_SCHEDULE}" + (f", warmup {spec.WARMUP_STEPS}" if spec.WARMUP_STEPS else "")
            + ")")
    ahead = bool(ahead) and len(set(round(v, 15) for v in lr)) > 1
    if ahead:
        said.append("your loop logs each step's learning_rate after its scheduler stepped: the rate it logs at a "
                    "step is the next step's (logged otherwise, not a cause)")
    return changes, said, ahead


def _near(a: float, b: float, scale: float) -> bool:
    """Two learning rates alike within a weights-read rate's noise (5%, or both below 0.1% of the peak)."""
    return abs(a - b) <= max(0.05 * max(abs(a), abs(b)), 1e-3 * abs(scale))


def _ahead(logged: list[float], rates: list | None) -> bool:
    """Whether the weights show each logged rate used at the next step (a log written after the scheduler stepped):
    the mean relative misfit a step later is under a third of the step's own (a warmup's steps tell them apart)."""
    if not rates:
        return False

    def misfit(ahead: int) -> float:
        pairs = [(logged[i - ahead], r) for i, r in enumerate(rates) if r is not None and 0 <= i - ahead < len(logged)]
        return statistics.fmean(abs(a - r) / max(abs(a), abs(r), 1e-30) for a, r in pairs) if pairs else math.inf
    own, later = misfit(0), misfit(1)
    return later < own / 3 and own > 0.02


def reward_weights_from_log(yours, spec, scores_by_round: list[dict]) -> tuple[dict, list[str]]:
    """The reward functions' weights your loop's logged `reward` (each step's mean total reward) states: fitted over
    the steps to each round's mean score per function (from your loop's rollouts file), where the spec's weights
    do not give it and other weights do exactly (TRL's `reward_weights`). A loop with reward code of its own, or
    that logs another mean, fits no weights and is left to the tensor diff and the search."""
    from harness.diagnose.tensordiff import fit_reward_weights

    per_round = spec.STEPS_PER_GENERATION * spec.NUM_ITERATIONS
    if "reward" not in yours.columns or not scores_by_round or spec.STEPS_PER_GENERATION > 1:
        return {}, []  # (a step of a round's slice logs its slice's mean: not the round's)
    logged = yours["reward"].dropna().astype(float)
    steps = [int(s) for s in logged.index if (int(s) - 1) // per_round < len(scores_by_round)]
    means = {name: [] for name in scores_by_round[0]}
    for step in steps:
        for name in means:
            vals = [v for v in scores_by_round[(step - 1) // per_round].get(name, []) if v is not None]
            means[name].append(sum(vals) / len(vals) if vals else None)
    w = fit_reward_weights([float(logged[s]) for s in steps], means, atol=1e-5, rtol=1e-4)
    spec_w = [float(v) for v in spec.rewards.weights]
    if w is None or all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(w, spec_w)):
        return {}, []
    scale = [a / b for a, b in zip(w, spec_w) if b]
    if len(scale) == len(w) and all(math.isclose(c, scale[0], rel_tol=1e-4) for c in scale):
        return {}, []  # the spec's weights times one factor: a logged sum, or a mean over other counts, not weights
    said = words("rewards.weights", w).removeprefix("your loop ")
    return {"rewards.weights": w}, [f"read from your loop's logged reward over {len(steps)} steps: {said} (the spec: "
                                    f"{spec_w})"]
