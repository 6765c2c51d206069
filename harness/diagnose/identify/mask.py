"""The mask stage: which tokens your loss counts, read as a rule on token features (id, eos, position, truncation)
against TRL's completion mask."""

from __future__ import annotations

from harness.diagnose.identify.finding import Finding
from harness.diagnose.identify.steps import _rows_of, steps


def mask(mask_rows, completion_ids, eos_ids, spec=None, pad_id: int | None = None, max_tokens: int | None = None,
         step=None, advantages=None) -> Finding:
    """The tokens your loss counts, against TRL's (every completion token through the first eos, the eos included;
    none after), read as a rule on token features: whole completions out (the truncated ones: TRL's
    mask_truncated_completions; those whose advantage, one per row in `advantages`, is exactly 0), the eos at the end
    out, every occurrence of some token ids out (a mask built from `ids != pad_id`, where a generated token equal to
    the pad id drops out too), every position from some index on out (a length limit), or the padding after short
    completions counted."""
    from scratch_grpo.core import truncated_rows

    eos = set(eos_ids)
    lengths = [len(c) for c in completion_ids]
    # what counts as truncated: TRL's rule (no eos nor pad id at the end) or a loop's `eos in ids` (TRUNCATED_IF)
    rule = getattr(spec, "TRUNCATED_IF", "no_eos_or_pad") if spec else "no_eos_or_pad"
    cut_by = {r: truncated_rows(completion_ids, eos, pad_id, r) for r in (rule, *{"no_eos_or_pad", "no_eos"} - {rule})}
    truncated = cut_by[rule]
    mask_trunc = bool(getattr(spec, "MASK_TRUNCATED", False)) if spec else False
    trl = [[0 if (mask_trunc and tr) else 1] * n for n, tr in zip(lengths, truncated)]
    mine = [[1 if float(x) > 0.5 else 0 for x in row] for row in mask_rows]
    if len(mine) != len(completion_ids):
        return Finding("mask", step, f"cannot be read: {len(mine)} mask rows for {len(completion_ids)} completions",
                       {}, False, readable=False)
    out = [(i, t) for i, (m, ref) in enumerate(zip(mine, trl)) for t in range(len(ref))
           if ref[t] == 1 and (t >= len(m) or m[t] == 0)]
    extra_in = [(i, t) for i, (m, ref) in enumerate(zip(mine, trl)) for t in range(len(ref))
                if ref[t] == 0 and t < len(m) and m[t] == 1]
    padding = [(i, t) for i, m in enumerate(mine) for t in range(lengths[i], len(m)) if m[t] == 1]
    counted = sum(map(sum, (r[:n] for r, n in zip(mine, lengths))))
    ev = {"out": len(out), "padding_counted": len(padding), "tokens": counted}
    left, token_unsettled, no_switch = set(out), (), False
    # whole completions out: the truncated ones (TRL's mask_truncated_completions), those whose advantage is 0
    whole = {i for i in range(len(mine)) if lengths[i] and all((i, t) in left for t in range(lengths[i]))}
    rules, settings, truncated, rows_out, shows_zero = _whole_rows(whole, cut_by, rule, lengths, advantages, mine, spec)
    left -= {(i, t) for i in rows_out for t in range(lengths[i])}
    if extra_in and mask_trunc and {i for i, _ in extra_in} == {i for i, tr in enumerate(truncated) if tr}:
        rules.append("keeps truncated completions in the loss")
        settings["MASK_TRUNCATED"] = False
        extra_in = []
    if left:  # a rule on the ids or positions of what is left out
        token = _token_rule(left, completion_ids, eos, lengths, rows_out, pad_id)
        if token:
            said, found, token_no_switch, token_unsettled = token
            no_switch = no_switch or token_no_switch
            rules.append(said)
            settings.update(found)
            left = set()
    exact = not left
    if left:
        i, t = sorted(left)[0]
        rules.append(f"leaves {len(left)} other token(s) out that no rule on their id, position or eos explains "
                     f"(the first: completion {i}, token {t}, id {completion_ids[i][t]})")
        no_switch = True
    if padding:
        rules.append(f"counts {len(padding)} padding position(s) after short completions in the loss")
        if settings.get("COMPLETION_MASK") == "no_eos":  # two mask rules at once: no one switch does both
            no_switch = True
            settings.pop("COMPLETION_MASK")
        else:
            settings["COMPLETION_MASK"] = "all"
    if extra_in:
        rules.append(f"counts {len(extra_in)} token(s) TRL leaves out")
        no_switch = True
    # what this step can show: truncation only where a completion is truncated, the eos rule only where one ends
    # with an eos, the padding only where lengths differ
    shows = (("MASK_TRUNCATED",) if any(truncated) else ()) + (
        ("COMPLETION_MASK",) if not all(truncated) and len(set(lengths)) > 1 else ()) + (
        ("TRUNCATED_IF",) if settings.get("MASK_TRUNCATED", mask_trunc) and len(set(map(tuple, cut_by.values()))) > 1
        else ()) + shows_zero  # (the rules of what is truncated part only where a completion ends in the pad id)
    if not rules:
        return Finding("mask", step, "your loop counts every completion token through the eos, as TRL does", {},
                       True, same_as_spec=True, evidence=ev, settles=shows)
    spec_mask = getattr(spec, "COMPLETION_MASK", "eos") if spec else "eos"
    settings = {k: v for k, v in settings.items() if not (k == "COMPLETION_MASK" and v == spec_mask)
                and not (k == "MASK_TRUNCATED" and v == mask_trunc)
                and not (k == "MASK_TOKEN_ID" and v == (getattr(spec, "MASK_TOKEN_ID", -1) if spec else -1))}
    return Finding("mask", step, "your loop " + "; ".join(rules), settings, exact, no_switch=no_switch, evidence=ev,
                   unsettled=token_unsettled,
                   settles=tuple(k for k in ("COMPLETION_MASK", "MASK_TRUNCATED", "MASK_TOKEN_ID", "TRUNCATED_IF",
                                             "DROP_ZERO_ADV") if k in settings or k in shows) if exact and not no_switch
                   else ())


