"""The forward stage: what your loop's forward pass sees, read from the log-probs it saved at step 1.

Step 1's weights are the initial checkpoint's (every side starts from PARITY_INIT, and step 1's log-probs are taken
before its update), so the completions can be scored again under candidate forward rules and set against yours:
- the attention mask from token ids (a mask built as `ids != pad_id` hides a generated pad token from the tokens
  after it; the eos, the prompt's too, for a loop whose pad is its eos), with positions counted over the mask or the
  model's own (POSITIONS), or the token taken out of the sequence (MASK_TOKEN_DROP: a loop that packs without it);
- a log-prob of 0 at one id (cross_entropy's ignore_index: LOGP_ZERO_ID), read off your tensors without a pass;
- each completion ended at its first token of an id (a sampler that stops at the pad id: END_AT_ID): your log-probs
  agree with TRL's through it and not after, and the tokens after it are not compared;
- log-probs on the raw logits (LOGP_ON_RAW_LOGITS, at a temperature other than 1), the log_softmax taken on
  logits cast to bfloat16 or float16 (LOGITS_DTYPE: the model in float32, so it reproduces your log-probs exactly),
  another compute dtype (DTYPE: only at that dtype's own rounding); where none of these fits, the weights themselves
  loaded in bfloat16 (MASTER_WEIGHTS, a second model: a loop that loads its model in bf16), the log_softmax on the
  bf16 logits such a model returns or after a cast to float32.
Step 1 may hold no pad id before a completion's end (a loop that trains one prompt group per step): then the first
later step whose completions hold one is read from your reference log-probs there, which are the initial weights'
where your loop saves them (a KL to the initial model) and every row without the pad id is TRL's rule's; without
them the weights there are not known before the search, and hiding the pad id is handed to it as a candidate
(`beyond_step_1`).
Which tokens the loss counts is the mask stage's (it reads completions ended as found here). The rule that
reproduces your log-probs with the fewest switches is the finding; the others that reproduce them as well are said
as what the run could not tell. Nothing is scored where your log-probs already agree with TRL's rule (one pass), and
each other rule costs one batched pass of step 1's completions.
"""

from __future__ import annotations

import dataclasses

from harness.diagnose.fields import words as field_words
from harness.diagnose.identify.finding import Finding
from harness.diagnose.identify.steps import _rows_of, steps

MOST_IDS = 4  # token ids tried as hidden from attention (the pad id and the eos first; the pad id also as an end)
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # a log-prob reproduced (a batch's padding moves fp32 ~1e-6)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A candidate forward rule: the spec fields of its pass, an id zeroed and an id that ends completions."""
    passes: tuple = ()  # ((field, value), ...): the settings of the forward pass that scores it
    zero: int = -1  # LOGP_ZERO_ID
    end: int = -1  # END_AT_ID

    @property
    def settings(self) -> dict:  # (a pass's own keys, "_rows", are how it is scored, no spec field)
        return {**{k: v for k, v in self.passes if not k.startswith("_")},
                **({"LOGP_ZERO_ID": self.zero} if self.zero >= 0 else {}),
                **({"END_AT_ID": self.end} if self.end >= 0 else {})}


