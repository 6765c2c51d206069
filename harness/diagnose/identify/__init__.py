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

One module per stage. Each holds a plain function of plain lists (rows in the rollout's order, per-token rows read
up to each completion's length where said), reachable here as `identify.<name>`:
    selection.py   selection(chosen, sizes, group, ...)              which completions each step trains on
    rewards.py     rewards_stage(rewards, scores, spec)              the reward functions' weights, or reward code
                                                                     of your own
    advantages.py  advantages(rewards, advantages, group)            centring, scaling (std estimator, epsilon),
                                                                     clipping
    mask.py        mask(mask_rows, completion_ids, eos_ids, ...)     which tokens count in the loss, as a rule on
                                                                     token features (id, eos, position, truncation)
    forward.py     forward(logps, prompts, completions, score, ...)  what the forward pass sees: step 1's log-probs
                                                                     (or a later step's reference log-probs, where
                                                                     step 1 holds no pad id) scored again at the
                                                                     initial weights under
                                                                     candidate rules (ids hidden from attention,
                                                                     positions, an id's log-prob 0, a completion's
                                                                     end, raw logits, dtype)
    weighting.py   weighting(per_token_loss, mask, loss, ...)        how per-token losses become the loss (TRL's loss
                                                                     types, or a divisor)
    gradient.py    read_weights(rows_grad, grad, advantages, ...)    the weighting again from the first training
                                                                     step's gradient (the Probe's slice against each
                                                                     completion's own at the initial weights): what
                                                                     the loss's value cannot show (a constant divisor
                                                                     of a mean over completions, an advantage
                                                                     broadcast)
    objective.py   objective(per_token_loss, advantages, logps, ...) the per-token objective: ratio form, KL estimator
                                                                     and weight, clip bounds, importance sampling
    optimizer.py   optimizer(probe_rows, grad_norms)                 Adam's learning rate per step, betas, epsilon,
                                                                     weight decay, gradient clipping
and one entry `read(cell, earlier) -> list[Finding]`: that stage's readings at every step it can read, from a cell
(harness.diagnose.cell.CellData: its spec is the one the reading is relative to, the built-in loop as TRL) and the
findings of the stages read before it. steps.py says which completions each step's tensors are rows of; the numbers
the stages share (snapping to round values, KL estimators, look-alike margins) are in numerics.py.

