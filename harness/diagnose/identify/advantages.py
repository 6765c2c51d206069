"""The advantages stage: your advantages as a function of your own rewards, group by group: the centring (the
group's mean, the batch's, none, or the mean of the group's other completions), the scale (none, a constant, the
group's or the batch's std with its estimator and epsilon, solved in closed form) and a clip."""

from __future__ import annotations

import numpy as np

from harness.diagnose.identify.finding import Finding
from harness.diagnose.identify.numerics import _arr, _same, snap
from harness.diagnose.identify.steps import _rows_of, steps


def advantages(rewards, adv, group: int, spec=None, rtol: float = 2e-5, atol: float = 1e-6, step=None,
               mask=None) -> Finding:
    """Your advantages as a function of your own rewards (`_centred_on_a_mean`), and where no centring on a mean
    fits, on the mean of the group's other completions (leave-one-out, `_leave_one_out`); where neither reproduces
    them (or only a rule with no switch does), the built-in loop's advantage quirks on top of a group rule (`_extras`:
    float16 statistics, a second normalisation over the loss tokens of `mask`, your loop's loss mask rows, then a
    clamp), the simplest that reproduces them exactly winning."""
    found = _centred_on_a_mean(rewards, adv, group, spec, rtol, atol, step)
    if not found.readable or group < 2:
        return found
    r, a = _arr(rewards), _arr(adv)
    loo = _leave_one_out(r, a, group, spec, rtol, atol, step)
    # both fit within tolerance (no scale and the others' mean is the group's times G / (G - 1), which a group
    # std with an odd epsilon can mimic): the rule that reproduces your advantages more closely; misfits under
    # FLOAT32_ALIKE are float32 rounding of the saved values, alike: then leave-one-out, which needs no epsilon
    # (a fit's epsilon snapped to the digits its uncertainty allows can otherwise win by a rounding); a std with a
    # clamp after it is two parts: where leave-one-out fits too, it is the simpler (NeMo-RL's, a step whose groups
    # a population std and a clamp at 1 happen to give)
    if loo is not None and (not found.exact or found.no_switch or "ADV_CLAMP" in found.settings
                            or _misfit(r, a, group, spec, loo.settings)
                            < max(_misfit(r, a, group, spec, found.settings), FLOAT32_ALIKE)):
        found = loo
    if found.exact and not found.no_switch or len(r) != len(a) or np.isnan(r).any():
        return found  # one rule reproduces them (a float32 residue left out, as NeMo-RL's): simpler than a quirk on top
    extra = _extras(r, a, group, spec, mask, rtol, atol, step)
    return extra if extra is not None else found


FLOAT32_ALIKE = 1e-6  # relative misfits below this are float32 rounding of the saved advantages (2^-23 ~ 1.2e-7 each)


# the built-in loop's advantage fields, TRL's values: what a rule sets on top of (the spec's where it has them)
ADV_FIELDS = {"ADV_SCALE": "group", "STD": "bessel", "STD_EPS": 1e-4, "STD_EPS_INSIDE": False, "ADV_BASELINE": "group",
              "ADV_STATS_DTYPE": "float32", "ADV_RENORM": "none", "ADV_CLAMP": 0.0}


def _misfit(r, a, group: int, spec, settings: dict, mask=None) -> float:
    """The largest |A - predicted| / (|A| + 1e-6) of an advantage rule (the spec's fields, `settings` over them) on
    your rewards (`_predict`); inf where the rule needs the loss mask and none was saved."""
    pred = _predict(r, group, spec, settings, mask)
    return np.inf if pred is None else float(np.max(np.abs(a - pred) / (np.abs(a) + 1e-6)))


