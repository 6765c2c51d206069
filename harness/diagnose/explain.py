"""Explain your loop: every setting in which it differs from TRL, in TRL's terms where TRL has a setting (a runnable
`[trl]` table, your_loop_in_trl.toml), in words where it has none (a quirk, named with the built-in loop's spec field
that reproduces it).

The harness cannot flip switches inside your loop, so the explanation turns around: on the cell's lockstep rollouts
it runs the built-in loop (scratch_grpo, set up as TRL is: `scratch_as_trl`) with spec changes until its log matches
your loop's, step by step. `explain` goes in one line:

- the cell: `CellData`, handed in by the pair or loaded once (cell.py);
- the start (`Start`): what your loop's saved tensors settle (identify/), what its log states (logged.py: the
  learning rate's schedule, the reward weights), where the two disagree, and the notes so far;
- the tensor diff (tensordiff.py) and the guesses it gives (`Found`);
- the search (search.py) from that start, the guesses first, for what is left; again judged without the logged loss
  where only the loss's value parts;
- the float32 re-check, where bf16's rounding hides the rest or before a full answer is claimed (`in_float32`);
- the entry: the kept set over every step compared as the cell was, and TRL itself with the table where no quirk is
  left (`_confirm`); worded as confirmed or suspected (explain_words.py: the sentences and the table).

How the search goes (its rounds, `LOOKAHEAD`, `PAIR_POOL`, `MAX_FIELDS`) is search.py's; docs/your-loop.md says it
step by step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

from harness.diagnose import identify
from harness.diagnose.as_trl import scratch_as_trl, trl_fields
from harness.diagnose.cell import EXPLAIN_FILE
from harness.diagnose.compare import steps_logged_words
from harness.diagnose.explain_words import (confirmed_words, float32_notes, found_how,
                                            loss_in_value_words, suspected_words, write_table)
from harness.diagnose.fitted import admissible, refused_words
from harness.diagnose.identify.selection import implied as implied_selection
from harness.diagnose.fields import toml_value, words
from harness.diagnose.logged import reward_weights_from_log, settings_from_log
from harness.diagnose.look_alikes import look_alikes
from harness.diagnose.preflight import apply_alignment
from harness.diagnose.search import Search, Trial, _same, one_change, trl_moves
from harness.diagnose.tensordiff import words as tensor_words

# the fields an exactly recomputed tensor settles (where all its alike candidates agree on them): once kept, the
# search does not offer them again, so a change that only happens to shrink some other gap cannot undo what the
# tensors showed (docs/your-loop.md, nano-aha-moment)
SETTLES = {"advantages": ("ADV_SCALE", "STD", "STD_EPS", "STD_EPS_INSIDE"),
           "mask": ("COMPLETION_MASK",), "loss": ("LOSS_NORM",)}  # not MASK_TRUNCATED: a step may have no truncation


# ---------------------------------------------------------------------------------------------
# what one step hands the next
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Start:
    """What your loop's tensors and log settle before any search: where the search starts and what it tries first."""
    base: object  # the built-in loop set up as TRL (scratch_as_trl): what the search changes
    read: dict  # the search's start: what your log states, with what your tensors settle
    unsure: dict  # what the stages read but could not tell from look-alikes: tried first, kept only if it helps
    identified: dict  # the fields read from what your loop saved (settled or not): "read from what your loop saved"
    settles: tuple  # the fields the stages settle: a tensor guess leaves them out
    settled: frozenset  # those the search never offers: what the stages settle, less what your log states otherwise
    findings: tuple  # identify's findings, stage by stage
    lr_ahead: bool  # your loop logs learning_rate after its scheduler stepped: not compared step by step
    notes: tuple  # the notes so far: what parts first, what was read, the stages' words


@dataclasses.dataclass(frozen=True)
class Found:
    """The tensor diff and the guesses the search tries first."""
    diff: dict | None  # the tensor diff's finding (None: no diff was made)
    guesses: tuple  # changes tried first: the diff's, less what the stages read, and the stages' unsure one
    exact_first: bool  # the first guess was recomputed exactly from your tensors: kept as found
    notes: tuple  # the start's notes, with the diff's words


@dataclasses.dataclass(frozen=True)
class Answer:
    """The set the search kept, in TRL's terms."""
    trl: dict  # the GRPOConfig fields it moves (trl_fields): the table
    quirks: dict  # the changes TRL has no setting for
    differences: list  # each change: its field, value, TRL fields and words, and how it was found


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """The kept set over every step, compared as the cell was, and TRL itself with the table."""
    final: dict  # the whole comparison (the loss judged out where it differs in value alone)
    by_trl: bool | None  # TRL with the table at parity with your loop (None: not run, a quirk is left)

    @property
    def weights_off(self) -> bool:
        return "param_rel_l2" in self.final.get("outside", [])

    @property
    def by_scratch(self) -> bool:
        return self.final.get("first_divergence") is None and not self.weights_off


