"""The weighting read from the gradient: what the loss's value cannot show.

At a ratio of 1 with advantages centred in each group, a mean over completions is 0 whatever it is divided by and
whatever advantage each completion is weighted with: the weighting stage reads the loss's value, and there it can
tell neither. Step 1 is taken at the initial weights (every side starts from PARITY_INIT; so is a later step where
every step before it had no gradient), and the contract's `Probe` saves a slice of its gradient before clipping. At
a ratio of 1 (no clip acts, a k2 or k3 KL has no gradient there) the per-token loss is -A x ratio, and its gradient
is linear in the per-token coefficients: a loss whose coefficient is one number per completion gives, on the probed
slice,

    G = sum_i w_i g_i,     g_i the gradient of completion i's mean log-prob over the tokens its mask counts,

so each completion's g_i is recomputed once at the initial weights (under the forward rule the forward stage read)
and every candidate weighting is a vector w, set against the Probe's G by least squares in its scale alone:
- `own`: w_i = -c A_i (a mean per completion, then over completions: TRL's grpo, c = 1 / completions);
- `micro_batch_mean`: w_i = -c mean(A over i's micro-batch): a loss `(term * advantages).mean()` with the advantages
  shaped (B, 1) and the per-completion term (B,), a (B, B) broadcast;
- `own_tokens`: w_i = -c A_i |m_i| (a sum over tokens: dapo c = 1 / the step's tokens, dr_grpo 1 / (completions x
  max tokens), a divisor of its own 1 / D);
- `micro_batch_mean_tokens`: the micro-batch's mean advantage on a token sum;
- `own_micro_batch_tokens`: w_i = -c A_i |m_i| / (tokens of i's micro-batch): a token mean per micro-batch (bnpo).
The form that fits, its scale c read against the counts it could be (the micro-batches' number, the tokens), and
the weighting the loss's value read (the spec's where it read the spec's) set against the same G: where that one
fits as well, nothing is said; where it does not, the gradient's reading is the weighting.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from harness.diagnose.identify.finding import Finding

FORMS = ("own", "micro_batch_mean", "own_tokens", "micro_batch_mean_tokens", "own_micro_batch_tokens")
NOISE = {"float32": 2e-3, "bfloat16": 5e-2}  # the relative residual a right weighting leaves: the gradient
# recomputed row by row against your loop's batched one (float32: ~1e-6; bf16: ~1e-2, measured on Atropos' loop)
APART = 3.0  # a form fits where its residual is within this factor of the best (and the noise), others do not


# ---------------------------------------------------------------------------------------------
# the weights of each form (pure)
# ---------------------------------------------------------------------------------------------
def micro_batch_means(advantages, sizes) -> np.ndarray:
    """Each completion's micro-batch's mean advantage (micro-batches of `sizes`, cut in order)."""
    a = np.asarray(advantages, dtype=np.float64)
    bounds = np.cumsum([0, *sizes])
    return np.concatenate([np.full(e - b, a[b:e].mean()) for b, e in zip(bounds, bounds[1:]) if e > b])


def form_weights(form: str, advantages, counts, sizes) -> np.ndarray:
    """The per-completion weight of `form` on its mean log-prob's gradient, up to the scale c (the loss's sign
    included: the per-token loss is -A x ratio). `counts`: each completion's loss tokens; `sizes`: the micro-batches'
    sizes, in order."""
    a = np.asarray(advantages, dtype=np.float64)
    t = np.asarray(counts, dtype=np.float64)
    if form == "own":
        return -a
    if form == "micro_batch_mean":
        return -micro_batch_means(a, sizes)
    if form == "own_tokens":
        return -a * t
    if form == "micro_batch_mean_tokens":
        return -micro_batch_means(a, sizes) * t
    if form == "own_micro_batch_tokens":
        bounds = np.cumsum([0, *sizes])
        per = np.concatenate([np.full(e - b, max(t[b:e].sum(), 1.0)) for b, e in zip(bounds, bounds[1:]) if e > b])
        return -a * t / per
    raise ValueError(f"unknown weighting form {form!r}; one of {FORMS}")


def fit_scale(rows_grad, grad, weights) -> tuple[float, float]:
    """(c, relative residual) of grad ~ c x rows_grad @ weights, least squares in c alone (`rows_grad`: elements x
    completions, each column a completion's mean log-prob gradient on the probed slice)."""
    x = np.asarray(rows_grad, dtype=np.float64) @ np.asarray(weights, dtype=np.float64)
    g = np.asarray(grad, dtype=np.float64)
    norm = float(np.linalg.norm(g))
    if norm == 0 or not np.any(x):
        return 0.0, math.inf
    c = float(x @ g / (x @ x))
    return c, float(np.linalg.norm(c * x - g)) / norm


def residual(rows_grad, grad, weights) -> float:
    """The relative residual of grad against rows_grad @ weights as given (the scale included)."""
    g = np.asarray(grad, dtype=np.float64)
    norm = float(np.linalg.norm(g))
    x = np.asarray(rows_grad, dtype=np.float64) @ np.asarray(weights, dtype=np.float64)
    return float(np.linalg.norm(x - g)) / norm if norm else math.inf


def _alike(u, v) -> bool:
    """Two weight vectors proportional to each other (the same form at this step: every completion as long, say)."""
    u, v = np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64)
    nu, nv = float(np.linalg.norm(u)), float(np.linalg.norm(v))
    return nu > 0 and nv > 0 and abs(float(u @ v)) / (nu * nv) > 1 - 1e-9


