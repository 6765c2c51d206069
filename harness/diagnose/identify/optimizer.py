"""The optimizer stage: Adam(W) from the parameter slice your loop saved (harness.loop.Probe) and its pre-clip
gradient norms: learning rate per step and schedule, betas, epsilon, weight decay, gradient clipping, or parameter
groups with settings of their own."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from harness.diagnose.identify.finding import Finding
from harness.diagnose.identify.numerics import _alike, _refine, _rounding, _same, bfloat16_cell, bfloat16_exact, snap

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


@dataclasses.dataclass(frozen=True)
class _Probed:
    """The probed steps Adam took, each step's values flat in float64 (tensors with no gradient at any step left
    out, and steps after the last with a gradient)."""
    names: list  # the probed tensors' names
    sizes: list  # each probed tensor's length
    before: list  # per step: the weights before it
    after: list  # per step: the weights after it
    grads: list  # per step: the gradient before clipping
    updates: list  # per step: after - before
    decay: np.ndarray  # the elements a weight decay applies to (not the norms', not the biases')
    norms: list  # per step: the pre-clip gradient norm


def _probed(probe_rows: list[dict], grad_norms: list[float]) -> _Probed | Finding:
    """Your loop's probed steps as `_Probed`, or a Finding saying why they cannot be read."""
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
    return _Probed(names=names, sizes=[len(x) for x in rows[0]["before"]], before=before, after=after, grads=grads,
                   updates=[a - b for a, b in zip(after, before)], decay=decay,
                   norms=[float(x) for x in grad_norms[:len(rows)]])


def _score(p: _Probed, b1: float, b2: float, eps: float, clip: float) -> tuple:
    """The per-step fit (lrs, wds, relative residual) of Adam with these betas, epsilon and clipping threshold."""
    dirs = _adam_dirs(p.grads, p.norms, b1, b2, eps, clip)
    return _fit_updates(dirs, p.before, p.updates, p.decay)


def optimizer(probe_rows: list[dict], grad_norms: list[float], spec=None, steps_total: int | None = None) -> Finding:
    """Adam(W) from the parameter slice your loop saved (`harness.loop.Probe`: before and after each optimizer step,
    with the gradient before clipping) and its pre-clip gradient norms: for each (beta1, beta2, eps, max_grad_norm)
    the updates are fitted per step in closed form as u = -lr d - lr wd p, and the hypothesis with the smallest
    residual wins; then each value is narrowed on its own and snapped to a round one the run cannot tell from it."""
    p = _probed(probe_rows, grad_norms)
    if isinstance(p, Finding):
        return p
    finite = [x for x in p.norms if math.isfinite(x) and x > 0]
    clips = [math.inf] + sorted({float(f"{x:.3g}") for x in
                                 (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, *(m * f for m in finite for f in (0.5, 0.9, 1.1)))})
    if held_in_bfloat16(p):  # the weights themselves are bf16: each update is rounded, read as the rates it allows
        return _bf16_optimizer(p, clips, finite, spec, steps_total)
    b1, b2, eps, clip = _grid_fit(p, clips, finite)
    lrs, wds, res = _score(p, b1, b2, eps, clip)
    # what the run can tell: values whose residual stays within the fit's own noise of the best are alike; of those
    # the round value the commonest first (the grids' order), else the fitted value. The residual of a right
    # hypothesis is the weights' float32 rounding (an update of lr x O(1) is a few ulps of a weight), so a wrong
    # beta2 that a per-step rate half absorbs shows as a small excess over many elements: the margin shrinks with
    # their number (3 standard deviations of a chi-square's relative spread, at least 2% of the squared residual)
    n = sum(len(u) for u in p.updates)
    floor = max(res * _alike(n), 1e-6)
    (b1, b2, eps, clip), (alike_b1, alike_b2, alike_eps, alike_clip) = _look_alikes(p, b1, b2, eps, clip, clips,
                                                                                    floor, spec)
    lrs, wds, res = _score(p, b1, b2, eps, clip)
    rounding = _rounding(p.after, p.updates)
    exact = res < max(1e-3, 1.5 * rounding)  # (no rule fits better than the weights' own rounding)
    if not exact:  # one Adam for every parameter does not fit: parameter groups, each with settings of its own?
        groups = _parameter_groups(p.names, p.sizes, p.grads, p.before, p.updates, p.decay, p.norms, clip)
        if groups:
            said = "; ".join(f"lr {lr:.4g} with betas ({g1:g}, {g2:g}) on {', '.join(ns[:3])}"
                             + (f" and {len(ns) - 3} more" if len(ns) > 3 else "") for lr, g1, g2, ns in groups)
            return Finding("optimizer", None, "your loop steps its parameters in groups, each with its own Adam "
                           f"settings ({said}): the built-in loop and TRL step every parameter alike", {}, True,
                           no_switch=True, evidence={"residual": res, "groups": [list(g) for g in groups]})
    known = [(t, x) for t, x in enumerate(lrs) if x is not None]  # (a step with no gradient says no rate)
    if not known:
        return Finding("optimizer", None, "cannot be read: no probed step had a gradient (every advantage 0)", {},
                       False, readable=False)
    settings, words, unsettled = _learning_rate(known, res, steps_total, spec)
    settings["ADAM_BETA1"], settings["ADAM_BETA2"], settings["ADAM_EPS"] = b1, b2, eps
    words.append(f"with betas ({b1:g}, {b2:g}) and epsilon {eps:g}")
    unsettled += _alike_words(alike_b1, alike_b2, alike_eps, "the probed steps")
    wds = [w for w in wds if w is not None]
    for part in (_weight_decay(p, b1, b2, eps, clip, wds), _clipping(clip, alike_clip, finite, spec)):
        settings.update(part[0])
        words += part[1]
        unsettled += part[2]
    if spec:
        has = {k: getattr(spec, k) for k in settings}
        settings = {k: v for k, v in settings.items() if not _same(has[k], v)
                    and not (k == "MAX_GRAD_NORM" and not v and not has[k])}
    settles = _optimizer_settles(len(known) == len(lrs) and len(known) >= 2, alike_b1, alike_b2, alike_eps, unsettled)
    if any(u.startswith("the learning rate per step") for u in unsettled):
        settings.pop("LR_SCHEDULE", None)
    return Finding("optimizer", None, "your loop " + " ".join(words), settings, exact,
                   same_as_spec=not settings, unsettled=tuple(unsettled), settles=settles if exact else (),
                   evidence={"residual": res, "lrs": lrs, "weight_decays": wds})


