"""Learning-rate schedules fitted to the rates a loop steps at (logged, or read from its weights by the optimizer
stage): every `lr_scheduler_type` TRL takes that steps on the step count, with its parameters in TRL's own fields
(`warmup_steps`, `lr_scheduler_kwargs`). The simplest family that reproduces the rates wins (fewest parameters
first); each fitted number is then the simplest one within the fit's tolerance. A warmup or a horizon longer than
the run is written as the fields that reproduce it over the run (a linear decay to 0 over H > STEPS steps is
`polynomial` with power 1 and lr_end = LR (H - STEPS) / (H - warmup); a cosine over H is `cosine` with num_cycles =
0.5 (STEPS - warmup) / (H - warmup); a warmup from a fraction of LR is `warmup_stable_decay` with min_lr_ratio)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from harness.diagnose.identify.numerics import _refine


@dataclasses.dataclass(frozen=True)
class ScheduleFit:
    """A schedule that reproduces the rates: the spec's fields (LR_SCHEDULE `constant` with a warmup is TRL's
    `constant_with_warmup`)."""
    peak: float  # LR: transformers' learning_rate, the rate the multipliers scale
    schedule: str  # LR_SCHEDULE
    warmup: int  # WARMUP_STEPS
    kwargs: dict  # LR_SCHEDULER_KWARGS
    misfit: float  # the largest misfit over the steps, relative to each step's rate (or 1e-3 of the peak)

    def settings(self) -> dict:
        return {"LR": self.peak, "LR_SCHEDULE": self.schedule, "WARMUP_STEPS": self.warmup,
                "LR_SCHEDULER_KWARGS": dict(self.kwargs)}


@dataclasses.dataclass(frozen=True)
class _Family:
    """One schedule with the parameters a fit solves: `affine` (kwargs the multiplier is affine in, a floor or a
    start: solved by least squares with the peak), `free` ((kwarg, lo, hi): searched, then narrowed), `variants`
    (fixed kwargs tried in turn), `warm` (whether it has a warmup)."""
    schedule: str
    affine: tuple = ()
    free: tuple | None = None
    variants: tuple = ({},)
    warm: bool = True


_RATES = ("lr_end", "min_lr")  # kwargs that are rates, not fractions of the peak


def families(steps: int) -> list[_Family]:
    """The families in the order of their simplicity (fewest parameters first)."""
    cycles = ("num_cycles", 0.01, 4.0)
    wsd = tuple({"num_decay_steps": d, "decay_type": t} for d in range(1, steps + 1)
                for t in ("linear", "cosine", "1-sqrt"))
    return [
        _Family("constant", warm=False), _Family("linear", warm=False), _Family("constant"), _Family("linear"),
        _Family("cosine"), _Family("cosine", free=cycles),
        _Family("polynomial", affine=("lr_end",), variants=({"power": 1.0},)),
        _Family("cosine_with_min_lr", affine=("min_lr_rate",)),
        _Family("cosine_with_min_lr", affine=("min_lr_rate",), free=cycles),
        _Family("polynomial", affine=("lr_end",), free=("power", 0.05, 8.0)),
        _Family("warmup_stable_decay", affine=("min_lr_ratio",), variants=({"num_decay_steps": 0},)),
        _Family("inverse_sqrt"), _Family("inverse_sqrt", free=("timescale", 1.0, 1e6)),
        _Family("cosine_with_restarts", variants=tuple({"num_cycles": k} for k in range(2, 9))),
        _Family("warmup_stable_decay", affine=("min_lr_ratio",), variants=wsd),
        _Family("cosine_warmup_with_min_lr", affine=("min_lr_rate",), free=cycles),
        _Family("cosine_warmup_with_min_lr", affine=("min_lr_rate", "warmup_lr_rate"), free=cycles),
    ]


def fit_schedule(rates: dict, steps: int, tol, stated: dict | None = None) -> ScheduleFit | None:
    """The simplest schedule whose rates are `rates` ({0-based optimizer step: rate}) over a run of `steps` steps,
    each within `tol` (a relative tolerance, or {step: tolerance}); None where no TRL schedule does. `stated`: the
    loop's own values (LR, LR_SCHEDULE, WARMUP_STEPS, LR_SCHEDULER_KWARGS), tried first and preferred where a
    number is not told apart (a peak and a warmup that both scale a warmup through the whole run)."""
    try:
        return _fit(rates, steps, tol, stated or {})
    except (np.linalg.LinAlgError, ArithmeticError, ValueError):  # numbers no schedule fits (a fit never crashes)
        return None


def _fit(rates: dict, steps: int, tol, stated: dict) -> ScheduleFit | None:
    obs = sorted((int(s), float(r)) for s, r in rates.items() if r is not None and math.isfinite(r))
    if not obs or max(r for _, r in obs) <= 0 or min(r for _, r in obs) < 0:
        return None
    tols = np.array([tol.get(s, 1e-5) if isinstance(tol, dict) else tol for s, _ in obs])
    at, y = np.array([s for s, _ in obs]), np.array([r for _, r in obs])
    own = _own(stated, at, y, tols, steps)
    if own is not None:
        return own
    from_zero = at[0] == 0 and y[0] > 0  # a rate at the first step: no warmup from 0 (transformers' own)
    candidates: dict = {}  # the warmups worth trying, per kind of warmup
    for fam in families(steps):
        warm = fam.warm and not (from_zero and fam.schedule not in ("warmup_stable_decay", "cosine_warmup_with_min_lr"))
        kind = _warmup_kind(fam)
        if warm and kind not in candidates:
            candidates[kind] = _warmups(at, y, steps, stated, kind)
        for warmup in (candidates[kind] if warm else [0]):
            if warmup and not _warmup_fits(at, y, warmup, _warmup_kind(fam), tols):
                continue
            if len(at) <= 1 + len(fam.affine) + (fam.free is not None) + (warmup > 0):
                continue  # (as many numbers fitted as rates read: any rates fit, none is told)
            fit = _best(fam, warmup, at, y, tols, steps)
            if fit is not None:
                fit = _simplest(fit, fam, at, y, tols, steps, stated)
                return fit if fit.warmup <= at[-1] else _simplest_span(fit, fam, at, y, tols, steps, stated)
    return None


def _simplest_span(fit: ScheduleFit, fam: _Family, at, y, tols, steps: int, stated: dict) -> ScheduleFit:
    """A warmup through the whole run tells the rates' line, not the peak and the warmup apart: of the warmups that
    fit, the one whose numbers (peak, warmup, kwargs) are written with the fewest digits (the first at a tie: the
    stated LR's)."""
    best, score = fit, _score(fit)
    for warmup in _warmups(at, y, steps, stated, _warmup_kind(fam)):
        if warmup <= at[-1] or warmup == fit.warmup or not _warmup_fits(at, y, warmup, _warmup_kind(fam), tols):
            continue
        other = _best(fam, warmup, at, y, tols, steps)
        if other is not None:
            other = _simplest(other, fam, at, y, tols, steps, stated)
            if _score(other) < score:
                best, score = other, _score(other)
    return best


def _score(fit: ScheduleFit) -> int:
    """How many digits the fit's numbers take to write."""
    return _digits(fit.peak, 1e-12) + len(str(fit.warmup)) + sum(_digits(v, 1e-12) for v in fit.kwargs.values()
                                                                 if isinstance(v, float) and v)


def _own(stated: dict, at, y, tols, steps: int) -> ScheduleFit | None:
    """The loop's stated schedule, where it reproduces the rates (at its own peak, or a peak fitted to it)."""
    if "LR_SCHEDULE" not in stated:
        return None
    kwargs = dict(stated.get("LR_SCHEDULER_KWARGS") or {})
    fits = [_solve(stated["LR_SCHEDULE"], int(stated.get("WARMUP_STEPS", 0)), kwargs, (), at, y, steps, peak)
            for peak in (stated.get("LR"), None)]  # (at the stated peak, else at a fitted one)
    fit = next((f for f in fits if _within(f, at, y, tols, steps)), None)
    if fit is None:
        return None
    return dataclasses.replace(_simplest(fit, _Family(fit.schedule), at, y, tols, steps, stated),
                               schedule=fit.schedule)


def _warmups(at, y, steps: int, stated: dict, kind: str) -> list[int]:
    """The warmups worth trying for a warmup of this kind (see _warmup_kind), the likeliest first: the stated one,
    the one a peak of the stated LR gives, for a warmup through the run the shortest whose peak is a round number
    (from the first rate, and from the rise per step fitted to every rate, within three of its standard errors: a
    slope read from noisy rates still finds the round peak), then each step of the run."""
    out = [int(stated.get("WARMUP_STEPS", 0))]
    rising = [(s, r) for s, r in zip(at, y) if s > 0 and r > 0]
    lr, shift = stated.get("LR"), 1 if kind == "plus1" else 0
    if kind == "line":  # from a fraction a of LR: a + (LR - a) s / w (warmup_stable_decay's; cosine_warmup_with_min_lr's
        if len(at) >= 2 and at[0] == 0 and at[1] == 1 and y[1] > y[0] > 0:  # over w - 1)
            a, b = y[0], y[1] - y[0]
            out += [round((lr - a) / b), round((lr - a) / b) + 1] if lr and (lr - a) / b < 1e6 else []
            for digits in (2, 3):  # a warmup through the run: the shortest whose peak and start are round numbers
                out += [next((w for w in range(steps, 1000 * steps)
                              if _digits(a + b * w, 1e-9) + _digits(a / (a + b * w), 1e-9) <= digits), 0)]
    elif rising:  # s / w x LR (transformers' own), (s + 1) / w x LR (cosine_warmup_with_min_lr's)
        s, r = rising[0]
        out += [round(lr * (s + shift) / r)] if lr else []
        slope, rel = _slope([s + shift for s, _ in rising], [r for _, r in rising])
        for digits in (1, 2):  # a warmup through the run: its rate s / w x peak tells the ratio only
            out += [next((w for w in range(steps, 1000 * steps) if _digits(r * w / (s + shift), 1e-9) <= digits), 0)]
            out += [next((w for w in range(steps, 1000 * steps) if _digits(slope * w, rel) <= digits), 0)]
    out += list(range(1, steps + 1))
    return [w for w in dict.fromkeys(out) if w >= 0][:steps + 10]


def _slope(x: list, r: list) -> tuple[float, float]:
    """The rise per step of rates on a line through 0 (least squares) and its relative uncertainty (three standard
    errors, at least 1e-9)."""
    x, r = np.asarray(x, dtype=float), np.asarray(r, dtype=float)
    slope = float(np.dot(x, r) / np.dot(x, x))
    if len(x) < 2 or slope <= 0:
        return slope, 1e-9
    se = math.sqrt(float(np.sum((r - slope * x) ** 2)) / (len(x) - 1) / float(np.dot(x, x)))
    return slope, max(3 * se / slope, 1e-9)


def _warmup_kind(fam: _Family) -> str:
    """How the family warms up: `zero` (transformers' own: s / w, the peak at w), `plus1` ((s + 1) / w), `line` (from
    a fraction of the peak: min_lr_ratio, warmup_lr_rate)."""
    if fam.schedule == "cosine_warmup_with_min_lr":
        return "line" if "warmup_lr_rate" in fam.affine else "plus1"
    return "line" if fam.schedule == "warmup_stable_decay" else "zero"


def _warmup_fits(at, y, warmup: int, kind: str, tols) -> bool:
    """Whether the rates up to the warmup's end lie as that warmup puts them (a cheap test before any fit): on a line
    through 0 (`zero`, the peak at the warmup's end included), through -1 (`plus1`), or on any line (`line`)."""
    top = float(np.max(y))
    last = warmup if kind == "zero" else warmup - 1
    idx = at <= last
    x = at[idx].astype(float) + (1.0 if kind == "plus1" else 0.0)
    cols = [x] if kind != "line" else [np.ones_like(x), x]
    if idx.sum() <= len(cols):
        return True
    a = np.stack(cols, axis=1)
    try:
        coef, *_ = np.linalg.lstsq(a, y[idx], rcond=None)
    except np.linalg.LinAlgError:
        return False
    err = np.abs(a @ coef - y[idx]) / np.maximum(np.abs(y[idx]), 1e-3 * top)
    return bool(np.all(err <= np.asarray(tols)[idx] if np.ndim(tols) else err <= tols))


def _best(fam: _Family, warmup: int, at, y, tols, steps: int) -> ScheduleFit | None:
    """The family's best fit with this warmup, where it is within the tolerance."""
    best = None
    for variant in fam.variants:
        if fam.free is None:
            fit = _solve(fam.schedule, warmup, dict(variant), fam.affine, at, y, steps)
        else:
            key, lo, hi = fam.free

            def rms(x, key=key, variant=variant):
                f = _solve(fam.schedule, warmup, {**variant, key: x}, fam.affine, at, y, steps)
                return _rms(f, at, y, steps) if f is not None else math.inf
            grid = np.geomspace(lo, hi, 30)
            x0 = float(min(grid, key=rms))
            x = _refine(rms, x0, lo, hi, iters=40)
            fit = _solve(fam.schedule, warmup, {**variant, key: x}, fam.affine, at, y, steps)
        if fit is not None and (best is None or fit.misfit < best.misfit):
            best = fit
    return best if best is not None and _within(best, at, y, tols, steps) else None


def _solve(schedule: str, warmup: int, kwargs: dict, affine: tuple, at, y, steps: int,
           peak: float | None = None) -> ScheduleFit | None:
    """The peak (and the `affine` kwargs) by least squares, relative to each rate: y = peak (u + sum theta_i v_i),
    u the multiplier with every affine kwarg 0, v_i its change with the i-th 1. `peak`: given, not fitted (and no
    affine kwargs)."""
    from scratch_grpo.core import lr_multiplier

    def mult(kw):
        try:
            return np.array([lr_multiplier(int(s), schedule, steps, warmup, kw, lr=1.0) for s in at])
        except (ValueError, ZeroDivisionError, OverflowError, KeyError, TypeError):
            return None
    u = mult({**kwargs, **{k: 0.0 for k in affine}})
    if u is None:
        return None
    others = [mult({**kwargs, **{k: float(k == j) for k in affine}}) for j in affine]
    if any(c is None for c in others):
        return None
    cols = [u] + [c - u for c in others]
    if not all(np.all(np.isfinite(c)) for c in cols):
        return None  # (a multiplier past its range: an inverse square root of a negative count, say)
    w = 1.0 / np.maximum(np.abs(y), 1e-3 * np.max(np.abs(y)))
    if peak is None:
        x = np.stack(cols, axis=1)
        try:
            coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        except np.linalg.LinAlgError:
            return None
        peak = float(coef[0])
        if not peak > 0 or not math.isfinite(peak):
            return None
        thetas = [float(c) / peak for c in coef[1:]]
    elif affine:  # the peak given: the affine kwargs alone, y - peak u = sum (peak theta_i) v_i
        x = np.stack(cols[1:], axis=1)
        try:
            coef, *_ = np.linalg.lstsq(x * w[:, None], (y - peak * u) * w, rcond=None)
        except np.linalg.LinAlgError:
            return None
        thetas = [float(c) / peak for c in coef]
    else:
        thetas = []
    # a floor or a start outside [0, 1], an end rate not below the peak, is no schedule TRL takes: held at the bound
    # (the misfit then says how far off it is, and the search over a free parameter sees a continuous misfit)
    thetas = [min(max(t, 0.0), 1.0 - 1e-9 if k in _RATES else 1.0) for k, t in zip(affine, thetas)]
    kw = {**kwargs, **{k: (t * peak if k in _RATES else t) for k, t in zip(affine, thetas)}}
    fit = ScheduleFit(peak, schedule, warmup, kw, 0.0)
    return dataclasses.replace(fit, misfit=_misfit(fit, at, y, steps))


def _predicted(fit: ScheduleFit, at, steps: int) -> np.ndarray | None:
    from scratch_grpo.core import lr_multiplier

    try:
        return np.array([fit.peak * lr_multiplier(int(s), fit.schedule, steps, fit.warmup, fit.kwargs, lr=fit.peak)
                         for s in at])
    except (ValueError, ZeroDivisionError, OverflowError, KeyError, TypeError):
        return None


def _errors(fit: ScheduleFit | None, at, y, steps: int) -> np.ndarray:
    pred = _predicted(fit, at, steps) if fit is not None else None
    if pred is None or not np.all(np.isfinite(pred)):
        return np.full(len(y), math.inf)
    return np.abs(pred - y) / np.maximum(np.abs(y), 1e-3 * np.max(np.abs(y)))


def _misfit(fit, at, y, steps: int) -> float:
    return float(np.max(_errors(fit, at, y, steps)))


def _rms(fit, at, y, steps: int) -> float:
    """The misfit a search over a free parameter narrows: root mean square, relative to the largest rate (smooth
    where each step's own relative misfit is not: near a rate of 0)."""
    pred = _predicted(fit, at, steps)
    return math.inf if pred is None else float(np.sqrt(np.mean(((pred - y) / np.max(np.abs(y))) ** 2)))


def _within(fit: ScheduleFit | None, at, y, tols, steps: int) -> bool:
    return fit is not None and bool(np.all(_errors(fit, at, y, steps) <= tols))


def _digits(x: float, rel: float) -> int:
    """The fewest significant digits that write `x` within `rel` of itself."""
    for d in range(1, 16):
        if abs(float(f"{x:.{d}g}") - x) <= rel * abs(x):
            return d
    return 16


def _simplest(fit: ScheduleFit, fam: _Family, at, y, tols, steps: int, stated: dict) -> ScheduleFit:
    """The peak, then each fitted kwarg, as the simplest number that keeps the fit within the tolerance (the stated
    LR first: a value as your loop states it; an integer where one does: a timescale, a cycle count); the numbers
    not yet fixed are fitted again each time."""
    free = fam.free[0] if fam.free else None
    for cand in ([stated["LR"]] if stated.get("LR") else []) + [float(f"{fit.peak:.{d}g}") for d in range(1, 10)]:
        trial = _refit(fit, fam, {}, at, y, steps, cand)
        if trial is not None and _within(trial, at, y, tols, steps):
            fit = trial
            break
    fixed: dict = {}
    for key in [k for k in (*fam.affine, free) if k is not None and isinstance(fit.kwargs.get(k), float)]:
        for cand in _shorter(fit.kwargs[key]):
            trial = _refit(fit, fam, {**fixed, key: cand}, at, y, steps, fit.peak)
            if trial is not None and _within(trial, at, y, tols, steps):
                fit, fixed = trial, {**fixed, key: cand}
                break
    schedule = "constant" if fit.schedule == "constant_with_warmup" else fit.schedule
    return dataclasses.replace(fit, schedule=schedule, misfit=_misfit(fit, at, y, steps))


def _refit(fit: ScheduleFit, fam: _Family, fixed: dict, at, y, steps: int, peak: float) -> ScheduleFit | None:
    """The fit again at this peak with the `fixed` kwargs: the affine kwargs not fixed by least squares, the free
    one (not fixed) narrowed again around its value."""
    affine = tuple(k for k in fam.affine if k not in fixed)
    kwargs = {**{k: v for k, v in fit.kwargs.items() if k not in fam.affine}, **fixed}
    free = fam.free[0] if fam.free and fam.free[0] not in fixed else None
    if free is None:
        return _solve(fit.schedule, fit.warmup, kwargs, affine, at, y, steps, peak)

    def rms(x):
        f = _solve(fit.schedule, fit.warmup, {**kwargs, free: x}, affine, at, y, steps, peak)
        return _rms(f, at, y, steps) if f is not None else math.inf
    x = _refine(rms, fit.kwargs[free], fam.free[1], fam.free[2], iters=50)
    return _solve(fit.schedule, fit.warmup, {**kwargs, free: x}, affine, at, y, steps, peak)


def _shorter(value: float) -> list[float]:
    """`value` as 0, as an integer, then with 1, 2, ... significant digits."""
    out = [0.0, float(round(value))]
    out += [float(f"{value:.{d}g}") for d in range(1, 10)]
    return [v for v in dict.fromkeys(out)] + [value]
