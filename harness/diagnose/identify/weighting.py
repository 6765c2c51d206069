"""The weighting stage: how your per-token losses become your loss: one of TRL's loss types recomputed from your own
per-token losses and mask, or a divisor of your own."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from harness.diagnose.identify.finding import Finding
from harness.diagnose.identify.numerics import _kl, _same
from harness.diagnose.identify.steps import _number, _rows_of, steps, tolerance

_NAMES = {"sequence": "averages per completion, then over completions (TRL's grpo)",
          "token_global": "divides the masked sum by the step's loss tokens (TRL's dapo)",
          "constant": "divides the masked sum by completions x max_completion_length (TRL's dr_grpo)",
          "sum": "sums the per-token losses without normalising",
          "token_local": "divides each micro-batch's masked sum by its own loss tokens (TRL's bnpo)",
          "token_local_in_order": "divides each micro-batch's masked sum by its own loss tokens, then averages over "
                                  "micro-batches cut in the rollout's order (TRL's bnpo cuts a shuffled round)"}


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
    names = _NAMES
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
                           if alike else (), settles=() if alike else ("LOSS_NORM", "LOSS_SUM", "MICRO_BATCH_ORDER"),
                           evidence=_alike_evidence(alike, spec))
        k, f = hits[0]
        said = names[k] + (f", and what it logs is the mean of its {f} micro-batches' losses" if f > 1 else "")
        settings = _settings_of(k, spec)
        alike = list(dict.fromkeys(h for h, _ in hits[1:] if h != k))
        return Finding("weighting", step, "your loop " + said, settings, True,
                       unsettled=(f"{', '.join(alike)} give the same number at this step",) if alike else (),
                       evidence={"values": values, "logged_mean_of_micro_batches": f > 1,
                                 **_alike_evidence(alike, spec)},
                       settles=() if alike else ("LOSS_NORM", "LOSS_SUM", "MICRO_BATCH_ORDER"))
    if abs(total) < 1e-3 * max(float(np.abs(sums).sum()), 1e-30) or loss == 0:
        return Finding("weighting", step, "cannot be read: the masked per-token losses sum to nearly 0 or the loss "
                       "is 0", {}, False, readable=False)
    return _divisor(total, loss, counts, lengths, n, max_tokens, grad_accum, step)


def _settings_of(kind: str, spec) -> dict:
    """The built-in loop's fields for loss type `kind` (less what the spec already sets so)."""
    settings = {"LOSS_SUM": True} if kind == "sum" else {"LOSS_NORM": "token_local", "MICRO_BATCH_ORDER": "rollout"} \
        if kind == "token_local_in_order" else {"LOSS_NORM": kind}
    return {k: v for k, v in settings.items() if not _same(getattr(spec, k, None), v)} if spec else settings


def _alike_evidence(alike: list, spec) -> dict:
    """The loss types that give the same number at this step, as the settings each would read ({"look_alikes": [...]}, or
    {} where none does): a step that cannot tell them apart says nothing against another step that reads one of them
    (identify.pick)."""
    return {"look_alikes": [_settings_of(k, spec) for k in alike]} if alike else {}


def _divisor(total: float, loss: float, counts, lengths, n: int, max_tokens: int, grad_accum: int, step) -> Finding:
    """No loss type gives your loss: the divisor itself, D = sum / loss, set against the counts it could be (the
    mask's tokens, every completion token, completions x the longest, completions x max tokens, completions)."""
    d = total / loss
    named = _count(d, counts, lengths, n, max_tokens, grad_accum)
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


def _count(d: float, counts, lengths, n: int, max_tokens: int, grad_accum: int) -> str | None:
    """The count of the step a divisor `d` is (within 1e-3), in words, or None: the mask's tokens, every completion
    token, completions x the longest, completions x max tokens, completions; each also times the micro-batches."""
    longest = max(lengths) if lengths else 0
    cands = {"the loss's tokens": float(np.sum(counts)), "every completion token (the mask's dropped tokens too)":
             sum(lengths), "completions x the longest completion": n * longest, "completions x max tokens":
             n * max_tokens, "completions": n}
    return next((f"{what} ({v:.0f})" + (f", times {f} micro-batches" if f > 1 else "")
                 for f in (1, grad_accum) for what, v in cands.items() if abs(d - f * v) <= 1e-3 * abs(d)), None)