def implied(spec, advantages, counts, sizes, max_tokens: int) -> np.ndarray | None:
    """The per-completion weights (scale included) the built-in loop's weighting of `spec` gives: its loss type
    (LOSS_NORM, LOSS_SUM) or divisor (LOSS_DIVISOR, ACCUM_DIVISOR in place of the micro-batches' number), on each
    completion's advantage or its micro-batch's mean (ADV_MICRO_BATCH_MEAN), over the step's completions in
    micro-batches of `sizes`. None where they depend on a shuffle these rows do not show (a token mean per
    micro-batch, or a micro-batch's mean advantage, of a shuffled round)."""
    n, total, m = len(counts), max(float(np.sum(counts)), 1.0), len(sizes)
    in_order = m == 1 or getattr(spec, "MICRO_BATCH_ORDER", "") == "rollout"
    if getattr(spec, "ADV_MICRO_BATCH_MEAN", False):
        if not in_order:
            return None
        advantages = micro_batch_means(advantages, sizes)
    if getattr(spec, "LOSS_DIVISOR", 0.0):
        return form_weights("own_tokens", advantages, counts, sizes) / spec.LOSS_DIVISOR
    if getattr(spec, "LOSS_SUM", False):
        return form_weights("own_tokens", advantages, counts, sizes)
    norm = getattr(spec, "LOSS_NORM", "sequence")
    accum = getattr(spec, "ACCUM_DIVISOR", 0.0) or m  # (each micro-batch's loss over this, not over m)
    if norm == "sequence":
        return form_weights("own", advantages, counts, sizes) / n * m / accum
    if norm == "token_global":
        return form_weights("own_tokens", advantages, counts, sizes) / total
    if norm == "constant":
        return form_weights("own_tokens", advantages, counts, sizes) / (n * max_tokens) * m / accum
    if norm == "token_local" and in_order:
        return form_weights("own_micro_batch_tokens", advantages, counts, sizes) / accum
    return None


@dataclasses.dataclass(frozen=True)
class Reading:
    """What the first training step's gradient says of the weighting: the form that fits, its scale, how well, and
    the rest."""
    form: str | None  # None: no form fits (a per-token weight, an importance-sampling ratio, ...)
    scale: float
    residual: float
    fits: dict  # form -> (c, residual)
    alike: tuple  # other forms that fit as well (the same vector at this step)
    opposite: bool = False  # the form that fits does so with a negative scale: the loss's sign is the other one


