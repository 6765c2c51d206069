"""Identify each stage of your loop from its own tensors: the rule it applies, in closed form where the math allows,
without re-running anything.

The explanation search (explain.py) re-runs the built-in loop with candidate settings and finds what its vocabulary
holds. A loop nobody here has seen brings choices no list holds (an advantage epsilon of 3.7e-3, a mask on the pad
token's id, a divisor of its own, Adam's beta2 0.995). Each stage below reads one link of the loop's step from the
tensors the loop saved (`harness.loop.tensors`, and for the optimizer `harness.loop.Probe`) and says:
- the rule, in words, said of your loop;
- the spec fields that make the built-in loop do the same (`settings`), where it has a switch, or `no_switch`;
- whether the rule reproduces your tensors within tolerance (`exact`), and what this run could not tell
  (`unsettled`: an epsilon below the run's resolution, a clip bound never reached, a threshold every step exceeds).

The stages, each a plain function of plain lists (rows in the rollout's order, per-token rows read up to each
completion's length where said):
    advantages(rewards, advantages, group)                       centring, scaling (std estimator, epsilon), clipping
    mask(mask_rows, completion_ids, eos_ids, ...)                which tokens count in the loss, as a rule on token
                                                                 features (id, eos, position, truncation)
    weighting(per_token_loss, mask, loss, ...)                   how per-token losses become the loss (TRL's loss
                                                                 types, or a divisor)
    objective(per_token_loss, advantages, logps, ...)            the per-token objective: ratio form, KL estimator and
                                                                 weight, clip bounds
    optimizer(probe_rows, grad_norms)                            Adam's learning rate per step, betas, epsilon, weight
                                                                 decay, gradient clipping
`identify(...)` runs every stage the saved tensors allow and returns the findings in the chain's order.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one stage of your loop does, read from its tensors."""
    stage: str  # one of STAGES: selection | rewards | advantages | mask | weighting | objective | optimizer
    step: int | None  # the step whose tensors were read (None: several)
    rule: str  # in words, of your loop ("centres each group's rewards and divides by its population std + 1e-8")
    settings: dict  # spec fields that make the built-in loop do the same ({}: TRL's as the spec sets it up)
    exact: bool  # the rule reproduces your tensors within tolerance
    same_as_spec: bool = False  # the rule is the spec's own (TRL's as configured): nothing to name
    no_switch: bool = False  # a rule the built-in loop has no switch for (named, never searched)
    unsettled: tuple = ()  # what this run could not tell, in words
    evidence: dict = dataclasses.field(default_factory=dict)
    settles: tuple = ()  # the spec fields this finding settles: the search leaves them as found
    readable: bool = True  # False: nothing could be read at this step (all advantages 0, a function scoring alike)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _arr(value) -> np.ndarray:
    return np.asarray(value, dtype=np.float64).reshape(-1)


# round values a measured setting snaps to when it is within the run's resolution of one
_NICE_EPS = (1e-8, 0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-7, 1e-10, 1e-12)


def snap(value: float, unc: float, nice=_NICE_EPS) -> float:
    """The first round value within `unc` of `value` (the commonest choices first), else `value` to 3 digits."""
    for v in nice:
        if abs(v - value) <= unc:
            return v
    return float(f"{value:.3g}")