def last_micro_batch(per_token_loss, mask_rows, lengths, loss: float, grad_accum: int, max_tokens: int,
                     prefer: str | None = None, rtol: float = 1e-4, atol: float = 1e-7,
                     telling: bool = False) -> tuple[str, int] | None:
    """(loss type, factor) under which `loss` is your last micro-batch's loss alone (the rows, in your order, cut into
    `grad_accum` equal micro-batches; its loss as it goes into backward, divided by `grad_accum` (factor), or as
    computed (1)), the loss type `prefer` first; None where no loss type gives it. A loop that logs `loss.item()` of
    its last micro-batch logs that. `telling`: only where the number tells it from the step's own (the other
    micro-batches' losses do not sum to 0, nor the last one's, nor the loss)."""
    n = len(lengths)
    if grad_accum < 2 or not n or n % grad_accum or not math.isfinite(float(loss)):
        return None
    sums = np.array([float((np.nan_to_num(np.asarray(r[:k], dtype=np.float64)) * np.asarray(m[:k], dtype=np.float64))
                           .sum()) for r, m, k in zip(per_token_loss, mask_rows, lengths)])
    counts = np.array([float(np.asarray(m[:k], dtype=np.float64).sum()) for m, k in zip(mask_rows, lengths)])
    last = slice(n - n // grad_accum, n)
    sl, cl = sums[last], counts[last]
    if telling and (not np.any(np.abs(sums[:last.start]) > 1e-12) or abs(float(loss)) <= 10 * atol):
        return None  # the first micro-batches add nothing, or nothing is logged: no number tells the two apart
    if not np.any(np.abs(sl) > 1e-12):  # (every advantage 0 there: any loss type gives 0)
        return (prefer or "sequence", 1) if abs(float(loss)) <= atol and not telling else None
    values = {"sequence": float(np.mean(sl / np.maximum(cl, 1.0))), "token_local": float(sl.sum() / max(cl.sum(), 1.0)),
              "token_global": float(sl.sum() / max(counts.sum(), 1.0)), "constant": float(sl.sum() / max(n * max_tokens, 1)),
              "sum": float(sl.sum())}
    order = sorted(values, key=lambda k: k != prefer)
    for k in order:
        for f in ((grad_accum, 1) if k in ("sequence", "token_local") else (1,)):
            if abs(values[k] / f - loss) <= atol + rtol * abs(loss):
                return k, f
    # a divisor of its own that is a count of the step (verl's seq-mean-token-sum: the sum over its completions)
    # (only where the step's sum and the last micro-batch's differ by more than a count's own margin: else either
    # reads as the same divisor, and nothing tells what is logged)
    apart = abs(float(sums.sum()) - float(sl.sum())) > 1e-3 * abs(float(sl.sum()))
    d = float(sl.sum()) / float(loss) if apart and abs(float(loss)) > 10 * atol else 0.0
    named = _count(d, counts, lengths, n, max_tokens, grad_accum) if d > 0 else None
    return (f"divisor:{d:.5g}", 1) if named else None


def _logged_last(w: Finding, t: dict, logged: float | None, lengths, ga: int, spec, tol: dict, kl) -> Finding:
    """`w` read again where the loss your loop saved or logged is its last micro-batch's alone: the loss type that
    gives that micro-batch's loss, and the words that say it (logged otherwise than trained, not a difference). Not
    read at a step with nothing to read, nor where the objective found a KL term (what is logged may leave it out)."""
    if not w.readable or kl:
        return w
    saved = _number(t["loss"])
    weak = not w.exact or w.no_switch or "LOSS_DIVISOR" in w.settings
    value = saved if weak else logged if logged is not None and not (abs(logged - saved) <= 1e-7 + 1e-4 * abs(saved)) \
        else None
    spec_norm = "sum" if getattr(spec, "LOSS_SUM", False) else getattr(spec, "LOSS_NORM", "sequence")
    if value is None:  # the step's loss: does its last micro-batch's alone give the same number (nothing told)?
        alike = last_micro_batch(t["per_token_loss"], t["mask"], lengths, saved, ga, spec.MAX_TOKENS, spec_norm, **tol)
        if alike and w.exact and w.evidence.get("logged_mean_of_micro_batches"):  # two readings of one number
            return dataclasses.replace(w, unsettled=w.unsettled + (
                "what it logs may be its last micro-batch's loss alone: that gives the same number at this step",),
                settles=(), evidence={**w.evidence, "last_fits": True})
        return dataclasses.replace(w, evidence={**w.evidence, "last_fits": True}) if alike and w.exact else w
    hit = last_micro_batch(t["per_token_loss"], t["mask"], lengths, value, ga, spec.MAX_TOKENS, spec_norm, **tol,
                           telling=True)
    if hit is None:
        return w
    kind, _ = hit
    if weak:  # what it saved is the last micro-batch's too: the step's weighting is that loss type's
        w = _of_kind(kind, spec, w.step)
    said = ("what it logs as its loss is its last micro-batch's loss alone, not the sum over its "
            f"{ga} micro-batches (logged otherwise than trained: not a difference in training)")
    return dataclasses.replace(w, rule=f"{w.rule}; {said}", evidence={**w.evidence, "logged_last_micro_batch": True,
                                                                    "logged_words": said})


def _of_kind(kind: str, spec, step) -> Finding:
    """The weighting of loss type `kind` (read from a micro-batch's loss), against the spec's."""
    if kind.startswith("divisor:"):  # a count of the step: the built-in loop divides by it as a constant
        d = float(kind.partition(":")[2])
        return Finding("weighting", step, f"your loop divides the masked per-token losses' sum by {d:g}",
                       {"LOSS_DIVISOR": d}, True, evidence={"divisor": d, "count": True},
                       settles=("LOSS_NORM", "LOSS_SUM", "LOSS_DIVISOR"))
    settings = {"LOSS_SUM": True} if kind == "sum" else {"LOSS_NORM": kind}
    settings = {k: v for k, v in settings.items() if not _same(getattr(spec, k, None), v)}
    return Finding("weighting", step, f"your loop {_NAMES[kind]}" + ("" if settings else ", as the spec's loss type "
                   "does"), settings, True, same_as_spec=not settings, settles=())


def read(cell, earlier: dict) -> list[Finding]:
    """How your per-token losses become your loss at every step that saved them with its mask and loss. Where the
    objective read a KL term at the same step (earlier["objective"]) and the loss fits no loss type, the loss is
    read again without the KL term (a loop may log it apart, as verl does)."""
    spec, tol = cell.spec, tolerance(cell.spec)
    objectives = {f.step: f for f in earlier.get("objective", ())}
    found = []
    for s in steps(cell):
        t, comps = s.tensors, s.completions
        if not ("per_token_loss" in t and "mask" in t and "loss" in t and _rows_of(t["per_token_loss"], len(comps))):
            continue
        parts = t.get("micro_batches")  # your own micro-batches (a list of tensors): their number, where equal
        ga = len(parts) if isinstance(parts, list) and len(set(parts)) == 1 and sum(parts) == len(comps) \
            else getattr(spec, "GRAD_ACCUM", 1)
        w = weighting(t["per_token_loss"], t["mask"], _number(t["loss"]), s.lengths, ga, spec.MAX_TOKENS, spec,
                      step=s.step, **tol)
        obj = objectives.get(s.step)
        kl = (obj.evidence.get("kl") if obj is not None and obj.exact else None)
        weak = not w.exact or w.no_switch or "LOSS_DIVISOR" in w.settings  # (a constant divisor fits any one step)
        if kl and weak:  # what it logs may leave the KL term out (verl logs it apart)
            w2 = weighting(_without_kl(t, kl), t["mask"], _number(t["loss"]), s.lengths, ga, spec.MAX_TOKENS, spec,
                           step=s.step, **tol)
            if _strength(w2) < _strength(w):  # (a count of its own with the KL term beats a bare number without)
                w = dataclasses.replace(w2, rule=w2.rule + "; what it logs as its loss leaves the KL term out "
                                        "(logged otherwise than trained: not a difference in training)",
                                        same_as_spec=w2.same_as_spec, evidence={**w2.evidence,
                                                                                "logged_without_kl": True})
        logged = cell.yours["loss"].get(s.step) if cell.yours is not None and "loss" in cell.yours.columns else None
        w = _logged_last(w, t, None if logged is None else float(logged), s.lengths, ga, spec, tol, kl)
        per_micro_batch = w.exact and (w.settings.get("LOSS_NORM") == "token_local" or w.same_as_spec and
                                       getattr(spec, "LOSS_NORM", "") == "token_local")
        if ga != getattr(spec, "GRAD_ACCUM", 1) and per_micro_batch:  # your micro-batches, not the spec's count
            w = dataclasses.replace(w, rule=f"{w.rule} (in {ga} micro-batches of {parts[0]}, as your loop cut "
                                    "them)", settings={**w.settings, "GRAD_ACCUM": ga}, same_as_spec=False,
                                    settles=w.settles + ("GRAD_ACCUM",) if w.settles else ())
        found.append(w)
    return found


def _strength(w: Finding) -> int:
    """How much a weighting reading says, least first: a loss type, a divisor that is a count (of its completions,
    its tokens), a constant divisor of no count, no reading."""
    if not w.exact or w.no_switch:
        return 3
    return 0 if "LOSS_DIVISOR" not in w.settings else 1 if w.evidence.get("count") else 2


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
