"""The answer on your loop, said first (issue 49): one sentence (TRL with N settings changed, plus M things TRL
cannot set; confirmed or suspected over the run's steps), the runnable [trl] table, what TRL cannot set with the
built-in loop's switch, and what this run could not tell, one line each. The summary (`verdict.format_verdict`)
and the report (reports/render.py) both print it first, from `your_loop_answer`; everything else follows.

Also what both name as where the two loops part (`training_divergence`): against your loop the first metric that
training computes to leave tolerance, never a statistic the verdict calls defined differently.
"""

from __future__ import annotations

import re

from harness.diagnose.fields import toml_value, words

UNTOLD = "this run could not tell: "
# a run of more than 4 numbers in a sentence ("(0, 1.002e-06, 9.116e-07, ...)"): said by its count and its ends
_NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
_NUMBERS = re.compile(rf"\[?{_NUMBER}(?:, {_NUMBER}){{4,}}(?:, \.\.\.)?\]?")


def training_divergence(cell: dict) -> dict | None:
    """Where a cell's two runs part, as its headline says it: against your loop the first metric training computes
    to leave tolerance (loss, grad_norm, learning_rate, the final weights: not `is_derived`, nor a loss the
    confirmed explanation found logged otherwise from that step on), ties broken by the comparator's priority; None
    where only statistics part. The built-in sides define their statistics alike: their first divergence as it is."""
    from harness.diagnose.compare import PRIORITY, is_derived

    fd = cell.get("first_divergence")
    if not fd or "yours" not in cell.get("sides", ()):
        return fd
    rank = {m: i for i, m in enumerate(PRIORITY)}
    lead = (cell.get("attribution_detail") or [{}])[0]
    # a loss the confirmed explanation found logged otherwise from some step (its value alone parts from there): not
    # where training parts, from that step on
    since = (lead.get("loss_logged_otherwise") or {}).get("from_step")
    trains = [(v.get("first_outside"), rank.get(m, len(rank)), m) for m, v in (cell.get("metrics") or {}).items()
              if not is_derived(m) and v.get("first_outside") is not None
              and not (m == "loss" and since is not None and v["first_outside"] >= since)]
    if not trains:
        return None
    step, _rank, metric = min(trains)
    return {"step": step, "metric": metric}


def short_numbers(text: str, what: str = "values") -> str:
    """`text` with each run of more than 4 numbers said as '12 values, 3.1e-07 to 3.5e-08' (its count, its first
    and its last), never as the raw list."""
    def said(m: re.Match) -> str:
        numbers = re.findall(_NUMBER, m.group(0))
        more = "+" if m.group(0).rstrip("]").endswith("...") else ""
        return f"{len(numbers)}{more} {what}, {numbers[0]} to {numbers[-1]}"
    return _NUMBERS.sub(said, str(text))


def short_value(key: str, value) -> str:
    """A switch's value as the answer shows it: a list of more than 4 numbers by its count and ends, a file by its
    name (the full value is in your_loop_in_trl.toml), anything else as TOML writes it."""
    if isinstance(value, list) and len(value) > 4 and all(isinstance(v, (int, float)) for v in value):
        what = "rates" if key == "LR_STEPS" else "values"
        return f"{len(value)} {what}, {value[0]:.3g} to {value[-1]:.3g}"
    if isinstance(value, str) and "/" in value:
        return toml_value(value.rsplit("/", 1)[-1])
    return toml_value(value)


def _untold(lead: dict) -> list[str]:
    """What this run could not tell, one line each, from the explanation's notes: each note that says so, its stage
    first ('Optimizer: ...'), the look-alike settings shortened to the setting and what it stands for."""
    from harness.diagnose.look_alikes import UNTOLD_TAIL

    out = []
    for note in lead.get("notes") or []:
        stage, sep, said = note.partition(UNTOLD)
        if not sep and "cannot tell" not in note:
            continue
        alike = sep and UNTOLD_TAIL in said  # a look-alike setting: the setting, and that it does as well
        text = said.split(UNTOLD_TAIL)[0].removeprefix("with ") + " does as well" if alike else said if sep else note
        stage = stage.rstrip(": ") if sep else ""
        line = short_numbers(f"{stage}: {text}" if stage else text)
        named = alike or "_" in line.split(" ", 1)[0]  # a setting keeps its name as TRL spells it
        out.append(line if named else line[:1].upper() + line[1:])
    return list(dict.fromkeys(out))