# ---------------------------------------------------------------------------------------------
# the explanation
# ---------------------------------------------------------------------------------------------
def explain(spec, cell_dir: Path, result: dict, log=print, table: tuple[Path, str] | None = None,
            data=None) -> list[dict]:
    """Explain the cell's divergence (your loop against TRL on the rollouts of `cell_dir`): the attribution entries,
    the first one the verdict (status `confirmed` when the built-in loop with the found changes, and TRL with the
    written table where no quirk is left, match your loop at every step; `suspected` otherwise). `table`: where
    the TRL table goes and the cell it names (default: beside verdict.json, the cell folder's name)."""
    from harness.diagnose import cell as cells

    t0 = time.perf_counter()
    cell_dir = Path(cell_dir)
    data = data if data is not None else cells.load(spec, cell_dir, result)  # the cell, read once
    passes = implied_selection(data)  # several passes over each round, told by the rows your tensors hold
    data = dataclasses.replace(data, trained=passes) if passes else data
    yours = data.yours  # (the cell's dtype: the clipping look-alikes count its norms after a float32 re-check too)
    root = cell_dir / "explain"
    if root.exists():
        shutil.rmtree(root)
    start = _start(spec, data, result, log)
    search = Search(start.base, yours, list(data.records), root, data.envelope, log)
    if start.lr_ahead and "learning_rate" in search.judge.columns:  # logged a step ahead: not compared step by step
        search.judge.columns.remove("learning_rate")  # (by the search, nor by the confirmation's whole comparison)
        data = dataclasses.replace(data, runs={**data.runs, "yours": data.yours.drop(columns=["learning_rate"])})
    search.settled |= start.settled  # settled by your own tensors: the search leaves them
    search.extra = candidate_options(start)  # (a stage's candidate no option list holds)
    found = _found(spec, search, start, data, log)
    state, trace, value_only = _searched(search, start, found, log)
    spec_dtype, notes = spec.DTYPE, list(found.notes)
    escalated = in_float32(spec, data, search, state, start.read, log)
    if escalated is not None:  # what bf16 could not tell apart, told in float32 on the same rollouts
        spec, search, state, trace, data = escalated
        value_only = search.value_only
        notes += float32_notes(search.escalated_from, state.changes, spec_dtype)
    notes = candidate_notes(notes, start.findings, state.changes, state.agree)
    answer = _answer(search.base, state.changes, start, trace)
    alike, cost = look_alikes(search, state, yours)
    entry = {"cause": "+".join(sorted(answer.trl) + sorted(answer.quirks)) or "your loop", "fields": sorted(answer.trl),
             "quirks": answer.quirks, "differences": answer.differences, "trace": trace, "notes": notes + alike,
             "cost": cost}
    if found.diff:
        entry["tensor_diff"] = {**found.diff, "words": tensor_words(found.diff)}
    if start.findings:
        entry["identified"] = [f.to_dict() for f in start.findings]
    escalated_from = search.escalated_from if escalated is not None else None
    if escalated_from is not None:
        entry["precision"] = {"dtype": spec.DTYPE, "from": spec_dtype, **escalated_from}
    at = table or (cell_dir.parent / EXPLAIN_FILE, cell_dir.name)
    if state.agree < search.steps:
        evidence = suspected_words(answer.trl, answer.quirks, state, value_only, search.below_rounding, spec.DTYPE,
                                   start.findings, found.diff)
        return [_suspected(entry, answer, evidence, search, state, at, t0, log)]
    # every step agrees on what training computes: the whole comparison, as the cell was judged
    confirmation = _confirm(spec, data, search, state, answer, value_only, root)
    why, untold = _loss_logged(data, search, state, start.findings)
    entry["notes"] += [why] if why else untold
    _logged_why(confirmation.final, start.findings, why)
    evidence = confirmed_words(answer.trl, answer.quirks, at[0], confirmation.final, confirmation.by_trl,
                               escalated_from, spec_dtype, start.findings)
    return [_confirmed(entry, answer, evidence, confirmation, search, state, at, t0, log)]


