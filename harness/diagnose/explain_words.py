"""The explanation's words: what `explain` says of your loop, and the TRL table it writes.

- the sentences of an entry: `sentence` (your loop in TRL's terms), `suspected_words` and `confirmed_words` (the
  evidence of each status), `float32_notes`, `escalated_words` and `below_rounding_words` (the float32 re-check and
  why a search stopped), `defined_differently_words` and `loss_in_value_words` (what parts that is not training),
  `clip_alike_words` (clipping thresholds the run cannot tell apart);
- `found_how`: how each difference was found; `write_table`: your_loop_in_trl.toml, each line marked by it.
"""

from __future__ import annotations

from pathlib import Path

from harness.diagnose.fields import toml_value, words
from harness.diagnose.search import _same, _with
from harness.runlog.atomic import atomic_write_text


def sentence(trl: dict, quirks: dict, path: Path | None) -> str:
    """Your loop in TRL's terms: TRL with the table's fields (written to `path`), plus the quirks TRL has no setting
    for, each with the built-in loop's field that reproduces it."""
    parts = []
    if trl:
        parts.append(f"your loop is TRL with {', '.join(f'{k} = {toml_value(v)}' for k, v in trl.items())}"
                     + (f" (written to {path})" if path else ""))
    if quirks:
        said = "; ".join(words(k, v).removeprefix("your loop ") for k, v in quirks.items())
        scratch = ", ".join(f"{k} = {toml_value(v)}" for k, v in quirks.items())
        parts.append(("plus" if trl else "your loop is TRL except that it") + f" {said}: TRL has no setting for "
                     f"{'it' if len(quirks) == 1 else 'these'} (the built-in loop with {scratch} matches your loop)")
    return ", ".join(parts) if parts else "your loop is TRL as the spec sets it up"


def found_how(differences: list[dict]) -> dict:
    """How each difference was found, by spec field and by the TRL fields it moves: read from your tensors, read
    from your log, by the tensor diff, or by the search."""
    out = {}
    for d in differences:
        how = ("read from what your loop saved" if d.get("identified") else "read from your log" if d.get("read_from_log")
               else "by the tensor diff" if d.get("from_tensors") else "by the search")
        out[d["field"]] = how
        out.update({k: how for k in d.get("trl") or {}})
    return out


def write_table(path: Path, trl: dict, quirks: dict, cell: str, runs: int, status: str, how: dict | None = None) -> None:
    """The [trl] table (and the quirks as comments), each line marked by how it was found and whether the whole
    was confirmed (the built-in loop, and TRL where no quirk is left, with all of it reproduce your loop at every
    step) or is suspected (the closest the search came: each line is still what was found, the whole is not shown)."""
    what = ("does what your loop does" if not quirks else "does what your loop does but for the quirks below, which "
            "TRL cannot set") if status == "confirmed" else ("comes closest to your loop (suspected, not confirmed: "
                                                             "see the verdict)")
    mark = "confirmed" if status == "confirmed" else "suspected"
    lines = [f"# Your loop, in TRL's terms: TRL with these [trl] fields added to the spec's own [trl] table (a field it "
             f"sets already takes the value here) {what}",
             f"# on the same rollouts (cell {cell}, {runs} runs of the search).",
             "[trl]"]
    for k, v in trl.items():  # each with how it was found, on the line above it
        lines += [f"# {mark}, {(how or {}).get(k, 'by the search')}", f"{k} = {toml_value(v)}"]
    if quirks:
        lines += ["", "# What TRL has no setting for; the built-in loop reproduces it with these spec fields:"]
        lines += [f"# {k} = {toml_value(v)}    ({words(k, v)}; {mark}, {(how or {}).get(k, 'by the search')})"
                  for k, v in quirks.items()]
    atomic_write_text(path, "\n".join(lines) + "\n")


