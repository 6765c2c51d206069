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
                                                                     scored again at the initial weights under
                                                                     candidate rules (ids hidden from attention,
                                                                     positions, an id's log-prob 0, a completion's
                                                                     end, raw logits, dtype)
    weighting.py   weighting(per_token_loss, mask, loss, ...)        how per-token losses become the loss (TRL's loss
                                                                     types, or a divisor)
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
    found["objective"] = _old_logps(found["objective"], cell)
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


def _old_logps(objective: list[Finding], cell) -> list[Finding]:
    """A -logp A objective (no ratio) over a round your loop trained at several steps (its selection): each step
    is trained on the current policy, which the built-in loop does with LOGP_OLD "current"."""
    steps_of_round: dict[int, set] = {}
    for s, rows in (cell.trained or {}).items():
        for r, _ in rows:
            steps_of_round.setdefault(r, set()).add(s)
    spread = any(len(steps) > 1 for steps in steps_of_round.values())  # some round trained over several steps
    if not spread or getattr(cell.spec, "LOGP_OLD", "auto") == "current":
        return objective
    return [dataclasses.replace(f, rule=f"{f.rule}; its policy term has no ratio, so a round trained over several "
                                "steps is trained on the current policy at each (TRL keeps the round's generation-time "
                                "log-probs as the old ones)", settings={**f.settings, "LOGP_OLD": "current"},
                                same_as_spec=False)
            if f.exact and f.evidence.get("form") == "logp" else f for f in objective]


def pick(stage: str, cands: list[Finding]) -> Finding | None:
    """A stage's readings at several steps -> the one said (None where it was read at none): the reading that says
    most: exact, least left unsettled, most settled (a step where a KL term or the ratio can show at all), then the
    earliest; for the mask, a rule seen acting first (a mask on the pad id shows only at a step that generated one:
    the steps without one read TRL's mask, and do not contradict it; an exact mask reading cannot come from an
    ambiguity, as a scale read from one group can). Steps that read other rules leave it unsettled, each said."""
    if not cands:
        return None
    best = min(cands, key=lambda f: (not f.readable, not f.exact, stage == "mask" and f.same_as_spec,
                                     len(f.unsettled), -len(f.settles), f.step or 0))
    logged = next((f for f in cands if f.evidence.get("logged_without_kl") and f.settings == best.settings), None)
    if logged and logged is not best:
        best = dataclasses.replace(best, rule=logged.rule)
    others = [f for f in cands if f.exact and f.readable and f is not best and f.settings != best.settings
              and stage not in ("optimizer", "selection")]
    if best.exact and others:  # steps that read other rules: none is settled, each is said
        said = "; ".join(f"at step {f.step}: {f.rule.removeprefix('your loop ')}" for f in others[:2])
        best = dataclasses.replace(best, settles=(), unsettled=best.unsettled + (
            f"other steps read otherwise ({said}): the search decides",))
    return best


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