def _grid_fit(p: _Probed, clips: list, finite: list) -> tuple:
    """(beta1, beta2, eps, clip) of the smallest residual: every (beta1, beta2, threshold) on the grid (a wrong
    threshold skews the betas' fit), then two rounds of coordinate refinement: clip, eps, then the betas on finer
    grids."""
    best = None
    for clip in clips:
        for b1 in _BETA1:
            for b2 in _BETA2:
                res = _score(p, b1, b2, 1e-8, clip)[2]
                if best is None or res < best[0]:
                    best = (res, b1, b2, 1e-8, clip)
    _res, b1, b2, eps, clip = best
    for _ in range(2):
        clip = min(clips, key=lambda c: _score(p, b1, b2, eps, c)[2])
        if math.isfinite(clip):  # narrowed between the norms around it (the clipped steps stay the same there)
            lo = max([x for x in finite if x < clip], default=clip / 4)
            hi = min([x for x in finite if x > clip], default=clip * 4)
            clip = _refine(lambda c: _score(p, b1, b2, eps, c)[2], clip, lo, hi, bracket=False)
        eps = min(_ADAM_EPS, key=lambda e: _score(p, b1, b2, e, clip)[2])
        b2 = _refine(lambda x: _score(p, b1, 1 - x, eps, clip)[2], 1 - b2, 1e-5, 0.6)
        b2 = 1 - b2
        b1 = min(_BETA1, key=lambda x: _score(p, x, b2, eps, clip)[2])
    return b1, b2, eps, clip


def _look_alikes(p: _Probed, b1, b2, eps, clip, clips: list, floor: float, spec) -> tuple:
    """The values of each setting that fit within `floor` of the best, one setting at a time, and the value kept:
    of values alike, the spec's own (nothing to name), else the grid's commonest; a round threshold the run cannot
    tell from the fitted one. ((b1, b2, eps, clip), (alike b1s, alike b2s, alike epsilons, alike thresholds))."""
    prefer = lambda alike, own: own if own in alike else alike[0]  # noqa: E731
    alike_b1 = [x for x in _BETA1 if _score(p, x, b2, eps, clip)[2] <= floor]
    b1 = prefer(alike_b1, getattr(spec, "ADAM_BETA1", None)) if alike_b1 else b1
    alike_b2 = [x for x in _BETA2 if _score(p, b1, x, eps, clip)[2] <= floor]
    b2 = prefer(alike_b2, getattr(spec, "ADAM_BETA2", None)) if alike_b2 else float(f"{b2:.4g}")
    alike_eps = [e for e in _ADAM_EPS if _score(p, b1, b2, e, clip)[2] <= floor]
    eps = prefer(alike_eps, getattr(spec, "ADAM_EPS", None)) if alike_eps else eps
    alike_clip = sorted({clip, *(c for c in clips if _score(p, b1, b2, eps, c)[2] <= floor)})
    nice = [c for c in (1.0, 0.5, 0.2, 0.1, 2.0, 5.0) if c in alike_clip]
    clip = nice[0] if nice and math.isfinite(clip) else clip  # a round threshold the run cannot tell from the fit
    return (b1, b2, eps, clip), (alike_b1, alike_b2, alike_eps, alike_clip)