def _start(spec, data, result: dict, log) -> Start:
    """What your loop's tensors (identify, against the built-in loop set up as TRL) and its log (the learning rate,
    the reward weights) settle, where the two disagree (the log's value stands), and the notes so far (logged as
    they are said, up to the stages' words)."""
    base = scratch_as_trl(spec)
    findings = tuple(_identify(data, base, log))
    opt = next((f for f in findings if f.stage == "optimizer" and f.readable), None)
    stated: dict = {}  # the schedule your log states, changed or not
    read, said, lr_ahead = settings_from_log(data.yours, base, opt.evidence.get("lrs") if opt else None, stated)
    passes = {k: v for f in findings if f.stage == "selection" for k, v in f.settings.items() if k == "NUM_ITERATIONS"}
    weights, weights_said = reward_weights_from_log(data.yours, apply_alignment(base, {"set": passes}) if passes else
                                                    base, list(data.scores))  # (each step's round, as your passes)
    read, said = {**read, **weights}, said + weights_said
    fd = result.get("first_divergence") or {}
    outside_first = sorted(m for m, v in result.get("metrics", {}).items()
                           if isinstance(v, dict) and v.get("first_outside") == fd.get("step"))
    notes = [f"at step {fd.get('step')} these are outside tolerance: {', '.join(outside_first)}"] if outside_first else []
    notes += said
    skipped = steps_logged_words(data.yours, spec)
    if skipped:
        notes.append(skipped)
    for n in notes:
        log(f"    {n}")
    fixed, unsure, settles = identify.settings_of(findings)
    if "LR_STEPS" in read:  # a schedule of your loop's own: the log's rates stand for the fit's
        peak = max(read["LR_STEPS"])  # (the peak: TRL's learning_rate, the nearest it has)
        if peak and not math.isclose(peak, base.LR, rel_tol=1e-6):
            read["LR"] = peak
        schedule = ("LR", "LR_SCHEDULE", "WARMUP_STEPS", "LR_SCHEDULER_KWARGS")
        fixed = {k: v for k, v in fixed.items() if k not in schedule}
        unsure = {k: v for k, v in unsure.items() if k not in schedule}
    logged = {**stated, **read}  # a value your log states stands as it states it (1e-6, not the tensors' 9.988e-07)
    conflict = {k: (logged[k], v) for k, v in fixed.items() if k in logged and not _alike(logged[k], v)}
    for k, (said_, measured) in conflict.items():  # what your log states and what your tensors show disagree
        notes.append(f"{k}: your log states {toml_value(said_)}, your tensors show {toml_value(measured)}; the "
                     "search starts from the log's")
    fixed = {k: v for k, v in fixed.items() if k not in logged}
    unsure = {k: v for k, v in unsure.items() if k not in read}  # (a value your log states beats a fit's look-alike)
    notes += identify.words(findings)
    start, refused = admissible(base, {**read, **fixed})  # (a fit the spec check refuses: not told, said so)
    on_top, refused_unsure = admissible(base, {**start, **unsure})
    unsure = {k: v for k, v in unsure.items() if k in on_top}
    fixed = {k: v for k, v in fixed.items() if k in start}
    notes += refused_words({**refused, **{k: v for k, v in refused_unsure.items() if k not in start}})
    return Start(base=base, read=start, unsure=unsure, identified={**fixed, **unsure}, settles=settles,
                 settled=frozenset(set(settles) - set(conflict)), findings=findings, lr_ahead=lr_ahead,
                 notes=tuple(notes))