def forward(saved, prompts, completions, score, spec, pad_id, eos_ids, step=1,
            what: str = "your log-probs") -> Finding | None:
    """Your log-probs `saved` (one row per completion, read up to its length) against `score(settings)` (the
    completions scored at the initial weights under the built-in loop's forward switches, one list per row): None
    where TRL's rule reproduces them; else the rule that does with the fewest switches, said with its look-alikes,
    or that none does. `what`: what `saved` is, in the words said (your reference model's log-probs at a later
    step: the initial weights' too)."""
    tol = TOLERANCE.get(getattr(spec, "DTYPE", "float32"), 1e-4)
    mine = [[float(x) for x in row[:len(c)]] + [float("nan")] * (len(c) - len(row)) for row, c in
            zip(saved, completions)]
    scored = {(): score({})}
    off = _differing(mine, scored[()], tol)
    if not any(off):
        return None
    zeros = _zeroed_ids(mine, scored[()], completions, off)
    ids = _hidden_ids(prompts, completions, off, mine, zeros, pad_id, eos_ids)
    rules = [Rule(p, z, e) for p in _passes(ids, eos_ids, spec) for z in (-1, *zeros)
             for e in (-1, *(i for i in ids if i == pad_id and i not in eos_ids))]  # (a sampler stops at its pad id)
    trl_off = max((abs(a - b) for m, t in zip(mine, scored[()]) for a, b in zip(m, t) if a == a), default=0.0)

    def within(rule: Rule, fit: float) -> bool:  # another dtype: its own rounding, and far closer than TRL's rule
        dtype = dict(rule.passes).get("DTYPE")
        return fit <= tol if dtype is None else fit <= min(TOLERANCE.get(dtype, tol), trl_off / 10)

    fits = []

    def try_rules(rules):
        for rule in rules:
            if rule.passes not in scored:
                scored[rule.passes] = score(dict(rule.passes))
            fits.append((rule, *_fit(mine, scored[rule.passes], completions, rule, tol)))
        # a rule that reproduces every token beats one that leaves some uncompared (an end), then the fewest switches
        return sorted((x for x in fits if within(x[0], x[1])), key=lambda x: (x[2], len(x[0].settings), x[1]))

    exact = try_rules(rules)
    if not exact:  # none with the spec's weights: the weights loaded in another dtype (a second model, so only here)
        exact = try_rules([Rule(p, z, e) for p in _weights_passes(spec) for z in (-1, *zeros)
                           for e in (-1, *(i for i in ids if i == pad_id and i not in eos_ids))])
    rows = sum(1 for o in off if o)
    ev = {"rows": rows, "max_abs": trl_off, "rules_tried": len(fits), "passes": len(scored)}
    if not exact:
        closest = min(fits, key=lambda x: x[1])
        said = _said(closest[0].settings) or "TRL's"
        whose = what.replace("your ", "your loop's ", 1)
        return Finding("forward", step, f"{whose} at step {step} "
                       f"differ from TRL's in {rows} of {len(mine)} rows, and no forward rule tried reproduces them "
                       f"(closest: {said}, {closest[1]:.3g} off)", {}, False, no_switch=True, evidence=ev)
    best, fit, uncompared = exact[0]
    alike = [r for r, _, u in exact[1:] if u == uncompared and len(r.settings) == len(best.settings)
             and r.settings != best.settings]  # (one rule scored two ways is no look-alike of itself)
    settles = tuple(k for k, v in best.settings.items() if all(r.settings.get(k) == v for r in alike))
    unsettled = tuple(f"{_said(r.settings)} reproduces your log-probs as well (a look-alike at this step)"
                      for r in alike[:3])
    ids = [best.settings.get(k) for k in ("ATTENTION_HIDE_ID", "LOGP_ZERO_ID", "END_AT_ID")]
    pad = f" ({pad_id} is the pad token's id)" if pad_id is not None and pad_id in ids else ""
    return Finding("forward", step, f"your loop {_said(best.settings)}{pad}: it reproduces {what} at step {step} "
                   f"({rows} of {len(mine)} rows part from TRL's; {fit:.2g} off)", best.settings, True,
                   unsettled=unsettled, evidence={**ev, "alike": [r.settings for r in alike]}, settles=settles)


def _said(settings: dict) -> str:
    return "; ".join(field_words(k, v).removeprefix("your loop ") for k, v in settings.items())


def _differing(mine, theirs, tol) -> list[list[int]]:
    """Per row, the positions where your log-prob is not theirs within `tol` (a NaN of yours differs)."""
    return [[t for t, (a, b) in enumerate(zip(m, th)) if not abs(a - b) <= tol] for m, th in zip(mine, theirs)]


def _zeroed_ids(mine, theirs, completions, off) -> list[int]:
    """The ids scored 0 where TRL's rule scores otherwise, each 0 wherever it stands (cross_entropy's ignore_index)."""
    ids = {completions[i][t] for i, ts in enumerate(off) for t in ts if mine[i][t] == 0.0 and theirs[i][t] != 0.0}
    return sorted(x for x in ids if all(m[t] == 0.0 for m, c in zip(mine, completions)
                                        for t, tok in enumerate(c) if tok == x))


