"""The objective stage: your per-token loss against TRL's -min(ratio A, clip(ratio) A) + beta KL: the ratio form
(or -logp A), the KL estimator and weight, the clip bounds, and TRL's importance-sampling weight where a separate
sampler generated."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from harness.diagnose.identify.finding import Finding
from harness.diagnose.identify.numerics import _arr, _kl, _same, snap
from harness.diagnose.identify.steps import _rows_of, steps, tolerance


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

    fitted = {}
    for form, pg in forms.items():
        got = _kl_fit(ptl - pg, lp, ref, ratio, tol)
        if got is not None:
            fitted[form] = (pg, *got)
            if not weights:  # (with a sampler's log-probs every form is tried: with and without its weight)
                break
    form, settings, words, is_settles, unsettled = _policy_term(fitted, weights, spec, tol, a)
    if form is None:
        return _no_objective(ptl, ratio, a, ref, weights, old_logps is None, clip_low, clip_high, step)
    _pg, kl, spread, kl_unsettled = fitted[form]
    form = "ratio" if form.startswith("is:") else form
    unsettled += kl_unsettled
    if form == "logp":
        words.append("takes the policy term as -logp * A (REINFORCE's value; TRL's -ratio * A has the same gradient "
                     "at ratio 1, another value: the logged loss differs in value alone)")
    kl_words, kl_settings, kl_unsettled = _kl_term(kl, spread, ratio, lp, ref, tol)
    words += kl_words
    settings.update(kl_settings)
    unsettled += kl_unsettled
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
    # a KL term 0 in value here (the reference is the policy, or none saved): this step cannot contradict another's
    unseen = ("BETA", "KL_ESTIMATOR", "KL_IS_CORRECTION") if kl is None and (
        ref is None or not np.any(np.abs(ref - lp) > 1e-6)) else ()
    # no KL term read where the reference is apart: the weights it could not have shown (a KL read at another step
    # with a smaller weight is no contradiction: identify.pick)
    below = kl_resolution(lp, ref, ratio, tol) if kl is None and ref is not None and not unseen else None
    return Finding("objective", step, rule, settings, True, same_as_spec=not settings and form == "ratio",
                   unsettled=tuple(unsettled), settles=settles + is_settles,
                   evidence={"form": form, **({"kl": kl} if kl else {}), **({"unseen": unseen} if unseen else {}),
                             **({"kl_below": below} if below else {})})


def kl_resolution(lp, ref, ratio, tol) -> dict[str, float]:
    """For each KL estimator, the smallest weight whose term would leave some counted token's per-token loss beyond
    its tolerance at this step (with or without TRL's factor of the policy ratio, the larger term): min over tokens
    of tol / |KL|; inf where the estimator is 0 at every token (the reference is the policy). A step whose loss holds
    no KL term says nothing against a KL of a smaller weight read at another step: it could not show there."""
    out = {}
    for est in ("k1", "k2", "k3"):
        k = _kl(np.asarray(lp, dtype=np.float64), np.asarray(ref, dtype=np.float64), est)
        k = np.maximum(np.abs(k), np.abs(k * np.asarray(ratio, dtype=np.float64)))
        live = k > 0
        out[est] = float(np.min(np.broadcast_to(tol, k.shape)[live] / k[live])) if np.any(live) else math.inf
    return out


def _kl_fit(resid, lp, ref, ratio, tol):
    """None, or how a policy term (+ a KL term) gives your per-token loss, from the residual `resid` it leaves: (the
    KL fit (estimator, weight, ratio factor) or None, its weights' spread, what stays unsettled)."""
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


def _policy_term(fitted: dict, weights: dict, spec, tol, a) -> tuple:
    """Of the policy-term forms that fit (`fitted`: form -> (term, KL fit, spread, unsettled)), the one read, with
    what it says of TRL's importance-sampling weight: (form or None, settings, words, settles, unsettled)."""
    plain = next((f for f in ("ratio", "logp") if f in fitted), None)
    is_fit = [m for m in weights if f"is:{m}" in fitted]
    if weights and (plain or is_fit):
        is_settings, is_words, is_settles, is_unsettled = _is_reading(plain, is_fit, weights, spec, tol, a)
        form = plain or f"is:{is_settings['IS_MODE']}"  # (the mode read is one that fits)
        return form, dict(is_settings), list(is_words), is_settles, list(is_unsettled)
    return plain, {}, [], (), []


def _kl_term(kl, spread: float, ratio, lp, ref, tol) -> tuple[list, dict, list]:
    """What the KL fit says (or, with none, what the reference log-probs let the run tell): (words, settings,
    unsettled)."""
    words, settings, unsettled = [], {}, []
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
        unsettled.append(f"a KL weight below about {kl_resolution(lp, ref, ratio, tol)['k3']:.2g} would not show at "
                         "this step (the reference is that close to the policy)")
    elif ref is not None:
        unsettled.append("the reference model's log-probs equal the policy's at this step (it starts from them): a "
                         "KL term is 0 in value here")
    return words, settings, unsettled


def _no_objective(ptl, ratio, a, ref, weights: dict, no_old: bool, clip_low: float, clip_high: float, step) -> Finding:
    """No form fits: the clip bounds where a term was clipped (no KL term, no importance-sampling weight, a ratio
    away from 1), else why not."""
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
    if no_old:
        return Finding("objective", step, "cannot be read: your per-token loss is not -A (+ a KL term) with the "
                       "ratio taken as 1; where the ratio is not 1 (a second pass, old log-probs from another "
                       "pass) the stage needs old_logps saved", {}, False, readable=False)
    return Finding("objective", step, "your per-token loss is not -min(ratio A, clip(ratio) A) + beta KL (k1, k2 "
                   "or k3, with or without the ratio factor) nor -logp A with the same inputs", {}, False,
                   no_switch=True)


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


def read(cell, earlier: dict) -> list[Finding]:
    """Your per-token objective at every step that saved its per-token loss, advantages, log-probs and mask (with
    the sampler's log-probs where a separate sampler generated the rows)."""
    spec, tol = cell.spec, tolerance(cell.spec)
    found = []
    for s in steps(cell):
        t = s.tensors
        if all(k in t for k in ("per_token_loss", "advantages", "logps", "mask")) and _rows_of(t["logps"],
                                                                                              len(s.completions)):
            found.append(objective(t["per_token_loss"], t["advantages"], t["logps"], t["mask"], s.lengths,
                                   t.get("old_logps"), t.get("ref_logps"), spec, step=s.step, sampler_logps=s.sampled,
                                   **tol))
    return found