def read_weights(rows_grad, grad, advantages, counts, sizes, noise: float) -> Reading:
    """The form of FORMS whose weights, in a scale of their own, give the probed gradient within `noise`, and at
    least `APART` times better than every form that is another vector at this step (a form within `noise` or within
    `APART` of the best is a rival); forms whose weights are the same vector up to scale (every completion as long,
    micro-batches of one) are alike, and the first of FORMS is said. Where none is that clear, where every weight is 0
    (no advantage to train on), or where the fit's scale is negative (`opposite`), `form` is None."""
    shapes = {f: form_weights(f, advantages, counts, sizes) for f in FORMS}
    fits = {f: fit_scale(rows_grad, grad, w) for f, w in shapes.items()}
    top = min(FORMS, key=lambda f: (fits[f][1], FORMS.index(f)))
    res = fits[top][1]
    same = [f for f in FORMS if _alike(shapes[f], shapes[top])]  # (top among them; none where every weight is 0)
    if not same or not math.isfinite(res):
        return Reading(None, 0.0, res, fits, ())
    best = min(same, key=FORMS.index)
    rivals = [f for f in FORMS if f not in same and fits[f][1] <= max(APART * res, noise)]
    if res > noise or rivals:
        return Reading(None, 0.0, res, fits, tuple(rivals))
    if fits[best][0] <= 0:  # the gradient of +A x ratio: a loss of the other sign, which no divisor or count gives
        return Reading(None, fits[best][0], res, fits, (), opposite=True)
    return Reading(best, fits[best][0], res, fits, tuple(f for f in same if f != best))


# ---------------------------------------------------------------------------------------------
# words and settings
# ---------------------------------------------------------------------------------------------
def fit_rel(residual_: float) -> float:
    """The relative uncertainty of a scale fitted with relative residual `residual_` (the part of the error along
    the fitted direction is of the order of the part across it), floored at float32's 1e-4."""
    return max(2 * residual_, 1e-4)


def _round_count(x: float, rel: float) -> float:
    """x with the fewest digits within its relative uncertainty `rel` (numerics.snap: 32.3 known to +-3% is 32,
    57.3 known to +-0.01% stays 57.3); a count where that is a whole number."""
    from harness.diagnose.identify.numerics import snap

    return snap(x, rel * abs(x), nice=())


def _micro_batch_words(c: float, sizes, n: int, rel: float) -> tuple[str, float | None]:
    """How a per-completion mean's scale `c` (> 0: the weight of one completion's mean, known to a relative `rel`)
    divides, against the micro-batches (`sizes`): (words, the constant each micro-batch's mean is divided by, or None
    where it is the micro-batches' own count; micro-batches of several sizes: the divisor of the sum of the
    completions' means, None where it is their count)."""
    m = len(sizes)
    k = sizes[0] if sizes and len(set(sizes)) == 1 else None
    if k is None:  # micro-batches of several sizes: the mean over the completions' count alone
        d = _round_count(1 / c, rel)
        return (f"divides the sum of its completions' means by {d:g} (its {n} completions give TRL's grpo)",
                None if d == n else d)
    d = _round_count(1 / (c * k), rel)  # each micro-batch's mean over its k completions, divided by this
    if d == m:
        return f"over micro-batches of {k}, each micro-batch's mean divided by their number ({m})", None
    return (f"over micro-batches of {k}, each micro-batch's mean divided by {d:g}, a constant of its own "
            f"(its {m} micro-batches would give a mean over the round's completions: its gradient is {m}/{d:g} "
            "of that)", d)


def _token_settings(c: float, counts, n: int, max_tokens: int, rel: float) -> tuple[dict, str]:
    """A token sum of scale c (> 0, known to a relative `rel`): the loss type or constant divisor that gives it, and
    its words."""
    from harness.diagnose.identify.weighting import _NAMES

    d = 1 / c
    total = float(np.sum(counts))
    for norm, count in (("token_global", total), ("constant", n * max_tokens)):
        if abs(d - count) <= rel * count:
            return {"LOSS_NORM": norm}, _NAMES[norm]
    if abs(d - 1) <= rel:
        return {"LOSS_SUM": True}, _NAMES["sum"]
    d = _round_count(d, rel)
    return {"LOSS_DIVISOR": d}, f"divides the masked per-token losses' sum by {d:g}"