def _hidden_ids(prompts, completions, off, mine, zeros, pad_id, eos_ids) -> list[int]:
    """The token ids whose hiding (or a completion's end) could part your log-probs from TRL's: each stands before
    the first differing position (a zeroed one aside) in every row that differs, and in no row that agrees with a
    token after it; the pad id and the eos first, then the rarest; at most MOST_IDS."""
    first = [next((t for t in ts if not (completions[i][t] in zeros and mine[i][t] == 0.0)), None)
             for i, ts in enumerate(off)]
    parted = [i for i, f in enumerate(first) if f is not None]
    if not parted:
        return []
    ids = set.intersection(*(set(prompts[i]) | set(completions[i][:first[i]]) for i in parted))
    for i, f in enumerate(first):
        if f is None:
            ids -= set(prompts[i]) | set(completions[i][:-1])
    count = {x: sum(c.count(x) for c in completions) for x in ids}
    return sorted(ids, key=lambda x: (x != pad_id, x not in eos_ids, count[x], x))[:MOST_IDS]


def _passes(ids, eos_ids, spec) -> list[tuple]:
    """The forward passes to score: TRL's, each id hidden from attention at either kind of positions (the eos as
    EOS_ATTENTION: the prompt's too) or taken out of the sequence (MASK_TOKEN_DROP), the raw logits at a
    temperature, the log_softmax on low-precision logits (LOGITS_DTYPE: reproduced exactly, at float32's tolerance),
    the other compute dtype."""
    out = [()]
    for x in ids:
        if x in eos_ids:
            out += [(("EOS_ATTENTION", "mask"),), (("EOS_ATTENTION", "mask"), ("POSITIONS", "plain"))]
        else:
            out += [(("ATTENTION_HIDE_ID", x),), (("ATTENTION_HIDE_ID", x), ("POSITIONS", "mask")),
                    (("MASK_TOKEN_ID", x), ("MASK_TOKEN_DROP", True))]  # (out of the sequence: packed without it)
    if spec.TEMPERATURE != 1.0:
        out.append((("LOGP_ON_RAW_LOGITS", not spec.LOGP_ON_RAW_LOGITS),))
    out += [(("LOGITS_DTYPE", d),) for d in ("bfloat16", "float16") if d != getattr(spec, "LOGITS_DTYPE", "float32")]
    if getattr(spec, "MASTER_WEIGHTS", "float32") == "float32":
        out.append((("DTYPE", "bfloat16" if spec.DTYPE == "float32" else "float32"),))
    return list(dict.fromkeys(out))


def _weights_passes(spec) -> list[tuple]:
    """The forward passes of a model whose weights are loaded in bfloat16 (MASTER_WEIGHTS, with the DTYPE it needs),
    where the spec's are float32: its log_softmax on the bf16 logits such a model returns (LOGITS_DTYPE: a loop that
    scores them as they come, `cross_entropy(model(ids).logits, ...)`), or in float32 after a cast; each scored in
    the built-in loop's padded batches and each row alone (`_rows`: at bf16's rounding a left-padded prompt's shifted
    positions move a log-prob by ~1e-3, as much as the weights' dtype does on a small model)."""
    if getattr(spec, "MASTER_WEIGHTS", "float32") != "float32":
        return []
    bf16 = (("DTYPE", "bfloat16"), ("MASTER_WEIGHTS", "bfloat16"))
    return [p + rows for p in (bf16 + (("LOGITS_DTYPE", "bfloat16"),), bf16) for rows in ((), (("_rows", True),))]


def _fit(mine, theirs, completions, rule: Rule, tol: float) -> tuple[float, int]:
    """(the largest |yours - the rule's| over the tokens the rule scores, the tokens it leaves uncompared): through
    the first `end` id where it ends a completion (the tokens after it are none of the rule's), a token taken out of
    the sequence left out, an id zeroed scoring 0; inf where a token the rule scores is missing from yours, or where
    a completion the rule ends has your log-probs after its end as if it went on (the rule is refuted there)."""
    worst, uncompared = 0.0, 0
    passes = dict(rule.passes)
    dropped = passes.get("MASK_TOKEN_ID", -1) if passes.get("MASK_TOKEN_DROP") else -1  # (none of the loop's tokens)
    for m, th, c in zip(mine, theirs, completions):
        n = c.index(rule.end) + 1 if rule.end in c else len(c)
        uncompared += len(c) - n + c[:n].count(dropped)
        if n < len(c) and all(abs(a - b) <= tol for a, b in zip(m[n:], th[n:])):
            return float("inf"), uncompared
        for t in (t for t in range(n) if c[t] != dropped):
            d = abs(m[t] - (0.0 if c[t] == rule.zero else th[t]))
            if not d <= worst:  # (NaN: missing)
                worst = d if d == d else float("inf")
    return worst, uncompared


