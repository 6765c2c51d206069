"""The verdict: verdict.json (the document, written whole after every cell), whether an earlier run's entry is
whole enough for --resume to keep, and its words: a cell's line, the summary table, and the headline (the report's
first sentence and what to change). verdict.json's keys are read by the report, --resume and the golden tests."""

from __future__ import annotations

import json
import math
import textwrap
import time
from pathlib import Path

from harness.diagnose.fields import toml_value


# ---------------------------------------------------------------------------------------------
# verdict.json
# ---------------------------------------------------------------------------------------------
def verdict_doc(base, matrix, mode, verdicts, t_start, processes, only=None, total: int | None = None) -> dict:
    """verdict.json. A run cut short (killed, interrupted) has `complete: false` and is never `ok`: the cells it
    finished may all be as expected, but the run as a whole has not said so."""
    from harness.runlog.log import library_versions

    complete = total is None or len(verdicts) >= total
    return {"ok": complete and all(v["ok"] for v in verdicts), "complete": complete,
            "cells_done": len(verdicts), "cells_total": total if total is not None else len(verdicts),
            "spec": base.NAME, "matrix": matrix, "mode": mode,
            "base_spec": base.to_dict(), "processes": processes, "cells_selected": list(only or []), "cells": verdicts,
            "elapsed_s": round(time.perf_counter() - t_start, 1), "versions": library_versions(), "ran": _ran(base)}


def _ran(base) -> dict | None:
    """What the cells ran on (dtype, autocast, device, model and its weights hash): models.run_label."""
    from harness.experiment.models import ModelSourceError, resolve_device, run_label
    from harness.runlog.log import device_description

    try:
        return run_label(base, device_description(resolve_device(base)))
    except ModelSourceError:  # DEVICE = "cuda" without a GPU: the cells say so themselves
        return None


