"""Free-run parity: each loop samples its own completions, several seeds per side.

Two runs of one loop with different seeds already differ, so free-run parity asks whether the two
sides differ by more than the seed-to-seed noise allows.

The statistic (named so its false-alarm rate can be measured): for each compared metric, the run
is cut into `windows` equal windows and each seed's window mean taken. Per window,
    t_w = (mean_A - mean_B) / (s_w * sqrt(1/n_A + 1/n_B)),
with s_w the pooled std of the seeds' window means on both sides (the noise floor: self-parity
spread). A metric is flagged at the first window where |t_w| exceeds the Student-t quantile at
1 - alpha / (2 * windows * metrics), with n_A + n_B - 2 degrees of freedom (Bonferroni over windows
and metrics, so `alpha` is the family-wise false-alarm rate of one cell). Measured on null pairs
(same settings, other seeds; tests/test_freerun.py and docs/benchmarks.md): 5.3% at alpha = 0.05.
A percentile bootstrap over 3 seeds per side, tried first, raised a false alarm on 93% of null pairs:
with 3 seeds its intervals are far too narrow.

Counts and hashes that do not depend on sampling (prompts per step, prompt_ids_hash, learning rate)
are compared exactly, seed by seed; a metric logged on one side only is never a divergence (there is nothing to
hold it against): it is listed (`only_in_a/b`; `one_sided="not_compared"`, for other people's logs, also in
`not_compared`). A NaN or inf that a run logged for a compared metric is a divergence at that step.
"""

from __future__ import annotations

import math

import numpy as np

from harness.diagnose.compare import (CompareInputError, Inputs, absent_at, compare_frames, finish_inputs,
                                      input_mode, load_any_run, load_tolerances)

FREE_METRICS = ("reward", "reward_std", "loss", "grad_norm", "entropy", "completions/mean_length")
EXACT_FREE = ("prompts_in_step", "sequences_in_step", "prompt_ids_hash", "learning_rate", "epoch")
DEFAULT_WINDOWS = 5


# ---------------------------------------------------------------------------------------------
# Student-t quantiles without scipy: the regularised incomplete beta by continued fraction
# ---------------------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 3e-14:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom, t >= 0."""
    return 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The p-quantile (p >= 0.5) of Student's t, by bisection on the survival function."""
    lo, hi = 0.0, 1e7
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if 1.0 - t_sf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------
def window_means(values: np.ndarray, windows: int) -> np.ndarray:
    k = len(values) // windows
    return np.array([np.nanmean(values[i * k:(i + 1) * k]) for i in range(windows)])