def _learning_rate(known: list, res: float, steps_total: int | None, spec=None) -> tuple[dict, list, list]:
    """The rate from each step's reading (`known`: (step index, rate)) and its schedule, any TRL names
    (diagnose.schedules, each rate within the fit's own noise; the spec's own first): (settings, words,
    unsettled)."""
    from harness.diagnose.schedules import fit_schedule

    settings, unsettled = {}, []
    lr_tol = max(1e-3, 2 * res)  # each step's rate carries the fit's own noise
    middle = float(np.median([x for _, x in known]))  # a constant rate: the middle of the steps' noisy readings
    flat = all(math.isclose(x, middle, rel_tol=lr_tol) for _, x in known)
    stated = {k: getattr(spec, k) for k in ("LR", "LR_SCHEDULE", "WARMUP_STEPS", "LR_SCHEDULER_KWARGS")
              if hasattr(spec, k)}
    fit = fit_schedule(dict(known), steps_total, lr_tol, stated) if steps_total and len(known) >= 2 and not flat \
        else None
    if fit is not None and fit.warmup > known[-1][0]:  # a rise through every probed step
        rise = ("the learning rate per step (" + ", ".join(f"{x:.4g}" for _, x in known) + ") rises through every "
                "probed step: ")
        # a line from a fraction of the peak: its start, peak and warmup all untold
        if fit.schedule in ("warmup_stable_decay", "cosine_warmup_with_min_lr"):
            unsettled.append(rise + "its peak and its warmup are not told apart (" + _schedule_words(fit)
                             + f" at {fit.peak:g} fits, as do others)")
            return {}, ["steps Adam at a learning rate rising through every probed step"], unsettled
        # a rise from 0: only its slope is read, written as the roundest peak over its warmup
        unsettled.append(rise + "only its rise per step is read, so its peak and its warmup are not told apart "
                         f"(written as the roundest peak that gives it: {fit.peak:g} over {fit.warmup} steps; "
                         f"{2 * fit.peak:g} over {2 * fit.warmup} fits as well), nor what follows the warmup")
        return fit.settings(), [f"steps Adam at a learning rate rising through every probed step ({fit.peak:g} over "
                                f"a warmup of {fit.warmup} steps, or any peak and warmup in that ratio)"], unsettled
    if fit is not None:
        settings.update(fit.settings())
        said = [f"steps Adam at a learning rate of {fit.peak:g} ({_schedule_words(fit)})"]
        return settings, said, unsettled
    peak = middle if flat else max(x for _, x in known)
    peak = snap(peak, lr_tol * peak, (stated["LR"],) if "LR" in stated else ())  # (the spec's own rate, if alike)
    settings["LR"] = peak
    if steps_total and len(known) >= 2 and not flat:
        unsettled.append("the learning rate per step (" + ", ".join(f"{x:.4g}" for _, x in known) + ") follows "
                         "no schedule TRL names (lr_scheduler_type with its warmup and lr_scheduler_kwargs)")
    elif len(known) < 2:
        unsettled.append(f"the learning rate was read at {len(known)} step(s) only (the others had no gradient): its "
                         "schedule cannot be told")
    settings["LR_SCHEDULE"] = "constant"
    return settings, [f"steps Adam at a learning rate of {peak:g} (constant)"], unsettled


def _alike_words(alike_b1, alike_b2, alike_eps, fitted: str) -> list[str]:
    """What the run could not tell of Adam's betas and epsilon: each with more than one value that fits `fitted`."""
    out = [f"{what}: {', '.join(f'{x:g}' for x in alike)} fit {fitted} alike"
           for what, alike in (("Adam's beta1", alike_b1), ("Adam's beta2", alike_b2)) if len(alike) > 1]
    if len(alike_eps) > 1:
        out.append(f"Adam's epsilon: {', '.join(f'{x:g}' for x in alike_eps)} fit alike (gradients far above it)")
    return out