def _alike(a, b) -> bool:
    """A value your log states and one your tensors show alike: a rate within its fit's noise (2e-3), a table
    whose every value is."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_alike(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=2e-3)
    return a == b


def _found(spec, search: Search, start: Start, data, log) -> Found:
    """The tensor diff from the start, and the guesses it gives: its own, less what the stages read (settled or not:
    read from your own tensors), the exact one first where anything of it is left; the stages' unsure reading
    before them, or after the exact one."""
    found = _tensor_diff(spec, search, start.read, data, log)
    notes = list(start.notes)
    first = ((found or {}).get("first") or {}).get("tensor")
    if tensor_words(found) and not any(f.exact and f.stage == _STAGE_OF.get(first) for f in start.findings):
        notes.insert(0, tensor_words(found))  # (a link the stages read exactly is said by them)
    if (found or {}).get("skipped"):
        notes.append("the tensor diff was skipped: " + found["skipped"])
    raw = (found or {}).get("guesses", [])
    exact_first = bool(found) and any(c.get("exact") for c in found.get("chain", [])) and bool(raw)
    guesses = []
    for i, g in enumerate(raw):
        g = {k: v for k, v in g.items() if k not in start.settles and k not in start.unsure}
        if g and g not in guesses:
            guesses.append(g)
        elif i == 0:
            exact_first = False
    at = 1 if exact_first else 0
    if start.unsure:  # what the stages read but could not tell from look-alikes: tried first, kept only if it helps
        guesses.insert(at, start.unsure)
        at += 1
    # a rule a stage's steps could not show (the forward stage's: no step it could read at known weights held the
    # pad id): tried with the unsure readings and alone, after them (at a tie they win), kept only if it helps
    candidate = candidates(start)
    if candidate:
        for g in ({**start.unsure, **candidate}, candidate):  # (one guess where nothing is unsure)
            if g not in guesses:
                guesses.insert(at, g)
                at += 1
    return Found(found, tuple(guesses), exact_first, tuple(notes))


def _handed_on(start: Start) -> list[tuple[str, object, int]]:
    """(field, value, the step it can first act at) of each candidate a stage handed on (evidence["candidate"],
    ["candidate_step"]), less what your log or tensors settle."""
    return [(k, v, f.evidence.get("candidate_step", 1)) for f in start.findings
            for k, v in f.evidence.get("candidate", {}).items() if k not in start.read and k not in start.settles]


def candidates(start: Start) -> dict:
    """What the stages handed on as candidates, as one set of changes."""
    return {k: v for k, v, _at in _handed_on(start)}


def candidate_options(start: Start) -> list:
    """The stages' candidates as search options, each from the step it can first act at: a round that needs it with
    another change finds it in a pair."""
    from harness.diagnose.search import Option

    return [Option(k, v, at) for k, v, at in _handed_on(start)]


def candidate_notes(notes: list[str], findings, changes: dict, agree: int) -> list[str]:
    """The notes, with what the forward stage said it could not show and handed on as a candidate (a rule on an id
    no completion of step 1 holds before its end) said as the search left it: kept (the run needed it); not kept
    where the kept set agrees with your loop through the first step it could act at (your loop does not do it, or
    its effect stays under the tolerance: without a run that parts with it, the two are not told apart); else the
    stage's words stand (the search stopped before it could act)."""
    out = list(notes)
    for f in findings:
        cand, at = f.evidence.get("candidate"), f.evidence.get("candidate_step")
        if not cand or not f.unsettled:
            continue
        said = f"{f.stage}: this run could not tell: {f.unsettled[0]}"
        if said not in out:
            continue
        what = "; ".join(words(k, v).removeprefix("your loop ") for k, v in cand.items())
        if all(changes.get(k) == v for k, v in cand.items()):
            now = (f"{f.stage}, found by the search: your loop {what} (step 1 could not show it: the first step whose "
                   f"completions hold the id before their end is step {at}; kept, the built-in loop needs it)")
        elif agree >= at:
            rule = what.split(" (")[0]
            now = (f"{f.stage}: this run could not tell: whether your loop {rule}: without it the built-in loop "
                   f"agrees with your loop through step {agree} (from step {at} on, completions hold the id before "
                   "their end; step 1's held none), so it does not, or its effect stays under the tolerance here")
        else:
            continue
        out[out.index(said)] = now
    return out


def _searched(search: Search, start: Start, found: Found, log) -> tuple[Trial, list, int | None]:
    """The search from the start, the guesses first: its best trial and trace, and the step from which it was judged
    without your logged loss (None: with it), where only the loss's value parts and the gradient norm agrees."""
    settles = settled_by(found.diff)
    state, trace = search.run(start.read, list(found.guesses), found.exact_first, settles=settles)
    value_only = None
    if _loss_value_alone(search, state):  # -logp * A, say: judged again on the gradient
        value_only = state.agree + 1
        log(f"    explain: at step {value_only} only the loss's value parts, the gradient norm agrees: searched again "
            "without the logged loss (judged on grad_norm; the final weights are compared at the end)")
        search.without_loss(value_only)
        state, trace = search.run(start.read, list(found.guesses), found.exact_first, settles=settles)
    search.save()
    return state, trace, value_only


def _answer(base, changes: dict, start: Start, trace: list[dict]) -> Answer:
    """The kept changes in TRL's terms, each difference marked by how it was found: read from your log, read from
    what your loop saved, guessed from the tensor diff, or searched."""
    from_tensors = {k for t in trace if t.get("guessed_from_tensors") for k in t["changes"]}
    trl = trl_fields(base, changes) if changes else {}
    quirks = {k: v for k, v in changes.items() if not trl_moves(base, one_change(changes, k))}
    differences = [{"field": k, "value": v, "trl": trl_fields(base, one_change(changes, k)), "words": words(k, v),
                    "read_from_log": k in start.read and k not in start.identified, "identified": k in start.identified,
                    "from_tensors": k in from_tensors} for k, v in changes.items()]
    return Answer(trl, quirks, differences)


def _suspected(entry: dict, answer: Answer, evidence: str, search: Search, state: Trial, at: tuple[Path, str],
               t0: float, log) -> dict:
    """The entry of an explanation that does not agree at every step: the closest the search came, its table written
    where it changed anything (every difference marked by how it was found: the table to start from)."""
    path, cell = at
    if state.changes:
        write_table(path, answer.trl, answer.quirks, cell, search.runs, "suspected", found_how(answer.differences))
    entry.update(status="suspected", evidence=evidence, fix={"trl": answer.trl, "scratch": answer.quirks,
                                                             "sentence": evidence},
                 runs=search.runs, **({"written": str(path)} if state.changes else {}))
    if state.outside:  # where the closest still parts: the answer's first sentence says it
        entry["parts"] = {"step": state.agree + 1, "metrics": list(state.outside[:4])}
    log(f"    explain: {search.runs} runs, {search.steps_run} steps, {time.perf_counter() - t0:.1f} s")
    return entry