def loss_in_value_words(result: dict) -> str:
    """'your logged loss is defined otherwise in value (...), while grad_norm and the final weights agree ...'."""
    v = result["loss_in_value_only"]
    if v.get("why"):  # read from your tensors: what your logged loss is
        return (f"your logged loss is defined otherwise in value (outside tolerance from step {v['from_step']}): "
                f"{v['why']}, while {' and '.join(_TRAINS.get(m, m) for m in v['agrees'])} agree at every compared "
                "step")
    return (f"your logged loss is defined otherwise in value (outside tolerance from step {v['from_step']}), while "
            f"{' and '.join(_TRAINS.get(m, m) for m in v['agrees'])} agree at every compared step: a loss whose "
            "gradient agrees with TRL's within tolerance and whose value does not (-logp * A, say, where TRL's is "
            "-ratio * A with the ratio 1; or a mean over micro-batches logged in place of their sum)")


def clip_alike_words(found: float, alike: list[float], norms: list[float], steps: int) -> str:
    """Said when other gradient-clipping thresholds (`alike`, each run over every step) reproduce your loop as well
    as the one the table names: the run cannot tell them apart. With your loop's logged (pre-clip) gradient norms,
    how many steps each clips: a threshold below a step's norm scales that step's gradient, which Adam's
    normalisation all but cancels."""
    values = sorted({found, *alike})
    named = ", ".join(f"{v:g}" for v in values[:-1]) + f" and {values[-1]:g}"
    text = f"max_grad_norm: {named} each reproduce your loop over all {steps} steps, so the run cannot tell which it has"
    if norms:
        clips = ", ".join(f"{v:g}: {sum(n > v for n in norms) if v > 0 else 0}" for v in values)
        text += (f" (steps each clips, of the {len(norms)} your loop logged: {clips}; Adam all but cancels the scale "
                 "of a clipped gradient)")
    return text + f"; the table says {found:g}"


def escalated_words(where: dict, dtype: str) -> str:
    if where.get("checked"):
        said = (f"in {dtype} the explanation agreed at every step, and was checked in float32 on the same rollouts "
                "(your loop and the built-in loop again), where rounding hides less")
    else:
        said = (f"in {dtype} the search's best agreed through step {where['agree']} and what was left from step "
                f"{where['at_step']} was below its rounding, so your loop and the search were re-run in float32 on "
                "the same rollouts")
    if where.get("loop_ignores_dtype"):
        said += (" (your loop's float32 run logged exactly what its bf16 run did, step for step: does it read DTYPE "
                 "from PARITY_SPEC?)")
    return said


def below_rounding_words(where: dict, dtype: str) -> str:
    """Why the search stopped where only changes below the run's rounding did better."""
    said = " or ".join(_with(c, "").strip() for c in where["changes"])
    return (f"from step {where['at_step']} the changes that bring the two back inside tolerance ({said}) move no "
            f"metric beyond the bound from the current set: in {dtype} what is left cannot be told from rounding "
            f"noise (run the cell with DTYPE = \"float32\" to tell it apart)")


_HOW_TRL_LOGS = {"kl": "a mean over each micro-batch's completion tokens, micro-batches cut from the shuffled batch, "
                       "then over micro-batches", "entropy": "as kl: per micro-batch of the shuffled batch, then over them",
                 "clip_ratio/": "per micro-batch of the shuffled batch, then over them",
                 "reward": "the batch mean of the weighted sum of the reward functions",
                 "completions/": "token counts through the first eos"}


_TRAINS = {"param_rel_l2": "the final weights"}  # the training metrics' names in a sentence


def defined_differently_words(metrics: list[str], comparison: dict) -> str:
    """'kl is defined differently in your loop (TRL: ...); training agrees (...)'."""
    hows = []
    for m in metrics:
        how = next((v for k, v in _HOW_TRL_LOGS.items() if m == k or (k.endswith("/") and m.startswith(k))
                    or m.startswith(k + "_")), None)
        hows.append(f"{m} (TRL's: {how})" if how else m)
    trains = [m for m in ("loss", "grad_norm", "param_rel_l2") if m in comparison.get("metrics", {})
              and not (m == "loss" and comparison.get("loss_in_value_only"))]
    return (", ".join(hows) + (" is" if len(metrics) == 1 else " are") + " defined differently in your loop: "
            f"training agrees ({', '.join(_TRAINS.get(m, m) for m in trains)} within tolerance at every step)")