def _schedule_words(fit) -> str:
    """'linear', 'cosine_with_min_lr, warmup 2, min_lr_rate = 0.1'."""
    from harness.diagnose.fields import toml_value

    return ", ".join([fit.schedule] + ([f"warmup {fit.warmup}"] if fit.warmup else [])
                     + [f"{k} = {toml_value(v)}" for k, v in fit.kwargs.items()])


def _weight_decay(p: _Probed, b1, b2, eps, clip, wds: list) -> tuple[dict, list, list]:
    """The decoupled weight decay from each step's reading (`wds`) and its standard error, and whether the norms and
    biases decay too: (settings, words, unsettled)."""
    settings, words, unsettled = {}, [], []
    ses = _fit_updates(_adam_dirs(p.grads, p.norms, b1, b2, eps, clip), p.before, p.updates, p.decay, with_se=True)[3]
    rest_wd = [x[1:] for x in ses if isinstance(x, tuple)]
    ses = [x[0] if isinstance(x, tuple) else x for x in ses]
    wd = float(np.mean(wds)) if p.decay.any() and wds else 0.0
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
    return settings, words, unsettled


def _clipping(clip: float, alike_clip: list, finite: list, spec) -> tuple[dict, list, list]:
    """The gradient clipping read (`clip`: the threshold fitted, inf for none): (settings, words, unsettled)."""
    settings, words, unsettled = {}, [], []
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
    return settings, words, unsettled


def _optimizer_settles(every_rate: bool, alike_b1, alike_b2, alike_eps, unsettled: list) -> tuple:
    """The fields the reading settles: the rate where every probed step read one and they follow a schedule
    (`every_rate`: every step read a rate, at least 2); a field with look-alikes, or left unsettled, is not."""
    settles = ("LR", "LR_SCHEDULE", "WARMUP_STEPS", "LR_SCHEDULER_KWARGS") if every_rate else ()
    settles += () if len(alike_b1) > 1 else ("ADAM_BETA1",)
    settles += () if len(alike_b2) > 1 else ("ADAM_BETA2",)
    settles += () if len(alike_eps) > 1 else ("ADAM_EPS",)
    settles += () if any(u.startswith("weight decay") for u in unsettled) else ("WEIGHT_DECAY", "WEIGHT_DECAY_ALL")
    settles += () if any("max_grad_norm" in u for u in unsettled) else ("MAX_GRAD_NORM",)
    if any(u.startswith("the learning rate per step") for u in unsettled):
        settles = tuple(k for k in settles if k not in ("LR", "LR_SCHEDULE", "WARMUP_STEPS", "LR_SCHEDULER_KWARGS"))
    return settles


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


def _clip_setting(alike, norms, spec) -> float:
    """No step clipped: keep the spec's threshold where it is above every norm seen, else none (0)."""
    have = float(getattr(spec, "MAX_GRAD_NORM", 0.0)) if spec else 0.0
    if have and have > max(norms, default=0):
        return have
    return 0.0


def read(cell, earlier: dict) -> list[Finding]:
    """Adam from the parameter slices your loop probed (every step that saved one), where it logs each one's pre-clip
    gradient norm: one finding for the run."""
    mine, grad_norms = cell.tensors, cell.grad_norms()
    probes = [mine[s]["probe"] for s in sorted(mine) if isinstance(mine[s].get("probe"), dict)]
    norms = [grad_norms.get(s) for s in sorted(mine) if isinstance(mine[s].get("probe"), dict)]
    if probes and all(isinstance(x, (int, float)) for x in norms):
        return [optimizer(probes, norms, cell.spec, steps_total=cell.spec.STEPS)]
    return []


# ---------------------------------------------------------------------------------------------
# weights held in bfloat16: every update rounded to the weight's bf16 spacing
# ---------------------------------------------------------------------------------------------
BF16_SLACK = 2 ** -7  # the least relative margin on Adam's direction as a bf16 optimizer computes it
BF16_U = 2 ** -8  # a bound on one bf16 rounding, relative (2^-9 to nearest; twice it, for the op's own float32 math)


def held_in_bfloat16(p: _Probed) -> bool:
    """Your weights are held (and stepped) in bfloat16: every probed weight before and after every probed step is a
    bf16 number, some moved, and enough of them are not 0 or +-1 (a float32 model's weights are bf16 numbers by
    chance 1 in 65536 each; a moved float32 weight almost never is)."""
    before, after = np.concatenate(p.before), np.concatenate(p.after)
    plain = np.count_nonzero((np.abs(before) != 1.0) & (before != 0.0))
    return bool(np.all(bfloat16_exact(before)) and np.all(bfloat16_exact(after)) and np.any(after != before)
                and plain >= 16)


