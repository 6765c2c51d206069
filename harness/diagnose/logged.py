"""What your loop's log states, read rather than searched: the explanation's first facts about your loop.

- `settings_from_log`: the peak learning rate, the schedule and the warmup your logged `learning_rate` states (or,
  where no named schedule fits, the rates step by step), and whether it is logged a step ahead;
- `reward_weights_from_log`: the reward functions' weights your logged `reward` states.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from harness.diagnose.fields import toml_value, words


def settings_from_log(yours, spec, rates: list | None = None, stated: dict | None = None) -> tuple[dict, list[str],
                                                                                               bool]:
    """Spec changes your loop's logged `learning_rate` states (peak rate, schedule, warmup, the schedule's
    parameters: any schedule TRL names, diagnose.schedules), and sentences saying what was read. The logged rate is
    the step's own, or (read after the scheduler stepped, as many loops log it) the next step's: both are tried, the
    step's own first. A series no TRL schedule fits is replayed as it is: LR_STEPS, one rate per step. `rates`: the
    rate of each step your weights show (the optimizer stage's reading, None where a step had no gradient): they tell
    a log a step ahead from the step's own, and the first step's rate the log does not show. `stated`: filled with
    the schedule the log states (every field, changed or not), where one fits: a value your loop logs stands as it
    logs it."""
    if "learning_rate" not in yours.columns:
        return {}, [], False
    lr = yours["learning_rate"].dropna().astype(float)
    if lr.empty:
        return {}, [], False
    steps = [int(s) for s in lr.index]
    fit, ahead = _fitted(lr, steps, spec, rates)
    if fit is None:
        return _own_schedule(lr, steps, rates)
    settings = fit.settings()
    if stated is not None:
        stated.update(settings)
    have = {"LR": spec.LR, "LR_SCHEDULE": spec.LR_SCHEDULE, "WARMUP_STEPS": spec.WARMUP_STEPS,
            "LR_SCHEDULER_KWARGS": dict(spec.LR_SCHEDULER_KWARGS)}
    changes = {k: v for k, v in settings.items() if not (v == have[k] or k == "LR" and math.isclose(v, have[k],
                                                                                                  rel_tol=1e-6))}
    said = []
    if changes:
        said.append("read from your loop's logged learning_rate: " + ", ".join(
            words(k, v).removeprefix("your loop ") for k, v in changes.items())
            + f" (the spec: {spec.LR:g}, {spec.LR_SCHEDULE}" + (f", warmup {spec.WARMUP_STEPS}" if spec.WARMUP_STEPS else "")
            + (f", {toml_value(spec.LR_SCHEDULER_KWARGS)}" if spec.LR_SCHEDULER_KWARGS else "") + ")")
    ahead = bool(ahead) and len(set(round(v, 15) for v in lr)) > 1
    if ahead:
        said.append("your loop logs each step's learning_rate after its scheduler stepped: the rate it logs at a "
                    "step is the next step's (logged otherwise, not a cause)")
    return changes, said, ahead


def _fitted(lr, steps: list[int], spec, rates: list | None):
    """The simplest TRL schedule your logged rates follow, as the step's own rate or the next step's (ahead = 1,
    where the weights do not show the step's own: the first step's rate from the weights, where they read one):
    (fit, ahead), or (None, 0)."""
    from harness.diagnose.schedules import fit_schedule

    stated = {"LR": spec.LR, "LR_SCHEDULE": spec.LR_SCHEDULE, "WARMUP_STEPS": spec.WARMUP_STEPS,
              "LR_SCHEDULER_KWARGS": dict(spec.LR_SCHEDULER_KWARGS)}
    for ahead in (0, 1):  # the step's own rate, or the next step's (logged after the scheduler stepped)
        logged = {s - 1 + ahead: float(v) for s, v in zip(steps, lr)}
        tries = [(logged, 1e-5)]
        if ahead and rates and rates[0] is not None and 0 not in logged:  # the first step's rate, which a log a
            first = {**logged, 0: float(rates[0])}  # step ahead never shows, read from the weights (to 5%)
            tries.insert(0, (first, {**{s: 1e-5 for s in logged}, 0: 0.05}))
        fit = next((f for f in (fit_schedule(obs, spec.STEPS, tol, stated) for obs, tol in tries) if f), None)
        if fit is not None and (ahead or not _ahead(list(lr), rates)):
            return fit, ahead
    return None, 0


def _own_schedule(lr, steps: list[int], rates: list | None) -> tuple[dict, list[str], bool]:
    """A logged series no TRL schedule fits: replayed step by step (LR_STEPS), or, where the log skips steps, left
    as the spec has it."""
    if steps != list(range(1, len(steps) + 1)):
        shown = ", ".join(f"{v:.3g}" for v in lr.iloc[:4])
        return {}, [f"your loop's logged learning_rate ({shown}, ...) follows no schedule TRL names "
                    "(lr_scheduler_type with its warmup and lr_scheduler_kwargs) and skips steps: the search leaves "
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
                                    .removeprefix("your loop ") + " (no schedule TRL names fits it: the built-in "
                                    "loop replays it step by step)", *said], bool(said)


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


def loss_logged_as(logged: dict, ref: dict, lengths: dict, grad_accum: int, spec, kl: tuple | None = None) -> str:
    """What your loop logs as its loss, read at every step against the per-token losses of the run that reproduces
    your loop (the built-in loop's, `ref`: {step: its tensors, rows in your order}; `lengths`: {step: each row's
    completion length}; `logged`: {step: your logged loss}), your rows cut into `grad_accum` micro-batches in that
    order: "last" where at some step it is the last micro-batch's loss alone and not the step's, and no step's is the
    step's alone; "step" where some step's is the step's own and no micro-batch's; "other" where some step's is
    neither (logged otherwise still); "untold" where no step tells the two apart (every loss 0, say). `kl`:
    (estimator, beta, ratio factor) of a KL term in the per-token losses: a loss logged without it (oat's pg_loss)
    is read so as well."""
    from harness.diagnose.identify.steps import _number, _rows_of, tolerance
    from harness.diagnose.identify.weighting import _without_kl, last_micro_batch

    if grad_accum < 2:  # one micro-batch: the step's loss is its last micro-batch's
        return "step"
    tol = {"rtol": 1e-4, "atol": 1e-7, **tolerance(spec)}
    prefer = "sum" if getattr(spec, "LOSS_SUM", False) else getattr(spec, "LOSS_NORM", "sequence")
    last = own = other = 0
    for step, t in sorted(ref.items()):
        value, rows = logged.get(step), lengths.get(step)
        if value is None or not math.isfinite(value) or not rows or not (
                _rows_of(t.get("per_token_loss"), len(rows)) and _rows_of(t.get("mask"), len(rows))):
            continue
        losses = [t["per_token_loss"]]
        if kl and _rows_of(t.get("logps"), len(rows)) and _rows_of(t.get("ref_logps"), len(rows)):
            losses.append(_without_kl(t, kl))
        step_loss = _number(t.get("loss"))
        same = abs(value - step_loss) <= tol["atol"] + tol["rtol"] * abs(step_loss)
        read = [last_micro_batch(p, t["mask"], rows, value, grad_accum, spec.MAX_TOKENS, prefer, **tol, telling=True)
                or _one_completion(p, t["mask"], rows, value, spec.MAX_TOKENS, **tol) for p in losses]
        alike = any(last_micro_batch(p, t["mask"], rows, value, grad_accum, spec.MAX_TOKENS, prefer, **tol)
                    for p in losses)  # (the last micro-batch's gives it too: nothing told)
        if any(read) and not same:
            last += 1
        elif same and not alike and abs(value) > 10 * tol["atol"]:
            own += 1
        elif not same and not alike:
            other += 1
    return "step" if own else "other" if other else "last" if last else "untold"


def _one_completion(per_token_loss, mask_rows, lengths, value: float, max_tokens: int, rtol: float,
                    atol: float) -> bool:
    """Whether `value` is one completion's loss alone (a micro-batch of one, in any order: oat's shuffled
    micro-batches): its masked per-token losses' mean, sum over `max_tokens`, or sum; never a loss of 0."""
    if abs(value) <= 10 * atol:
        return False
    for row, m, k in zip(per_token_loss, mask_rows, lengths):
        x, w = np.nan_to_num(np.asarray(row[:k], dtype=np.float64)), np.asarray(m[:k], dtype=np.float64)
        total = float((x * w).sum())
        if any(abs(v - value) <= atol + rtol * abs(value) for v in (total / max(float(w.sum()), 1.0),
                                                                     total / max(max_tokens, 1), total)):
            return True
    return False