def _confirm(spec, data, search: Search, state: Trial, answer: Answer, value_only: int | None,
             root: Path) -> Confirmation:
    """The kept set's run over every step compared with your loop as the cell was judged (final weights included),
    and, where no quirk is left, TRL itself with the table on the cell's rollouts (one more run of the search)."""
    final = _loss_in_value_only(_against(spec, data, Path(state.folder)), value_only)
    by_trl = None
    if answer.trl and not answer.quirks:  # TRL itself, with the table: the claim in TRL's own terms
        by_trl = _trl_check(spec, answer.trl, data, root / "trl-with-table", value_only)
        search.runs += 1
    return Confirmation(final, by_trl)


def _confirmed(entry: dict, answer: Answer, evidence: str, confirmation: Confirmation, search: Search, state: Trial,
               at: tuple[Path, str], t0: float, log) -> dict:
    """The entry of an explanation that agrees at every step on what training computes: confirmed where the whole
    comparison and TRL with the table agree too, suspected where either still parts; its table written."""
    path, cell = at
    status = "confirmed" if confirmation.by_scratch and confirmation.by_trl is not False else "suspected"
    write_table(path, answer.trl, answer.quirks, cell, search.runs, status, found_how(answer.differences))
    cost = entry["cost"]
    entry.update(status=status, evidence=evidence, fix={"trl": answer.trl, "scratch": answer.quirks,
                                                        "sentence": evidence},
                 runs=search.runs, written=str(path),
                 defined_differently=confirmation.final.get("defined_differently", []), matched_by=state.folder,
                 confirmed_by={"scratch": confirmation.by_scratch, "trl": confirmation.by_trl})
    if confirmation.final.get("loss_in_value_only"):  # the loss parts in value alone: not where training parts
        entry["loss_logged_otherwise"] = {k: v for k, v in confirmation.final["loss_in_value_only"].items()
                                          if k in ("from_step", "agrees")}
    entry["cost"] = {**cost, "runs": search.runs - cost["look_alike_runs"], "seconds": round(time.perf_counter() - t0, 1)}
    log(f"    explain: {search.runs} runs ({cost['look_alike_runs']} of them look-alikes of the confirmed set), "
        f"{search.steps_run} steps, {time.perf_counter() - t0:.1f} s")
    return entry


def in_float32(spec, data, search: Search, state: Trial, read: dict, log=print):
    """Where a bf16 search stopped because only changes below its rounding did better: your loop and the search
    again in float32 (fp32 weights and arithmetic; TF32 is off in torch by default) on the same rollouts, starting
    from what bf16 found. None when not needed (float32 already, or the search stopped for another reason) or when
    your loop fails in float32; else (spec, search, state, trace, the cell) in float32, the search's
    `escalated_from` saying where bf16 stopped (the cell: `data` with your float32 run and its envelope)."""
    import dataclasses

    from harness.diagnose.precision import FLOAT32, float32_twin, your_loop_in_float32
    from loop_runner.run import LoopError

    full = state.agree >= search.steps  # an explanation reached in bf16 is checked in float32 before it is claimed
    if spec.DTYPE == "float32" or spec.FLOAT32_CHECK == "off" or (not full and not search.below_rounding):
        return None
    root = search.root / "float32"
    spec32 = apply_alignment(spec, {"set": FLOAT32})
    if full:
        log(f"    explain: in {spec.DTYPE} the explanation agrees at every step; before it is claimed, your loop and the "
            "built-in loop again in float32 on the same rollouts (bf16's rounding hides smaller differences)")
    elif search.below_rounding:
        log(f"    explain: in {spec.DTYPE} the rest is below rounding from step {search.below_rounding['at_step']}: "
            "your loop and the search again in float32 on the same rollouts")
    t0 = time.perf_counter()
    try:
        yours, same = your_loop_in_float32(spec32, data, root)
    except LoopError as e:
        log(f"    explain: your loop in float32 failed ({str(e)[:200]}); the {spec.DTYPE} answer stands")
        return None
    if full and same:  # a loop that runs in bf16 whatever DTYPE says cannot be checked in float32
        log(f"    explain: your loop's float32 run logged exactly its {spec.DTYPE} run (does it read DTYPE from "
            f"PARITY_SPEC?): the {spec.DTYPE} explanation stands, unchecked")
        return None
    base = scratch_as_trl(spec32)
    envelope = None
    if spec32.TOLERANCE == "calibrated":  # the float32 noise twin of what bf16 found
        envelope = float32_twin(apply_alignment(base, {"set": state.changes}), list(data.records), root, "plain")
    search.warm = None  # the bf16 model: freed before the float32 one loads
    again = Search(base, yours, list(data.records), root / "search", envelope, search.log)
    again.extra = list(search.extra)  # (a stage's candidate, offered in float32 as in bf16)
    guess = {k: v for k, v in state.changes.items() if k not in read}
    again.settled |= float32_settles(data, spec32, root, yours, base, read, set(guess), log)
    again.runs, again.seconds = search.runs + 3, search.seconds + time.perf_counter() - t0  # the search's cost
    again.steps_run = search.steps_run + 3 * search.steps
    if search.value_only is not None:  # judged as the bf16 search was (nothing settled: bf16's alike candidates may
        again.without_loss(search.value_only)  # differ in float32)
    again.escalated_from = {**(search.below_rounding or {"at_step": None}), "agree": state.agree,
                            "found": state.changes, "loop_ignores_dtype": bool(same), "checked": full}
    state32, trace = again.run(read, [guess] if guess else [], guessed_by=f"the {spec.DTYPE} search")
    again.save()
    data32 = dataclasses.replace(data, spec=spec32, folder=root, runs={"yours": yours}, envelope=envelope, sketches={},
                                 comparison={}, tensors={}, trained=None)  # (what was the bf16 run's)
    return spec32, again, state32, trace, data32