def _as_cut(settings: dict, sizes, spec, in_order: bool) -> dict | None:
    """`settings` where the weighting depends on your micro-batches (a divisor in place of their number, a
    micro-batch's mean advantage or its tokens): GRAD_ACCUM as many as yours, cut in the rollout's order where
    `in_order` (which completions share a micro-batch matters); None where yours are of several sizes (the built-in
    loop cuts equal ones)."""
    if not sizes or len(set(sizes)) > 1:
        return None
    m = len(sizes)
    return {**settings, **({"MICRO_BATCH_ORDER": "rollout"} if in_order and m > 1 else {}),
            **({"GRAD_ACCUM": m} if m != spec.GRAD_ACCUM else {})}


def _form_settings(r: Reading, counts, sizes, spec, rel: float) -> tuple[dict | None, str]:
    """The built-in loop's settings for the form read (None: no switch reproduces it), and the words said of it."""
    n, m = len(counts), len(sizes)
    broadcast = ("weights each completion's per-token {} by the mean advantage of its micro-batch, not by its own "
                 "(advantages shaped (B, 1) against a per-completion term shaped (B,): `(term * advantages).mean()` "
                 "is a (B, B) broadcast)")
    mean_adv = {"ADV_MICRO_BATCH_MEAN": True} if r.form.startswith("micro_batch_mean") else {}
    if r.form in ("own", "micro_batch_mean"):
        scale, d = _micro_batch_words(r.scale, sizes, n, rel)
        what = "averages each completion's per-token terms" if r.form == "own" else broadcast.format("mean")
        settings = {"LOSS_NORM": "sequence", **mean_adv, **({"ACCUM_DIVISOR": float(d)} if d is not None else {})}
        settings = _as_cut(settings, sizes, spec, bool(mean_adv)) if mean_adv or d is not None else settings
        return settings, f"{what}, {scale}" + (" (TRL's grpo)" if r.form == "own" and d is None else "")
    if r.form in ("own_tokens", "micro_batch_mean_tokens"):
        settings, words = _token_settings(r.scale, counts, n, spec.MAX_TOKENS, rel)
        if mean_adv:
            words = f"{broadcast.format('sum')}, and {words.removeprefix('your loop ')}"
        return (_as_cut({**settings, **mean_adv}, sizes, spec, True) if mean_adv else settings), words
    d = _round_count(1 / r.scale, rel)  # own_micro_batch_tokens: each micro-batch's token mean, over d
    words = (f"divides each micro-batch's masked sum by its own loss tokens, then averages over its {m} "
             "micro-batches cut in the rollout's order (TRL's bnpo cuts a shuffled round)" if d == m else
             f"divides each micro-batch's masked sum by its own loss tokens and by {d:g}, a constant of its own "
             f"(its {m} micro-batches would give TRL's bnpo), its micro-batches cut in the rollout's order")
    settings = {"LOSS_NORM": "token_local", "MICRO_BATCH_ORDER": "rollout",
                **({"ACCUM_DIVISOR": float(d)} if d != m else {})}
    return (settings if d == m else _as_cut(settings, sizes, spec, True)), words


SETTLES = ("LOSS_NORM", "LOSS_SUM", "LOSS_DIVISOR", "MICRO_BATCH_ORDER", "ADV_MICRO_BATCH_MEAN", "ACCUM_DIVISOR")
# said of a form whose switches need your micro-batches cut alike (`_as_cut` None)
UNEQUAL = (": no TRL setting and no switch of the built-in loop reproduces it (its micro-batches are of several sizes; "
           "the built-in loop cuts equal ones)")


