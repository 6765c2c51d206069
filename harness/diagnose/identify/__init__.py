"""Identify each stage of your loop from its own tensors: the rule it applies, in closed form where the math allows,
without re-running anything.

The explanation search (explain.py) re-runs the built-in loop with candidate settings and finds what its vocabulary
holds. A loop nobody here has seen brings choices no list holds (an advantage epsilon of 3.7e-3, a mask on the pad
token's id, a divisor of its own, Adam's beta2 0.995). Each stage below reads one link of the loop's step from the
tensors the loop saved (`harness.loop.tensors`, and for the optimizer `harness.loop.Probe`) and says, as a `Finding`
(finding.py):
- the rule, in words, said of your loop;
- the spec fields that make the built-in loop do the same (`settings`), where it has a switch, or `no_switch`;
- whether the rule reproduces your tensors within tolerance (`exact`), and what this run could not tell
  (`unsettled`: an epsilon below the run's resolution, a clip bound never reached, a threshold every step exceeds).

One module per stage, each with a plain function of plain lists (rows in the rollout's order, per-token rows read up
to each completion's length where said):
    selection.py   selection(chosen, sizes, group, ...)              which completions each step trains on
    rewards.py     rewards_stage(rewards, scores, spec)              the reward functions' weights, or reward code
                                                                     of your own
    advantages.py  advantages(rewards, advantages, group)            centring, scaling (std estimator, epsilon),
                                                                     clipping
    mask.py        mask(mask_rows, completion_ids, eos_ids, ...)     which tokens count in the loss, as a rule on
                                                                     token features (id, eos, position, truncation)
    weighting.py   weighting(per_token_loss, mask, loss, ...)        how per-token losses become the loss (TRL's loss
                                                                     types, or a divisor)
    objective.py   objective(per_token_loss, advantages, logps, ...) the per-token objective: ratio form, KL estimator
                                                                     and weight, clip bounds, importance sampling
    optimizer.py   optimizer(probe_rows, grad_norms)                 Adam's learning rate per step, betas, epsilon,
                                                                     weight decay, gradient clipping
The numbers they share (snapping to round values, KL estimators, look-alike margins) are in numerics.py.
`identify(...)` runs every stage the saved tensors allow and returns the findings in the chain's order.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from harness.diagnose.identify.advantages import advantages
from harness.diagnose.identify.finding import Finding
from harness.diagnose.identify.mask import mask
from harness.diagnose.identify.numerics import _arr, _kl, snap
from harness.diagnose.identify.objective import objective
from harness.diagnose.identify.optimizer import optimizer
from harness.diagnose.identify.rewards import rewards_stage
from harness.diagnose.identify.selection import selection
from harness.diagnose.identify.weighting import weighting

__all__ = ["Finding", "STAGES", "advantages", "identify", "mask", "objective", "optimizer", "rewards_stage",
           "selection", "settings_of", "snap", "weighting", "words"]

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