def loss_logged_words(yours, ref: dict, records: list, spec, grad_accum: int) -> tuple[str | None, list[str]]:
    """`loss_logged_as` on your logged loss and the tensors `ref` of the run that reproduces your loop (the built-in
    loop set up as `spec`, every step saved; rows of whole rounds in the rollout's order): (the words where what you
    log is your last micro-batch's loss alone, []), (None, [what this run could not tell]) where no step tells the
    two apart, (None, []) otherwise."""
    per_round = spec.NUM_ITERATIONS
    lengths = {s: [len(c) for c in records[(s - 1) // per_round]["completion_ids"]] for s in ref
               if (s - 1) // per_round < len(records)}
    logged = {int(s): float(v) for s, v in yours["loss"].dropna().astype(float).items()}
    kl = (spec.KL_ESTIMATOR, spec.BETA, spec.KL_IS_CORRECTION) if spec.BETA and not spec.KL_IN_REWARD else None
    read = loss_logged_as(logged, ref, lengths, grad_accum, spec, kl)
    if read == "last":
        return ("your loop logs as its loss its last micro-batch's loss alone, not the sum over its micro-batches "
                "(read at every step against the per-token losses of the run that reproduces yours: "
                "logged otherwise than trained, not a difference in training)"), []
    if read == "untold":
        zero = all(abs(v) <= 1e-6 for v in logged.values())
        return None, ["weighting: this run could not tell: what your loop logs as its loss, the sum over its "
                      "micro-batches or one micro-batch's loss alone: the two are alike at every step"
                      + (" (every loss it logs is 0 to rounding)" if zero else "")]
    return None, []