def windowed_t(A: np.ndarray, B: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per window: the difference of side means, the pooled seed std (noise floor) and t. A, B: seeds x windows."""
    n, m = len(A), len(B)
    pooled = np.sqrt(((n - 1) * A.var(0, ddof=1) + (m - 1) * B.var(0, ddof=1)) / (n + m - 2))
    delta = A.mean(0) - B.mean(0)
    se = pooled * math.sqrt(1.0 / n + 1.0 / m)
    t = np.where(se > 0, np.abs(delta) / np.where(se > 0, se, 1.0), np.where(np.abs(delta) > 0, np.inf, 0.0))
    return delta, pooled, t


def compare_free(runs_a: list, runs_b: list, *, alpha: float = 0.05, windows: int = DEFAULT_WINDOWS,
                 metrics=FREE_METRICS, paired: bool = True, one_sided: str = "divergence") -> dict:
    """Free-run comparison of two sets of seeds (run folders or loaded frames). `paired`: run i of each side used
    the same seed, so the fields that do not depend on sampling are compared exactly, pair by pair (off for null
    pairs of different seeds). A metric only one side logs is listed, never a divergence; `one_sided="not_compared"`
    lists it in `not_compared` too."""
    if len(runs_a) < 2 or len(runs_b) < 2:
        raise ValueError("free-run parity needs at least 2 seeds per side to estimate the noise floor")
    A_frames = [r if hasattr(r, "columns") else load_any_run(r) for r in runs_a]
    B_frames = [r if hasattr(r, "columns") else load_any_run(r) for r in runs_b]
    steps = min(len(f) for f in A_frames + B_frames)
    windows = max(1, min(windows, steps))
    k = steps // windows
    present = [m for m in metrics if all(m in f.columns for f in A_frames + B_frames)]
    crit = t_quantile(1.0 - alpha / (2.0 * windows * max(1, len(present))), len(runs_a) + len(runs_b) - 2)
    result = {"mode": "free", "dtype": None, "steps": [steps, steps], "seeds": [len(runs_a), len(runs_b)],
              "statistic": f"windowed pooled-variance t, {windows} windows, Bonferroni over windows x metrics, "
                           f"family-wise alpha {alpha}", "t_critical": crit, "metrics": {}, "notes": []}
    failures = []

    def at(pos: int) -> int:  # a position in the runs -> its step (the same for harness runs: steps 1..N)
        label = A_frames[0].index[pos]
        return int(label) if float(label).is_integer() else label

    for m in present:
        # a NaN or inf a run logged (not a step it did not log): a divergence at that step
        bad = [int(pos) for f in A_frames + B_frames for pos in
               np.nonzero(~np.isfinite(f[m].to_numpy(dtype=float)[:steps]) & ~absent_at(f, m, f.index[:steps]))[0]]
        A = np.stack([window_means(f[m].to_numpy(dtype=float)[:steps], windows) for f in A_frames])
        B = np.stack([window_means(f[m].to_numpy(dtype=float)[:steps], windows) for f in B_frames])
        delta, floor, t = windowed_t(A, B)
        over = np.nonzero(t > crit)[0]
        first = at(int(over[0]) * k) if len(over) else None
        if bad:
            first = at(min(bad)) if first is None else min(first, at(min(bad)))
        scale = np.maximum(np.abs(B.mean(0)), 1e-30)
        result["metrics"][m] = {"max_abs": float(np.abs(delta).max()), "step_max_abs": at(int(np.abs(delta).argmax()) * k),
                                "max_rel": float((np.abs(delta) / scale).max()), "mean_delta": float(delta.mean()),
                                "noise_floor": [float(x) for x in floor], "t": [float(x) for x in t],
                                "window_delta": [float(x) for x in delta], "first_outside": first,
                                "tolerance": {"t_critical": crit}}
        if bad:
            result["metrics"][m]["non_finite_steps"] = sorted({at(p) for p in bad})[:20]
            result["notes"].append(f"{m}: NaN or inf at step {at(min(bad))} (a divergence)")
        if first is not None:
            failures.append((first, m))
    # sampling-free fields, seed by seed; and metrics logged on one side only
    tol = load_tolerances()
    only_a, only_b, why = set(), set(), {}
    for fa, fb in zip(A_frames, B_frames):
        pair = compare_frames(fa, fb, tolerances=tol, one_sided=one_sided)
        only_a |= set(pair["only_in_a"])
        only_b |= set(pair["only_in_b"])
        why.update(pair.get("not_compared_why", {}))
        for name in EXACT_FREE if paired else ():
            mm = pair["metrics"].get(name)
            if mm is not None and mm["first_outside"] is not None:
                failures.append((mm["first_outside"], name))
                result["metrics"].setdefault(name, mm)
    result["only_in_a"], result["only_in_b"] = sorted(only_a), sorted(only_b)
    result["one_sided"] = one_sided
    if one_sided == "not_compared":
        result["not_compared"], result["not_compared_why"] = sorted(why), dict(sorted(why.items()))
    from harness.diagnose.compare import PRIORITY

    rank = {m: i for i, m in enumerate(PRIORITY)}
    failures.sort(key=lambda f: (f[0], rank.get(f[1], len(rank)), f[1]))
    result["first_divergence"] = {"step": failures[0][0], "metric": failures[0][1]} if failures else None
    result["outside"] = sorted({m for _, m in failures})
    return result


def compare_free_inputs(inputs: Inputs, *, alpha: float = 0.05, evidence=None) -> dict:
    """`compare` on several seeds per side of anyone's logs (compare.load_inputs): the statistic above, never
    lockstep's tolerances; a metric one side logs is listed as not compared. The fields that do not depend on
    sampling are compared seed by seed only when both sides hold the same seed folders (seed-N)."""
    input_mode(inputs, "free")
    if not any(all(m in f.columns for f in inputs.a + inputs.b) for m in FREE_METRICS):
        raise CompareInputError(f"free runs compare {', '.join(FREE_METRICS)}; none of them is in every run of both "
                                "sides: name your columns with --map OURS=THEIRS")
    paired = [p.name for p in inputs.paths[0]] == [p.name for p in inputs.paths[1]]
    result = compare_free(inputs.a, inputs.b, alpha=alpha, paired=paired, one_sided="not_compared")
    result["notes"].append(f"free runs: {', '.join(m for m in FREE_METRICS if m in result['metrics'])} against the "
                           "seed-to-seed noise floor" + ("; counts and hashes seed by seed (the same seed folders on "
                                                         "both sides)" if paired else ""))
    return finish_inputs(result, inputs, evidence)