def finding_of(r: Reading, counts, sizes, spec, said_value: str, zero_loss: bool = False, step: int = 1) -> Finding:
    """The weighting stage's finding from the gradient's reading `r` (at `step`), against the spec's weighting: the
    built-in loop's settings where it has a switch for it, else named as what no switch reproduces. `said_value`:
    what the loss's value read, said as what it could not tell."""
    from harness.diagnose.identify.numerics import _same

    why = (" (a loss of 0, as a mean over completions of centred advantages at a ratio of 1 is however it is "
           "divided)") if zero_loss else ""
    told = (f"from the loss's value alone it reads as {said_value}{why}, which step {step}'s gradient does not give"
            if said_value else "")
    ev = {"from_gradient": True, "form": r.form, "scale": r.scale, "residual": r.residual,
          "fits": {f: [c, res] for f, (c, res) in r.fits.items()}}
    lead = f"your loop's gradient at step {step} (the Probe's slice, at the initial weights) says its loss "
    settings, words = _form_settings(r, counts, sizes, spec, fit_rel(r.residual))
    no_switch = settings is None
    rule = lead + words + (UNEQUAL if no_switch else "")
    settings = {k: v for k, v in (settings or {}).items() if not _same(getattr(spec, k, None), v)}
    settles = () if no_switch else SETTLES + (("GRAD_ACCUM",) if "GRAD_ACCUM" in settings else ())
    return Finding("weighting", step, rule, settings, True,
                   same_as_spec=not settings and not no_switch, no_switch=no_switch,
                   unsettled=(told,) if told else (), evidence=ev, settles=settles)