`STAGES` holds the `read` functions in the order they run (the forward pass before the mask: the mask reads
completions ended where the forward stage found them ended; the objective before the weighting: the weighting reads
the loss again without the KL term the objective found); `identify(cell)` runs them, applies the rules across steps
and stages, and returns each stage's best reading in the chain's order (`CHAIN`). (A stage's function takes its
module's name on this package: reach a module itself by `from harness.diagnose.identify.mask import ...`.)
"""

from __future__ import annotations

import dataclasses

from harness.diagnose.identify.advantages import advantages
from harness.diagnose.identify.advantages import read as _read_advantages
from harness.diagnose.identify.finding import Finding
from harness.diagnose.identify.forward import forward
from harness.diagnose.identify.forward import read as _read_forward
from harness.diagnose.identify.gradient import read as _read_gradient
from harness.diagnose.identify.mask import mask
from harness.diagnose.identify.mask import read as _read_mask
from harness.diagnose.identify.numerics import snap
from harness.diagnose.identify.objective import objective
from harness.diagnose.identify.objective import read as _read_objective
from harness.diagnose.identify.optimizer import optimizer
from harness.diagnose.identify.optimizer import read as _read_optimizer
from harness.diagnose.identify.rewards import read as _read_rewards
from harness.diagnose.identify.rewards import rewards_stage
from harness.diagnose.identify.selection import read as _read_selection
from harness.diagnose.identify.selection import selection
from harness.diagnose.identify.weighting import read as _read_weighting
from harness.diagnose.identify.weighting import weighting

__all__ = ["CHAIN", "Finding", "STAGES", "advantages", "forward", "identify", "mask", "objective", "optimizer", "pick",
           "rewards_stage", "selection", "settings_of", "snap", "weighting", "words"]

# the order the stages are read in: each `read(cell, earlier)` is given the findings of the ones before it
STAGES = (_read_selection, _read_forward, _read_rewards, _read_advantages, _read_mask, _read_objective,
          _read_weighting, _read_optimizer)
# the chain's order, in which the findings are said
CHAIN = ("selection", "rewards", "advantages", "mask", "forward", "weighting", "objective", "optimizer")


def identify(cell) -> list[Finding]:
    """Every stage your saved tensors allow, in the chain's order. `cell`: a CellData whose `spec` is the built-in
    loop as TRL (what differs is said against it), `tensors` your loop's {step: {tensor: value}} (read_tensors),
    `records` the lockstep rounds it trained on, `trained` its selection ({step: [(round, index), ...]},
    harness.loop.trained: a step's tensors are read as those rows), and its log's pre-clip gradient norms. A stage is
    read at every step that has its tensors; the exact reading with the least left unsettled wins (the earliest at a
    tie). Steps that train on a slice of a round (STEPS_PER_GENERATION > 1) are not read: their rows are not the
    round's."""
    if cell.spec.STEPS_PER_GENERATION > 1:
        return []
    found: dict[str, list[Finding]] = {}
    for read in STAGES:
        found[read.__module__.rpartition(".")[2]] = read(cell, dict(found))  # (a stage's module is named for it)
    found["weighting"] = _divisors(found["weighting"])
    found["weighting"] = _by_gradient(found["weighting"], _gradient(cell, dict(found)))
    found["objective"] = _old_logps(found["objective"], cell)
    found["weighting"] = _last_loss(_own_order(found["weighting"], found["selection"]))
    return [best for stage in CHAIN if (best := pick(stage, found[stage])) is not None]


def _divisors(weighting: list[Finding]) -> list[Finding]:
    """A divisor of your own read at some steps, set against the other steps: a loss type read at some step beats a
    divisor read at another; one divisor read at one step with no count behind it is unsettled (any number divides
    one step); a divisor that changes from step to step is no constant."""
    read_w = [f for f in weighting if f.exact]
    divisors = {f.settings.get("LOSS_DIVISOR") for f in read_w}
    if None in divisors and len(divisors) > 1:  # a loss type read at some step beats a divisor read at another
        weighting = [f for f in weighting if "LOSS_DIVISOR" not in f.settings]
    divisors.discard(None)
    with_divisor = [f for f in read_w if "LOSS_DIVISOR" in f.settings]
    if len(with_divisor) == 1 and len(divisors) == 1 and not with_divisor[0].evidence.get("count"):
        # one step, and no count of its tokens or completions: any number divides it
        weighting = [dataclasses.replace(f, unsettled=f.unsettled + (
            "a constant divisor was read at one step only, and one number fits any one step: save two steps' "
            "tensors to check it",), settles=()) if "LOSS_DIVISOR" in f.settings else f for f in weighting]
    if len(divisors) > 1:  # a divisor that changes from step to step is no constant
        seen = ", ".join(f"{x:g}" for x in sorted(x for x in divisors if x))
        weighting = [dataclasses.replace(f, exact=False, settings={}, settles=(), no_switch=True, rule=(
            f"{f.rule}; but the divisor is not the same at every step read ({seen})")) if "LOSS_DIVISOR" in f.settings
            else f for f in weighting]
    return weighting


def _gradient(cell, found: dict) -> list[Finding]:
    """The weighting read from the first training step's gradient (gradient.py), or nothing where it cannot be
    computed (a model or tensors of another shape: the other stages' readings stand); what stopped it is warned of,
    never dropped unsaid."""
    import warnings

    try:
        return _read_gradient(cell, found)
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, RuntimeError, OSError) as e:
        warnings.warn(f"the gradient stage was skipped, the loss's value read alone: {type(e).__name__}: {e}",
                      stacklevel=2)
        return []


def _by_gradient(weighting: list[Finding], gradient: list[Finding]) -> list[Finding]:
    """Where the first training step's gradient (gradient.py: the Probe's slice against each completion's gradient at
    the initial weights) gives another weighting than the loss's value read, the gradient's reading is the weighting: a value is
    one number a step (0 at a ratio of 1 for a mean over completions of centred advantages, however it is divided),
    the gradient hundreds; what the value read at step 1 is said as what it could not tell (and what your loop logs,
    read from the value, is kept)."""
    if not gradient:
        return weighting
    logged = next((f.evidence for f in weighting if f.evidence.get("logged_last_micro_batch")
                   or f.evidence.get("logged_without_kl")), {})  # (what your loop logs, read from the value: kept)
    keep = {k: v for k, v in logged.items() if k in ("logged_last_micro_batch", "logged_words", "logged_without_kl")}
    return [dataclasses.replace(f, evidence={**f.evidence, **keep}) for f in gradient]


def _last_loss(weighting: list[Finding]) -> list[Finding]:
    """Where some step's loss is its last micro-batch's alone, the steps whose loss that micro-batch's also gives
    (a first micro-batch whose losses sum to 0, or two alike; a last one all 0 and a loss of 0) tell nothing against
    it: they are left out, and the steps that tell are read."""
    if any(f.evidence.get("logged_last_micro_batch") for f in weighting):
        weighting = [f for f in weighting if not f.evidence.get("last_fits")]
    return [dataclasses.replace(f, evidence={k: v for k, v in f.evidence.items() if k != "last_fits"})
            if "last_fits" in f.evidence else f for f in weighting]


def _own_order(weighting: list[Finding], selection: list[Finding]) -> list[Finding]:
    """A loss averaged per micro-batch, read on your rows in the order harness.loop.trained gives (its micro-batches
    cut in that order), where that order is your loop's own: the built-in loop replays it (the selection's SELECTION),
    so the micro-batches are not the rollout's (no MICRO_BATCH_ORDER)."""
    if not any(f.evidence.get("own_order") for f in selection):
        return weighting
    return [dataclasses.replace(f, rule=f.rule.replace("cut in the rollout's order (TRL's bnpo cuts a shuffled round)",
                                                       "cut in the order your loop gives (harness.loop.trained; TRL's "
                                                       "bnpo cuts a shuffled round)"),
                                settings={k: v for k, v in f.settings.items() if k != "MICRO_BATCH_ORDER"},
                                settles=tuple(k for k in f.settles if k != "MICRO_BATCH_ORDER"))
            if "MICRO_BATCH_ORDER" in f.settings else f for f in weighting]


def _old_logps(objective: list[Finding], cell) -> list[Finding]:
    """A round your loop trained at several steps (its selection: parts of a round, or several passes over it, TRL's
    num_iterations), trained on the current policy at each step, which the built-in loop does with LOGP_OLD
    "current" (TRL keeps the round's generation-time log-probs as the old ones: its ratio leaves 1 after the round's
    first step): a -logp A objective (no ratio), or at a later step over a round its old log-probs equal to its
    current ones (taken again before each pass; saved, or, without them, its per-token loss read at a ratio of 1)."""
    steps_of_round: dict[int, set] = {}
    for s, rows in (cell.trained or {}).items():
        for r, _ in rows:
            steps_of_round.setdefault(r, set()).add(s)
    later = {s for ss in steps_of_round.values() for s in ss if s > min(ss)}  # a round trained at an earlier step
    if not later or getattr(cell.spec, "LOGP_OLD", "auto") == "current":
        return objective
    out = []
    for f in objective:
        if f.exact and f.evidence.get("form") == "logp":
            f = dataclasses.replace(f, rule=f"{f.rule}; its policy term has no ratio, so a round trained over several "
                                    "steps is trained on the current policy at each (TRL keeps the round's "
                                    "generation-time log-probs as the old ones)", settings={**f.settings, "LOGP_OLD":
                                                                                            "current"}, same_as_spec=False)
        elif f.exact and f.step in later and (saved := _old_is_current(cell, f.step)) is not None:
            f = dataclasses.replace(f, rule=f"{f.rule}; at step {f.step}, over a round it trained at an earlier step, "
                                    "its old log-probs are its current ones (" + ("saved" if saved else "its per-token "
                                                                                  "loss read at a ratio of 1")
                                    + "): taken again before each pass, the ratio is 1 at every step (TRL keeps the "
                                    "round's generation-time log-probs, and its ratio leaves 1 after the round's "
                                    "first step)", settings={**f.settings, "LOGP_OLD": "current"}, same_as_spec=False,
                                    settles=f.settles + ("LOGP_OLD",) if saved else f.settles)
        out.append(f)
    if any(f.step in later and f.settings.get("LOGP_OLD") == "current" for f in out):  # a round's first step
        # cannot tell: the ratio is 1 there with TRL's old log-probs too (its reading of TRL's objective is no other)
        out = [f for f in out if not (f.exact and f.step not in later and f.same_as_spec and not f.settings)]
    return out


def _old_is_current(cell, step: int) -> bool | None:
    """At `step`: True where your saved old log-probs equal your log-probs on every counted token, False where none
    were saved and the objective was read with the ratio taken as 1 (your per-token loss is the ratio-1 one), None
    where they differ."""
    from harness.diagnose.identify.steps import steps

    at = next((s for s in steps(cell) if s.step == step), None)
    if at is None:
        return None
    old, lp = at.tensors.get("old_logps"), at.tensors.get("logps")
    if old is None:
        return False
    if not isinstance(lp, list) or not isinstance(old, list) or len(old) != len(lp):
        return None
    same = all(abs(float(a) - float(b)) <= 1e-5 + 1e-5 * abs(float(b)) for ra, rb, n in zip(old, lp, at.lengths)
               for a, b in zip(ra[:n], rb[:n]))
    return True if same else None


def pick(stage: str, cands: list[Finding]) -> Finding | None:
    """A stage's readings at several steps -> the one said (None where it was read at none): the reading that says
    most: exact, least left unsettled, most settled (a step where a KL term or the ratio can show at all), then the
    earliest; for the mask, a rule seen acting first, the most rules first (a mask on the pad id shows only at a step
    that generated one, what counts as truncated only at one where a completion ends in the pad id: the steps without
    one read fewer rules, and do not contradict it; an exact mask reading cannot come from an ambiguity, as a scale
    read from one group can). Steps that read other rules leave it unsettled, each said."""
    if not cands:
        return None
    read_ = [f for f in cands if f.exact and f.readable]
    best = min(cands, key=lambda f: (not f.readable, not f.exact, stage == "mask" and f.same_as_spec,
                                     -len(f.settings) if stage == "mask" else 0, _blind(f, read_), len(f.unsettled),
                                     -len(f.settles), f.step or 0))
    logged = next((f for f in cands if f.evidence.get("logged_without_kl") and f.settings == best.settings), None)
    if logged and logged is not best:
        best = dataclasses.replace(best, rule=logged.rule)
    others = [f for f in cands if f.exact and f.readable and f is not best and _differ(f, best)
              and stage not in ("optimizer", "selection")
              and not (stage == "mask" and _could_not_show(f, best))]
    if best.exact and others:  # steps that read other rules: none is settled, each is said
        said = "; ".join(f"at step {f.step}: {f.rule.removeprefix('your loop ')}" for f in others[:2])
        best = dataclasses.replace(best, settles=(), unsettled=best.unsettled + (
            f"other steps read otherwise ({said}): the search decides",))
    # (what a step could not see served the comparison across steps only)
    if not {"unseen", "kl_below", "look_alikes"} & set(best.evidence):
        return best
    return dataclasses.replace(best, evidence={k: v for k, v in best.evidence.items()
                                               if k not in ("unseen", "kl_below", "look_alikes")})


_KL_FIELDS = ("BETA", "KL_ESTIMATOR", "KL_IS_CORRECTION")


def _unseen(f: Finding, other: Finding) -> set:
    """The fields reading `f` could not see of what `other` reads: those its step leaves unseen (a KL term 0 in value,
    its reference the policy), and a KL term `other` reads whose weight is below what f's step could show (its KL
    term below its own resolution: evidence["kl_below"], per estimator)."""
    unseen = set(f.evidence.get("unseen", ()))
    kl, below = other.evidence.get("kl"), f.evidence.get("kl_below")
    if kl and below and kl[1] < below.get(kl[0], 0.0):
        unseen |= set(_KL_FIELDS)
    return unseen


def _blind(f: Finding, read_: list[Finding]) -> bool:
    """Whether another exact reading sets a field that `f`'s step could not see (a KL weight read where the
    reference is apart enough to show it): that reading says more, and is said (the steps that could not see it do
    not outvote it)."""
    return any(set(g.settings) & _unseen(f, g) for g in read_ if g is not f)


def _differ(f: Finding, best: Finding) -> bool:
    """Whether two readings of a stage say otherwise on a field both could see (a step where the KL term is 0 in
    value, its reference the policy, or below what the step can resolve, says nothing of its weight)."""
    unseen = _unseen(f, best) | _unseen(best, f)
    mine = {k: v for k, v in f.settings.items() if k not in unseen}
    theirs = {k: v for k, v in best.settings.items() if k not in unseen}
    # a step whose readings give the same number cannot tell them apart (evidence["look_alikes"]): one of them read
    # elsewhere is no contradiction
    return mine != theirs and theirs not in f.evidence.get("look_alikes", ()) and \
        mine not in best.evidence.get("look_alikes", ())


def _could_not_show(f: Finding, best: Finding) -> bool:
    """A mask reading `f` that says less than `best` only where its step could not show the rest: its settings are
    part of best's, and each of best's others is a rule whose showing the mask stage tracks (`shows`: truncation,
    the eos and padding rules, what counts as truncated) and that f's step does not settle. (An id's mask is
    tracked by none: a step read as TRL's may have generated that id, and is said.)"""
    rest = set(best.settings) - set(f.settings)
    return f.settings.items() <= best.settings.items() and not rest & set(f.settles) and \
        rest <= {"MASK_TRUNCATED", "COMPLETION_MASK", "TRUNCATED_IF"}


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