def bf16_rate_interval(before, after, direction, slack: float = BF16_SLACK) -> tuple[float, float] | None:
    """The learning rates lr >= 0 under which every bf16 weight `before`, stepped by -lr x `direction` (Adam's
    update direction, known to a relative `slack`, one for all or one per element) and rounded to bf16, gives
    `after`: (lo, hi), lo > hi where no
    rate does; None where no element has a direction. Each element bounds the rate: the exact value before - lr x d
    must lie in the cell of values that round to `after` (numerics.bfloat16_cell), so lr x |d| lies in
    sign(d) x [before - hi, before - lo]; an element that did not move gives an upper bound alone, one that moved k
    spacings a rate about k spacings / |d|."""
    b, d = np.asarray(before, dtype=np.float64), np.asarray(direction, dtype=np.float64)
    cell_lo, cell_hi = bfloat16_cell(after)
    on = np.abs(d) > 0
    if not np.any(on):
        return None
    sign, size = np.sign(d[on]), np.abs(d[on])
    slack = np.broadcast_to(np.asarray(slack, dtype=np.float64), d.shape)[on]
    a1, a2 = sign * (b[on] - cell_hi[on]), sign * (b[on] - cell_lo[on])
    need_lo, need_hi = np.minimum(a1, a2), np.maximum(a1, a2)  # lr x |d| within [need_lo, need_hi]
    lo = np.maximum(need_lo / np.where(need_lo > 0, size * (1 + slack), size * (1 - slack)), 0.0)
    hi = need_hi / np.where(need_hi > 0, size * (1 - slack), size * (1 + slack))
    return float(np.max(lo)), float(np.min(hi))


def bf16_adam_dirs(grads, norms, beta1, beta2, eps, max_norm) -> list[tuple[np.ndarray, np.ndarray]]:
    """Adam's update direction at each step, as _adam_dirs, with a bound on its relative error where the moments are
    held in bfloat16 (torch's AdamW on bf16 parameters keeps exp_avg and exp_avg_sq in their dtype): each update of
    a moment rounds it (BF16_U of its size; the second moment twice, a multiply then an add), and an error carried
    from earlier steps shrinks with beta but not with the moment itself, so where m nearly cancels (a gradient that
    turns) its relative error is large. [(direction, relative error bound)] per step."""
    m = np.zeros_like(grads[0])
    v = np.zeros_like(grads[0])
    em, ev = np.zeros_like(m), np.zeros_like(v)  # absolute error bounds of the bf16 moments
    out = []
    for t, (g, nrm) in enumerate(zip(grads, norms), 1):
        c = 1.0 if not max_norm or not math.isfinite(max_norm) else min(1.0, max_norm / (nrm + 1e-6))
        g = g * c
        eg = BF16_U * np.abs(g) if c < 1.0 else 0.0  # (clip_grad_norm_ scales the bf16 gradient in place)
        m = beta1 * m + (1 - beta1) * g
        em = beta1 * em + (1 - beta1) * eg + BF16_U * np.abs(m)
        v_old, v = v, beta2 * v + (1 - beta2) * g * g
        ev = beta2 * ev + (1 - beta2) * 2 * np.abs(g) * eg + BF16_U * (beta2 * v_old + v)
        m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
        root = np.sqrt(v_hat)
        d = m_hat / (root + eps)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = em / np.abs(m) + 0.5 * ev / np.maximum(v, 1e-300) * root / (root + eps) + 3 * BF16_U
        out.append((d, np.where(np.isfinite(rel), np.maximum(rel, BF16_SLACK), 1.0)))
    return out


def _bf16_intervals(p: _Probed, b1, b2, eps, clip) -> list[tuple[float, float] | None]:
    """Per probed step, the rate interval of Adam with these settings (None where the step had no gradient); an
    element whose direction is known to no better than half of itself (a first moment that all but cancels) bounds
    nothing."""
    return [bf16_rate_interval(b, a, np.where(rel < 0.5, d, 0.0), rel)
            for b, a, (d, rel) in zip(p.before, p.after, bf16_adam_dirs(p.grads, p.norms, b1, b2, eps, clip))]


def _fits(intervals) -> bool:
    return all(iv is None or iv[0] <= iv[1] for iv in intervals) and any(iv is not None for iv in intervals)