def float32_settles(data, spec32, root: Path, yours, base, read: dict, guessed: set, log) -> set[str]:
    """The fields your loop's own float32 tensors (its run in root/yours, on `spec32`) settle at exactly the values
    the float32 search starts from (`read` over `base`): the stages read again in float32, where rounding hides less
    than in the bf16 run, whose settled fields the float32 search does not trust (their alike candidates may part in
    float32). A field read there at any other value (a beta2 of 0.9999 against 0.999 too), or one the bf16 answer sets
    (`guessed`: tried first, and kept only if it helps), is left to the search; nothing when your loop saved no
    tensors. (Its seconds count in the search's cost.)"""
    from harness.diagnose.cell import your_loop_files
    from harness.rollouts.lockstep import LOOP_ROLLOUTS_FILE

    files = your_loop_files(root / "yours", Path(data.folder) / LOOP_ROLLOUTS_FILE)
    if not files["tensors"] and not files["trained"]:
        return set()
    data32 = dataclasses.replace(data, spec=spec32, folder=root, runs={"yours": yours}, sketches={}, **files)
    passes = implied_selection(data32)  # several passes over each round, as explain() reads the bf16 cell
    data32 = dataclasses.replace(data32, trained=passes) if passes else data32
    fixed, _unsure, settles = identify.settings_of(_identify(data32, base, lambda *_: None))
    kept = {k for k in settles if k not in guessed
            and _same(fixed.get(k, getattr(base, k, None)), read.get(k, getattr(base, k, None)))}
    if kept:
        log(f"    explain: in float32 your tensors settle {', '.join(sorted(kept))}: the float32 search leaves them")
    return kept


def settled_by(found: dict | None) -> tuple:
    """The fields the tensor diff's exactly recomputed links settle (SETTLES): those on which every candidate the
    link found alike agrees (a field a candidate leaves out is the spec's own value)."""
    out = []
    for link in (found or {}).get("chain", []):
        cands = link.get("candidates") or []
        if link.get("exact") and cands:
            out += [k for k in SETTLES.get(link["tensor"], ())
                    if len({json.dumps(c.get(k, "spec's own"), default=str) for c in cands}) == 1]
    return tuple(out)


def _loss_value_alone(search: Search, state: Trial) -> bool:
    """The search stopped where only the loss parts, not below rounding (that goes to float32), and your loop's
    grad_norm, logged and finite at that step, agrees there."""
    if state.agree >= search.steps or state.outside != ["loss"] or search.below_rounding:
        return False
    if "grad_norm" not in search.judge.columns:  # the judge's columns are the ones your loop logs
        return False
    value = search.judge.rows.get(state.agree + 1, {}).get("grad_norm")
    return value is not None and math.isfinite(float(value))