def write_json(path: Path, doc: dict) -> None:
    """Atomically: a kill during the write leaves the previous verdict.json whole."""
    from harness.runlog.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(doc, indent=2, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


# ---------------------------------------------------------------------------------------------
# --resume: an earlier run's entry, whole enough to keep
# ---------------------------------------------------------------------------------------------
def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def finished_cell(c, cells: dict) -> bool:
    """Whether an entry of an earlier verdict.json is a finished cell of this matrix, whole enough to keep: the
    fields the verdict, the summary and the report read have their types (a damaged entry is run again)."""
    if not (isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"] in cells):
        return False
    fd, detail, metrics = c.get("first_divergence"), c.get("attribution_detail", []), c.get("metrics", {})
    return (c.get("verdict") in ("parity", "diverged") and isinstance(c.get("ok"), bool)
            and c.get("expected") == cells[c["name"]].expected and c.get("expected_cause") == cells[c["name"]].expected_cause
            and (fd is None or (isinstance(fd, dict) and _number(fd.get("step")) and isinstance(fd.get("metric"), str)))
            and isinstance(c.get("attribution", []), list) and all(isinstance(a, str) for a in c.get("attribution", []))
            and isinstance(detail, list) and all(_detail_ok(d) for d in detail)
            and isinstance(metrics, dict) and all(isinstance(m, dict) and all(v is None or _number(v) for v in m.values())
                                                  for m in metrics.values())
            and c.get("sides", list(cells[c["name"]].sides)) == list(cells[c["name"]].sides)
            and isinstance(c.get("notes", []), list) and isinstance(c.get("cannot_show", ""), str)
            and isinstance(c.get("untold", []), list) and all(isinstance(u, str) for u in c.get("untold", []))
            and isinstance(c.get("updates", {}), dict) and all(
                isinstance(u, dict) and _number(u.get("unchanged")) and _number(u.get("median_rel"))
                for u in c.get("updates", {}).values())
            and all(isinstance(c.get(k, {}), dict) for k in ("toggles", "only_in", "tolerance", "precision"))
            and _precision_ok(c.get("precision")))


def _precision_ok(p) -> bool:
    """The float32 pair's entry (precision.escalate), as the verdict and the report read it."""
    fd = (p or {}).get("first_divergence")
    return (p is None or (isinstance(p.get("words", ""), str) and isinstance(p.get("dtype", ""), str)
                          and (fd is None or (isinstance(fd, dict) and _number(fd.get("step"))
                                              and isinstance(fd.get("metric"), str)))
                          and isinstance(p.get("attribution_detail", []), list)
                          and all(_detail_ok(d) for d in p.get("attribution_detail", []))))


def _detail_ok(d) -> bool:
    fix, share = d.get("fix") if isinstance(d, dict) else None, d.get("share") if isinstance(d, dict) else None
    return (isinstance(d, dict) and isinstance(d.get("cause"), str) and isinstance(d.get("status"), str)
            and (fix is None or (isinstance(fix, dict) and isinstance(fix.get("sentence", ""), (str, type(None)))))
            and (share is None or (isinstance(share, dict) and all(_number(v) for v in share.values())))
            and isinstance(d.get("fields", []), list) and isinstance(d.get("evidence", ""), (str, type(None)))
            and all(_number(d.get(k, 0)) for k in ("reruns", "reused")))



# ---------------------------------------------------------------------------------------------
# the words: a cell's line, the table, the headline
# ---------------------------------------------------------------------------------------------
def _cause(v: dict) -> str | None:
    """The cell's causes and their status, e.g. 'loss_type (confirmed)' or 'batch+loss_type (confirmed)'."""
    detail = v.get("attribution_detail") or []
    if not detail:
        return None
    confirmed = [d["cause"] for d in detail if d.get("status") == "confirmed"]
    if len(confirmed) > 1:
        return f"{'+'.join(confirmed)} (confirmed)"
    d = detail[0]
    return f"{d['cause']} ({d['status']})"


def share_words(entry: dict) -> str | None:
    """'67% of the weight distance' (lockstep), else the share of the loss gap; None without shares."""
    share = entry.get("share") or {}
    for metric, words in (("weights", "the weight distance"), ("loss", "the loss gap")):
        if metric in share:
            return f"{100 * share[metric]:.0f}% of {words}"
    return None


def _shown_in_float32(v: dict) -> bool:
    """A cell whose difference hid in bf16 and showed in the float32 pair (precision.escalate)."""
    return bool((v.get("precision") or {}).get("first_divergence"))


def _no_effect_label(v: dict) -> str:
    return "shows in float32 only" if _shown_in_float32(v) else "cannot show here"


def cell_line(v: dict) -> str:
    mark = "ok " if v["ok"] else "BAD"
    if v.get("cannot_show") and (v.get("precision") or {}).get("loop"):  # your loop: parity, and what float32 showed
        return f"{mark} parity in {v['precision'].get('dtype')}; {v['cannot_show']}"
    if v.get("cannot_show"):
        return f"n/a {_no_effect_label(v)}: {v['cannot_show']}"
    if v["verdict"] in ("failed", "error"):
        return f"{mark} {v['verdict']}: {v['error']}"
    fd = v.get("first_divergence")
    where = f" at step {fd['step']} ({fd['metric']})" if fd else ""
    cause = f"; cause: {_cause(v)}" if _cause(v) else ""
    return f"{mark} {v['verdict']}{where}{cause}"


def format_verdict(doc: dict) -> str:
    from harness.diagnose.answer import answer_lines, training_divergence, your_loop_answer

    selected = f" (cells {', '.join(doc['cells_selected'])})" if doc.get("cells_selected") else ""
    state = "OK" if doc["ok"] else "NOT OK" if doc.get("complete", True) else "INCOMPLETE"
    lines = [f"parity {state}: {sum(v['ok'] for v in doc['cells'])}/{len(doc['cells'])} "
             f"cells as expected ({doc['mode']}, matrix {doc['matrix']}{selected}, {doc['elapsed_s']:.0f} s)", ""]
    if (doc.get("ran") or {}).get("text"):
        lines.insert(1, f"ran: {doc['ran']['text']}")
    answer = your_loop_answer(doc)
    if answer:  # your loop: the answer first, in 15 lines at most; the table and the evidence after it
        lines += [*answer_lines(answer), ""]
    lines.append(f"{'cell':30s} {'expected':9s} {'got':9s} {'first divergence':28s} cause")
    for v in doc["cells"]:
        fd, parted = v.get("first_divergence"), training_divergence(v)  # the headline's metric
        fd_s = f"step {parted['step']} {parted['metric']}" if parted else "statistics only" if fd else "-"
        cause = v["error"][:60] if v["verdict"] in ("failed", "error") else \
            f"{_no_effect_label(v)} (see below)" if v.get("cannot_show") else (_cause(v) or "-")
        lines.append(f"{v['name']:30s} {v['expected']:9s} {v['verdict']:9s} {fd_s:28s} {cause}"
                     + ("" if v["ok"] else "   <- not as expected"))
    head = headline(doc)
    lines += ["", textwrap.fill(head["sentence"], 110)]
    lines += [textwrap.fill(item, 110, initial_indent="  - ", subsequent_indent="    ") for item in head["items"]]
    return "\n".join(lines)


def _cause_of_no_effect(cell: dict) -> str:
    """The differences a cell with no measured effect lists, in words: "Adam beta2 (TRL 0.9, ...)" where the
    attribution has a fix sentence, else the check's name."""
    detail = (cell.get("precision") or {}).get("attribution_detail") or cell.get("attribution_detail") or []
    named = [(d.get("fix") or {}).get("sentence") or d["cause"] for d in detail
             if d.get("cause") not in (None, "unexplained")]
    return "; ".join(dict.fromkeys(named)) or cell.get("expected_cause") or cell["name"]


def _fix_sentences(cell: dict) -> list[str]:
    """The cell's causes in words, with what to change (from the attribution's `fix`): every confirmed cause with
    its share of the gap, else the leading suspicion."""
    detail = cell.get("attribution_detail") or []
    confirmed = [d for d in detail if d.get("status") == "confirmed"]
    leads = confirmed or [d for d in detail if d.get("status") == "suspected"][:1]
    out = []
    for lead in leads:
        if lead.get("cause") == "unexplained":
            out.append("no setting explains it: " + (lead.get("evidence") or "a bug on one side, or nondeterminism"))
            continue
        text = (lead.get("fix") or {}).get("sentence") or \
            f"{lead['cause']} differs ({', '.join(lead.get('fields', []))})"
        share = share_words(lead)
        if share:
            text = f"{lead['cause']} ({share}): {text}"
        out.append(text if lead["status"] == "confirmed" else f"suspected, not confirmed: {text}")
    return out


def _capital(text: str) -> str:
    """A sentence's first letter up, unless it starts with a cause's name (batch, loss_type, ...)."""
    head = text.split(" ", 1)[0]
    return text if "_" in head or head in ("batch",) or head.startswith("other:") else text[:1].upper() + text[1:]


def _fix_sentence(cell: dict) -> str | None:
    found = _fix_sentences(cell)
    return "; ".join(found) if found else None


def _your_loop_found(c: dict) -> tuple[str, list[str]]:
    """What the explanation found for your loop (its first attribution entry): the words that end the headline's
    sentence, and one item per cause, difference and note."""
    lead = c["attribution_detail"][0]
    cost = lead.get("cost") or {}
    said = (" Re-running the built-in loop, set up as TRL, on the same rollouts with candidate settings "
            + ("found settings that reproduce your loop within tolerance" if lead["status"] == "confirmed"
               else "found no full match")
            + f" ({cost.get('runs', 0)} runs, {cost.get('steps', 0)} steps, {cost.get('seconds', 0):g} s):")
    items = [_capital(why) + "." for why in _fix_sentences(c)]
    for d in lead.get("differences") or []:
        how = ", ".join(f"{k} = {toml_value(v)}" for k, v in d["trl"].items())
        items.append(f"{d['field']} = {toml_value(d['value'])}: {d['words']}"
                     + (f" ([trl] {how})" if d["trl"] else " (TRL has no setting for it)")
                     + (", read from what your loop saved" if d.get("identified") else ", read from your log"
                        if d.get("read_from_log") else "") + ".")
    items += [_capital(n) + "." for n in lead.get("notes", [])]
    return said, items


def _parting(c: dict) -> str:
    """Where a diverged cell's runs part, said first: 'The two loops part at step N, first on M.' Against your loop M
    is the first metric training computes to leave tolerance (answer.training_divergence, as the cell table names
    it), not compare's first_divergence, which may be a statistic (kl, reward_std) that the same verdict calls
    defined differently in your loop while training parts steps later; where only statistics part, said so."""
    from harness.diagnose.answer import training_divergence
    from harness.diagnose.compare import PRIORITY, is_derived

    fd, parted = c["first_divergence"], training_divergence(c)
    if parted:
        return (f"The two loops part at step {parted['step']}, first on {parted['metric']}"
                + (" (the final weights)." if parted["metric"] == "param_rel_l2" else "."))
    rank = {m: i for i, m in enumerate(PRIORITY)}
    trains = [m for m in c.get("metrics") or {} if not is_derived(m)]
    said = ", ".join(sorted(trains, key=lambda m: (rank.get(m, len(rank)), m))) or "none logged by both"
    return (f"Only statistics part, first {fd['metric']} at step {fd['step']}: what training computes ({said}) agrees "
            "at every compared step.")


def _untold_items(cell: dict) -> list[str]:
    """What your loop's parity cannot show (matrix: the cell's `untold`, e.g. clip bounds at a ratio of 1), one item
    each."""
    return [f"{_capital(u)}." for u in cell.get("untold") or ()]


def headline(doc: dict) -> dict:
    """The report's first words: one plain sentence, and what to change, one line per cause."""
    cells = doc.get("cells", [])
    items: list[str] = []
    if len(cells) == 1:
        c = cells[0]
        fd = c.get("first_divergence")
        if c.get("verdict") in ("failed", "error"):
            return {"sentence": f"The run could not finish: {c.get('error')}", "items": []}
        if not fd:
            within = ("within the seed-to-seed noise (free mode)" if doc.get("mode") == "free"
                      else "on every step within tolerance (lockstep mode)")
            loop = c.get("precision") or {}
            if not loop.get("loop"):
                loop = {}
            if c.get("cannot_show") and loop.get("attribution_detail"):  # your loop, parted in float32 only
                said, found = _your_loop_found({**c, "attribution_detail": loop["attribution_detail"]})
                items += [f"{_capital(c['cannot_show'])}.", f"In float32,{said[:2].lower()}{said[2:-1]}.",
                          *[i for i in found if not i.startswith("At step ")]]  # the first item says where
            elif c.get("cannot_show"):  # what the table's "see below" points at
                items.append(f"{_capital(_cause_of_no_effect(c))}. {_capital(c['cannot_show'])}.")
            elif loop.get("words"):  # your loop's float32 check: agrees too, cannot tell, or failed
                items.append(f"{_capital(loop['words'])}.")
            if c.get("cannot_show") and _shown_in_float32(c):
                within = (f"on every step within tolerance in {c['precision'].get('dtype')} (lockstep mode); the same "
                          "pair in float32 parts")
            if c.get("defined_differently"):
                from harness.diagnose.explain_words import defined_differently_words

                items.append("Only statistics part: " + defined_differently_words(c["defined_differently"], c) + ".")
            return {"sentence": f"The two loops agree {within}.", "items": items + _untold_items(c)}
        sentence = _parting(c)
        detail = c.get("attribution_detail") or []
        confirmed = [d for d in detail if d.get("status") == "confirmed"]
        reruns = max((d.get("reruns", 0) + d.get("reused", 0) for d in detail), default=0)
        if "yours" in c.get("sides", ()) and detail and detail[0].get("differences") is not None:
            said, found = _your_loop_found(c)
            return {"sentence": sentence + said, "items": items + found}
        if confirmed and "yours" in c.get("sides", ()):
            sentence += " Re-running TRL on the same rollouts with other settings found what your loop does:"
        elif len(confirmed) > 1:
            sentence += (f" {len(confirmed)} differences together explain it: aligned, the runs agree, and each is "
                         f"needed ({reruns} re-runs). Each, with its share of the gap at the last step:")
        elif confirmed:
            sentence += " The cause, confirmed by a re-run with it aligned:"
        items += [_capital(why) + "." for why in _fix_sentences(c)]
        return {"sentence": sentence, "items": items}
    surprises = [c for c in cells if not c.get("ok")]
    if not surprises and not any(c.get("expected") == "diverged" for c in cells):
        return {"sentence": f"Every cell is at parity, as expected ({len(cells)} cells, {doc.get('mode')} mode).",
                "items": []}
    mute = [c for c in cells if c.get("cannot_show")]
    if not surprises:
        n_par = sum(c.get("expected") == "parity" for c in cells)
        sentence = (f"The two loops agree when set up alike ({n_par} cells at parity); each toggled check made them "
                    "part, and a re-run with only it aligned confirmed the cause. What each toggle means, and the "
                    "setting that matches TRL to the scratch loop:")
        if mute:
            sentence = (f"The two loops agree when set up alike ({n_par} cells at parity); {len(mute)} toggle(s) cannot "
                        "show at this configuration (why, below); each other toggled check made them part, and a "
                        "re-run with only it aligned confirmed the cause:")
            items += [f"{c['name']}: {_no_effect_label(c)}: {c['cannot_show']}." for c in mute]
        for c in cells:
            if c.get("first_divergence"):
                why = _fix_sentence(c)
                if why:
                    items.append(f"{c['name']}: {why}.")
        return {"sentence": sentence, "items": list(dict.fromkeys(items))}
    sentence = f"{len(surprises)} of {len(cells)} cells are not as expected:"
    for c in surprises:
        if c.get("verdict") in ("failed", "error"):
            items.append(f"{c['name']}: {c['verdict']}: {c.get('error')}")
            continue
        fd = c.get("first_divergence")
        where = f" at step {fd['step']} on {fd['metric']}" if fd else ""
        why = _fix_sentence(c)
        items.append(f"{c['name']}: expected {c.get('expected')}, got {c.get('verdict')}{where}"
                     + (f"; {why}." if why else "."))
    return {"sentence": sentence, "items": items}