KERNELS = {"adamw_torch_fused": {"fused": True}, "adamw_torch": {"foreach": False}}  # (for-each rounds as for-loop
# on CPU: the same weights over 12 steps, 20,000 elements; on a GPU unchecked)
KERNEL_NAMES = {"adamw_torch_fused": "the fused", "adamw_torch": "the for-loop"}
KERNEL_RATES = 33  # the rates tried per step across the interval the rounded updates allow (the read rate first)
KERNEL_ZOOMS = 3  # rounds of that scan, each around the best rate of the last
KERNEL_DECAYS = (0.0, 0.01, 0.1)  # the fused kernel decays in float32 before it rounds: a decay can tip a rounding


def bf16_kernel_misses(p: _Probed, intervals: list, b1: float, b2: float, eps: float, clip: float,
                       rate: float | None = None) -> dict:
    """How many probed bf16 updates each AdamW kernel misses, replayed by torch itself (its CPU kernels) on the probed
    slice: the fused kernel computes each weight update in float32 and rounds it once (its moments stored in bf16);
    the for-loop (and for-each) kernel rounds each moment update and the step to bfloat16 op by op. Adam's moments are
    elementwise, so the slice replays alone: from zero state at step 1, each step from your weights before it, with
    its gradient clipped as clip_grad_norm_ does in bf16, at the rate that misses fewest (`rate`, then KERNEL_RATES
    across the step's interval, KERNEL_ZOOMS rounds). The for-loop kernel's decay (weights times 1 - lr x wd, in
    bf16) rounds back to each weight; the fused kernel's can tip a rounding, so it is replayed at each of
    KERNEL_DECAYS, on the weights a decay reaches or on all, and the fewest misses kept. {kernel: misses per step};
    {} where a step's interval is unknown."""
    if any(iv is None or iv[0] > iv[1] for iv in intervals):
        return {}
    adam = (b1, b2, eps, clip)
    out = {"adamw_torch": _replay(p, intervals, adam, rate, KERNELS["adamw_torch"], 0.0, None)}
    fused = [_replay(p, intervals, adam, rate, KERNELS["adamw_torch_fused"], wd, scope)
             for wd in KERNEL_DECAYS for scope in ((None,) if not wd else (p.decay, None))]
    out["adamw_torch_fused"] = min(fused, key=sum)
    return out


def _replay(p: _Probed, intervals: list, adam: tuple, rate, kw: dict, wd: float, decay) -> list[int]:
    """One kernel's misses per probed step (bf16_kernel_misses), with decay `wd` on the elements `decay` marks (None:
    every element)."""
    import torch

    b1, b2, eps, clip = adam
    parts = [np.ones(len(p.before[0]), dtype=bool)] if decay is None else [decay, ~decay]
    parts = [m for m in parts if m.any()]
    xs = [torch.nn.Parameter(torch.tensor(p.before[0][m], dtype=torch.bfloat16)) for m in parts]
    groups = [{"params": [x], "weight_decay": wd if k == 0 else 0.0} for k, x in enumerate(xs)]
    opt = torch.optim.AdamW(groups, lr=1.0, betas=(b1, b2), eps=eps, **kw)
    misses = []
    for (lo, hi), b, a, g, norm in zip(intervals, p.before, p.after, p.grads, p.norms):
        grad = torch.tensor(g, dtype=torch.bfloat16)
        if clip and math.isfinite(clip):  # (the total norm, its coefficient and the product all in bf16)
            grad = grad * (clip / (torch.tensor(norm, dtype=torch.bfloat16) + 1e-6)).clamp(max=1.0)
        kept = [{k: v.clone() for k, v in opt.state[x].items()} for x in xs]
        starts = [torch.tensor(b[m], dtype=torch.bfloat16) for m in parts]
        targets = [torch.tensor(a[m], dtype=torch.bfloat16) for m in parts]
        grads = [grad[torch.from_numpy(m)] for m in parts]

        def step_at(lr: float) -> tuple:
            for x, state, start, g_part in zip(xs, kept, starts, grads):
                opt.state[x] = {k: v.clone() for k, v in state.items()}
                with torch.no_grad():
                    x.copy_(start)
                x.grad = g_part.clone()
            for group in opt.param_groups:
                group["lr"] = float(lr)
            opt.step()
            miss = sum(int((x.detach() != target).sum()) for x, target in zip(xs, targets))
            return miss, lr, [{k: v.clone() for k, v in opt.state[x].items()} for x in xs]

        best = step_at(rate) if rate else None
        for _ in range(KERNEL_ZOOMS):  # the rates that reproduce a step can be a window of 1e-4 of the interval:
            if best is not None and not best[0]:  # each round scans around the best so far, a grid spacing each side
                break
            for lr in np.linspace(lo, hi, KERNEL_RATES):
                tried = step_at(lr)
                if best is None or tried[0] < best[0]:
                    best = tried
                if not tried[0]:
                    break
            width = (hi - lo) / (KERNEL_RATES - 1)
            lo, hi = max(best[1] - width, 0.0), best[1] + width
        for x, state in zip(xs, best[2]):  # (the moments do not depend on the rate: any rate's carry the same state)
            opt.state[x] = state
        misses.append(best[0])
    return misses


