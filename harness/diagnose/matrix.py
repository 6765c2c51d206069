"""The toggle matrix, cell by cell: run both loops, compare, and name the cause of a divergence.

Cells vary the lesson's three checks on the TRL side against a matched base spec:
batch semantics {matched, naive} x TRL `loss_type` {grpo, bnpo, dr_grpo, dapo} x IS correction
{off, each mode}. A cell is expected at parity when TRL is set up as the scratch loop is, and to
diverge otherwise. Each cell is one pair of runs (`pairs.run_pair`); a diverged cell
goes to `attribution.attribute`. `run_matrix` writes `verdict.json` after every cell, so a killed run
keeps the cells it finished (`--resume`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
import time
import traceback
from pathlib import Path

from harness.diagnose import precision
from harness.diagnose.attribution import attribute, own_pair, reset_cache
from harness.diagnose.backends import InProcess, WorkerDied, make_backend
from harness.diagnose.explain import toml_value
from harness.diagnose.pairs import SHARED_DIR, ScratchStore
from harness.diagnose.preflight import apply_alignment, preflight
from harness.diagnose.showable import exact_reason, lost_updates_warning, small_effect_reason, update_summary
from loop_runner.run import LoopError
from trl_runner.translate import LOSS_TYPES, NORM_OF_LOSS_TYPE

IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
EMULATED_NOISE = 0.02  # the IS cells' emulated sampler: weights + 2% noise (a stated, controlled mismatch)


@dataclasses.dataclass
class Cell:
    name: str
    toggles: dict
    spec: object
    expected: str  # "parity" | "diverged"
    expected_cause: str | None = None
    sides: tuple = ("scratch", "trl")  # the pair compared; ("yours", "trl") for a user's loop


def _variant(base, trl: dict | None = None, **changes):
    """A copy of the base spec with keys changed (`table__key` for a table's key) and `[trl]` entries added."""
    return apply_alignment(base, {"set": {k.replace("__", "."): v for k, v in changes.items()}, "set_trl": trl or {}})


def _is_sampler(base):
    if base.sampler.kind == "policy":
        return {"sampler__kind": "emulated", "sampler__noise_scale": EMULATED_NOISE}
    return {}


def build_cells(base, matrix: str, processes: int = 1) -> list[Cell]:
    """`none`: the spec as given; `default`: each check toggled alone, plus matched pairs; `full`: the product.
    `processes` > 1 adds the world-size equivalence class: TRL on that many processes (accumulation divided
    by it) against the one-process scratch loop, both set up alike, for each loss type."""
    cells = _build_cells(base, matrix)
    if processes > 1:
        for lt, norm in LOSS_TYPES.items():
            cells.append(Cell(f"processes={processes}:loss_type={norm}", {"processes": processes, "loss_type": norm},
                              _variant(base, PROCESSES=processes, LOSS_NORM=lt),
                              # bnpo divides by each process's own micro-batch: it cannot match one process's split
                              "diverged" if norm == "bnpo" else "parity"))
    return cells


def _build_cells(base, matrix: str) -> list[Cell]:
    if base.loop.command:  # your loop against TRL and/or the scratch loop: the harness cannot see inside it
        if matrix != "none":
            raise ValueError("--loop: a loop of yours runs with --matrix none (its differences from TRL are found by "
                             "the explanation search, not by toggles)")
        against = ("trl", "scratch") if base.loop.against == "both" else (base.loop.against,)
        return [Cell(f"yours-vs-{other}", {"against": other}, base, "parity", None, ("yours", other))
                for other in against]
    if matrix == "none":
        _tr, diffs, _facts = preflight(base)
        return [Cell("as-given", {}, base, "diverged" if diffs else "parity",
                     diffs[0].check if diffs else None)]
    base_lt = LOSS_TYPES[base.LOSS_NORM]
    other_lts = [lt for lt in LOSS_TYPES.values() if lt != base_lt]
    toggles0 = {"batch": "matched", "loss_type": base_lt, "is": "off"}
    cells = [Cell("matched", toggles0, base, "parity")]
    if matrix == "default":
        cells.append(Cell("batch=naive", {**toggles0, "batch": "naive"}, _variant(base, BATCH_MAPPING="naive"),
                          "diverged", "batch"))
        for lt in other_lts:
            cells.append(Cell(f"loss_type={lt}", {**toggles0, "loss_type": lt},
                              _variant(base, trl={"loss_type": lt}), "diverged", "loss_type"))
        mode = IS_MODES[0]  # TRL's default mode
        cells.append(Cell(f"is={mode}", {**toggles0, "is": mode},
                          _variant(base, **_is_sampler(base), trl={"vllm_importance_sampling_correction": True,
                                                                  "vllm_importance_sampling_mode": mode}),
                          "diverged", "importance_sampling"))
        # matched pairs: the scratch loop set up like each TRL choice must agree with it
        for lt in other_lts:
            cells.append(Cell(f"matched:loss_type={lt}", {**toggles0, "loss_type": lt, "scratch": NORM_OF_LOSS_TYPE[lt]},
                              _variant(base, LOSS_NORM=NORM_OF_LOSS_TYPE[lt]), "parity"))
        cells.append(Cell(f"matched:is={mode}", {**toggles0, "is": mode, "scratch_is": mode},
                          _variant(base, **_is_sampler(base), IS_CORRECTION=True, IS_MODE=mode), "parity"))
        return cells
    cells = []
    for batch in ("matched", "naive"):
        for lt in LOSS_TYPES.values():
            for is_mode in ("off", *IS_MODES):
                changes = {}
                if batch == "naive":
                    changes["BATCH_MAPPING"] = "naive"
                trl = {}
                if lt != base_lt:
                    trl["loss_type"] = lt
                if is_mode != "off":
                    changes.update(_is_sampler(base))
                    trl.update(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=is_mode)
                if trl:
                    changes["trl"] = trl
                name = "matched" if not changes else ",".join(
                    p for p in (f"batch={batch}" if batch != "matched" else "", f"loss_type={lt}" if lt != base_lt
                                else "", f"is={is_mode}" if is_mode != "off" else "") if p)
                expected_cause = next((c for c, on in (("batch", batch != "matched"), ("loss_type", lt != base_lt),
                                                       ("importance_sampling", is_mode != "off")) if on), None)
                cells.append(Cell(name, {"batch": batch, "loss_type": lt, "is": is_mode},
                                  _variant(base, **changes) if changes else base,
                                  "diverged" if expected_cause else "parity", expected_cause))
    return cells


# ---------------------------------------------------------------------------------------------
# the matrix
# ---------------------------------------------------------------------------------------------
def _summary_metrics(result: dict) -> dict:
    keep = {}
    for name, m in result["metrics"].items():
        keep[name] = {"max_abs": m["max_abs"], "max_rel": m["max_rel"], "mean_delta": m["mean_delta"],
                      "first_outside": m["first_outside"]}
        for k in ("ratio_to_noise", "ratio_to_bound", "noise_last"):  # the calibrated tolerance's figures
            if m.get(k) is not None:
                keep[name][k] = m[k]
    return keep


def run_cell(cell: Cell, cell_dir: Path, mode: str = "lockstep", progress: bool = False, log=print,
             store: ScratchStore | None = None, backend=None) -> dict:
    """One cell: both loops, the comparison, the attribution. Never raises for a failing run: the verdict says.
    `store`: scratch runs shared by the matrix's cells and re-runs (pairs.ScratchStore). `backend`: where its
    pairs run (backends.InProcess when None)."""
    backend = backend or InProcess()
    t0 = time.perf_counter()
    v = {"name": cell.name, "dir": str(cell_dir), "toggles": cell.toggles, "expected": cell.expected,
         "expected_cause": cell.expected_cause}
    try:
        def pair():
            return backend.run_pair(cell.spec, cell_dir, mode, progress, sides=cell.sides, store=store, keep=True)

        data = own_pair(cell.spec, mode, pair) if tuple(cell.sides) == ("scratch", "trl") else pair()
        result = data.comparison
        v["sides"] = list(cell.sides)
        v["verdict"] = "parity" if result["first_divergence"] is None else "diverged"
        v["first_divergence"] = result["first_divergence"]
        details = attribute(cell, result, cell_dir, mode, progress, log, store, backend, data=data)
        v["attribution"] = [d["cause"] for d in details if d["status"] != "no measured effect"]
        v["attribution_detail"] = details
        v["metrics"] = _summary_metrics(result)
        v["tolerance"] = {"mode": result.get("tolerance_mode", "static"), "k": result.get("k_noise")}
        v["only_in"] = {cell.sides[0]: result["only_in_a"], cell.sides[1]: result["only_in_b"]}
        v["notes"] = result["notes"]
        if result.get("defined_differently"):  # your loop: only statistics part, training agrees
            v["defined_differently"] = result["defined_differently"]
        v["updates"] = update_summary(data)
        lost = lost_updates_warning(cell.spec, v["updates"])
        if lost:
            v["notes"].append(lost)
        if v["verdict"] == "parity" and cell.expected == "diverged":  # a toggle that had nothing to act on here?
            why = exact_reason(cell.expected_cause, data, details)
            if why is None and precision.wants_float32(cell, mode):  # or only bf16's rounding hid it
                found = _in_float32(cell, v, log, lambda: precision.escalate(cell, result, cell_dir, mode, progress,
                                                                               log, store, backend))
                why = found["words"] if found else None
            if why is None:
                why = small_effect_reason(result, data, cell.spec, details, v["updates"])
            if why:
                v["cannot_show"] = why
        elif precision.wants_float32_loop(cell, mode, result):  # your loop at parity: or only bf16's rounding hid it
            found = _in_float32(cell, v, log, lambda: precision.escalate_loop(cell, result, cell_dir, log))
            if found is None:
                v["precision"].update(loop=True, words=f"the float32 check of your loop failed "
                                      f"({v['precision']['error'][:300]}); the {cell.spec.DTYPE} parity stands unchecked")
            if found and found["finding"]:
                v["cannot_show"] = found["words"]  # the table: "shows in float32 only (see below)"
            else:
                v["notes"].append(v["precision"]["words"])
    except LoopError as e:  # your loop broke the contract: say where, keep the rest of the run
        v.update(verdict="error", error=str(e), first_divergence=None, attribution=[], metrics={})
    except Exception as e:  # one failing cell never takes the others down
        v.update(verdict="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8),
                 first_divergence=None, attribution=[], metrics={})
    v["ok"] = v["verdict"] == cell.expected and (
        cell.expected_cause is None or (v["attribution"][:1] == [cell.expected_cause] and
                                        v["attribution_detail"][0]["status"] == "confirmed"))
    if v.get("cannot_show"):  # not a failure: the reason is in the verdict
        v["ok"] = True
    v["wall_s"] = round(time.perf_counter() - t0, 1)
    return v


def _in_float32(cell: Cell, v: dict, log, escalate) -> dict | None:
    """`escalate()`, a float32 pair, into v["precision"]: its entry; None when it failed (the bf16 cell stands, the
    failure in v["precision"]["error"] and the log). A dead worker is no result: raised, so that the cell fails and
    --resume runs it again."""
    try:
        v["precision"] = escalate()
        return v["precision"]
    except WorkerDied:
        raise
    except Exception as e:
        v["precision"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"    {cell.name}: the float32 pair failed ({type(e).__name__}: {e})")
        return None


def run_matrix(base, out_dir: str | Path, matrix: str = "default", mode: str = "lockstep", progress: bool = False,
               log=print, only: list[str] | None = None, resume: bool = False, processes: int = 1,
               jobs: int = 1, started=None, backend: str = "local", address: str | None = None) -> dict:
    """Run every cell, writing verdict.json after each. `resume`: keep the cells an earlier run of the same
    spec, matrix and mode finished in `out_dir` (a cell cut short is run again from its start). `jobs` > 1:
    the pairs in that many worker processes, one GPU each where there are GPUs; `backend="ray"`: as Ray tasks
    on the cluster at `address` (backends.py). `started`: called once the run is on record (verdict.json,
    `complete: false`), before the first cell (the CLI refreshes the runs index there)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reset_cache()
    store = ScratchStore(out_dir / SHARED_DIR)  # cells whose scratch side is set up alike share one scratch run
    cells = build_cells(base, matrix, processes)
    if only:
        unknown = sorted(set(only) - {c.name for c in cells})
        if unknown:
            raise ValueError(f"--cells: no cell named {', '.join(unknown)} in matrix {matrix!r}; its cells: "
                             + ", ".join(c.name for c in cells))
        cells = [c for c in cells if c.name in only]
    done = {}
    if resume and (out_dir / "verdict.json").exists():
        try:
            old = json.loads((out_dir / "verdict.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = None
        if not isinstance(old, dict):
            log("resume: verdict.json in this folder is not readable; starting over")
        elif (old.get("base_spec"), old.get("matrix"), old.get("mode"), old.get("processes", 1)) == \
                (base.to_dict(), matrix, mode, processes):
            by_name = {c.name: c for c in cells}
            for c in old.get("cells") if isinstance(old.get("cells"), list) else []:
                if _finished(c, by_name):  # kept, in this folder (wherever the run was when it wrote the entry)
                    done[c["name"]] = {**c, "dir": str(out_dir / _dirname(c["name"]))}
                elif isinstance(c, dict) and c.get("verdict") in ("parity", "diverged"):
                    log(f"resume: the entry of cell {str(c.get('name'))[:60]!r} in verdict.json is damaged; running "
                        "it again")
        else:
            log("resume: the earlier run in this folder used another spec, matrix or mode; starting over")
    results = dict(done)
    t_start = time.perf_counter()

    def finished(v: dict) -> None:
        results[v["name"]] = v
        log(f"    {v['name']}: " + _cell_line(v))
        ordered = [results[c.name] for c in cells if c.name in results]
        _write_json(out_dir / "verdict.json", _verdict_doc(base, matrix, mode, ordered, t_start, processes, only,
                                                           total=len(cells)))

    pending = []
    for i, cell in enumerate(cells, 1):
        if cell.name in done:
            log(f"[cell {i}/{len(cells)}] {cell.name}: finished earlier, kept")
        else:
            pending.append(cell)
    # the backend first: one that cannot start, or cannot hold a cell, is refused before anything is written
    runner = make_backend(backend, jobs, address, log) if pending else InProcess()
    try:
        runner.check([c.spec for c in pending])
        # On record from the start: a kill before the first cell ends leaves `complete: false` (resumable), never
        # an earlier run's verdict beside cell folders this run is overwriting; that run's report and summary go.
        for stale in ("report.html", "summary.txt"):
            (out_dir / stale).unlink(missing_ok=True)
        _write_json(out_dir / "verdict.json", _verdict_doc(base, matrix, mode, [results[c.name] for c in cells
                                                                                if c.name in results],
                                                           t_start, processes, only, total=len(cells)))
        if started is not None:
            started()
        if runner.slots <= 1:
            for n, cell in enumerate(pending, 1):
                elapsed = time.perf_counter() - t_start
                eta = f", eta {elapsed / (n - 1) * (len(pending) - n + 1):.0f} s" if n > 1 else ""
                log(f"[cell {len(results) + 1}/{len(cells)}] {cell.name} (expected {cell.expected}{eta})")
                finished(run_cell(cell, out_dir / _dirname(cell.name), mode, progress, log, store, runner))
        else:  # each cell's logic in a thread here; its pairs wait on the backend's workers
            _run_cells_in_threads(pending, out_dir, mode, log, store, runner, finished, len(cells) - len(pending),
                                  len(cells), t_start)
    finally:
        runner.close()
    ordered = [results[c.name] for c in cells if c.name in results]
    doc = _verdict_doc(base, matrix, mode, ordered, t_start, processes, only, total=len(cells))
    _write_json(out_dir / "verdict.json", doc)
    return doc


def _run_cells_in_threads(pending, out_dir: Path, mode: str, log, store, runner, finished, done: int, total: int,
                          t_start: float) -> None:
    """The cells at once, each in a thread that sends its pairs to `runner`; verdict.json after each cell ends."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    log(f"running {len(pending)} cells, {runner.slots} runs at a time")
    # TRL's lazy module is not safe to import from several threads at once (two cells' cause searches raced to
    # "cannot import name 'GRPOConfig' from 'trl'"): the preflight imports it here first
    preflight(pending[0].spec)

    def one(cell):
        return run_cell(cell, out_dir / _dirname(cell.name), mode, False,
                        lambda msg, name=cell.name: log(f"  [{name}] {str(msg).strip()}"), store, runner)

    ex = ThreadPoolExecutor(max_workers=min(len(pending), 64))
    try:
        futures = {ex.submit(one, cell): cell for cell in pending}
        for n, fut in enumerate(as_completed(futures), 1):
            v = fut.result()  # run_cell never raises for a failed run; Ctrl-C / SIGTERM (Interrupted) it passes on
            elapsed, left = time.perf_counter() - t_start, len(pending) - n
            log(f"[cell {done + n}/{total} done] {v['name']}" + (f" (eta {elapsed / n * left:.0f} s)" if left else ""))
            finished(v)
    finally:  # on an interruption the cells not started never start; the others stop at their next wait
        ex.shutdown(wait=True, cancel_futures=True)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finished(c, cells: dict) -> bool:
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


def _write_json(path: Path, doc: dict) -> None:
    """Atomically: a kill during the write leaves the previous verdict.json whole."""
    from harness.runlog.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(doc, indent=2, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def _verdict_doc(base, matrix, mode, verdicts, t_start, processes, only=None, total: int | None = None) -> dict:
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


def _dirname(name: str) -> str:
    """A cell's folder: one path component under the run folder, whatever the name holds (no `/`, `..`)."""
    safe = name.replace("=", "-").replace(":", "_").replace(",", "+")
    safe = safe.replace("/", "_").replace("\\", "_").replace("\0", "_")
    return safe if safe.strip(".") else f"_{safe}"


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


def _cell_line(v: dict) -> str:
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
    selected = f" (cells {', '.join(doc['cells_selected'])})" if doc.get("cells_selected") else ""
    state = "OK" if doc["ok"] else "NOT OK" if doc.get("complete", True) else "INCOMPLETE"
    lines = [f"parity {state}: {sum(v['ok'] for v in doc['cells'])}/{len(doc['cells'])} "
             f"cells as expected ({doc['mode']}, matrix {doc['matrix']}{selected}, {doc['elapsed_s']:.0f} s)", ""]
    if (doc.get("ran") or {}).get("text"):
        lines.insert(1, f"ran: {doc['ran']['text']}")
    lines.append(f"{'cell':30s} {'expected':9s} {'got':9s} {'first divergence':28s} cause")
    for v in doc["cells"]:
        fd = v.get("first_divergence")
        fd_s = f"step {fd['step']} {fd['metric']}" if fd else "-"
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
    is the first metric training computes to leave tolerance (loss, grad_norm, learning_rate, the final weights:
    not is_derived), not compare's first_divergence, which may be a statistic (kl, reward_std) that the same verdict
    calls defined differently in your loop while training parts steps later; where only statistics part, said so.
    The built-in sides define their statistics alike: their first divergence is named as it is (prompts_in_step)."""
    from harness.diagnose.compare import PRIORITY, is_derived

    fd = c["first_divergence"]
    if "yours" not in c.get("sides", ()):
        return f"The two loops part at step {fd['step']}, first on {fd['metric']}."
    rank = {m: i for i, m in enumerate(PRIORITY)}
    metrics = c.get("metrics") or {}
    trains = {m: v.get("first_outside") for m, v in metrics.items() if not is_derived(m)}
    parted = sorted((step, rank.get(m, len(rank)), m) for m, step in trains.items() if step is not None)
    if parted:
        step, _rank, m = parted[0]
        return f"The two loops part at step {step}, first on {m}" + (" (the final weights)." if m == "param_rel_l2"
                                                                     else ".")
    said = ", ".join(sorted(trains, key=lambda m: (rank.get(m, len(rank)), m))) or "none logged by both"
    return (f"Only statistics part, first {fd['metric']} at step {fd['step']}: what training computes ({said}) agrees "
            "at every compared step.")


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
                from harness.diagnose.explain import defined_differently_words

                items.append("Only statistics part: " + defined_differently_words(c["defined_differently"], c) + ".")
            return {"sentence": f"The two loops agree {within}.", "items": items}
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