def _identify(data, base, log) -> list:
    """Each stage of your loop read from its own tensors (harness/diagnose/identify/): what the saved tensors allow,
    against the built-in loop set up as TRL (`base`)."""
    import dataclasses

    if not data.tensors and not data.trained:
        return []
    cell = dataclasses.replace(data, spec=base)
    if not cell.grad_norms() and any("probe" in t for t in data.tensors.values()):
        log("    identify: your loop saved a parameter slice (Probe) but logs no grad_norm: the optimizer stage needs the "
            "pre-clip gradient norm of each step (log_step(step, grad_norm=...))")
    try:
        found = identify.identify(cell)
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError) as e:  # tensors of another shape
        log(f"    identify: your tensors could not be read stage by stage ({type(e).__name__}: {str(e)[:120]})")
        return []
    for f in found:
        if not f.same_as_spec or f.unsettled:
            log(f"    identify: {f.stage}: {f.rule}" + (f" -> {f.settings}" if f.settings else "")
                + ("" if f.exact else " (no rule fits all)"))
    return found


_STAGE_OF = {"advantages": "advantages", "mask": "mask", "loss": "weighting", "per_token_loss": "objective"}


def rows_problem(mine: dict[int, dict], records: list[dict], per_round: int) -> str | None:
    """Why your saved tensors cannot be compared row by row with a round's (the tensor diff's unit), or None: a
    per-completion or per-token tensor whose rows are not the round's completions (a step that trains on part of a
    round, or a micro-batch saved alone)."""
    from harness.runlog.tensors import PER_ROW, PER_TOKEN

    for step in sorted(mine):
        r = (step - 1) // max(per_round, 1)
        if r >= len(records):
            return f"step {step} has tensors but the recording holds {len(records)} round(s)"
        n = len(records[r]["completion_ids"])
        for name in (*PER_ROW, *PER_TOKEN):
            value = mine[step].get(name)
            if isinstance(value, list) and len(value) != n:
                return (f"your {name} at step {step} has {len(value)} rows where round {r} has {n} completions: the "
                        "diff compares a whole round row by row (one row per completion, in the rollout's order)")
    return None


def _tensor_diff(spec, search: "Search", start: dict, data, log) -> dict | None:
    """The tensor diff, where your loop saved tensors (harness.loop.tensors): the built-in loop, set up as TRL, saves
    the same steps' tensors on the same rollouts, and the first link of the chain that differs is named."""
    from harness.diagnose.tensordiff import chain_facts, diff

    mine, records = data.tensors, list(data.records)
    if not mine or spec.loop.tensor_steps < 1:
        return None
    per_round = spec.NUM_ITERATIONS * spec.STEPS_PER_GENERATION
    from harness.diagnose.tensordiff import in_rollout_order

    # whole rounds in an order of your loop's own (harness.loop.trained): your rows, put back in the rollout's order
    mine, problem = in_rollout_order(mine, data.trained or {}, [len(rec["completion_ids"]) for rec in records],
                                     per_round)
    problem = problem or rows_problem(mine, records, per_round)
    if problem:
        log(f"    (the tensor diff is skipped: {problem})")
        return {"first": None, "chain": [], "skipped": problem}
    # a step trains on a slice of its round when STEPS_PER_GENERATION > 1: rows would not align. NUM_ITERATIONS passes
    # each train on the whole round (one row per completion, as the diff reads them): those steps are compared
    if spec.STEPS_PER_GENERATION > 1:
        log("    (the tensor diff compares steps that train on a whole round: with STEPS_PER_GENERATION above 1 a step "
            "trains on a slice of it, so the diff is skipped and the search alone explains)")
        return None
    steps = min(max(mine), spec.loop.tensor_steps, spec.STEPS)
    ref = search.tensor_values(start, steps)
    facts = chain_facts(spec, records, list(data.scores))
    lengths = {s: n for s, n in facts["lengths"].items() if s in ref}
    ends = {s: e for s, e in facts["ends_with_eos"].items() if s in lengths}
    eos, has_eos, atol, rtol = facts["eos_ids"], facts["prompts_have_eos"], facts["atol"], facts["rtol"]
    found = diff(mine, ref, search.base, lengths, eos, has_eos, atol, rtol, ends, facts["scores"])
    # a forward pass that differs on its own: which switch gives yours? Checked at the step the chain belongs to
    # (log-probs that part after a clean step are the first update's: a candidate acting through it shows at step 2,
    # and at step 1 every candidate would agree)
    at = (found or {}).get("first", {}) or {}
    at = at.get("step", min(mine))
    for link in (found or {}).get("chain", []):
        if link["tensor"] in ("logps", "ref_logps") and link.get("independent") and link.get("candidates"):
            for cand in link["candidates"]:
                again = search.tensor_values({**start, **cand}, at)
                check = diff({at: {link["tensor"]: mine.get(at, {}).get(link["tensor"])}},
                             {at: {link["tensor"]: again.get(at, {}).get(link["tensor"])}}, search.base,
                             {at: lengths.get(at, [])}, eos, has_eos, atol, rtol)
                if check is not None and check.get("first") is None:
                    names = ", ".join(f"{k} = {v!r}" for k, v in cand.items())
                    link.update(exact=True, candidates=[cand], how=f"{link['how']}; with {names} the built-in loop's "
                                "are yours")
                    break
    if found and found.get("first"):
        from harness.diagnose.tensordiff import guesses_of

        first = next(c for c in found["chain"] if c["tensor"] == found["first"]["tensor"])
        found["first"].update({k: first[k] for k in ("how", "candidates", "exact") if k in first})
        found["guesses"] = guesses_of(found["chain"], found["first"])
    said = tensor_words(found)
    if said:
        log(f"    {said}")
    return found


