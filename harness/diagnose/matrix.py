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
import time
import traceback
from pathlib import Path

from harness.diagnose import precision
from harness.diagnose.attribution import attribute, own_pair, reset_cache
from harness.diagnose.backends import InProcess, WorkerDied, make_backend
from harness.diagnose.explain import explain
from harness.diagnose.pairs import SHARED_DIR, ScratchStore
from harness.diagnose.preflight import apply_alignment, preflight
from harness.diagnose.showable import (exact_reason, lost_updates_warning, ratio_one_words, small_effect_reason,
                                      update_summary)
from harness.diagnose.verdict import cell_line, finished_cell, verdict_doc, write_json
from loop_runner.run import LoopError
from trl_runner.translate import LOSS_TYPES, NORM_OF_LOSS_TYPE

IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
# The `is=` cells' stand-in for vLLM where the spec samples with the policy: the emulated sampler holding the weights
# rounded to bf16, as an engine serving a bf16 run holds them. Calibrated against vLLM 0.24 on an H100 (2026-12-07,
# tools/sampler_mismatch.py, docs/benchmarks.md): at the embedded default in bf16 its per-token |delta| p50 / p99 is
# 5.5e-4 / 3.3e-3 against vLLM's 5.1e-4 / 2.4e-3 (sequence sums' std 2.3e-3 against 2.4e-3); at the Qwen3-0.6B shape
# 7.8e-3 / 3.9e-2 against 5.8e-3 / 2.0e-2. The noise stand-in used before (0.02 x each tensor's std) was 8-9x vLLM's
# at both shapes, and no noise scale reaches vLLM's at the 0.6B shape (0.002 still gives 9.8e-3: bf16's own floor).
IS_STAND_IN = {"sampler__kind": "emulated", "sampler__emulation": "bfloat16"}
EMULATED_NOISE = 0.02  # the noise stand-in's scale where a spec or a tool asks for `noise` (a stated, magnified mismatch)


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
        return dict(IS_STAND_IN)
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
    pairs run (backends.InProcess when None). The pair hands on the cell (CellData), read once; every step after
    takes it: the attribution (or your loop's explanation), why a toggle cannot show, the float32 re-check."""
    backend = backend or InProcess()
    t0 = time.perf_counter()
    v = {"name": cell.name, "dir": str(cell_dir), "toggles": cell.toggles, "expected": cell.expected,
         "expected_cause": cell.expected_cause}
    try:
        data = _pair(cell, cell_dir, mode, progress, store, backend)
        result = data.comparison
        v.update(sides=list(cell.sides), verdict="parity" if result["first_divergence"] is None else "diverged",
                 first_divergence=result["first_divergence"])
        details = attribute(cell, result, cell_dir, mode, progress, log, store, backend, data=data)
        _describe(v, cell, data, details)
        if v["verdict"] == "parity" and tuple(cell.sides) == ("yours", "trl"):  # what agreeing here cannot show
            v["untold"] = [w for w in (ratio_one_words(cell.spec, data.tensors),) if w]
        if v["verdict"] == "parity" and cell.expected == "diverged":  # a toggle that had nothing to act on here?
            _no_effect(v, cell, data, details, mode, progress, log, store, backend)
        elif precision.wants_float32_loop(cell, mode, result):  # your loop at parity: or only bf16's rounding hid it
            _loop_in_float32(v, cell, data, log)
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


def _pair(cell: Cell, cell_dir: Path, mode: str, progress: bool, store, backend):
    """The cell's pair, as a CellData; a scratch-against-TRL pair where other cells' re-runs can find it."""
    def pair():
        return backend.run_pair(cell.spec, cell_dir, mode, progress, sides=cell.sides, store=store, keep=True)

    return own_pair(cell.spec, mode, pair) if tuple(cell.sides) == ("scratch", "trl") else pair()


def _describe(v: dict, cell: Cell, data, details: list[dict]) -> None:
    """The cell's entry from its comparison and attribution: causes, metrics, tolerance, notes, weight updates."""
    result = data.comparison
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


def _no_effect(v: dict, cell: Cell, data, details: list[dict], mode: str, progress: bool, log, store,
               backend) -> None:
    """A toggle at parity: why it cannot show (exactly, or as a float32 cell shows, or because the effect is small)."""
    why = exact_reason(cell.expected_cause, data, details)
    if why is None and precision.wants_float32(cell, mode):  # or only bf16's rounding hid it
        found = _in_float32(cell, v, log, lambda: precision.escalate(cell, data, mode, progress, log, store, backend,
                                                                       attribute, own_pair))
        why = found["words"] if found else None
    if why is None:
        why = small_effect_reason(data.comparison, data, cell.spec, details, v["updates"])
    if why:
        v["cannot_show"] = why


def _loop_in_float32(v: dict, cell: Cell, data, log) -> None:
    """Your loop at parity in bf16: the float32 cell, and what it says (a finding goes in the table)."""
    found = _in_float32(cell, v, log, lambda: precision.escalate_loop(cell, data, log, explain))
    if found is None:
        v["precision"].update(loop=True, words=f"the float32 check of your loop failed "
                              f"({v['precision']['error'][:300]}); the {cell.spec.DTYPE} parity stands unchecked")
    if found and found["finding"]:
        v["cannot_show"] = found["words"]  # the table: "shows in float32 only (see below)"
    else:
        v["notes"].append(v["precision"]["words"])


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
    done = _kept(base, cells, out_dir, matrix, mode, processes, log) if resume else {}
    results = dict(done)
    t_start = time.perf_counter()

    def finished(v: dict) -> None:
        results[v["name"]] = v
        log(f"    {v['name']}: " + cell_line(v))
        ordered = [results[c.name] for c in cells if c.name in results]
        write_json(out_dir / "verdict.json", verdict_doc(base, matrix, mode, ordered, t_start, processes, only,
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
        write_json(out_dir / "verdict.json", verdict_doc(base, matrix, mode, [results[c.name] for c in cells
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
    doc = verdict_doc(base, matrix, mode, ordered, t_start, processes, only, total=len(cells))
    write_json(out_dir / "verdict.json", doc)
    return doc


def _kept(base, cells: list[Cell], out_dir: Path, matrix: str, mode: str, processes: int, log) -> dict:
    """--resume: the entries of the cells an earlier run of the same spec, matrix and mode finished in `out_dir`'s
    verdict.json, by name (none when there is no such run)."""
    done = {}
    if (out_dir / "verdict.json").exists():
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
                if finished_cell(c, by_name):  # kept, in this folder (wherever the run was when it wrote the entry)
                    done[c["name"]] = {**c, "dir": str(out_dir / _dirname(c["name"]))}
                elif isinstance(c, dict) and c.get("verdict") in ("parity", "diverged"):
                    log(f"resume: the entry of cell {str(c.get('name'))[:60]!r} in verdict.json is damaged; running "
                        "it again")
        else:
            log("resume: the earlier run in this folder used another spec, matrix or mode; starting over")
    return done


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



def _dirname(name: str) -> str:
    """A cell's folder: one path component under the run folder, whatever the name holds (no `/`, `..`)."""
    safe = name.replace("=", "-").replace(":", "_").replace(",", "+")
    safe = safe.replace("/", "_").replace("\\", "_").replace("\0", "_")
    return safe if safe.strip(".") else f"_{safe}"