# ---------------------------------------------------------------------------------------------
# the stage: step 1's rows recomputed at the initial weights
# ---------------------------------------------------------------------------------------------
def read(cell, earlier: dict) -> list[Finding]:
    """The weighting from the gradient of the first step that trains (step 1, or a later one where every step before
    it logged a gradient norm of 0: the weights are still the initial ones), where it says otherwise than the
    weighting the loss's value read there (earlier["weighting"]; the spec's where none): [] where your loop saved no
    Probe gradient, advantages or mask there, its probed weights there are not the initial ones, the objective stage
    did not read its per-token loss from those advantages, no form fits, or the value's reading fits as well. A
    gradient that all but vanishes where the value's reading gives one is said too (each micro-batch's mean advantage
    0, or no form found)."""
    from harness.diagnose.identify.steps import _number, _rows_of

    at = _first_training_step(cell)
    if at is None:
        return []
    first, probe = at
    t, n, step = first.tensors, len(first.completions), first.step
    adv = t.get("advantages")
    if not (_rows_of(t.get("mask"), n) and isinstance(adv, list) and len(adv) == n):
        return []
    if not all(isinstance(a, (int, float)) for a in adv):
        return []
    if "per_token_loss" in t and not _objective_as_formed(earlier, cell.spec, step):
        return []  # (the per-token loss is not -A x ratio of the advantages saved: the forms' weights are not its)
    spec = _forward_spec(cell, earlier)
    # each completion's loss tokens as its gradient column counts them (ended where the forward stage found it ended)
    counts = [float(np.sum(np.asarray(m[:len(c)], dtype=np.float64))) for m, c in zip(t["mask"], _ended(spec, first))]
    parts = t.get("micro_batches")
    sizes = list(parts) if isinstance(parts, list) and sum(parts) == n else \
        [n // spec.GRAD_ACCUM] * spec.GRAD_ACCUM if n % spec.GRAD_ACCUM == 0 else [n]
    got = _row_gradients(cell, spec, first, probe)
    if got is None:
        return []
    rows_grad, grad = got
    noise = NOISE.get(spec.DTYPE, NOISE["bfloat16"])
    value = next((f for f in earlier.get("weighting", ()) if f.step == step and f.exact and f.readable), None)
    by_value = dataclasses.replace(spec, **value.settings) if value is not None else spec
    mine = implied(by_value, adv, counts, sizes, spec.MAX_TOKENS)
    said = "" if value is None else "the spec's loss type" if value.same_as_spec and not value.settings else \
        value.rule.removeprefix("your loop ")
    loss = _number(t["loss"]) if "loss" in t else math.nan
    r = read_weights(rows_grad, grad, adv, counts, sizes, noise)
    if r.opposite:
        return [Finding("weighting", step, f"your loop's gradient at step {step} (the Probe's slice, at the initial "
                        "weights) is that of +A x ratio, the opposite sign of the loss -A x ratio every loss type "
                        "takes: no TRL setting and no switch of the built-in loop reproduces it", {}, True,
                        no_switch=True, evidence={"from_gradient": True, "scale": r.scale, "residual": r.residual})]
    if r.form is None:
        expected = float(np.linalg.norm(np.asarray(rows_grad) @ mine)) if mine is not None else 0.0
        if expected and float(np.linalg.norm(grad)) <= noise * expected:  # nothing where the value's reading has some
            return [vanishing(grad, expected, adv, sizes, spec, said, step)]
        return []
    if mine is not None and residual(rows_grad, grad, mine) <= max(2 * r.residual, noise):
        return []  # the value's reading gives this gradient too
    return [finding_of(r, counts, sizes, spec, said, zero_loss=abs(loss) <= 1e-6, step=step)]


def _first_training_step(cell):
    """(the first step with something to train on, its probe: a Probe gradient not 0, or advantages not all 0),
    where every step before it saved a probe whose gradient is 0 and logged a pre-clip gradient norm of exactly 0
    (Adam does not move a weight on no gradient: the weights there are the initial ones, which _row_gradients checks
    on the probed slice); None where a step before it trained, saved nothing, or its tensors' rows are not the
    recording's."""
    from harness.diagnose.identify.steps import steps

    by_step = {s.step: s for s in steps(cell)}
    norms = cell.grad_norms()
    for k in range(1, max(by_step, default=0) + 1):
        s, probe = by_step.get(k), (cell.tensors.get(k) or {}).get("probe")
        if s is None or not isinstance(probe, dict) or not probe.get("grad") or any(g is None for g in probe["grad"]):
            return None
        adv = s.tensors.get("advantages")
        some = isinstance(adv, list) and any(isinstance(a, (int, float)) and a != 0 for a in adv)
        if some or any(np.any(np.asarray(g, dtype=np.float64)) for g in probe["grad"]):
            return s, probe  # (a gradient of 0 with advantages to train on is a reading too)
        if norms.get(k) != 0.0:
            return None
    return None


def vanishing(grad, expected: float, advantages, sizes, spec, said_value: str, step: int) -> Finding:
    """A gradient all but 0 where the value's reading gives one of norm `expected`: each micro-batch's mean advantage
    is 0 (the broadcast of a loop whose micro-batches hold whole groups of centred advantages), or no form says why."""
    a = np.asarray(advantages, dtype=np.float64)
    ratio = float(np.linalg.norm(grad)) / expected
    what = said_value or "the spec's loss type"
    than = f"|gradient| {ratio:.1g} of what {what} gives"
    lead = f"your loop's gradient at step {step} (the Probe's slice, at the initial weights) "
    means = micro_batch_means(a, sizes)
    if np.any(np.abs(a) > 0) and np.all(np.abs(means) <= 1e-5 * np.max(np.abs(a))):
        bounds = np.cumsum([0, *sizes])
        whole = all(b % spec.GROUP_SIZE == 0 for b in bounds)
        settings = _as_cut({"ADV_MICRO_BATCH_MEAN": True}, sizes, spec, True)
        rule = (f"{lead}is all but 0 ({than}): its loss weights each completion's per-token mean by the mean advantage "
                "of its micro-batch, not by its own (advantages shaped (B, 1) against a per-completion term shaped "
                "(B,): `(term * advantages).mean()` is a (B, B) broadcast), and every micro-batch's mean advantage is 0 "
                + ("(each holds whole groups of centred advantages)" if whole else "here")
                + (UNEQUAL if settings is None else ""))
        return Finding("weighting", step, rule, settings or {}, True, no_switch=settings is None,
                       evidence={"from_gradient": True, "form": "micro_batch_mean", "vanishing": ratio},
                       settles=() if settings is None else tuple(settings))
    return Finding("weighting", step, f"{lead}is all but 0 ({than}), and no weighting tried says why", {}, False,
                   no_switch=True, evidence={"from_gradient": True, "vanishing": ratio})


def _objective_as_formed(earlier: dict, spec, step: int = 1) -> bool:
    """The objective stage read the step's per-token loss exactly from the advantages your loop saved, with nothing
    at a ratio of 1 whose gradient a per-completion weight leaves out: no importance-sampling weight (per token, or
    per completion off 1), no k1 KL term (its gradient beta grad logp is there at the initial weights; k2's and k3's
    are 0)."""
    obj = next((f for f in earlier.get("objective", ()) if f.step == step), None)
    if obj is None or not obj.exact:
        return False
    if obj.settings.get("IS_CORRECTION", getattr(spec, "IS_CORRECTION", False)):
        return False
    kl = obj.evidence.get("kl")
    estimator = kl[0] if kl else obj.settings.get("KL_ESTIMATOR", getattr(spec, "KL_ESTIMATOR", "k3"))
    weight = kl[1] if kl else obj.settings.get("BETA", getattr(spec, "BETA", 0.0))
    return not (estimator == "k1" and weight)


def _forward_spec(cell, earlier: dict):
    """The cell's spec with the forward pass your loop's log-probs showed (the forward stage's settings)."""
    fwd = next((f for f in earlier.get("forward", ()) if f.exact), None)
    return dataclasses.replace(cell.spec, **fwd.settings) if fwd is not None else cell.spec


def _ended(spec, first) -> list:
    """The step's completions, each ended at its first END_AT_ID where the forward pass ends it there."""
    from scratch_grpo import core

    return core.end_at_id(first.completions, spec.END_AT_ID) if spec.END_AT_ID >= 0 else first.completions


def _row_gradients(cell, spec, first, probe) -> tuple[np.ndarray, np.ndarray] | None:
    """(elements x completions: each completion's mean log-prob gradient over its mask's tokens, at the initial
    weights, on the probed elements; the Probe's gradient there), or None where the probed weights at that step are
    not the initial checkpoint's (held as MASTER_WEIGHTS says) or a probed name is not the model's."""
    import torch

    from harness.diagnose.identify.forward import pass_rules
    from harness.experiment.models import autocast_for, checkpoint_dir, load_model
    from harness.rollouts.generate import pad_left, pad_right
    from harness.runlog.tensors import probe_indices
    from scratch_grpo.train import completion_forward

    model = load_model(checkpoint_dir(spec), getattr(spec, "MASTER_WEIGHTS", "float32"), "cpu")
    named = dict(model.named_parameters())
    picks = []
    for name, before in zip(probe["names"], probe["before"]):
        p = named.get(name)
        if p is None or len(before) > p.numel():
            return None
        idx = probe_indices(int(p.numel()), len(before))
        if p.detach().reshape(-1)[idx].float().tolist() != [float(x) for x in before]:
            return None  # not the initial weights at that step (or not the dtype they are held in)
        picks.append((p, idx))
    grad = np.concatenate([np.asarray(g, dtype=np.float64) for g in probe["grad"]])
    rules = pass_rules(spec, cell.eos_ids)
    temperature = 1.0 if spec.LOGP_ON_RAW_LOGITS else spec.TEMPERATURE
    cols = []
    for (r, i), c, m in zip(first.rows, _ended(spec, first), first.tensors["mask"]):
        model.zero_grad(set_to_none=True)
        p_ids, p_mask = pad_left([cell.records[r]["prompt_ids"][i]], cell.pad_id)
        c_ids, c_mask = pad_right([c], cell.pad_id)
        with autocast_for("cpu", spec.DTYPE):
            lp = completion_forward(model, p_ids, p_mask, c_ids, c_mask, temperature, zero_id=spec.LOGP_ZERO_ID,
                                    **rules)[0][0]
        mask = torch.tensor([float(x) for x in m[:len(c)]] + [0.0] * (len(c) - len(m[:len(c)])))
        if float(mask.sum()) > 0:
            ((lp.float() * mask).sum() / mask.sum()).backward()
        cols.append(np.concatenate([p.grad.reshape(-1)[idx].double().numpy() if p.grad is not None
                                    else np.zeros(len(idx)) for p, idx in picks]))
    return np.stack(cols, axis=1), grad