def float32_notes(where: dict, changes: dict, dtype: str) -> list[str]:
    """The notes of a float32 re-check (`where`: the float32 search's `escalated_from`; `changes`: what it kept;
    `dtype`: the cell's): how it went, what float32 did without, and what it showed that `dtype`'s rounding hid."""
    notes = [escalated_words(where, dtype)]
    was = where["found"]
    only32 = {k: v for k, v in changes.items() if k not in was or not _same(was[k], v)}
    dropped = [k for k in was if k not in changes]
    if dropped:
        notes.append(f"in float32 the search did without {', '.join(dropped)}, which {dtype} had kept")
    if only32:  # what bf16's noise hid: named, and marked as seen in float32 only
        notes.append(f"shown in float32 only (under {dtype}'s rounding in the {dtype} run): "
                     + "; ".join(words(k, v).removeprefix("your loop ") for k, v in only32.items()))
    return notes


def suspected_words(trl: dict, quirks: dict, state, value_only: int | None, below_rounding: dict | None, dtype: str,
                    findings, diff: dict | None) -> str:
    """The evidence of a suspected explanation: the closest the search came (`state`, its best trial) and where even
    it parts, why the search stopped, what your tensors show that no switch reproduces (`findings`, identify's) and
    the tensor diff's links (`diff`)."""
    where = (f"; even it parts at step {state.agree + 1} on {', '.join(state.outside[:4])}" if state.outside
             else "")
    closest = sentence(trl, quirks, None) if state.changes else "the spec's own settings"
    text = f"no setting the search knows matches your loop at every step (closest: {closest}{where}); "
    if value_only is not None:
        text += (f"judged without your logged loss, whose value alone parted at step {value_only} while the "
                 "gradient norm agreed at that step; ")
    if below_rounding:  # what would do better is rounding: at this precision the rest is noise
        text += below_rounding_words(below_rounding, dtype)
    else:
        text += "the difference is outside what TRL and the built-in loop's switches can be set to"
    apart = [f.rule for f in findings if f.no_switch or not f.exact]
    if apart:
        text += "; read from your tensors, what no switch reproduces: " + "; ".join(apart)
    links = [c for c in (diff or {}).get("chain", []) if c.get("independent") or c.get("only_yours")]
    if links:
        text += "; the tensor diff found, link by link: " + "; ".join(f"{c['tensor']}: {c['how']}" for c in links)
    return text


def confirmed_words(trl: dict, quirks: dict, path: Path, final: dict, by_trl: bool | None, escalated: dict | None,
                    dtype: str, findings=()) -> str:
    """The evidence of an explanation that agrees at every step on what training computes: your loop in TRL's terms,
    how the float32 re-check went (`escalated`: its `escalated_from`, None where there was none; `dtype`: the
    cell's), what parts that is not training, and what still parts in the whole comparison (`final`) or with TRL
    itself (`by_trl` False; final weights apart where the gradient stage read a gradient of rounding alone: said
    so, from `findings`)."""
    said = sentence(trl, quirks, path)
    if escalated is not None:
        said += (f" ({'checked' if escalated.get('checked') else 'found'} in float32: "
                 f"{escalated_words(escalated, dtype)})")
    derived = final.get("defined_differently", [])
    if derived:
        said += "; " + defined_differently_words(derived, final)
    if final.get("loss_in_value_only"):
        said += "; " + loss_in_value_words(final)
    final_fd = final.get("first_divergence")
    if "param_rel_l2" in final.get("outside", []):
        rounding = any(f.stage == "weighting" and "vanishing" in f.evidence and f.settings for f in findings)
        said += "; but the final weights still differ beyond tolerance: " + (
            "your loop's gradient is rounding alone (each micro-batch's mean advantage is 0 to rounding), so its "
            "weights move on its own arithmetic's rounding, which no other loop reproduces bit for bit" if rounding
            else "a difference no logged metric shows (log grad_norm, or save the weights at more steps)")
    elif final_fd is not None:
        said += f"; but over every step the runs still part at step {final_fd['step']} on {final_fd['metric']}"
    if by_trl is False:
        said += "; but TRL with that table still parts from your loop (a bug on one side?)"
    return said