# ---------------------------------------------------------------------------------------------
# which completions each step trains on
# ---------------------------------------------------------------------------------------------
def selection(chosen: dict[int, list[tuple[int, int]]], sizes: list[int], group: int, per_round: int,
              rewards: list[list[float]] | None = None, lengths: list[list[int]] | None = None,
              truncated: list[list[bool]] | None = None, path: str = "") -> Finding:
    """Which completions each optimizer step of your loop trained on (harness.loop.trained), against TRL's (step s:
    the whole round (s - 1) // per_round): how many per step, from how many rounds, each round over how many steps,
    completions trained more than once, and the groups never trained with a rule that fits them (every group whose
    rewards are all equal: DAPO's dynamic sampling; every group of truncated completions; the groups of the
    lowest or highest mean reward) or none. `sizes`: each round's completions; `rewards`, `lengths`, `truncated`:
    per round, per completion."""
    steps = sorted(chosen)
    default = {s: [((s - 1) // per_round, i) for i in range(sizes[(s - 1) // per_round])] for s in steps
               if (s - 1) // per_round < len(sizes)}
    if all(sorted(chosen[s]) == default.get(s) for s in steps):
        order = any(chosen[s] != default.get(s) for s in steps)
        return Finding("selection", None, "your loop trains each step on one whole round, as TRL does" + (
            " (in an order of its own)" if order else ""), {}, True, same_as_spec=True)
    words, unsettled = [], []
    counts = [len(chosen[s]) for s in steps]
    per_step = f"{counts[0]}" if len(set(counts)) == 1 else f"{min(counts)} to {max(counts)}"
    rounds_per = [len({r for r, _ in chosen[s]}) for s in steps]
    words.append(f"trains each step on {per_step} completions" + (
        f" from {max(rounds_per)} rounds at once" if max(rounds_per) > 1 else ""))
    seen: dict[tuple[int, int], int] = {}
    steps_of: dict[int, set] = {}
    for s in steps:
        for r, i in chosen[s]:
            seen[(r, i)] = seen.get((r, i), 0) + 1
            steps_of.setdefault(r, set()).add(s)
    used_rounds = sorted(steps_of)
    spread = {len(v) for v in steps_of.values()}
    if max(spread) > 1 and max(rounds_per) == 1:
        words.append(f"taking each round over {min(spread)}" + (f" to {max(spread)}" if len(spread) > 1 else "")
                     + " steps, a part at a time (TRL: steps_per_generation, on shuffled slices)")
    again = sum(1 for v in seen.values() if v > 1)
    if again:
        words.append(f"trains {again} completion(s) more than once (a replay buffer, or several passes)")
    skipped = sorted({(r, i // group) for r in used_rounds for i in range(sizes[r])} - {(r, i // group) for r, i in seen})
    partial = [(r, g) for r, g in {(r, i // group) for r, i in seen} if any((r, g * group + j) not in seen
                                                                            for j in range(group))]
    rule = None
    if skipped and rewards is not None:
        def spread_of(r, g):
            x = [v for v in rewards[r][g * group:(g + 1) * group] if v == v]
            return max(x) - min(x) if x else 0.0
        kept = sorted({(r, i // group) for r, i in seen})
        flat = {(r, g) for r in used_rounds for g in range(sizes[r] // group) if spread_of(r, g) <= 1e-9}
        if set(skipped) == flat:
            rule = "every group whose rewards are all equal (advantage 0 for each of its completions; DAPO's dynamic " \
                   "sampling filters them)"
        elif truncated is not None and all(all(truncated[r][g * group:(g + 1) * group]) for r, g in skipped) and \
                not any(all(truncated[r][g * group:(g + 1) * group]) for r, g in kept):
            rule = "every group whose completions are all truncated"
        else:
            means = {(r, g): float(np.nanmean(rewards[r][g * group:(g + 1) * group]))
                     for r in used_rounds for g in range(sizes[r] // group)}
            lo = max(means[k] for k in skipped)
            hi = min(means[k] for k in skipped)
            if all(means[k] > lo for k in kept):
                rule = f"every group whose mean reward is at most {lo:g}"
            elif all(means[k] < hi for k in kept):
                rule = f"every group whose mean reward is at least {hi:g}"
    if skipped:
        words.append(f"and never trains on {len(skipped)} of the {sum(sizes[r] // group for r in used_rounds)} "
                     "groups of the rounds it reads: " + (rule if rule else "no rule on their rewards' spread, mean "
                                                          "reward or truncation fits them"))
    if partial:
        words.append(f"({len(partial)} group(s) trained only in part)")
    return Finding("selection", None, "your loop " + ", ".join(words[:1]) + (", " if len(words) > 1 else "")
                   + ", ".join(words[1:]), {"SELECTION": path} if path else {}, True, unsettled=tuple(unsettled),
                   evidence={"steps": len(steps), "skipped_groups": len(skipped), "rule": rule},
                   settles=("SELECTION",))


# ---------------------------------------------------------------------------------------------
# rewards as a function of the reward functions' scores
# ---------------------------------------------------------------------------------------------
def rewards_stage(rewards, scores: dict[str, list], spec=None, step=None) -> Finding:
    """Your per-completion rewards against the spec's reward functions' scores of the same completions: the weights
    that give them (TRL's reward_weights), by least squares and checked exactly, or your own reward code."""
    from harness.diagnose.tensordiff import fit_reward_weights

    r = [float(x) for x in _arr(rewards)]
    w = fit_reward_weights(r, scores, atol=1e-5, rtol=1e-4)
    spec_w = [float(v) for v in spec.rewards.weights] if spec is not None else None
    cols = np.array([[np.nan if v is None else float(v) for v in col] for col in scores.values()]).T
    cols = cols[~np.isnan(cols).any(axis=1)] if cols.size else cols
    if w is None and (not cols.size or np.linalg.matrix_rank(cols) < len(scores)):
        return Finding("rewards", step, "cannot be read at this step: a reward function scores every completion alike, "
                       "so no weights can be told apart", {}, False, readable=False)
    if w is None:
        return Finding("rewards", step, "your loop scores the completions with reward code of its own: no weighting of "
                       f"the spec's reward functions ({', '.join(scores)}) gives its rewards", {}, False, no_switch=True)
    w = [0.0 if abs(x) < 1e-12 else x for x in w]  # (no -0.0 in the words)
    if spec_w is not None and all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(w, spec_w)):
        return Finding("rewards", step, "your loop weighs the reward functions as the spec does", {}, True,
                       same_as_spec=True, settles=("rewards.weights",))
    return Finding("rewards", step, f"your loop weighs the reward functions ({', '.join(scores)}) {w}",
                   {"rewards.weights": w}, True, settles=("rewards.weights",))


# ---------------------------------------------------------------------------------------------
# advantages as a function of rewards
# ---------------------------------------------------------------------------------------------
def advantages(rewards, adv, group: int, spec=None, rtol: float = 2e-5, atol: float = 1e-6, step=None) -> Finding:
    """Your advantages as a function of your own rewards (`_centred_on_a_mean`), and where no centring on a mean
    fits, on the mean of the group's other completions (leave-one-out, `_leave_one_out`)."""
    found = _centred_on_a_mean(rewards, adv, group, spec, rtol, atol, step)
    if found.readable and group >= 2:
        r, a = _arr(rewards), _arr(adv)
        loo = _leave_one_out(r, a, group, spec, rtol, atol, step)
        # both fit within tolerance (no scale and the others' mean is the group's times G / (G - 1), which a group
        # std with an odd epsilon can mimic): the rule that reproduces your advantages more closely
        if loo is not None and (not found.exact or found.no_switch
                                or _misfit(r, a, group, spec, loo.settings) < _misfit(r, a, group, spec, found.settings)):
            return loo
    return found


def _misfit(r, a, group: int, spec, settings: dict) -> float:
    """The largest |A - predicted| / (|A| + 1e-6) of an advantage rule (the spec's fields, `settings` over them) on
    your rewards: predicted by the built-in loop's own advantage function (scratch_grpo.core), in float64."""
    import torch

    from scratch_grpo.core import group_advantages

    f = {"ADV_SCALE": "group", "STD": "bessel", "STD_EPS": 1e-4, "STD_EPS_INSIDE": False, "ADV_BASELINE": "group",
         **({k: getattr(spec, k) for k in ("ADV_SCALE", "STD", "STD_EPS", "STD_EPS_INSIDE", "ADV_BASELINE")
             if hasattr(spec, k)} if spec else {}), **settings}
    pred = group_advantages(torch.tensor(r, dtype=torch.float64), group, f["ADV_SCALE"], f["STD"], f["STD_EPS"],
                            f["STD_EPS_INSIDE"], f["ADV_BASELINE"])[0].numpy()
    return float(np.max(np.abs(a - pred) / (np.abs(a) + 1e-6)))


def _leave_one_out(r, a, group: int, spec, rtol: float, atol: float, step) -> Finding | None:
    """A_i = r_i - the mean of its group's other completions, not scaled, or divided by those others' std (Bessel's
    or the population's) + an epsilon solved per element, a completion whose others are alike left undivided (as
    NeMo-RL's leave-one-out baseline does). None where that does not give your advantages."""
    if len(r) != len(a) or len(r) % group or np.isnan(r).any():
        return None
    g, n = r.reshape(-1, group), group - 1
    total, squares = g.sum(1, keepdims=True), (g * g).sum(1, keepdims=True)
    mean = ((total - g) / n).reshape(-1)
    c = r - mean
    tol = atol + rtol * np.abs(a)
    if not np.any(np.abs(c) > 1e-7):
        return None
    spec_has = {k: getattr(spec, k) for k in ("ADV_SCALE", "STD", "STD_EPS", "STD_EPS_INSIDE")} if spec else {}
    rule = "centres each reward on the mean of its group's other completions (leave-one-out; TRL: the group's own mean)"
    if np.all(np.abs(a - c) <= tol):
        settings = {"ADV_BASELINE": "loo", "ADV_SCALE": "none"}
        return Finding("advantages", step, f"your loop {rule} and does not divide by a std",
                       {k: v for k, v in settings.items() if not (k in spec_has and _same(spec_has[k], v))}, True,
                       settles=("ADV_BASELINE", "ADV_SCALE"))
    for ddof, name in ((1, "bessel"), (0, "population")):
        if n - ddof <= 0:
            continue
        m = (total - g) / n
        var = (((squares - g * g) / n - m * m) * (n / (n - ddof))).reshape(-1)
        sd = np.sqrt(np.clip(var, 0.0, None))
        # where the others are alike the advantage is r_i - their mean, undivided; but a loop that takes their std
        # from sums of squares in float32 (NeMo-RL) can leave a rounding residue there and divide by it: such an
        # element is not read (either value is the rule's)
        alike = sd <= 1e-6 * max(float(np.abs(r).max()), 1.0)
        div = ~alike & (np.abs(c) > 1e-7)
        if not np.any(div) or np.any(np.abs(a[div]) <= 1e-12):
            continue
        eps_i = c[div] / a[div] - sd[div]
        unc = 10 * rtol * float(np.max(np.abs(c[div] / a[div]))) + 1e-12
        if float(np.ptp(eps_i)) > 2 * unc:
            continue
        eps = snap(float(np.median(eps_i)), unc)
        settings = {"ADV_BASELINE": "loo", "ADV_SCALE": "group", "STD": name, "STD_EPS": eps, "STD_EPS_INSIDE": False}
        est = "population std (n)" if name == "population" else "Bessel's std (n - 1)"
        unsettled = (f"the advantage epsilon is known to +-{unc:.1g} only ({eps:g} is the round value within that)",) \
            if unc >= max(eps, 1e-12) / 20 else ()
        return Finding("advantages", step, f"your loop {rule} and divides by those others' {est} + {eps:g}, not at "
                       "all where they are alike",
                       {k: v for k, v in settings.items() if not (k in spec_has and _same(spec_has[k], v))}, True,
                       unsettled=unsettled, settles=("ADV_BASELINE", "ADV_SCALE", "STD") + (() if unsettled else
                                                                                             ("STD_EPS",)))
    return None


def _centred_on_a_mean(rewards, adv, group: int, spec=None, rtol: float = 2e-5, atol: float = 1e-6,
                       step=None) -> Finding:
    """Your advantages as a function of your own rewards, group by group: the centring (the group's mean, the
    batch's, none), the scale (none, a constant, the group's or the batch's std, Bessel's or the population's, plus
    an epsilon outside or inside the square root, solved for in closed form: eps = (r - mean) / A - std), and a clip
    of the advantages where some sit at one magnitude. `spec`: the built-in loop's current settings (ADV_SCALE, STD,
    STD_EPS, STD_EPS_INSIDE), to say what differs."""
    r, a = _arr(rewards), _arr(adv)
    if len(r) != len(a) or len(r) == 0 or len(r) % group:
        return Finding("advantages", step, f"cannot be read: {len(r)} rewards and {len(a)} advantages in groups of "
                       f"{group}", {}, False, readable=False)
    g = r.reshape(-1, group)
    if not np.any(np.abs(a) > 1e-7) and np.all(np.nanstd(g, axis=1) == 0):  # every group's rewards alike
        return Finding("advantages", step, "every advantage is 0 and every group's rewards are alike: nothing to read "
                       "at this step", {}, False, readable=False)
    centred = {"group": (g - np.nanmean(g, axis=1, keepdims=True)).reshape(-1), "batch": r - np.nanmean(r), "none": r}
    tol = lambda x: atol + rtol * np.abs(x)  # noqa: E731
    best = None
    for centring, c in centred.items():
        zero_c = np.abs(c) <= tol(r) + 1e-7
        if not np.all(np.abs(a[zero_c]) <= tol(a[zero_c]) + 1e-6):
            continue  # a reward at its centre must have advantage 0 (no offset)
        live = ~zero_c & (np.abs(a) > 1e-7)
        if not np.any(live):
            if not np.any(~zero_c):
                continue
            best = best or (centring, None, "every advantage is 0")
            continue
        dead = ~zero_c & ~live
        if np.any(dead):
            continue  # a nonzero centred reward with advantage 0: not this centring
        s = np.full(len(r), np.nan)
        s[live] = c[live] / a[live]
        if np.any(s[live] <= 0):
            continue
        clipped = np.zeros(len(r), bool)
        mags = np.abs(a[live])
        top = mags.max()
        # advantages clipped at one magnitude: those at the top whose own scale is off the group's
        scale_kind, fitted = _scale(s, live, clipped, group, rtol)
        if scale_kind is None:
            at_top = live & np.isclose(np.abs(a), top, rtol=1e-6)
            scale_kind, fitted = _scale(s, live & ~at_top, at_top, group, rtol)
            # a clip only lowers a magnitude: each value at the top must be at least the top unclipped
            # (a group whose every live value is at the top has no scale of its own to check against: left out)
            unclipped = [abs(c[i]) / (fitted if not isinstance(fitted, dict) else fitted[i // group])
                         for i in np.flatnonzero(at_top) if not isinstance(fitted, dict) or i // group in fitted] \
                if scale_kind is not None else []
            if scale_kind is not None and unclipped and all(u >= top * (1 - 10 * rtol) for u in unclipped):
                clipped = at_top
            else:
                scale_kind = None
        if scale_kind is None:
            continue
        best = (centring, (scale_kind, fitted, clipped, top if clipped.any() else None), None)
        break
    if best is None:
        return Finding("advantages", step, "not a centring and scaling of your rewards the stage knows (group, batch or "
                       "no mean; a constant, group or batch scale)", {}, False, evidence={"rewards": r.tolist()[:8],
                                                                                       "advantages": a.tolist()[:8]})
    centring, scaled, empty = best
    if scaled is None:
        if np.any(np.nanstd(g, axis=1) > 0):  # rewards that differ within a group, every advantage 0
            return Finding("advantages", step, "your loop's advantages are 0 where the rewards of a group differ: no "
                           "centring and scaling the stage knows gives that", {}, False, no_switch=True)
        return Finding("advantages", step, f"{empty}: the rewards of every group are equal, nothing to read", {},
                       False, readable=False)
    kind, fitted, clipped, top = scaled
    return _advantage_finding(centring, kind, fitted, clipped, top, g, spec, step)


def _scale(s, live, clipped, group: int, rtol: float):
    """('none' | 'constant' | 'group', value(s)) when the per-element scales s = centred / A are 1, one constant, or
    one constant per group; None otherwise."""
    use = live & ~clipped
    if not np.any(use):
        return None, None
    vals = s[use]
    spread = lambda v: (v.max() - v.min()) / max(abs(np.median(v)), 1e-30)  # noqa: E731
    if spread(vals) <= 10 * rtol:
        if abs(np.median(vals) - 1.0) <= 10 * rtol:
            return "none", 1.0
        return "constant", float(np.median(vals))
    per_group = {}
    for i in np.flatnonzero(use):
        per_group.setdefault(i // group, []).append(s[i])
    if all(spread(np.asarray(v)) <= 10 * rtol for v in per_group.values()):
        return "group", {k: float(np.median(v)) for k, v in per_group.items()}
    return None, None


def _advantage_finding(centring, kind, fitted, clipped, top, g, spec, step) -> Finding:
    spec_has = {k: getattr(spec, k) for k in ("ADV_SCALE", "STD", "STD_EPS", "STD_EPS_INSIDE")} if spec else {}
    unsettled, settings, words, no_switch = [], {}, [], False
    if centring == "batch":
        words.append("centres the rewards on the batch's mean (TRL: each group's)")
        no_switch = True
    elif centring == "none":
        words.append("uses the rewards without subtracting a mean (TRL: each group's)")
        no_switch = True
    else:
        words.append("centres each group's rewards on its mean")
    if kind == "none":
        settings["ADV_SCALE"] = "none"
        words.append("and does not divide by a std")
        fit = {}
    elif kind == "constant" and (fit := _std_fit({k: fitted for k in range(len(g)) if np.nanstd(g[k]) > 0},
                                                 {k: g[k] for k in range(len(g))})):
        kind = "group"  # one scale for every group, as each group's own std gives it (their stds are equal here)
        settings["ADV_SCALE"] = "group"
    elif kind == "constant":
        flat = g.reshape(-1)
        fit = _std_fit({0: fitted}, {0: flat})
        if fit:
            settings["ADV_SCALE"] = "batch"
        else:
            words.append(f"and divides by a constant {fitted:.4g} (no std of the rewards + an epsilon gives it)")
            no_switch = True
    else:
        fit = _std_fit(fitted, {k: g[k] for k in fitted})
        if fit:
            settings["ADV_SCALE"] = "group"
        else:
            words.append("and divides each group by a factor of its own that no std + epsilon of its rewards gives")
            no_switch = True
    live_sd = [float(np.nanstd(g[k], ddof=1)) for k in range(len(g)) if np.nanstd(g[k]) > 0]
    if fit and len(live_sd) > 1 and max(live_sd) - min(live_sd) <= 1e-9 * max(live_sd):
        unsettled.append("every group's rewards have the same spread at this step: the group's std or the batch's, "
                         "Bessel's or the population's, each with its own epsilon, fit alike")
    elif fit and len(live_sd) == 1 and len(g) > 1:
        unsettled.append("one group's rewards differ at this step: the group's std and the batch's cannot be told "
                         "apart")
    if fit:
        std, inside, eps, unc = fit["std"], fit["inside"], fit["eps"], fit["unc"]
        settings.update(STD=std, STD_EPS_INSIDE=inside, STD_EPS=eps)
        where = "the batch's" if kind == "constant" else "the group's"
        est = "population std (n)" if std == "population" else "Bessel's std (n - 1)"
        words.append(f"and divides by {where} {est}" + (f" with {eps:g} inside the square root, sqrt(var + eps)"
                                                        if inside else f" + {eps:g}"))
        if unc > 0 and (eps == 0 or unc >= eps):
            unsettled.append(f"the advantage epsilon is below {unc:.1g}: the run cannot tell {eps:g} from other "
                             "values that small (the rewards' spread is too wide for it to show)")
        elif unc > 0 and unc >= eps / 20:
            unsettled.append(f"the advantage epsilon is known to +-{unc:.1g} only ({eps:g} is the round value within "
                             "that)")
    if clipped is not None and clipped.any():
        words.append(f"then clips the advantages to [-{top:.4g}, {top:.4g}]")
        no_switch = True
    if spec_has:
        settings = {k: v for k, v in settings.items() if k in spec_has and not _same(spec_has[k], v)}
        if "STD_EPS" in settings and unsettled and abs(spec_has["STD_EPS"] - fit["eps"]) <= fit["unc"]:
            settings.pop("STD_EPS")  # the spec's own epsilon is as good as any the run can tell apart
    same = not settings and not no_switch
    ambiguous = any(u.startswith(("every group's rewards", "one group's rewards")) for u in unsettled)
    settles = () if ambiguous else ("ADV_SCALE", "STD", "STD_EPS_INSIDE") + (() if unsettled else ("STD_EPS",)) \
        if fit or kind == "none" else ()
    return Finding("advantages", step, "your loop " + " ".join(words), settings, True, same_as_spec=same,
                   no_switch=no_switch, unsettled=tuple(unsettled), settles=settles if not no_switch else (),
                   evidence={"centring": centring, "scale": kind, **({"eps_estimate": fit["raw"]} if fit else {})})


def _std_fit(scales: dict, rewards: dict) -> dict | None:
    """The std estimator and epsilon (outside or inside the square root) that give each group's measured scale from
    its rewards: eps = scale - std (outside) or scale^2 - var (inside), the same for every group and not negative.
    Returns the simplest fit ({std, inside, eps, unc, raw}) or None."""
    fits = []
    for std in ("bessel", "population"):
        for inside in (False, True):
            est = []
            for k, sc in scales.items():
                x = rewards[k][~np.isnan(rewards[k])]
                if len(x) < 2:
                    continue
                sd = float(np.std(x, ddof=1 if std == "bessel" else 0))
                est.append((sc * sc - sd * sd, sc * sc) if inside else (sc - sd, sc))
            if not est:
                continue
            eps = np.array([e for e, _ in est])
            # resolution: the scale is known to ~1e-6 relative (float32 arithmetic on your side)
            unc = max(3e-6 * max(s for _, s in est), float(eps.max() - eps.min()) / 2)
            centre = float(np.median(eps))
            if eps.max() - eps.min() > max(6e-6 * max(s for _, s in est), 0.05 * abs(centre)):
                continue  # not one epsilon for every group
            if centre < -unc:
                continue
            fits.append({"std": std, "inside": inside, "eps": snap(max(centre, 0.0), unc), "unc": unc,
                         "raw": centre, "spread": float(eps.max() - eps.min())})
    if not fits:
        return None
    # the simplest: the epsilon outside the root before inside, Bessel's (TRL's) before the population's
    return sorted(fits, key=lambda f: (f["inside"], f["spread"] > f["unc"], f["std"] != "bessel"))[0]


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)
    return a == b


# ---------------------------------------------------------------------------------------------
# which tokens count in the loss
# ---------------------------------------------------------------------------------------------
def mask(mask_rows, completion_ids, eos_ids, spec=None, pad_id: int | None = None, max_tokens: int | None = None,
         step=None) -> Finding:
    """The tokens your loss counts, against TRL's (every completion token through the first eos, the eos included;
    none after), read as a rule on token features: whole completions out (the truncated ones: TRL's
    mask_truncated_completions), the eos at the end out, every occurrence of some token ids out (a mask built from
    `ids != pad_id`, where a generated token equal to the pad id drops out too), every position from some index on
    out (a length limit), or the padding after short completions counted."""
    eos = set(eos_ids)
    lengths = [len(c) for c in completion_ids]
    truncated = [not c or c[-1] not in eos for c in completion_ids]
    mask_trunc = bool(getattr(spec, "MASK_TRUNCATED", False)) if spec else False
    trl = [[0 if (mask_trunc and tr) else 1] * n for n, tr in zip(lengths, truncated)]
    mine = [[1 if float(x) > 0.5 else 0 for x in row] for row in mask_rows]
    if len(mine) != len(completion_ids):
        return Finding("mask", step, f"cannot be read: {len(mine)} mask rows for {len(completion_ids)} completions",
                       {}, False, readable=False)
    out = [(i, t) for i, (m, ref) in enumerate(zip(mine, trl)) for t in range(len(ref))
           if ref[t] == 1 and (t >= len(m) or m[t] == 0)]
    extra_in = [(i, t) for i, (m, ref) in enumerate(zip(mine, trl)) for t in range(len(ref))
                if ref[t] == 0 and t < len(m) and m[t] == 1]
    padding = [(i, t) for i, m in enumerate(mine) for t in range(lengths[i], len(m)) if m[t] == 1]
    counted = sum(map(sum, (r[:n] for r, n in zip(mine, lengths))))
    ev = {"out": len(out), "padding_counted": len(padding), "tokens": counted}
    rules, settings, no_switch, left = [], {}, False, set(out)
    token_unsettled: tuple = ()
    # truncated completions entirely out (TRL's mask_truncated_completions), or entirely in against it
    whole = {i for i in range(len(mine)) if lengths[i] and all((i, t) in left for t in range(lengths[i]))}
    if whole and whole == {i for i, tr in enumerate(truncated) if tr and lengths[i]}:
        rules.append(f"leaves the {len(whole)} truncated completion(s) (no eos) out of the loss entirely")
        settings["MASK_TRUNCATED"] = True
        left -= {(i, t) for i in whole for t in range(lengths[i])}
    if extra_in and mask_trunc and {i for i, _ in extra_in} == {i for i, tr in enumerate(truncated) if tr}:
        rules.append("keeps truncated completions in the loss")
        settings["MASK_TRUNCATED"] = False
        extra_in = []
    if left:
        ids = {completion_ids[i][t] for i, t in left}
        every = {(i, t) for i, c in enumerate(completion_ids) for t, tok in enumerate(c) if tok in ids
                 and not (settings.get("MASK_TRUNCATED") and truncated[i])}
        last_eos = {(i, lengths[i] - 1) for i in range(len(mine)) if lengths[i] and not truncated[i]}
        if left == last_eos or (ids <= eos and left == every):
            rules.append("leaves each completion's eos token out of the loss (TRL counts it)")
            settings["COMPLETION_MASK"] = "no_eos"
            left = set()
        elif left == every:
            named = ", ".join(str(x) for x in sorted(ids)[:6])
            pad = f" (the pad token's id, {pad_id}: a mask built from `ids != pad_id`)" if pad_id in ids else ""
            rules.append(f"leaves every token with id {named}{pad} out of the loss, wherever it stands "
                         f"({len(left)} token(s) here)")
            if len(ids) == 1:  # one id: MASK_TOKEN_ID (whether it also leaves the sequence is the search's to tell)
                settings["MASK_TOKEN_ID"] = int(next(iter(ids)))
                token_unsettled = ("whether that token also leaves the sequence the model sees (MASK_TOKEN_DROP, as a "
                                   "loop that packs its sequences without pad tokens does): the mask cannot tell, the "
                                   "log-probs after it can: the search decides",)
            else:
                no_switch = True
            left = set()
        else:
            starts = {}
            for i, t in left:
                starts.setdefault(i, []).append(t)
            cut = {min(ts) for ts in starts.values()}
            if len(cut) == 1 and all(sorted(ts) == list(range(min(ts), lengths[i])) for i, ts in starts.items()) and \
                    all(lengths[i] <= min(cut) for i in range(len(mine)) if i not in starts):
                k = min(cut)
                rules.append(f"counts only the first {k} tokens of each completion")
                no_switch = True
                left = set()
    unexplained = bool(left)
    if left:
        i, t = sorted(left)[0]
        rules.append(f"leaves {len(left)} other token(s) out that no rule on their id, position or eos explains "
                     f"(the first: completion {i}, token {t}, id {completion_ids[i][t]})")
        no_switch = True
    if padding:
        rules.append(f"counts {len(padding)} padding position(s) after short completions in the loss")
        if settings.get("COMPLETION_MASK") == "no_eos":  # two mask rules at once: no one switch does both
            no_switch = True
            settings.pop("COMPLETION_MASK")
        else:
            settings["COMPLETION_MASK"] = "all"
    if extra_in:
        rules.append(f"counts {len(extra_in)} token(s) TRL leaves out")
        no_switch = True
    # what this step can show: truncation only where a completion is truncated, the eos rule only where one ends
    # with an eos, the padding only where lengths differ
    shows = (("MASK_TRUNCATED",) if any(truncated) else ()) + (
        ("COMPLETION_MASK",) if not all(truncated) and len(set(lengths)) > 1 else ())
    if not rules:
        return Finding("mask", step, "your loop counts every completion token through the eos, as TRL does", {},
                       True, same_as_spec=True, evidence=ev, settles=shows)
    spec_mask = getattr(spec, "COMPLETION_MASK", "eos") if spec else "eos"
    settings = {k: v for k, v in settings.items() if not (k == "COMPLETION_MASK" and v == spec_mask)
                and not (k == "MASK_TRUNCATED" and v == mask_trunc)}
    exact = not unexplained
    spec_token = getattr(spec, "MASK_TOKEN_ID", -1) if spec else -1
    if settings.get("MASK_TOKEN_ID") == spec_token:
        settings.pop("MASK_TOKEN_ID")
    return Finding("mask", step, "your loop " + "; ".join(rules), settings, exact, no_switch=no_switch, evidence=ev,
                   unsettled=token_unsettled,
                   settles=tuple(k for k in ("COMPLETION_MASK", "MASK_TRUNCATED", "MASK_TOKEN_ID")
                                 if k in settings or k in shows) if exact and not no_switch else ())


# ---------------------------------------------------------------------------------------------
# how per-token losses are weighted into the loss
# ---------------------------------------------------------------------------------------------
def weighting(per_token_loss, mask_rows, loss: float, lengths, grad_accum: int, max_tokens: int, spec=None,
              step=None, rtol: float = 1e-4, atol: float = 1e-7) -> Finding:
    """How your per-token losses become your loss: each of TRL's loss types recomputed from your own per-token losses
    and mask (grpo: a mean per completion, then over completions; dapo: over every token of the step; dr_grpo: the
    sum over completions x max_completion_length; the plain sum), each also as the mean of the micro-batches' losses
    (a loop that logs that); else the divisor itself, D = sum / loss, set against the counts it could be (the
    mask's tokens, every completion token, completions x the longest, completions x max tokens)."""
    rows = [np.nan_to_num(np.asarray(r[:n], dtype=np.float64)) for r, n in zip(per_token_loss, lengths)]
    masks = [np.asarray(m[:n], dtype=np.float64) for m, n in zip(mask_rows, lengths)]
    sums = np.array([float((x * m).sum()) for x, m in zip(rows, masks)])
    counts = np.array([float(m.sum()) for m in masks])
    n = len(rows)
    loss = float(loss)
    if not n or not math.isfinite(loss):
        return Finding("weighting", step, f"cannot be read (loss {loss:g}, {n} rows)", {}, False, readable=False)
    total = float(sums.sum())
    values = {"sequence": float(np.mean(sums / np.maximum(counts, 1.0))),
              "token_global": total / max(float(counts.sum()), 1.0),
              "constant": total / max(n * max_tokens, 1), "sum": total}
    if grad_accum > 1 and n % grad_accum == 0:  # a mean per micro-batch, micro-batches cut in the rollout's order
        k = n // grad_accum
        values["token_local_in_order"] = float(np.mean([sums[i:i + k].sum() / max(counts[i:i + k].sum(), 1.0)
                                                        for i in range(0, n, k)]))
    names = {"sequence": "averages per completion, then over completions (TRL's grpo)",
             "token_global": "divides the masked sum by the step's loss tokens (TRL's dapo)",
             "constant": "divides the masked sum by completions x max_completion_length (TRL's dr_grpo)",
             "sum": "sums the per-token losses without normalising",
             "token_local": "divides each micro-batch's masked sum by its own loss tokens (TRL's bnpo)",
             "token_local_in_order": "divides each micro-batch's masked sum by its own loss tokens, then averages over "
                                     "micro-batches cut in the rollout's order (TRL's bnpo cuts a shuffled round)"}
    if not np.any(np.abs(sums) > 1e-12) and abs(loss) <= atol:  # nothing trains at this step (every advantage 0)
        return Finding("weighting", step, "nothing to read at this step: the per-token losses and the loss are 0 (every "
                       "advantage 0)", {}, False, readable=False)
    close = lambda v: abs(v - loss) <= atol + rtol * abs(loss)  # noqa: E731
    hits = [(k, 1) for k, v in values.items() if close(v)]
    hits += [(k, grad_accum) for k, v in values.items() if grad_accum > 1 and close(v / grad_accum)
             and k != "token_local_in_order"]
    spec_norm = ("sum" if getattr(spec, "LOSS_SUM", False) else getattr(spec, "LOSS_NORM", "sequence")) if spec else None
    if spec_norm == "token_local" and grad_accum == 1:  # one micro-batch: bnpo is dapo
        spec_norm = "token_global"
    if spec_norm == "token_local" and not any(close(v) for v in values.values()):
        return Finding("weighting", step, "cannot be read: the spec's loss type averages per micro-batch of a shuffled "
                       "round, which these tensors cannot recompute", {}, False, readable=False)
    if hits:
        if spec_norm and any(k == spec_norm and f == 1 for k, f in hits):
            alike = list(dict.fromkeys(k for k, _ in hits if k != spec_norm))
            return Finding("weighting", step, f"your loop {names[spec_norm]}, as the spec's loss type does", {}, True,
                           same_as_spec=True, unsettled=(f"{', '.join(alike)} give the same number at this step",)
                           if alike else (), settles=() if alike else ("LOSS_NORM", "LOSS_SUM", "MICRO_BATCH_ORDER"))
        k, f = hits[0]
        said = names[k] + (f", and what it logs is the mean of its {f} micro-batches' losses" if f > 1 else "")
        settings = {"LOSS_SUM": True} if k == "sum" else {"LOSS_NORM": "token_local", "MICRO_BATCH_ORDER": "rollout"} \
            if k == "token_local_in_order" else {"LOSS_NORM": k}
        if spec:
            settings = {s: v for s, v in settings.items() if not _same(getattr(spec, s, None), v)}
        alike = list(dict.fromkeys(h for h, _ in hits[1:] if h != k))
        return Finding("weighting", step, "your loop " + said, settings, True,
                       unsettled=(f"{', '.join(alike)} give the same number at this step",) if alike else (),
                       evidence={"values": values, "logged_mean_of_micro_batches": f > 1},
                       settles=() if alike else ("LOSS_NORM", "LOSS_SUM", "MICRO_BATCH_ORDER"))
    if abs(total) < 1e-3 * max(float(np.abs(sums).sum()), 1e-30) or loss == 0:
        return Finding("weighting", step, "cannot be read: the masked per-token losses sum to nearly 0 or the loss "
                       "is 0", {}, False, readable=False)
    d = total / loss
    longest = max(lengths) if lengths else 0
    cands = {"the loss's tokens": counts.sum(), "every completion token (the mask's dropped tokens too)": sum(lengths),
             "completions x the longest completion": n * longest, "completions x max tokens": n * max_tokens,
             "completions": n}
    named = next((f"{what} ({v:.0f})" + (f", times {f} micro-batches" if f > 1 else "")
                  for f in (1, grad_accum) for what, v in cands.items() if abs(d - f * v) <= 1e-3 * abs(d)), None)
    ev = {"divisor": d, "tokens": float(counts.sum()), "completion_tokens": sum(lengths)}
    if named:  # a count: the built-in loop divides by it as a constant where it is the same at every step read
        return Finding("weighting", step, f"your loop divides the masked per-token losses' sum by {d:.6g}: {named}",
                       {"LOSS_DIVISOR": float(f"{d:.5g}")}, True, evidence={**ev, "count": named},
                       settles=("LOSS_NORM", "LOSS_SUM", "LOSS_DIVISOR"))
    d = float(f"{d:.5g}")
    unsettled = (f"if what your loop logs is the mean of its {grad_accum} micro-batches' losses, it trains with a "
                 f"divisor of {d / grad_accum:.5g}",) if grad_accum > 1 else ()
    return Finding("weighting", step, f"your loop divides the masked per-token losses' sum by a constant {d:g} (no "
                   "count of its tokens or completions)", {"LOSS_DIVISOR": d}, True, unsettled=unsettled, evidence=ev,
                   settles=("LOSS_NORM", "LOSS_SUM", "LOSS_DIVISOR"))


# ---------------------------------------------------------------------------------------------
# the per-token objective
# ---------------------------------------------------------------------------------------------
def _kl(logp, ref, estimator: str):
    d = ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return np.exp(d) - d - 1.0


def objective(per_token_loss, adv, logps, mask_rows, lengths, old_logps=None, ref_logps=None, spec=None, step=None,
              rtol: float = 1e-4, atol: float = 1e-6, sampler_logps=None) -> Finding:
    """Your per-token loss against TRL's -min(ratio A, clip(ratio) A) + beta kl: the residual after the policy term
    is fitted as beta times each KL estimator (k1, k2, k3; with and without TRL's factor of the policy ratio) by least
    squares; a policy term -logp A (REINFORCE's value) is recognised; where the ratio leaves 1, the clip bounds are
    read from the tokens whose term is clipped (the ratio used: -term / A), and bracketed where none is.
    `sampler_logps` (the rollouts' log-probs of a separate sampler, vLLM's): the policy term with and without TRL's
    importance-sampling weight of each mode (the spec's bounds), so a loop that corrects, or does not, is read, and
    where every weight sits within tolerance of 1 it is said that this step cannot tell."""
    clip_low = getattr(spec, "CLIP_LOW", 0.2) if spec else 0.2
    clip_high = getattr(spec, "CLIP_HIGH", 0.2) if spec else 0.2
    keep = [np.asarray(m[:n], dtype=np.float64) > 0.5 for m, n in zip(mask_rows, lengths)]
    cat = lambda rows: np.concatenate([np.asarray(r[:n], dtype=np.float64)[k] for r, n, k  # noqa: E731
                                       in zip(rows, lengths, keep)]) if rows is not None else None
    ptl, lp = cat(per_token_loss), cat(logps)
    a = np.concatenate([np.full(int(k.sum()), float(x)) for x, k in zip(_arr(adv), keep)])
    old = cat(old_logps) if old_logps is not None else lp
    ref = cat(ref_logps)
    if ptl is None or lp is None or len(ptl) != len(a) or not len(ptl):
        return Finding("objective", step, "cannot be read (per_token_loss, logps and advantages are needed)", {}, False,
                       readable=False)
    if not np.any(np.abs(a) > 0) and (ref is None or not np.any(np.abs(ref - lp) > 1e-6)):
        return Finding("objective", step, "nothing to read at this step: every advantage is 0 and no KL term can "
                       "show", {}, False, readable=False)
    ratio = np.exp(lp - old)
    tol = atol + rtol * np.abs(ptl)
    forms = {"ratio": -np.minimum(ratio * a, np.clip(ratio, 1 - clip_low, 1 + clip_high) * a), "logp": -lp * a}
    whole = sampler_logps is not None and len(sampler_logps) == len(lengths) and all(
        len(r) >= n for r, n in zip(sampler_logps, lengths))  # (rows as long as their completions, else not read)
    weights = _is_weights(old_logps if old_logps is not None else logps, sampler_logps, lengths, keep,
                          getattr(spec, "IS_CLIP_MIN", 0.0) or None, getattr(spec, "IS_CLIP_MAX", 3.0)) if whole else {}
    forms.update({f"is:{m}": forms["ratio"] * w for m, w in weights.items()})  # TRL: the weight before the KL term

    def fit(pg):
        """None, or how `pg` (+ a KL term) gives your per-token loss: (the KL fit or None, its weights' spread, what
        stays unsettled)."""
        resid = ptl - pg
        if np.all(np.abs(resid) <= tol):
            return None, 0.0, []
        if ref is None:
            return None
        fits = []  # every estimator (and ratio factor) that fits: for a small log-ratio k2 and k3 look alike
        for est in ("k3", "k1", "k2"):
            for factor in (True, False):
                k = _kl(lp, ref, est) * (ratio if factor else 1.0)
                if not np.any(np.abs(k) > 1e-12):
                    continue
                beta = float(np.dot(k, resid) / np.dot(k, k))
                if beta > 0 and np.all(np.abs(resid - beta * k) <= tol + 1e-6 * beta):
                    fits.append((est, beta, factor))
        if not fits:
            return None
        ests, betas = list(dict.fromkeys(e for e, _, _ in fits)), [b for _, b, _ in fits]
        return fits[0], max(betas) - min(betas), ([] if len(ests) < 2 else [  # (estimators alike: weights alike)
            f"the KL estimators {', '.join(ests)} fit alike at this step (a small log-ratio), with weights "
            f"{min(betas):.3g} to {max(betas):.3g}"])

    fitted = {}
    for form, pg in forms.items():
        got = fit(pg)
        if got is not None:
            fitted[form] = (pg, *got)
            if not weights:  # (with a sampler's log-probs every form is tried: with and without its weight)
                break
    unsettled, out, spread, is_settings, is_words, is_settles = [], None, 0.0, {}, [], ()
    plain = next((f for f in ("ratio", "logp") if f in fitted), None)
    is_fit = [m for m in weights if f"is:{m}" in fitted]
    if weights and (plain or is_fit):
        is_settings, is_words, is_settles, is_unsettled = _is_reading(plain, is_fit, weights, spec, tol, a)
        unsettled += is_unsettled
        form = plain or f"is:{is_settings['IS_MODE']}"  # (the mode read is one that fits)
    else:
        form = plain
    if form is not None:
        pg, kl, spread, kl_unsettled = fitted[form]
        out = ("ratio" if form.startswith("is:") else form, pg, kl)
        unsettled += kl_unsettled
    settings, words = dict(is_settings), list(is_words)
    if out is None:
        # (a weight on the policy term is no clip: -term / A is the weight then; and at a ratio of exactly 1 no clip
        # bound can act)
        clip = None if weights or not np.any(np.abs(ratio - 1.0) > 1e-6) else _clip_bounds(
            ptl, ratio, a, ref is None, clip_low, clip_high)
        if clip:
            return dataclasses.replace(clip, step=step)
        if weights:
            return Finding("objective", step, "your per-token loss is not TRL's objective with or without its "
                           "importance-sampling weight (any of its four modes at the spec's bounds IS_CLIP_MIN, "
                           "IS_CLIP_MAX; other bounds, or another correction, are not read)", {}, False, no_switch=True)
        if old_logps is None:
            return Finding("objective", step, "cannot be read: your per-token loss is not -A (+ a KL term) with the "
                           "ratio taken as 1; where the ratio is not 1 (a second pass, old log-probs from another "
                           "pass) the stage needs old_logps saved", {}, False, readable=False)
        return Finding("objective", step, "your per-token loss is not -min(ratio A, clip(ratio) A) + beta KL (k1, k2 "
                       "or k3, with or without the ratio factor) nor -logp A with the same inputs", {}, False,
                       no_switch=True)
    form, pg, kl = out
    if form == "logp":
        words.append("takes the policy term as -logp * A (REINFORCE's value; TRL's -ratio * A has the same gradient "
                     "at ratio 1, another value: the logged loss differs in value alone)")
    if kl:
        est, beta, factor = kl
        near = min((0.001, 0.005, 0.01, 0.02, 0.04, 0.05, 0.1, 0.2, 0.5, 1.0), key=lambda v: abs(v - beta))
        b = near if abs(near - beta) <= max(1e-4 * beta, min(spread, 0.05 * beta)) else snap(beta, 1e-4 * beta, ())
        words.append(f"adds a KL penalty {est} of weight {b:g}" + ("" if factor else ", not multiplied by the policy "
                                                                                "ratio (TRL multiplies it)"))
        settings["BETA"] = b
        if est != "k3":
            settings["KL_ESTIMATOR"] = est
        if not factor:
            settings["KL_IS_CORRECTION"] = False
        if np.allclose(ratio, 1.0, atol=1e-7):
            unsettled.append("the ratio is 1 at this step: TRL's factor of the policy ratio on the KL changes the "
                             "gradient only, which the tensors' values cannot show")
            settings.pop("KL_IS_CORRECTION", None)
    elif ref is not None and np.any(np.abs(ref - lp) > 1e-6):
        words.append("saves a per-token loss with no KL term in it, though it saves reference log-probs (a KL "
                     "aggregated apart, or none)")
        k3 = np.abs(_kl(lp, ref, "k3")).max()
        unsettled.append(f"a KL weight below about {float(np.max(tol)) / max(k3, 1e-30):.2g} would not show at this "
                         "step (the reference is that close to the policy)")
    elif ref is not None:
        unsettled.append("the reference model's log-probs equal the policy's at this step (it starts from them): a "
                         "KL term is 0 in value here")
    moved = np.abs(ratio - 1.0) > 1e-6
    if not np.any(moved):
        unsettled.append("the ratio is exactly 1 at this step (one pass on the policy that generated): the clip bounds "
                         "cannot act")
    elif form == "ratio":
        unsettled += _unreached(ratio, a, clip_low, clip_high)
    if spec:
        spec_has = {"BETA": spec.BETA, "KL_ESTIMATOR": getattr(spec, "KL_ESTIMATOR", "k3"),
                    "KL_IS_CORRECTION": getattr(spec, "KL_IS_CORRECTION", True),
                    "IS_CORRECTION": getattr(spec, "IS_CORRECTION", False), "IS_MODE": getattr(spec, "IS_MODE", None)}
        settings = {k: v for k, v in settings.items() if not _same(spec_has.get(k), v)}
    rule = "your loop " + ("; ".join(words) if words else "has TRL's per-token objective")
    # a KL term can show in value (the reference apart from the policy), and one was found: a per-token loss saved
    # without it (a KL aggregated apart, as verl's) says nothing of the weight
    seen = ref is not None and np.any(np.abs(ref - lp) > 1e-6) and kl is not None and not any(
        u.startswith("the KL estimators") for u in unsettled)
    settles = ("BETA", "KL_ESTIMATOR") + (("KL_IS_CORRECTION",) if kl and np.any(moved) else ()) if seen else ()
    return Finding("objective", step, rule, settings, True, same_as_spec=not settings and form == "ratio",
                   unsettled=tuple(unsettled), settles=settles + is_settles,
                   evidence={"form": form, **({"kl": kl} if kl else {})})


def _is_weights(trainer_rows, sampler_rows, lengths, keep, lo: float | None, hi: float) -> dict:
    """TRL's importance-sampling weight of every kept token, each mode, as the built-in loop computes it
    (core.is_weights, in float64): a sequence's ratio sums over the completion's tokens (TRL's completion mask, not
    the loss's), shared by its tokens."""
    import torch

    from scratch_grpo.core import IS_MODES, is_weights

    width = max(lengths)
    pad = lambda rows: torch.tensor([list(r[:n]) + [0.0] * (width - n) for r, n in zip(rows, lengths)],  # noqa: E731
                                    dtype=torch.float64)
    completion = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)
    kept = torch.tensor(np.array([np.pad(k, (0, width - len(k))) for k in keep], dtype=bool))
    out = {}
    for mode in IS_MODES:
        w, _raw = is_weights(pad(trainer_rows), pad(sampler_rows), completion, mode, lo, hi)
        out[mode] = w.expand(-1, width)[kept].numpy()
    return out


def _is_reading(plain, is_fit: list, weights: dict, spec, tol, a) -> tuple:
    """What the forms that fit say of the importance-sampling correction: (settings, words, settles, unsettled)."""
    spec_on = getattr(spec, "IS_CORRECTION", False)
    spec_mode = getattr(spec, "IS_MODE", "sequence_mask")
    live = np.abs(a) > 0  # (a token with A = 0 shows no weight)
    shown = weights[spec_mode if not is_fit or spec_mode in is_fit else is_fit[0]]
    far = float(np.max(np.abs(shown[live] - 1.0))) if np.any(live) else 0.0
    if plain and is_fit:  # the weights sit within tolerance of 1: with or without them, the same values
        return {}, [], (), [f"the importance-sampling weights are within {far:.2g} of 1 at this step, inside the "
                            f"tolerance ({float(np.max(tol)):.2g}): whether your loop weights its loss by them cannot "
                            "show here"]
    if plain:
        words = ["does not weight its per-token loss by the sampler's importance-sampling ratio, though it trains on "
                 f"a separate sampler's completions (the weights reach {far:.2g} from 1 here)"] if spec_on else []
        return {"IS_CORRECTION": False}, words, ("IS_CORRECTION",), []
    mode = spec_mode if spec_mode in is_fit else is_fit[0]
    differs = not spec_on or mode != spec_mode
    words = [f"weights its per-token loss by TRL's importance-sampling ratio ({mode})"] if differs else []
    levels = {m.split("_")[0] for m in is_fit}
    lo, hi = getattr(spec, "IS_CLIP_MIN", 0.0) or 0.0, getattr(spec, "IS_CLIP_MAX", 3.0)
    unsettled = [] if len(is_fit) < 2 else [  # truncating and masking agree until a weight leaves the bounds
        f"no {levels.pop()} weight left TRL's bounds [{lo:g}, {hi:g}] at this step: what your loop does past them "
        "(truncates, masks, or neither) cannot show"] if len(levels) == 1 else [
        f"the modes {', '.join(is_fit)} give the same weights at this step"]
    return {"IS_CORRECTION": True, "IS_MODE": mode}, words, ("IS_CORRECTION",) + (
        ("IS_MODE",) if len(is_fit) == 1 else ()), unsettled


def _clip_bounds(ptl, ratio, a, no_kl: bool, clip_low: float, clip_high: float) -> Finding | None:
    """Without a KL term: the ratio each token's term used (-term / A) against the ratio itself; where they differ
    the term was clipped, and the bound is the ratio used. A bound no token reached is bracketed, not named."""
    if not no_kl:
        return None
    ok = np.abs(a) > 1e-6
    used = -ptl[ok] / a[ok]
    r = ratio[ok]
    clipped = np.abs(used - r) > 1e-4 * np.abs(r) + 1e-6
    if not np.any(clipped):
        return None
    hi, lo = used[clipped & (used > 1)], used[clipped & (used < 1)]
    found, words = {}, []
    if len(hi) and np.ptp(hi) <= 1e-4:
        found["CLIP_HIGH"] = float(f"{hi.mean() - 1:.4g}")
        words.append(f"clips the ratio above at 1 + {found['CLIP_HIGH']:g} ({len(hi)} token(s) clipped there)")
    if len(lo) and np.ptp(lo) <= 1e-4:
        found["CLIP_LOW"] = float(f"{1 - lo.mean():.4g}")
        words.append(f"clips the ratio below at 1 - {found['CLIP_LOW']:g} ({len(lo)} token(s) clipped there)")
    if not words:
        return None
    return Finding("objective", None, "your loop " + "; ".join(words), {
        k: v for k, v in found.items() if not _same(v, clip_high if k == "CLIP_HIGH" else clip_low)}, True,
        unsettled=_unreached(r[~clipped], a[ok][~clipped], *(None if k in found else b for k, b in (
            ("CLIP_LOW", clip_low), ("CLIP_HIGH", clip_high)))), settles=tuple(found))


def _unreached(ratio, a, clip_low: float | None, clip_high: float | None) -> tuple:
    """Where no token's ratio reached a bound (the upper one binds for A > 0, the lower for A < 0): what the run can
    say of it is a bracket."""
    out = []
    up, down = ratio[a > 0], ratio[a < 0]
    if clip_high is not None and len(up) and up.max() < 1 + clip_high:
        out.append(f"no token's ratio reached the upper clip bound (the largest with A > 0: {up.max():.4g}): any "
                   f"bound above {up.max() - 1:.3g} fits, the spec's {clip_high:g} among them")
    if clip_low is not None and len(down) and down.min() > 1 - clip_low:
        out.append(f"no token's ratio reached the lower clip bound (the smallest with A < 0: {down.min():.4g}): any "
                   f"bound above {1 - down.min():.3g} fits, the spec's {clip_low:g} among them")
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# the optimizer, from a slice of the parameters
# ---------------------------------------------------------------------------------------------
_BETA1 = (0.9, 0.0, 0.5, 0.8, 0.95, 0.99)
_BETA2 = (0.999, 0.99, 0.98, 0.95, 0.9, 0.9999, 0.5)
_ADAM_EPS = (1e-8, 1e-6, 1e-5, 1e-7, 1e-4, 1e-10)


def _adam_dirs(grads, norms, beta1, beta2, eps, max_norm):
    """Adam's update direction m_hat / (sqrt(v_hat) + eps) at each step, for gradients clipped as
    clip_grad_norm_ clips them (coefficient max_norm / (norm + 1e-6), at most 1)."""
    m = np.zeros_like(grads[0])
    v = np.zeros_like(grads[0])
    out = []
    for t, (g, nrm) in enumerate(zip(grads, norms), 1):
        c = 1.0 if not max_norm or not math.isfinite(max_norm) else min(1.0, max_norm / (nrm + 1e-6))
        g = g * c
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        out.append((m / (1 - beta1 ** t)) / (np.sqrt(v / (1 - beta2 ** t)) + eps))
    return out


def _fit_updates(dirs, before, updates, decay, with_se: bool = False):
    """Per step, least squares u = -lr d - lr wd p (p on the decayed elements only): (lrs, wds, relative residual),
    and with `with_se` the standard error of each step's wd (the weights' own rounding makes the update's noise: a
    decay of lr x wd x p is a few ulps of p)."""
    lrs, wds, ses, res, tot = [], [], [], 0.0, 0.0
    rest = ~decay
    for d, p, u in zip(dirs, before, updates):
        # a decay of its own on the norms and biases too (a column of theirs): torch's AdamW on model.parameters()
        cols = [-d] + ([-p * decay] if decay.any() else []) + ([-p * rest] if rest.any() else [])
        if not np.any(d):  # no gradient at this step (every advantage 0): decay alone moves the weights, and the
            x = np.stack(cols[1:], axis=1) if len(cols) > 1 else np.zeros((len(u), 1))  # rate cannot be read
            coef, *_ = np.linalg.lstsq(x, u, rcond=None)
            res += float(np.sum((x @ coef - u) ** 2))
            tot += float(np.sum(u ** 2))
            lrs.append(None)
            wds.append(None)
            continue
        x = np.stack(cols, axis=1)
        coef, *_ = np.linalg.lstsq(x, u, rcond=None)
        lr = float(coef[0])
        wd = float(coef[1] / lr) if decay.any() and lr else 0.0
        rss = float(np.sum((x @ coef - u) ** 2))
        res += rss
        tot += float(np.sum(u ** 2))
        lrs.append(lr)
        wds.append(wd)
        if with_se and decay.any() and lr:
            cov = np.linalg.pinv(x.T @ x) * rss / max(len(u) - x.shape[1], 1)
            ses.append(math.sqrt(max(float(cov[1, 1]), 0.0)) / abs(lr))
            if rest.any():  # the norms' and biases' own decay, and its standard error
                ses[-1] = (ses[-1], float(coef[-1] / lr), math.sqrt(max(float(cov[-1, -1]), 0.0)) / abs(lr))
    out = (lrs, wds, math.sqrt(res / max(tot, 1e-300)))
    return (*out, ses) if with_se else out


def optimizer(probe_rows: list[dict], grad_norms: list[float], spec=None, steps_total: int | None = None) -> Finding:
    """Adam(W) from the parameter slice your loop saved (`harness.loop.Probe`: before and after each optimizer step,
    with the gradient before clipping) and its pre-clip gradient norms: for each (beta1, beta2, eps, max_grad_norm)
    the updates are fitted per step in closed form as u = -lr d - lr wd p, and the hypothesis with the smallest
    residual wins; then each value is narrowed on its own and snapped to a round one the run cannot tell from it."""
    rows = [r for r in probe_rows if r]
    if len(rows) < 2 or len(grad_norms) < len(rows):
        return Finding("optimizer", None, f"cannot be read: {len(rows)} probed step(s) with gradient norms (at least 2 "
                       "are needed to tell Adam's betas)", {}, False, readable=False)
    never = {j for j in range(len(rows[0]["names"])) if all(r["grad"][j] is None for r in rows)}
    if never:  # parameters outside the loss's graph: they have no gradient and Adam leaves them be
        rows = [{k: [x for j, x in enumerate(v) if j not in never] for k, v in r.items()} for r in rows]
    names = rows[0]["names"]
    before = [np.concatenate([np.asarray(x, dtype=np.float64) for x in r["before"]]) for r in rows]
    after = [np.concatenate([np.asarray(x, dtype=np.float64) for x in r["after"]]) for r in rows]
    if any(g is None for r in rows for g in r["grad"]):  # a step whose backward was skipped: Adam did not step there
        keep = [i for i, r in enumerate(rows) if all(g is not None for g in r["grad"])]
        if any(i != j for i, j in zip(keep, range(len(keep)))):  # (only a skip at the end leaves Adam's count as read)
            return Finding("optimizer", None, "cannot be read: a probed step before others had no gradient at all (a "
                           "skipped backward), so Adam's step count there is not known", {}, False, readable=False)
        rows, grad_norms = [rows[i] for i in keep], [grad_norms[i] for i in keep]
        before = before[:len(keep)]
        after = after[:len(keep)]
        if len(rows) < 2:
            return Finding("optimizer", None, "cannot be read: fewer than 2 probed steps with a gradient", {}, False,
                           readable=False)
    grads = [np.concatenate([np.asarray(x, dtype=np.float64) for x in r["grad"]]) for r in rows]
    decay = np.concatenate([np.full(len(x), not ("bias" in n or "norm" in n.lower()))
                            for n, x in zip(names, rows[0]["before"])])
    updates = [a - b for a, b in zip(after, before)]
    norms = [float(x) for x in grad_norms[:len(rows)]]
    finite = [x for x in norms if math.isfinite(x) and x > 0]
    clips = [math.inf] + sorted({float(f"{x:.3g}") for x in
                                 (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, *(m * f for m in finite for f in (0.5, 0.9, 1.1)))})

    def score(b1, b2, eps, clip):
        dirs = _adam_dirs(grads, norms, b1, b2, eps, clip)
        return _fit_updates(dirs, before, updates, decay)

    best = None
    for clip in clips:  # every (beta1, beta2, threshold) on the grid: a wrong threshold skews the betas' fit
        for b1 in _BETA1:
            for b2 in _BETA2:
                res = score(b1, b2, 1e-8, clip)[2]
                if best is None or res < best[0]:
                    best = (res, b1, b2, 1e-8, clip)
    _res, b1, b2, eps, clip = best
    for _ in range(2):  # coordinate refinement: clip, eps, then the betas on finer grids
        clip = min(clips, key=lambda c: score(b1, b2, eps, c)[2])
        if math.isfinite(clip):  # narrowed between the norms around it (the clipped steps stay the same there)
            lo = max([x for x in finite if x < clip], default=clip / 4)
            hi = min([x for x in finite if x > clip], default=clip * 4)
            clip = _refine(lambda c: score(b1, b2, eps, c)[2], clip, lo, hi, bracket=False)
        eps = min(_ADAM_EPS, key=lambda e: score(b1, b2, e, clip)[2])
        b2 = _refine(lambda x: score(b1, 1 - x, eps, clip)[2], 1 - b2, 1e-5, 0.6)
        b2 = 1 - b2
        b1 = min(_BETA1, key=lambda x: score(x, b2, eps, clip)[2])
    lrs, wds, res = score(b1, b2, eps, clip)
    # what the run can tell: values whose residual stays within the fit's own noise of the best are alike; of those
    # the round value the commonest first (the grids' order), else the fitted value. The residual of a right
    # hypothesis is the weights' float32 rounding (an update of lr x O(1) is a few ulps of a weight), so a wrong
    # beta2 that a per-step rate half absorbs shows as a small excess over many elements: the margin shrinks with
    # their number (3 standard deviations of a chi-square's relative spread, at least 2% of the squared residual)
    n = sum(len(u) for u in updates)
    floor = max(res * _alike(n), 1e-6)
    # of values alike, the spec's own (nothing to name), else the grid's commonest
    prefer = lambda alike, own: own if own in alike else alike[0]  # noqa: E731
    alike_b1 = [x for x in _BETA1 if score(x, b2, eps, clip)[2] <= floor]
    b1 = prefer(alike_b1, getattr(spec, "ADAM_BETA1", None)) if alike_b1 else b1
    alike_b2 = [x for x in _BETA2 if score(b1, x, eps, clip)[2] <= floor]
    b2 = prefer(alike_b2, getattr(spec, "ADAM_BETA2", None)) if alike_b2 else float(f"{b2:.4g}")
    alike_eps = [e for e in _ADAM_EPS if score(b1, b2, e, clip)[2] <= floor]
    eps = prefer(alike_eps, getattr(spec, "ADAM_EPS", None)) if alike_eps else eps
    alike_clip = sorted({clip, *(c for c in clips if score(b1, b2, eps, c)[2] <= floor)})
    nice = [c for c in (1.0, 0.5, 0.2, 0.1, 2.0, 5.0) if c in alike_clip]
    clip = nice[0] if nice and math.isfinite(clip) else clip  # a round threshold the run cannot tell from the fit
    lrs, wds, res = score(b1, b2, eps, clip)
    rounding = _rounding(after, updates)
    exact = res < max(1e-3, 1.5 * rounding)  # (no rule fits better than the weights' own rounding)
    if not exact:  # one Adam for every parameter does not fit: parameter groups, each with settings of its own?
        sizes = [len(x) for x in rows[0]["before"]]
        groups = _parameter_groups(names, sizes, grads, before, updates, decay, norms, clip)
        if groups:
            said = "; ".join(f"lr {lr:.4g} with betas ({g1:g}, {g2:g}) on {', '.join(ns[:3])}"
                             + (f" and {len(ns) - 3} more" if len(ns) > 3 else "") for lr, g1, g2, ns in groups)
            return Finding("optimizer", None, "your loop steps its parameters in groups, each with its own Adam "
                           f"settings ({said}): the built-in loop and TRL step every parameter alike", {}, True,
                           no_switch=True, evidence={"residual": res, "groups": [list(g) for g in groups]})
    unsettled, settings, words = [], {}, []
    known = [(t, x) for t, x in enumerate(lrs) if x is not None]  # (a step with no gradient says no rate)
    if not known:
        return Finding("optimizer", None, "cannot be read: no probed step had a gradient (every advantage 0)", {},
                       False, readable=False)
    lr_tol = max(1e-3, 2 * res)  # each step's rate carries the fit's own noise
    middle = float(np.median([x for _, x in known]))  # a constant rate: the middle of the steps' noisy readings
    lr = middle if all(math.isclose(x, middle, rel_tol=lr_tol) for _, x in known) else max(x for _, x in known)
    peak = float(f"{lr:.4g}")
    settings["LR"] = peak
    sched = "constant"
    if steps_total and len(known) >= 2 and not all(math.isclose(x, middle, rel_tol=lr_tol) for _, x in known):
        if all(math.isclose(x, peak * (1 - t / steps_total), rel_tol=lr_tol) for t, x in known):
            sched = "linear"
        else:
            unsettled.append("the learning rate per step (" + ", ".join(f"{x:.4g}" for _, x in known) + ") follows "
                             "neither a constant nor a linear-to-0 schedule")
    elif len(known) < 2:
        unsettled.append(f"the learning rate was read at {len(known)} step(s) only (the others had no gradient): its "
                         "schedule cannot be told")
    settings["LR_SCHEDULE"] = sched
    words.append(f"steps Adam at a learning rate of {peak:g} ({sched})")
    settings["ADAM_BETA1"], settings["ADAM_BETA2"], settings["ADAM_EPS"] = b1, b2, eps
    words.append(f"with betas ({b1:g}, {b2:g}) and epsilon {eps:g}")
    if len(alike_b1) > 1:
        unsettled.append(f"Adam's beta1: {', '.join(f'{x:g}' for x in alike_b1)} fit the probed steps alike")
    if len(alike_b2) > 1:
        unsettled.append(f"Adam's beta2: {', '.join(f'{x:g}' for x in alike_b2)} fit the probed steps alike")
    if len(alike_eps) > 1:
        unsettled.append(f"Adam's epsilon: {', '.join(f'{x:g}' for x in alike_eps)} fit alike (gradients far above "
                         "it)")
    ses = _fit_updates(_adam_dirs(grads, norms, b1, b2, eps, clip), before, updates, decay, with_se=True)[3]
    rest_wd = [x[1:] for x in ses if isinstance(x, tuple)]
    ses = [x[0] if isinstance(x, tuple) else x for x in ses]
    wds = [w for w in wds if w is not None]
    wd = float(np.mean(wds)) if decay.any() and wds else 0.0
    wd_unc = 4 * (math.sqrt(sum(x * x for x in ses)) / len(ses) if ses else 0.0) + (float(np.ptp(wds)) / 2 if wds
                                                                                     else 0.0)
    wd = snap(wd, max(wd_unc, 1e-3 * abs(wd), 1e-6), (0.0, 0.01, 0.1, 0.001, 0.05, 0.02))
    if wd_unc > 0.5 * max(abs(wd), 1e-12) and wd_unc > 1e-4:
        unsettled.append(f"weight decay is known to about +-{wd_unc:.1g} only (at this learning rate a decay moves "
                         "weights by a few of their rounding steps)")
    settings["WEIGHT_DECAY"] = wd
    if rest_wd and wd:  # the norms and biases decayed too, at the same rate?
        w_rest = float(np.mean([w for w, _ in rest_wd]))
        se_rest = 4 * math.sqrt(sum(s * s for _, s in rest_wd)) / len(rest_wd)
        if abs(w_rest - wd) <= max(math.hypot(se_rest, wd_unc), 0.05 * wd) and abs(w_rest) > se_rest:
            settings["WEIGHT_DECAY_ALL"] = True
            words.append("on every parameter, norms and biases too (transformers' Trainer, so TRL, leaves them out)")
        elif abs(w_rest) > se_rest:
            unsettled.append(f"the norms and biases decay at {w_rest:.3g}, neither 0 nor the weights' {wd:g}")
    if wd:
        words.append(f"decoupled weight decay {wd:g}")
    if math.isinf(clip):
        settings["MAX_GRAD_NORM"] = _clip_setting(alike_clip, finite, spec)
        if settings["MAX_GRAD_NORM"]:
            unsettled.append(f"no probed step's gradient norm (the largest {max(finite, default=0.0):.4g}) reached a "
                             "clipping "
                             f"threshold: max_grad_norm {settings['MAX_GRAD_NORM']:g} or none cannot be told apart")
        else:
            words.append("without gradient clipping")
    else:
        settings["MAX_GRAD_NORM"] = float(f"{clip:.3g}")
        words.append(f"clipping the gradient norm at {clip:g}")
        below = [c for c in alike_clip if math.isfinite(c)]
        if len(below) > 1 and max(below) > 1.01 * min(below):
            unsettled.append(f"max_grad_norm between {min(below):g} and {max(below):g} fits alike (Adam all but "
                             "cancels a clipped gradient's scale)")
    if spec:
        has = {k: getattr(spec, k) for k in settings}
        settings = {k: v for k, v in settings.items() if not _same(has[k], v)
                    and not (k == "MAX_GRAD_NORM" and not v and not has[k])}
    # the rate is settled where every probed step read one and they follow a schedule; a field with look-alikes is not
    settles = ("LR", "LR_SCHEDULE") if len(known) == len(lrs) and len(known) >= 2 else ()
    settles += () if len(alike_b1) > 1 else ("ADAM_BETA1",)
    settles += () if len(alike_b2) > 1 else ("ADAM_BETA2",)
    settles += () if len(alike_eps) > 1 else ("ADAM_EPS",)
    settles += () if any(u.startswith("weight decay") for u in unsettled) else ("WEIGHT_DECAY", "WEIGHT_DECAY_ALL")
    settles += () if any("max_grad_norm" in u for u in unsettled) else ("MAX_GRAD_NORM",)
    if any(u.startswith("the learning rate per step") for u in unsettled):
        settles = tuple(k for k in settles if k not in ("LR", "LR_SCHEDULE"))
        settings.pop("LR_SCHEDULE", None)
    return Finding("optimizer", None, "your loop " + " ".join(words), settings, exact,
                   same_as_spec=not settings, unsettled=tuple(unsettled), settles=settles if exact else (),
                   evidence={"residual": res, "lrs": lrs, "weight_decays": wds})


def _parameter_groups(names, sizes, grads, before, updates, decay, norms, clip) -> list[tuple] | None:
    """Each probed tensor fitted on its own (Adam's betas on the grid, a rate per step): [(lr, beta1, beta2, names)]
    for each group of tensors stepped alike, where every tensor fits on its own and the groups' rates or betas differ
    (nanochat's AdamW groups: an embedding at 35x the rate of the rest, betas of their own); else None."""
    bounds = np.cumsum([0, *sizes])
    fits = []
    for j, name in enumerate(names):
        cut = slice(bounds[j], bounds[j + 1])
        g = [x[cut] for x in grads]
        if not any(np.any(x) for x in g):
            continue
        p, u, dec = [x[cut] for x in before], [x[cut] for x in updates], decay[cut]
        best = None
        for c in {math.inf, clip}:  # (the clip one Adam for all read may be the misfit's)
            for b1 in _BETA1:
                for b2 in _BETA2:
                    lrs, _wds, res = _fit_updates(_adam_dirs(g, norms, b1, b2, 1e-8, c), p, u, dec)
                    if best is None or res < best[0]:
                        best = (res, b1, b2, lrs)
        res, b1, b2, lrs = best
        if res > max(1e-2, 1.5 * _rounding(p, u)):
            return None  # a tensor no Adam fits on its own either (to 1%): not parameter groups
        known = [x for x in lrs if x is not None]
        fits.append((float(np.median(known)), b1, b2, name))
    groups: list[list] = []
    for lr, b1, b2, name in sorted(fits, key=lambda f: -f[0]):
        for grp in groups:
            if math.isclose(lr, grp[0], rel_tol=0.05) and (b1, b2) == (grp[1], grp[2]):
                grp[3].append(name)
                break
        else:
            groups.append([lr, b1, b2, [name]])
    return [tuple(x) for x in groups] if len(groups) > 1 else None


def _alike(n: int) -> float:
    """How far above the best relative residual another hypothesis may fit and still be alike, for a fit over n
    elements: 3 standard deviations of a chi-square's relative spread (sqrt(2 / n)) on the squared residual, at least
    2% of it."""
    return math.sqrt(1 + max(3 * math.sqrt(2 / max(n, 1)), 0.02))


def _rounding(after, updates) -> float:
    """The relative residual the weights' float32 rounding alone leaves: each stored weight is within half an ulp of
    its exact value (uniform: ulp^2 / 12)."""
    noise = sum(float(np.sum(np.spacing(np.abs(a).astype(np.float32)).astype(np.float64) ** 2)) / 12 for a in after)
    total = sum(float(np.sum(u ** 2)) for u in updates)
    return math.sqrt(noise / total) if total > 0 else 0.0


def _clip_setting(alike, norms, spec) -> float:
    """No step clipped: keep the spec's threshold where it is above every norm seen, else none (0)."""
    have = float(getattr(spec, "MAX_GRAD_NORM", 0.0)) if spec else 0.0
    if have and have > max(norms, default=0):
        return have
    return 0.0


def _refine(f, x0: float, lo: float, hi: float, iters: int = 40, bracket: bool = True) -> float:
    """Golden-section search of f on log(x) in [lo, hi] (with `bracket`, only x0 / 10 .. x0 * 10 of it); x0 unless
    something better is found."""
    a, b = (math.log(max(lo, x0 / 10)), math.log(min(hi, x0 * 10))) if bracket else (math.log(lo), math.log(hi))
    gr = (math.sqrt(5) - 1) / 2
    c, d = b - gr * (b - a), a + gr * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - gr * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + gr * (b - a)
            fd = f(math.exp(d))
    best = math.exp((a + b) / 2)
    return best if f(best) <= f(x0) else x0


# ---------------------------------------------------------------------------------------------
# every stage the saved tensors allow
# ---------------------------------------------------------------------------------------------
STAGES = ("selection", "rewards", "advantages", "mask", "weighting", "objective", "optimizer")


def identify(mine: dict[int, dict], records: list[dict], spec, eos_ids: list[int], pad_id: int | None,
             grad_norms: dict[int, float], chosen: dict[int, list] | None = None, chosen_path: str = "",
             scores: list[dict[str, list]] | None = None) -> list[Finding]:
    """Every stage your saved tensors allow, in the chain's order. `mine`: {step: {tensor: value}} (read_tensors);
    `records`: the lockstep rounds your loop trained on; `spec`: the built-in loop as TRL (what differs is said
    against it); `grad_norms`: your logged pre-clip gradient norm per step. A stage is read at every step that has
    its tensors; the exact reading with the least left unsettled wins (the earliest at a tie). Steps that train on a
    slice of a round (STEPS_PER_GENERATION > 1) are not read: their rows are not the round's. `chosen`: your loop's
    selection ({step: [(round, index), ...]}, harness.loop.trained): a step's tensors are read as those rows."""
    if spec.STEPS_PER_GENERATION > 1:
        return []
    per_round = spec.NUM_ITERATIONS
    G = spec.GROUP_SIZE
    found: dict[str, list[Finding]] = {k: [] for k in STAGES}
    weights = [float(w) for w in spec.rewards.weights]
    # each completion's total as TRL and the built-in loop sum it: a failed score counts 0, all failed is NaN
    round_rewards = [[sum(w * v for w, v in zip(weights, col) if v is not None) if any(v is not None for v in col)
                      else float("nan") for col in zip(*sc.values())] for sc in scores] if scores else None
    if chosen:
        sizes = [len(rec["completion_ids"]) for rec in records]
        eos = set(eos_ids)
        found["selection"].append(selection(
            chosen, sizes, G, per_round, round_rewards, [[len(c) for c in rec["completion_ids"]] for rec in records],
            [[not c or c[-1] not in eos for c in rec["completion_ids"]] for rec in records], chosen_path))
    bf16 = getattr(spec, "DTYPE", "float32") != "float32"  # losses computed under autocast: looser tolerances
    tol = {"rtol": 1e-2, "atol": 1e-4} if bf16 else {}
    for step in sorted(mine):
        t = dict(mine[step])
        adv_rows = t.get("advantages")
        if isinstance(adv_rows, list) and adv_rows and isinstance(adv_rows[0], list):  # per token (verl's (B, T))
            t["advantages"] = [row[0] if row else 0.0 for row in adv_rows]  # (constant along a completion's tokens)
        if chosen and step in chosen:  # the rows your loop named, in its order
            picks = chosen[step]
            if any(r >= len(records) for r, _ in picks):
                continue
            comps = [records[r]["completion_ids"][i] for r, i in picks]
            sampled = [records[r]["logprobs"][i] for r, i in picks] if all(
                records[r].get("logprobs") for r, _ in picks) else None
            whole = len(picks) % G == 0 and all(picks[k][1] % G == 0 and all(
                picks[k + j] == (picks[k][0], picks[k][1] + j) for j in range(G)) for k in range(0, len(picks), G))
        else:
            r = (step - 1) // per_round
            if r >= len(records):
                continue
            comps, whole = records[r]["completion_ids"], True
            sampled = records[r].get("logprobs")  # a separate sampler's log-probs of its tokens (vLLM's), or None
        lengths = [len(c) for c in comps]
        if "rewards" in t and scores:  # the spec's functions' scores of the same completions
            rows_of = chosen[step] if chosen and step in chosen else [((step - 1) // per_round, i)
                                                                      for i in range(len(comps))]
            if all(r < len(scores) for r, _ in rows_of) and len(_arr(t["rewards"])) == len(rows_of):
                found["rewards"].append(rewards_stage(
                    t["rewards"], {k: [scores[r][k][i] for r, i in rows_of] for k in scores[0]}, spec, step=step))
        if "rewards" in t and "advantages" in t and whole:
            found["advantages"].append(advantages(t["rewards"], t["advantages"], spec.GROUP_SIZE, spec, step=step))
        if "mask" in t and _rows_of(t["mask"], len(comps)):
            found["mask"].append(mask(t["mask"], comps, eos_ids, spec, pad_id, spec.MAX_TOKENS, step=step))
        parts = t.get("micro_batches")  # your own micro-batches (a list of tensors): their number, where equal
        ga = len(parts) if isinstance(parts, list) and len(set(parts)) == 1 and sum(parts) == len(comps) \
            else getattr(spec, "GRAD_ACCUM", 1)
        if "per_token_loss" in t and "mask" in t and "loss" in t and _rows_of(t["per_token_loss"], len(comps)):
            w = weighting(t["per_token_loss"], t["mask"], _number(t["loss"]), lengths, ga,
                          spec.MAX_TOKENS, spec, step=step, **tol)
        obj = None
        if all(k in t for k in ("per_token_loss", "advantages", "logps", "mask")) and _rows_of(t["logps"], len(comps)):
            obj = objective(t["per_token_loss"], t["advantages"], t["logps"], t["mask"], lengths, t.get("old_logps"),
                            t.get("ref_logps"), spec, step=step, sampler_logps=sampled, **tol)
            found["objective"].append(obj)
        if "per_token_loss" in t and "mask" in t and "loss" in t and _rows_of(t["per_token_loss"], len(comps)):
            kl = (obj.evidence.get("kl") if obj is not None and obj.exact else None)
            weak = not w.exact or w.no_switch or "LOSS_DIVISOR" in w.settings  # (a constant divisor fits any one step)
            if kl and weak:  # what it logs may leave the KL term out (verl logs it apart)
                w2 = weighting(_without_kl(t, kl), t["mask"], _number(t["loss"]), lengths, ga,
                               spec.MAX_TOKENS, spec, step=step, **tol)
                if w2.exact and not w2.no_switch:
                    w = dataclasses.replace(w2, rule=w2.rule + "; what it logs as its loss leaves the KL term out "
                                            "(logged otherwise than trained: not a difference in training)",
                                            same_as_spec=w2.same_as_spec, evidence={**w2.evidence,
                                                                                    "logged_without_kl": True})
            per_micro_batch = w.exact and (w.settings.get("LOSS_NORM") == "token_local" or w.same_as_spec and
                                           getattr(spec, "LOSS_NORM", "") == "token_local")
            if ga != getattr(spec, "GRAD_ACCUM", 1) and per_micro_batch:  # your micro-batches, not the spec's count
                w = dataclasses.replace(w, rule=f"{w.rule} (in {ga} micro-batches of {parts[0]}, as your loop cut "
                                        "them)", settings={**w.settings, "GRAD_ACCUM": ga}, same_as_spec=False,
                                        settles=w.settles + ("GRAD_ACCUM",) if w.settles else ())
            found["weighting"].append(w)
    probes = [mine[s]["probe"] for s in sorted(mine) if isinstance(mine[s].get("probe"), dict)]
    norms = [grad_norms.get(s) for s in sorted(mine) if isinstance(mine[s].get("probe"), dict)]
    if probes and all(isinstance(x, (int, float)) for x in norms):
        found["optimizer"].append(optimizer(probes, norms, spec, steps_total=spec.STEPS))
    read_w = [f for f in found["weighting"] if f.exact]
    divisors = {f.settings.get("LOSS_DIVISOR") for f in read_w}
    if None in divisors and len(divisors) > 1:  # a loss type read at some step beats a divisor read at another
        found["weighting"] = [f for f in found["weighting"] if "LOSS_DIVISOR" not in f.settings]
    divisors.discard(None)
    with_divisor = [f for f in read_w if "LOSS_DIVISOR" in f.settings]
    if len(with_divisor) == 1 and len(divisors) == 1 and not with_divisor[0].evidence.get("count"):
        # one step, and no count of its tokens or completions: any number divides it
        found["weighting"] = [dataclasses.replace(f, unsettled=f.unsettled + (
            "a constant divisor was read at one step only, and one number fits any one step: save two steps' "
            "tensors to check it",), settles=()) if "LOSS_DIVISOR" in f.settings else f for f in found["weighting"]]
    if len(divisors) > 1:  # a divisor that changes from step to step is no constant
        seen = ", ".join(f"{x:g}" for x in sorted(x for x in divisors if x))
        found["weighting"] = [dataclasses.replace(f, exact=False, settings={}, settles=(), no_switch=True, rule=(
            f"{f.rule}; but the divisor is not the same at every step read ({seen})")) if "LOSS_DIVISOR" in f.settings
            else f for f in found["weighting"]]
    steps_of_round: dict[int, set] = {}
    for s, rows in (chosen or {}).items():
        for r, _ in rows:
            steps_of_round.setdefault(r, set()).add(s)
    spread = any(len(steps) > 1 for steps in steps_of_round.values())  # some round trained over several steps
    if spread and getattr(spec, "LOGP_OLD", "auto") != "current":  # -logp A: no ratio, the current policy each step
        found["objective"] = [dataclasses.replace(f, rule=f"{f.rule}; its policy term has no ratio, so a round trained "
                                                  "over several steps is trained on the current policy at each (TRL "
                                                  "keeps the round's generation-time log-probs as the old ones)",
                                                  settings={**f.settings, "LOGP_OLD": "current"},
                                                  same_as_spec=False)
                              if f.exact and f.evidence.get("form") == "logp" else f for f in found["objective"]]
    out = []
    for stage in STAGES:
        cands = found[stage]
        if cands:
            # the reading that says most: exact, least left unsettled, most settled (a step where a KL term or the
            # ratio can show at all), then the earliest; for the mask, a rule seen acting first (a mask on the pad id
            # shows only at a step that generated one: the steps without one read TRL's mask, and do not contradict
            # it; an exact mask reading cannot come from an ambiguity, as a scale read from one group can)
            best = min(cands, key=lambda f: (not f.readable, not f.exact, stage == "mask" and f.same_as_spec,
                                             len(f.unsettled), -len(f.settles), f.step or 0))
            logged = next((f for f in cands if f.evidence.get("logged_without_kl") and f.settings == best.settings),
                          None)
            if logged and logged is not best:
                best = dataclasses.replace(best, rule=logged.rule)
            others = [f for f in cands if f.exact and f.readable and f is not best and f.settings != best.settings
                      and stage not in ("optimizer", "selection")]
            if best.exact and others:  # steps that read other rules: none is settled, each is said
                said = "; ".join(f"at step {f.step}: {f.rule.removeprefix('your loop ')}" for f in others[:2])
                best = dataclasses.replace(best, settles=(), unsettled=best.unsettled + (
                    f"other steps read otherwise ({said}): the search decides",))
            out.append(best)
    return out


def _without_kl(t: dict, kl) -> list[list[float]]:
    """Your per-token losses less the KL term the objective stage found (beta x estimator, with its ratio factor)."""
    est, beta, factor = kl
    out = []
    for i, row in enumerate(t["per_token_loss"]):
        lp, ref = np.asarray(t["logps"][i], dtype=np.float64), np.asarray(t["ref_logps"][i], dtype=np.float64)
        n = min(len(row), len(lp), len(ref))
        k = _kl(lp[:n], ref[:n], est)
        if factor and t.get("old_logps") is not None:
            k = k * np.exp(lp[:n] - np.asarray(t["old_logps"][i][:n], dtype=np.float64))
        out.append((np.asarray(row[:n], dtype=np.float64) - beta * k).tolist())
    return out


def _rows_of(value, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(isinstance(r, list) for r in value)


def _number(value) -> float:
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    return float(value) if isinstance(value, (int, float)) else float("nan")


def settings_of(findings: list[Finding]) -> tuple[dict, dict, tuple]:
    """(fixed, guess, settled): what the exact findings set that they also settle (where the search starts, and what
    it never changes), what they set without settling (a value the run could not tell from others: the search's first
    guess, kept only if it helps, changed if another does better), and the fields settled."""
    fixed, guess, settles = {}, {}, []
    for f in findings:
        if f.exact and f.readable:
            for k, v in f.settings.items():
                (fixed if k in f.settles else guess)[k] = v
            settles += list(f.settles)
    return fixed, {k: v for k, v in guess.items() if k not in fixed}, tuple(dict.fromkeys(settles))


def words(findings: list[Finding]) -> list[str]:
    """One sentence per finding that differs from the spec, and one per thing the run could not tell."""
    out = []
    for f in findings:
        if not f.readable:  # nothing read at any step: not a rule of your loop
            continue
        if not f.same_as_spec:
            how = "read from your tensors" + (f" at step {f.step}" if f.step else "") + ("" if f.exact else
                                                                                      " (partly: no rule fits all)")
            out.append(f"{f.stage}, {how}: {f.rule}")
        out += [f"{f.stage}: this run could not tell: {u}" for u in f.unsettled]
    return out