def _kernel(p: _Probed, b1, b2, alike_b2, eps, clip, rate) -> tuple[dict, list, list]:
    """The AdamW kernel as the rounded updates tell it: (settings, words, unsettled). A kernel is read where it alone
    reproduces every probed update at the beta2 read (`b2`) and the other kernel does so at no beta2 the updates
    leave alike (`alike_b2`); both reproducing them at some such beta2 is said as what the run could not tell (the
    kernels part on a few elements a step, which a probed slice may not hold); neither, as a kernel not read."""
    exact = {}  # kernel -> the beta2 values at which it reproduces every probed update
    for x in dict.fromkeys([b2, *alike_b2]):
        for name, misses in bf16_kernel_misses(p, _bf16_intervals(p, b1, x, eps, clip), b1, x, eps, clip,
                                               rate).items():
            if not any(misses):
                exact.setdefault(name, []).append(x)
    if len(exact) == 1 and b2 in next(iter(exact.values())):
        name, other = next(iter(exact)), next(k for k in KERNELS if k not in exact)
        return ({"OPTIM": name}, [f"with {KERNEL_NAMES[name]} AdamW kernel (optim = {name}: it reproduces every "
                                  f"probed update; {other} misses some at every beta2 alike)"], [])
    if len(exact) == 1:  # at other betas only: read with them, or the other kernel at the read one, alike
        name, at = next(iter(exact.items()))
        return {}, [], [f"the AdamW kernel: {KERNEL_NAMES[name]} one (optim = {name}) reproduces every probed rounded "
                        f"update at beta2 {', '.join(f'{x:g}' for x in at)} only, neither kernel at the {b2:g} read"]
    if len(exact) == 2:
        return {}, [], ["the AdamW kernel: the fused one (optim = adamw_torch_fused) and torch's for-loop or for-each "
                        "(optim = adamw_torch) reproduce every probed rounded update alike"]
    return {}, [], ["the AdamW kernel: neither the fused one nor torch's for-loop, replayed on the probed slice at the "
                    "betas read, reproduces every rounded update (a rate or a clip read to its interval only)"]