def _whole_rows(whole: set, cut_by: dict, rule: str, lengths, advantages, mine, spec) -> tuple:
    """The completions entirely out of your loss (`whole`) as whole-row rules: the truncated ones, by the spec's rule
    of what is truncated (`rule`) or the other (TRUNCATED_IF; `cut_by`: each rule's truncated rows), and, where
    every completion whose advantage is exactly 0 (one per row in `advantages`) is out, those (DROP_ZERO_ADV; a
    truncated one with advantage 0 is out either way); one of them counting a token (`mine`: the mask as read) shows
    the rule off. (words, settings against the spec, the spec's truncated rows as read, the rows out, the fields the
    step shows of the zero rule)."""
    zero = {i for i, a in enumerate(advantages if advantages is not None else ()) if i < len(lengths) and lengths[i]
            and float(a) == 0.0}
    counted = any(mine[i][t] == 1 for i in zero for t in range(min(lengths[i], len(mine[i]))))
    zero = zero if zero <= whole else set()
    rest = whole - zero
    by = next((r for r, cut in cut_by.items() if rest and rest == {i for i, tr in enumerate(cut) if tr and lengths[i]}
               - zero), None)
    rules, settings, truncated, out = [], {}, cut_by[rule], set()
    if by is not None:
        truncated, out = cut_by[by], {i for i, tr in enumerate(cut_by[by]) if tr and lengths[i]}
        pad_end = " (one ending in the pad id too: it checks for an eos)" if by == "no_eos" and by != rule else ""
        rules.append(f"leaves the {len(out)} truncated completion(s) (no eos){pad_end} out of the loss entirely")
        settings.update({"MASK_TRUNCATED": True, **({"TRUNCATED_IF": by} if by != rule else {})})
    drops = bool(getattr(spec, "DROP_ZERO_ADV", False)) if spec else False
    if zero - out:
        rules.append(f"leaves the {len(zero - out)} completion(s) whose advantage is exactly 0 out of the loss entirely")
        settings.update({} if drops else {"DROP_ZERO_ADV": True})
    elif counted and drops:
        settings["DROP_ZERO_ADV"] = False
    return rules, settings, truncated, out | zero, ("DROP_ZERO_ADV",) if zero - out or counted else ()