def _trl_check(spec, trl: dict, data, folder: Path, value_only: int | None = None) -> bool:
    """TRL with the table on the cell's rollouts (`data`) against your loop: parity? (`value_only`: your loss
    differs in value alone, see _loss_in_value_only)"""
    from harness.rollouts.lockstep import ReplaySource
    from trl_runner.runner import train as train_trl

    candidate = apply_alignment(spec, {"set_trl": trl})
    train_trl(candidate, folder / "trl", rollout_source=ReplaySource(list(data.records)), progress=False,
              lockstep=True)
    return _loss_in_value_only(_against(candidate, data, folder / "trl"), value_only)["first_divergence"] is None


def _logged_why(final: dict, findings, why: str | None = None) -> None:
    """Where your loss differs in value alone and your tensors (the weighting stage) or every logged step (`why`) say
    what your loop logs as its loss (its last micro-batch's), that is said as the reason."""
    why = why or next((f.evidence["logged_words"] for f in findings if f.stage == "weighting"
                       and f.evidence.get("logged_last_micro_batch")), None)
    if why and final.get("loss_in_value_only"):
        final["loss_in_value_only"]["why"] = why
        final["notes"] = [n for n in final.get("notes", []) if not n.startswith("your loss differs in value alone")] \
            + ["your loss differs in value alone: " + loss_in_value_words(final)]


def _loss_logged(data, search: Search, state: Trial, findings) -> tuple[str | None, list[str]]:
    """What your loop logs as its loss where its saved tensors did not say (the weighting stage reads the steps they
    hold): every logged step against the per-token losses of the built-in loop that reproduces yours, rows in your
    order (logged.loss_logged_words)."""
    from harness.diagnose.logged import loss_logged_words

    yours, changes = data.yours, state.changes
    if any(f.evidence.get("logged_last_micro_batch") for f in findings) or yours is None or "loss" not in yours.columns:
        return None, []
    spec = apply_alignment(search.base, {"set": changes})
    parts = next((t["micro_batches"] for t in data.tensors.values() if isinstance(t.get("micro_batches"), list)), None)
    ga = len(parts) if parts and len(set(parts)) == 1 else spec.GRAD_ACCUM
    if ga < 2 or spec.SELECTION or spec.STEPS_PER_GENERATION > 1:  # (rows of whole rounds only)
        return None, []
    return loss_logged_words(yours, search.tensor_values(changes, spec.STEPS),
                             list(data.records), spec, ga)


def _against(spec, data, run: Path) -> dict:
    """Your loop (the cell's) compared with a run the explanation made, as the cell was judged."""
    from harness.diagnose.pairs import compare_loaded

    return compare_loaded(spec, Path(data.folder) / "yours", Path(run), "lockstep", data.envelope, data.sketches,
                          runs={"yours": data.yours})[0]


def _loss_in_value_only(result: dict, value_only: int | None) -> dict:
    """A comparison in which, where the search found your loss differing in value alone (`value_only`: the step),
    the loss parting is not a divergence when grad_norm and the final weights are compared and agree, the loss is
    finite, and nothing else parts but statistics defined differently: `loss_in_value_only` says from which step,
    and what agrees."""
    from harness.diagnose.compare import is_derived

    outside = result.get("outside", [])
    metrics = result.get("metrics", {})
    if value_only is None or "loss" not in outside or "grad_norm" not in metrics or "grad_norm" in outside:
        return result
    if "param_rel_l2" not in metrics or metrics["loss"].get("non_finite_steps"):  # a norm alone says too little;
        return result  # a NaN loss is a divergence, never a value defined otherwise
    rest = [m for m in outside if m != "loss"]
    if not all(is_derived(m) for m in rest):
        return result
    out = {**result, "outside": [], "first_divergence": None, "notes": list(result.get("notes", []))}
    if rest:
        out["defined_differently"] = sorted(set(out.get("defined_differently", [])) | set(rest))
    out["loss_in_value_only"] = {"from_step": metrics["loss"].get("first_outside"),
                                 "agrees": ["grad_norm", "param_rel_l2"]}
    out["notes"].append("your loss differs in value alone: " + loss_in_value_words(out))
    return out