def read(cell, earlier: dict) -> list[Finding]:
    """Your forward pass, from the log-probs your loop saved at step 1 (the initial weights'): [] where it saved
    none, or where TRL's rule reproduces them and no later step could show more (`beyond_step_1`)."""
    first = next((s for s in steps(cell) if s.step == 1 and _rows_of(s.tensors.get("logps"), len(s.completions))),
                 None)
    if first is None or any("prompt_ids" not in cell.records[r] for r, _ in first.rows[:1]):
        return []
    prompts = [cell.records[r]["prompt_ids"][i] for r, i in first.rows]
    found = forward(first.tensors["logps"], prompts, first.completions, _scorer(cell, prompts, first.completions),
                    cell.spec, cell.pad_id, tuple(cell.eos_ids))
    if found is None:
        found = beyond_step_1(cell, first)
    return [found] if found is not None else []


def shows_id(completions, token: int) -> bool:
    """Whether a forward rule on `token` can act on these completions: the token stands inside one, before its last
    token (a later token to hide it from, a completion to end early; its log-prob scored at all)."""
    return any(token in c[:-1] for c in completions)


def beyond_step_1(cell, first) -> Finding | None:
    """TRL's rule reproduces step 1, but no completion of step 1 holds the pad id inside it, so no rule on the pad id
    could show there (a loop trained on part of a round per step, one prompt group, say). The first later step whose
    completions hold it is read where its weights are known:
    - your reference model's log-probs at that step, where your loop saves them and they are the initial weights'
      (every row without the pad id is TRL's rule's at the initial weights): read as step 1's are;
    - else none is known before the search: what step 1 could not show is said, and hiding the pad id from attention
      (the commonest such rule: an attention mask built as `ids != pad_id`) is handed to the search as a candidate
      (evidence["candidate"]: tried first, kept only where it helps).
    None where no step's completions hold the pad id inside them, or step 1's do (it read TRL's rule there)."""
    pad = cell.pad_id
    if pad is None or pad < 0 or pad in tuple(cell.eos_ids) or shows_id(first.completions, pad):
        return None
    last = getattr(cell.spec, "STEPS", 0) or max((cell.trained or cell.tensors or {1: None}).keys())
    at = next((s for s in range(2, last + 1) if shows_id(_completions_at(cell, s), pad)), None)
    if at is None:
        return None
    later = next((s for s in steps(cell) if s.step == at), None)  # (its saved tensors, where it saved them)
    ref = later.tensors.get("ref_logps") if later is not None else None
    if later is not None and _rows_of(ref, len(later.completions)) and all("prompt_ids" in cell.records[r]
                                                                            for r, _ in later.rows):
        prompts = [cell.records[r]["prompt_ids"][i] for r, i in later.rows]
        score = _cached(_scorer(cell, prompts, later.completions))
        if _initial(ref, later.completions, score({}), pad, getattr(cell.spec, "DTYPE", "float32")):
            found = forward(ref, prompts, later.completions, score, cell.spec, pad, tuple(cell.eos_ids),
                            step=later.step, what="your reference model's log-probs (the initial weights')")
            if found is None:  # TRL's rule reproduces them where the pad id stands: no rule on it
                return None
            if found.exact:
                return dataclasses.replace(found, rule=f"{found.rule}; step 1's completions hold no pad id before "
                                           "their end, so step 1 could not show it", evidence={**found.evidence,
                                                                                          "read_from": "ref_logps"})
            # no rule reproduces them: a forward pass of its own, or a reference that is not the initial weights
            # (where every row holds the pad id, none checks it): nothing is claimed, the candidate goes on
    candidate = {"ATTENTION_HIDE_ID": pad}
    return Finding("forward", 1, "your loop's log-probs at step 1 are TRL's rule's", {}, True, same_as_spec=True,
                   unsettled=(f"no completion of step 1 holds the pad id ({pad}) before its end, so a forward rule on "
                              f"it could not show there (the first step whose completions do is step {at}, "
                              "and its weights are known only once the steps before it are reproduced): whether "
                              f"your loop {_said(candidate)} is tried first by the search, kept only where it "
                              "helps",),
                   evidence={"candidate": candidate, "candidate_step": at})