def _token_rule(left: set, completion_ids, eos: set, lengths, rows_out: set, pad_id) -> tuple | None:
    """The rule on token features that leaves out exactly the tokens `left` ((completion, position) pairs TRL
    counts, the completions `rows_out` aside: out by a whole-row rule): each completion's eos, every occurrence of
    some ids, or every position from some index on. (words, settings, no_switch, unsettled), or None where no such
    rule fits."""
    ids = {completion_ids[i][t] for i, t in left}
    every = {(i, t) for i, c in enumerate(completion_ids) for t, tok in enumerate(c) if tok in ids and i not in rows_out}
    last_eos = {(i, lengths[i] - 1) for i in range(len(lengths)) if lengths[i] and i not in rows_out
                and completion_ids[i][-1] in eos}
    if left == last_eos or (ids <= eos and left == every):
        return "leaves each completion's eos token out of the loss (TRL counts it)", {"COMPLETION_MASK": "no_eos"}, \
            False, ()
    if left == every:
        named = ", ".join(str(x) for x in sorted(ids)[:6])
        pad = f" (the pad token's id, {pad_id}: a mask built from `ids != pad_id`)" if pad_id in ids else ""
        said = f"leaves every token with id {named}{pad} out of the loss, wherever it stands ({len(left)} token(s) here)"
        if len(ids) == 1:  # one id: MASK_TOKEN_ID (whether it also leaves the sequence is the search's to tell)
            return said, {"MASK_TOKEN_ID": int(next(iter(ids)))}, False, (
                "whether that token also leaves the sequence the model sees (MASK_TOKEN_DROP, as a loop that packs its "
                "sequences without pad tokens does): the mask cannot tell, the log-probs after it can: the search "
                "decides",)
        return said, {}, True, ()
    starts = {}
    for i, t in left:
        starts.setdefault(i, []).append(t)
    cut = {min(ts) for ts in starts.values()}
    if len(cut) == 1 and all(sorted(ts) == list(range(min(ts), lengths[i])) for i, ts in starts.items()) and \
            all(lengths[i] <= min(cut) for i in range(len(lengths)) if i not in starts):
        return f"counts only the first {min(cut)} tokens of each completion", {}, True, ()
    return None


def read(cell, earlier: dict) -> list[Finding]:
    """Your loss mask at every step that saved one row per completion, each completion as far as your forward pass
    takes it (the forward stage's END_AT_ID: the tokens after that id are in none of your sequences)."""
    spec = cell.spec
    end = next((f.settings["END_AT_ID"] for f in earlier.get("forward", ()) if f.exact and "END_AT_ID" in f.settings),
               -1)
    return [mask(s.tensors["mask"], _ended(s.completions, end), cell.eos_ids, spec, cell.pad_id, spec.MAX_TOKENS,
                 step=s.step, advantages=_per_row(s.tensors.get("advantages"), len(s.completions)))
            for s in steps(cell) if "mask" in s.tensors and _rows_of(s.tensors["mask"], len(s.completions))]


def _per_row(values, n: int) -> list | None:
    """One number per completion (the advantages as steps.py gives them), or None."""
    return values if isinstance(values, list) and len(values) == n and all(isinstance(v, (int, float)) for v in values) \
        else None


def _ended(completions, end: int):
    """Each completion through its first token of id `end` (-1: as it is)."""
    return [c[:c.index(end) + 1] if end in c else c for c in completions] if end >= 0 else completions