def your_loop_answer(doc: dict) -> dict | None:
    """The answer for a run of your loop that the explanation searched (one cell, its first attribution entry with
    `differences`), else None: `sentence`, `status`, `trl` (the table's fields), `table` (the [trl] table as TOML),
    `cannot_set` ([{words, field, value}]: the built-in loop's switch) and `untold` (lines)."""
    cells = doc.get("cells") or []
    if len(cells) != 1 or "yours" not in cells[0].get("sides", ()):
        return None
    detail = cells[0].get("attribution_detail") or []
    if not detail or detail[0].get("differences") is None:
        return None
    lead = detail[0]
    fix = lead.get("fix") or {}
    trl, quirks = fix.get("trl") or {}, fix.get("scratch") or {}
    steps = (doc.get("base_spec") or {}).get("STEPS")
    n, m = len(trl), len(quirks)
    said = f"Your loop is TRL with {n} setting{'s' if n != 1 else ''} changed" if n else "Your loop is TRL as set up"
    if m:
        said += f", plus {m} thing{'s' if m != 1 else ''} TRL cannot set"
    precision = (lead.get("precision") or {}).get("dtype")
    over = f"over {steps} steps" if steps else "over the run"
    over += f" (checked in {precision})" if precision else ""
    if lead.get("status") == "confirmed":
        said += f"; confirmed {over}."
    else:
        said += f"; suspected, not confirmed {over}: {_still_parts(lead)}."
    table = "[trl]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in trl.items())
    cannot = [{"words": words(k, v).removeprefix("your loop "), "field": k, "value": short_value(k, v)}
              for k, v in quirks.items()]
    return {"sentence": said, "status": lead.get("status"), "trl": trl, "table": table, "cannot_set": cannot,
            "untold": _untold(lead), "written": lead.get("written")}


def _still_parts(lead: dict) -> str:
    """Why a suspected explanation is not confirmed, in a few words."""
    confirmed_by, parts = lead.get("confirmed_by"), lead.get("parts")
    if confirmed_by is None and parts:
        return f"the closest found still parts at step {parts['step']} on {', '.join(parts['metrics'])}"
    if confirmed_by is None:
        return "no setting found reproduces every step of your loop (the closest is the table below)"
    if not confirmed_by.get("scratch"):
        return "training agrees at every step, but the whole comparison still parts (evidence below)"
    return "the built-in loop agrees at every step, but TRL with this table still parts (a bug on one side?)"


def answer_lines(answer: dict) -> list[str]:
    """The answer as the summary prints it first: the sentence, the [trl] table, what TRL cannot set, and what the
    run could not tell (as many as fit in 15 lines in all, the rest counted)."""
    import textwrap

    lines = textwrap.wrap(answer["sentence"], 110)
    if answer["trl"]:
        lines += answer["table"].rstrip("\n").splitlines()
    if answer["cannot_set"]:
        lines.append("TRL cannot set (the built-in loop's switch):")
        lines += [f"  - {c['words']}: {c['field']} = {c['value']}" for c in answer["cannot_set"]]
    untold = answer["untold"]
    room = 15 - len(lines) - 1  # the lines left under the heading
    if untold and (len(untold) <= room or room >= 3):
        shown = untold if len(untold) <= room else untold[:room - 1]
        lines.append(f"This run could not tell ({len(untold)}):")
        lines += [textwrap.shorten(u, 106, placeholder=" ...", initial_indent="  - ") for u in shown]
        if len(shown) < len(untold):
            lines.append(f"  ({len(untold) - len(shown)} more, in full below)")
    elif untold:
        lines.append(f"This run could not tell {len(untold)} things (in full below).")
    return lines