def _completions_at(cell, step: int) -> list:
    """The completions step `step` trains on, saved tensors or not: the rows your loop's selection names
    (cell.trained), else the round the step trains on (NUM_ITERATIONS steps a round); [] where the recording does
    not hold them."""
    records = cell.records
    picks = (cell.trained or {}).get(step)
    if picks is not None:
        return [records[r]["completion_ids"][i] for r, i in picks if r < len(records)]
    r = (step - 1) // max(1, getattr(cell.spec, "NUM_ITERATIONS", 1))
    return list(records[r]["completion_ids"]) if r < len(records) else []


def _cached(score):
    """`score`, each rule's pass made once."""
    seen: dict = {}

    def cached(settings: dict):
        key = tuple(sorted(settings.items()))
        if key not in seen:
            seen[key] = score(settings)
        return seen[key]

    return cached


def _initial(saved, completions, trl, pad: int, dtype: str) -> bool:
    """Whether log-probs `saved` are the initial weights' under TRL's rule (`trl`) in every row that holds no `pad`
    before its end (rows a rule on it cannot touch): True also where every row holds one (nothing refutes it), False
    where an untouched row differs (a reference that moved, or another model)."""
    tol = TOLERANCE.get(dtype, 1e-4)
    untouched = [(row, t, c) for row, t, c in zip(saved, trl, completions) if not shows_id([c], pad)]
    return all(abs(float(a) - b) <= tol for row, t, c in untouched for a, b in zip(row[:len(c)], t))


def pass_rules(s, eos_ids) -> dict:
    """The built-in loop's forward switches of spec `s` as completion_forward takes them (scratch_grpo/train.py)."""
    return {"masked_eos": tuple(eos_ids) if s.EOS_ATTENTION == "mask" else (), "positions": s.POSITIONS,
            "hidden": (s.ATTENTION_HIDE_ID,) if s.ATTENTION_HIDE_ID >= 0 else (),
            "dropped": s.MASK_TOKEN_ID if s.MASK_TOKEN_ID >= 0 and s.MASK_TOKEN_DROP else None,
            "logits_dtype": s.LOGITS_DTYPE}


def _scorer(cell, prompts, completions):
    """score(settings) -> the completions' log-probs (one list per row) at the initial weights, under the built-in
    loop's forward pass with `settings` on the cell's spec, in batches of its micro-batch size."""
    import torch

    from harness.experiment.models import autocast_for, checkpoint_dir, load_model
    from harness.rollouts.generate import pad_left, pad_right
    from scratch_grpo.train import completion_forward

    spec, models = cell.spec, {}

    def score(settings: dict) -> list[list[float]]:
        settings = dict(settings)
        alone = settings.pop("_rows", False)  # each row scored alone, unpadded
        s = dataclasses.replace(spec, **settings)
        held = getattr(s, "MASTER_WEIGHTS", "float32")
        if held not in models:  # loaded once per dtype its weights are held in, at the first score
            models[held] = load_model(checkpoint_dir(spec), held, "cpu").eval()
        rules = pass_rules(s, cell.eos_ids)
        size = 1 if alone else max(1, len(completions) // max(1, spec.GRAD_ACCUM))
        out = []
        for at in range(0, len(completions), size):
            p_ids, p_mask = pad_left(prompts[at:at + size], cell.pad_id)
            c_ids, c_mask = pad_right(completions[at:at + size], cell.pad_id)
            with torch.no_grad(), autocast_for("cpu", s.DTYPE):
                lp = completion_forward(models[held], p_ids, p_mask, c_ids, c_mask,
                                        1.0 if s.LOGP_ON_RAW_LOGITS else s.TEMPERATURE, **rules)[0]
            out += [row[:len(c)] for row, c in zip(lp.tolist(), completions[at:at + size])]
        return out

    return score