def _predict(r, group: int, spec, settings: dict, mask=None):
    """An advantage rule's advantages (the spec's fields, `settings` over them) of your rewards, by the built-in
    loop's own functions (scratch_grpo.core), in float64 (the group statistics in float16 where the rule says so,
    as your loop's were); None where the rule needs the loss mask and none was saved."""
    import torch

    from scratch_grpo.core import group_advantages, shape_advantages

    f = {**ADV_FIELDS, **({k: getattr(spec, k) for k in ADV_FIELDS if hasattr(spec, k)} if spec else {}), **settings}
    half = f["ADV_STATS_DTYPE"] == "float16"
    pred = group_advantages(torch.tensor(r, dtype=torch.float32 if half else torch.float64), group, f["ADV_SCALE"],
                            f["STD"], f["STD_EPS"], f["STD_EPS_INSIDE"], f["ADV_BASELINE"], f["ADV_STATS_DTYPE"])[0]
    if f["ADV_RENORM"] != "none" or f["ADV_CLAMP"] > 0:
        if f["ADV_RENORM"] != "none" and mask is None:
            return None
        width = max((len(m) for m in mask), default=0) if mask is not None else 0
        rows = torch.tensor([[float(x) > 0.5 for x in m] + [False] * (width - len(m)) for m in mask]
                            if mask is not None else [[]] * len(r), dtype=torch.float64)
        pred = shape_advantages(pred.double(), rows, False, f["ADV_RENORM"], f["ADV_CLAMP"])[0]
    return pred.double().numpy()


def _extras(r, a, group: int, spec, mask, rtol: float, atol: float, step) -> Finding | None:
    """Your advantages as a group rule (a centring on the group's mean, a std with its estimator and an epsilon from
    the ones loops write, or none) with the built-in loop's advantage quirks on top, predicted exactly, the simplest
    first: the group statistics in float16 (ADV_STATS_DTYPE), a second normalisation over your loss mask's tokens
    (ADV_RENORM), that then clamped at your largest advantage's magnitude (ADV_CLAMP). None where none reproduces
    your advantages within tolerance; several base rules alike (an epsilon the spread of the rewards hides) are said
    as unsettled."""
    spec_has = {k: getattr(spec, k) for k in ADV_FIELDS if hasattr(spec, k)} if spec else {}
    top = float(np.max(np.abs(a)))
    kinds = ({"ADV_STATS_DTYPE": "float16"}, {"ADV_RENORM": "tokens"},
             {"ADV_RENORM": "tokens", "ADV_CLAMP": snap(top, top * 1e-6)})
    epsilons = tuple(dict.fromkeys((spec_has.get("STD_EPS", 1e-4), 1e-4, 1e-8, 1e-6, 1e-5, 1e-3, 1e-2, 0.0)))
    bases = [{"ADV_SCALE": "none"}] + [{"ADV_SCALE": sc, "STD": sd, "STD_EPS": eps, "STD_EPS_INSIDE": inside}
                                       for sc in ("group", "batch") for inside in (False, True)
                                       for sd in ("bessel", "population") for eps in epsilons]
    bases.sort(key=lambda b: sum(not _same(spec_has.get(k, ADV_FIELDS[k]), v) for k, v in b.items()))
    tol = atol + rtol * np.abs(a)
    for kind in kinds:
        if kind.get("ADV_RENORM") and mask is None or kind.get("ADV_CLAMP") and not np.sum(np.isclose(np.abs(a), top,
                                                                                                       rtol=1e-6)) > 1:
            continue  # no mask saved; a clamp shows as two advantages or more at one magnitude
        preds = ((b, _predict(r, group, spec, {**b, **kind}, mask)) for b in bases)
        fits = [(float(np.max(np.abs(a - p) / (np.abs(a) + 1e-6))), b) for b, p in preds
                if p is not None and np.all(np.abs(a - p) <= tol)]
        if fits:
            return _extras_finding(fits, kind, spec_has, step)
    return None