def _bf16_optimizer(p: _Probed, clips: list, finite: list, spec, steps_total: int | None) -> Finding:
    """Adam(W) on weights held in bfloat16: the updates are rounded to each weight's bf16 spacing, so a least-squares
    rate would fit the rounding (most small updates round to nothing); instead each (beta1, beta2, threshold) is
    kept where, at every probed step, some rate reproduces every rounded weight (bf16_rate_interval), and the rate of
    each step is the middle of the interval it allows. Adam's epsilon is read as its grid allows; a decoupled weight
    decay cannot show (bf16 optimizers multiply the weights by 1 - lr x wd on their own, which rounds back to each
    weight for lr x wd below 2^-9)."""
    prefer = lambda alike, own: own if own in alike else alike[0]  # noqa: E731
    grid = [(b1, b2, clip) for clip in clips for b1 in _BETA1 for b2 in _BETA2]
    fit = {h: _bf16_intervals(p, h[0], h[1], 1e-8, h[2]) for h in grid}
    ok = [h for h in grid if _fits(fit[h])]
    said_bf16 = ("holds its weights in bfloat16 and steps them there (every probed weight and update is a bfloat16 "
                 "number: the model loaded in bfloat16; TRL: bf16 = true with the model loaded in bfloat16)")
    settings = {"MASTER_WEIGHTS": "bfloat16", "DTYPE": "bfloat16"}
    if not ok:
        return Finding("optimizer", None, f"your loop {said_bf16}; no Adam on the grid reproduces its rounded "
                       "updates at every probed step", _changed(settings, spec), False, same_as_spec=False,
                       evidence={"bfloat16_weights": True}, settles=("MASTER_WEIGHTS", "DTYPE"))
    alike_b1 = [x for x in _BETA1 if any(h[0] == x for h in ok)]
    b1 = prefer(alike_b1, getattr(spec, "ADAM_BETA1", None))
    alike_b2 = [x for x in _BETA2 if (b1, x) in {h[:2] for h in ok}]
    b2 = prefer(alike_b2, getattr(spec, "ADAM_BETA2", None))
    alike_clip = sorted(h[2] for h in ok if h[:2] == (b1, b2))
    nice = [c for c in (math.inf, 1.0, 0.5, 0.2, 0.1, 2.0, 5.0) if c in alike_clip]  # (none first: the simplest)
    own = float(getattr(spec, "MAX_GRAD_NORM", 0.0) or math.inf) if spec else math.inf
    clip = own if own in alike_clip else nice[0] if nice else alike_clip[0]
    alike_eps = [e for e in _ADAM_EPS if _fits(_bf16_intervals(p, b1, b2, e, clip))] or [1e-8]
    eps = prefer(alike_eps, getattr(spec, "ADAM_EPS", None))
    intervals = _bf16_intervals(p, b1, b2, eps, clip)
    # a step where no probed update left its weight's bf16 cell bounds the rate from above alone (lo = 0): no reading
    known = [(t, (iv[0] + iv[1]) / 2) for t, iv in enumerate(intervals) if iv is not None and iv[0] > 0]
    if not known:
        top = min(iv[1] for iv in intervals if iv is not None)
        return Finding("optimizer", None, f"your loop {said_bf16}; every probed update rounded to nothing, so its "
                       f"learning rate is known only to be at most {top:.3g}", _changed(settings, spec), True,
                       same_as_spec=False, unsettled=(f"the learning rate: at most {top:.3g} (no probed weight moved "
                                                      "by a bfloat16 spacing)",),
                       evidence={"bfloat16_weights": True}, settles=("MASTER_WEIGHTS", "DTYPE"))
    width = max((intervals[t][1] - intervals[t][0]) / (intervals[t][0] + intervals[t][1]) for t, _ in known)
    rates, words, unsettled = _learning_rate(known, width, steps_total, spec)
    settings.update(rates)
    settings["ADAM_BETA1"], settings["ADAM_BETA2"], settings["ADAM_EPS"] = b1, b2, eps
    words = [said_bf16 + ":", *words, f"with betas ({b1:g}, {b2:g}) and epsilon {eps:g}"]
    unsettled += _alike_words(alike_b1, alike_b2, alike_eps, "the probed steps' rounded updates")
    rate = settings.get("LR", getattr(spec, "LR", 0.0)) or 1e-300
    unsettled.append(f"weight decay cannot show on bfloat16 weights: a decay multiplies each weight by 1 - lr x wd, "
                     f"which rounds back to the weight itself below wd = {2 ** -9 / rate:.3g} at this rate")
    kernel = _kernel(p, b1, b2, alike_b2, eps, clip, settings.get("LR") if settings.get("LR_SCHEDULE") == "constant"
                     and not settings.get("WARMUP_STEPS") else None)
    for part in (_clipping(clip, alike_clip, finite, spec), kernel):
        settings.update(part[0])
        words += part[1]
        unsettled += part[2]
    settings = _changed(settings, spec)
    every = len(known) == len(intervals) and len(known) >= 2  # (every probed step read a rate)
    settles = ("MASTER_WEIGHTS", "DTYPE") + _optimizer_settles(every, alike_b1, alike_b2, alike_eps, unsettled)
    settles += ("OPTIM",) if kernel[1] else ()  # (read only where one kernel alone reproduces every update)
    settles = tuple(k for k in settles if k not in ("WEIGHT_DECAY", "WEIGHT_DECAY_ALL"))
    if any(u.startswith("the learning rate per step") for u in unsettled):
        settings.pop("LR_SCHEDULE", None)
    return Finding("optimizer", None, "your loop " + " ".join(words), settings, True, same_as_spec=False,
                   unsettled=tuple(unsettled), settles=settles,
                   evidence={"bfloat16_weights": True, "lrs": [None if iv is None else (iv[0] + iv[1]) / 2
                                                              for iv in intervals],
                             "intervals": [list(iv) if iv else None for iv in intervals], "residual": width})


def _changed(settings: dict, spec) -> dict:
    """The settings that differ from the spec's own (a threshold of 0 where the spec clips at none stays out)."""
    if not spec:
        return settings
    has = {k: getattr(spec, k, {"MASTER_WEIGHTS": "float32", "DTYPE": "float32", "OPTIM": "adamw_torch_fused"}.get(k))
           for k in settings}
    return {k: v for k, v in settings.items() if not _same(has[k], v) and not (k == "MAX_GRAD_NORM" and not v
                                                                              and not has[k])}
