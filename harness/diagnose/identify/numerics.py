"""The numbers the stage readings share: snapping a measured value to a round one within the run's resolution,
comparing a reading with the spec's value, the KL estimators, the golden-section search that narrows a fitted value,
the margin within which two hypotheses fit alike, and the floor the weights' float32 rounding leaves."""

from __future__ import annotations

import math

import numpy as np


def _arr(value) -> np.ndarray:
    return np.asarray(value, dtype=np.float64).reshape(-1)


# round values a measured setting snaps to when it is within the run's resolution of one
_NICE_EPS = (1e-8, 0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-7, 1e-10, 1e-12)


def snap(value: float, unc: float, nice=_NICE_EPS) -> float:
    """The first round value within `unc` of `value` (the commonest choices first), else `value` with the fewest
    significant digits that keep it within `unc` (the fit's own uncertainty: 0.0171 known to +-1e-4 is 0.017, not
    0.02)."""
    for v in nice:
        if abs(v - value) <= unc:
            return v
    for digits in range(1, 16):
        v = float(f"{value:.{digits}g}")
        if abs(v - value) <= unc:
            return v
    return value


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)
    return a == b


def _kl(logp, ref, estimator: str):
    d = ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return np.exp(d) - d - 1.0


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


def bfloat16_exact(values) -> np.ndarray:
    """Per value, whether it is a bfloat16 number (its float32 form has a zero lower half: bf16 keeps float32's top
    16 bits)."""
    bits = _arr(values).astype(np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFF)) == 0


def bfloat16_cell(values) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) per bfloat16 value a: the exact values that round to a (to nearest), from halfway to the bf16 number
    below it to halfway to the one above (at a power of two the spacing below is half the spacing above). 0's cell
    reaches halfway to the smallest bf16 subnormal either side."""
    a = _arr(values).astype(np.float32)
    bits = a.view(np.uint32).astype(np.int64)
    step = np.int64(0x10000)  # one bf16 unit in the last place, in float32's bit pattern
    neg = (bits >> 31) == 1  # (the sign bit; magnitudes grow with the bits either way)
    mag = bits & 0x7FFFFFFF
    bigger = ((mag + step) | (bits & 0x80000000)).astype(np.uint32).view(np.float32).astype(np.float64)
    smaller_mag = np.maximum(mag - step, 0)
    smaller = (smaller_mag | np.where(smaller_mag > 0, bits & 0x80000000, 0)).astype(np.uint32).view(
        np.float32).astype(np.float64)
    a64 = a.astype(np.float64)
    zero = mag == 0
    tiny = float(np.array([0x10000], dtype=np.uint32).view(np.float32)[0])  # the smallest bf16 subnormal
    up = np.where(neg, smaller, bigger)  # the next bf16 number toward +inf
    down = np.where(neg, bigger, smaller)
    up = np.where(zero, tiny, up)
    down = np.where(zero, -tiny, down)
    return (a64 + down) / 2, (a64 + up) / 2