def _extras_finding(fits: list, kind: dict, spec_has: dict, step) -> Finding:
    """The first (simplest) of the base rules `fits` ((misfit, settings)) that reproduce your advantages with the
    quirks `kind`, said; the fields the others set otherwise unsettled."""
    misfit, base = fits[0]
    full = {**ADV_FIELDS, **spec_has, **base, **kind}
    words = ["centres each group's rewards on its mean"]
    if full["ADV_SCALE"] == "none":
        words.append("and does not divide by a std")
    else:
        est = "population std (n)" if full["STD"] == "population" else "Bessel's std (n - 1)"
        words.append(f"and divides by the {full['ADV_SCALE']}'s {est}" + (
            f" with {full['STD_EPS']:g} inside the square root" if full["STD_EPS_INSIDE"] else f" + {full['STD_EPS']:g}"))
    if kind.get("ADV_STATS_DTYPE") == "float16":
        words.append("computing these statistics on float16 rewards (TRL: float32)")
    if kind.get("ADV_RENORM"):
        words.append("then normalises the advantages a second time over the step's loss tokens, each completion counted "
                     "once per token (TRL: once, per group)")
    if kind.get("ADV_CLAMP"):
        words.append(f"then clamps them to [-{kind['ADV_CLAMP']:g}, {kind['ADV_CLAMP']:g}]")
    differ = sorted({k for _, b in fits[1:] for k, v in b.items() if not _same(full.get(k), v)})
    unsettled = (f"under {' and '.join(k for k in sorted(kind))}, {len(fits)} group rules fit alike: "
                 f"{', '.join(differ)} could not be told (the one closest to the spec is said)",) if differ else ()
    settings = {k: v for k, v in full.items() if not _same(spec_has.get(k, ADV_FIELDS[k]), v)}
    return Finding("advantages", step, "your loop " + " ".join(words), settings, True, unsettled=unsettled,
                   settles=tuple(k for k in ADV_FIELDS if k not in differ and k != "ADV_BASELINE"),
                   evidence={"misfit": misfit, "quirks": sorted(kind)})


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
        if float(np.median(eps_i)) < -unc:
            continue  # a negative epsilon: no std + epsilon gives it (a rule of another form, read elsewhere)
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
    spec_has = {k: getattr(spec, k, ADV_FIELDS[k]) for k in ("ADV_SCALE", "STD", "STD_EPS", "STD_EPS_INSIDE", "ADV_CLAMP")
                } if spec else {}
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
        bound = snap(top, top * 1e-6)
        words.append(f"then clamps the advantages to [-{bound:g}, {bound:g}]")
        settings["ADV_CLAMP"] = bound
    if spec_has:
        settings = {k: v for k, v in settings.items() if k in spec_has and not _same(spec_has[k], v)}
        if "STD_EPS" in settings and unsettled and abs(spec_has["STD_EPS"] - fit["eps"]) <= fit["unc"]:
            settings.pop("STD_EPS")  # the spec's own epsilon is as good as any the run can tell apart
    same = not settings and not no_switch
    ambiguous = any(u.startswith(("every group's rewards", "one group's rewards")) for u in unsettled)
    settles = () if ambiguous else ("ADV_SCALE", "STD", "STD_EPS_INSIDE") + (() if unsettled else ("STD_EPS",)) \
        if fit or kind == "none" else ()
    settles += ("ADV_CLAMP",) if "ADV_CLAMP" in settings and settles else ()
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


def read(cell, earlier: dict) -> list[Finding]:
    """Your advantages at every step that saved them with its rewards, its rows whole groups (in any order: a round
    your loop sorted, say, is read back in its groups' order)."""
    g, out = cell.spec.GROUP_SIZE, []
    for s in steps(cell):
        if "rewards" not in s.tensors or "advantages" not in s.tensors:
            continue
        order = list(range(len(s.rows))) if s.whole else sorted(range(len(s.rows)), key=lambda k: s.rows[k])
        rows = [s.rows[k] for k in order]
        if len(rows) % g or any(rows[k] != (rows[k - k % g][0], rows[k - k % g][1] + k % g) or rows[k - k % g][1] % g
                                for k in range(len(rows))):
            continue  # not whole groups
        rewards, adv = s.tensors["rewards"], s.tensors["advantages"]
        if len(rewards) != len(order) or len(adv) != len(order):
            continue
        rows_mask = s.tensors.get("mask")
        mask = [rows_mask[k] for k in order] if _rows_of(rows_mask, len(order)) else None
        out.append(advantages([rewards[k] for k in order], [adv[k] for k in order], g, cell.spec, step=s.step,
                              mask=mask))
    return out
