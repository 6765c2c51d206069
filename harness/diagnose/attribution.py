"""Attribution: name the causes of a divergence, and confirm them by re-runs with differences aligned.

The preflight lists what differs between the sides, labelled by the lesson's checks (batch, loss_type,
importance_sampling) or `other:<field>`. One difference: a re-run with it aligned confirms it when the
divergence disappears. Several at once (the normal case when a loop is ported): `CauseSearch` aligns all of
them, then finds by delta debugging which are each needed for parity, and gives each confirmed cause its share
of the gap. Re-runs are cached by the resolved spec within a matrix (`reset_cache` at its start) and kept in its
folder for `--resume`, and a cell's own pair serves a re-run that resolves to its spec (`own_pair`). A difference
that the runs show no effect of says why when the harness can tell (`NO_EFFECT_WHY`). A user's own loop goes to
`explain` instead (the preflight cannot see inside it).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from pathlib import Path

from harness.diagnose.backends import WorkerDied
from harness.diagnose.preflight import CHECK_ORDER, alignment_for, apply_alignment, fix_for, preflight
from harness.diagnose.showable import AGREE_WITHIN

_SAMPLING_ONLY = "in lockstep TRL does not sample (the shared sampler does): sampling settings act only in free runs"
_CLIP_ONLY = ("clipping binds only where the policy ratio leaves 1: NUM_ITERATIONS > 1, or an IS sampler; with one "
              "pass per generation the ratio is exactly 1")
FREE_NO_EFFECT = ("free run: the two sides differ by less than the seed-to-seed noise allows at this many seeds and "
                  "steps; run --mode lockstep (same rollouts on both sides), or more seeds or steps")
NO_EFFECT_WHY = {"other:top_k": _SAMPLING_ONLY, "other:top_p": _SAMPLING_ONLY, "other:min_p": _SAMPLING_ONLY,
                 "other:repetition_penalty": _SAMPLING_ONLY, "other:epsilon_high": _CLIP_ONLY,
                 "other:epsilon": _CLIP_ONLY, "other:delta": _CLIP_ONLY,
                 "quirk:LOGP_ON_RAW_LOGITS": "at TEMPERATURE = 1 the logits and logits / temperature are the same",
                 "other:attention_dropout": "dropout while sampling changes which completions are drawn; in lockstep "
                                            "TRL does not sample (the shared sampler does): it acts only in free runs"}


# ---------------------------------------------------------------------------------------------
def evidence(check: str, result: dict) -> str | None:
    """What in the curves points at a check (used to word suspicions; confirmation decides)."""
    m = result["metrics"]
    outside = set(result["outside"])
    fd = result["first_divergence"] or {}
    if check == "batch":
        hit = [k for k in ("prompts_in_step", "sequences_in_step", "prompt_ids_hash", "epoch") if k in outside]
        return f"{', '.join(hit)} differ from step {min(m[k]['first_outside'] for k in hit)}" if hit else None
    if check == "loss_type":
        if fd and fd.get("metric") in ("loss", "grad_norm", "param_rel_l2") and "reward" not in outside:
            return f"{fd['metric']} parts at step {fd['step']} while the rewards agree"
        return None
    if check == "importance_sampling":
        one_sided = [k for k in result["only_in_a"] + result["only_in_b"] if k.startswith("sampling/")]
        if one_sided:
            return f"IS ratio statistics on one side only ({one_sided[0]}, ...)"
        hit = [k for k in outside if k.startswith("sampling/")]
        return f"IS ratio statistics differ ({hit[0]})" if hit else None
    return None


def attribute(cell, result: dict, cell_dir: Path, mode: str, progress: bool, log, store=None, backend=None,
              data=None) -> list[dict]:
    """Name the causes of a divergence and confirm them by re-runs with differences aligned.

    One difference: a re-run with it aligned confirms it when the divergence disappears. Several: align all of
    them (no parity then: `unexplained`, a bug on one side or a difference the preflight cannot see), then drop
    alignments, by halves and then one by one (delta debugging, at most about 2n re-runs for n differences),
    keeping a drop whenever parity holds without it. What is left is a set whose alignment was seen to give
    parity (sufficient) and each of whose members is needed (necessary): each is `confirmed`, the rest have
    `no measured effect`. With two or more causes, each gets its share of the gap at the last step, from a
    re-run with only that cause left different. `store`: the matrix's shared scratch runs (pairs.ScratchStore).
    `backend`: where the re-runs run (backends.py); one with room for several runs gets each round of candidates
    at once. `data`: the cell's CellData (your loop's explanation reads it instead of the cell folder)."""
    if "yours" in getattr(cell, "sides", ()):
        return _attribute_your_loop(cell, result, cell_dir, mode, log, data)
    _tr, diffs, _facts = preflight(cell.spec)
    checks = []
    for d in diffs:
        if d.check not in checks:
            checks.append(d.check)
    rank = {c: i for i, c in enumerate(CHECK_ORDER)}
    checks.sort(key=lambda c: rank.get(c, len(rank)))
    fields = {c: sorted({f for d in diffs if d.check == c for f in d.fields}) for c in checks}
    if result["first_divergence"] is None:
        why = (lambda c: NO_EFFECT_WHY.get(c, AGREE_WITHIN)) \
            if mode == "lockstep" else (lambda c: FREE_NO_EFFECT)
        return [{"cause": c, "status": "no measured effect", "evidence": why(c), "fields": fields[c]} for c in checks]
    if not checks:
        return [{"cause": "unexplained", "status": "suspected", "fields": [],
                 "evidence": "the preflight shows no difference: a bug on one side, or nondeterminism"}]
    # a difference no spec change aligns (bnpo across processes, say) cannot be tested by a re-run
    fixed = [c for c in checks if any(alignment_for(diffs, c).get(k) for k in ("set", "drop_trl", "set_trl"))]
    search = CauseSearch(cell.spec, diffs, fixed, cell_dir, mode, progress, log, store, backend)
    causes = search.minimal_causes() if fixed else None
    if causes is None and len(fixed) < len(checks):  # the untestable ones may carry it: suspected, not unexplained
        return sorted([{"cause": c, "fields": fields[c], "evidence": evidence(c, result) or (
            "no spec change aligns it, so no re-run can confirm it" if c not in fixed else None),
            "fix": fix_for(cell.spec, diffs, c), "status": "suspected", "reruns": search.reruns,
            "reused": search.reused} for c in checks], key=lambda e: e["cause"] in fixed)
    entries = []
    for c in checks:
        entry = {"cause": c, "fields": fields[c], "evidence": evidence(c, result), "fix": fix_for(cell.spec, diffs, c)}
        if causes is None:  # even everything aligned does not reach parity
            entry["status"] = "suspected"
        elif c in causes:
            entry["status"] = "confirmed"
            entry["rerun_first_divergence"] = None  # the set it belongs to, aligned, was seen at parity
        else:
            entry["status"] = "no measured effect"
            entry["evidence"] = NO_EFFECT_WHY.get(c, "aligning it is not needed for parity: no measured effect at "
                                                     "this config")
        entries.append(entry)
    if search.errors:
        entries[0]["rerun_error"] = search.errors[0]
    if causes is None:
        # where the all-aligned re-run parts (or that it failed), and its folder: without them a verdict of
        # "unexplained" on a remote machine says nothing about what to look at next
        rerun = search.results.get(frozenset(fixed))
        rerun_fd = rerun.get("first_divergence") if rerun else None
        where = (f" (the re-run parts at step {rerun_fd['step']} on {rerun_fd['metric']})" if rerun_fd else
                 f" ({search.errors[0]})" if search.errors else "")
        entry = {"cause": "unexplained", "status": "suspected", "fields": [],
                 "evidence": "with every difference the preflight lists aligned the runs still part"
                             + where + ": a bug on one side, or a difference the preflight cannot see"}
        if rerun:  # (a failed re-run has none: the report reads this key as the aligned re-run's outcome)
            entry.update(rerun_first_divergence=rerun_fd, rerun_outside=list(rerun.get("outside", [])),
                         rerun_runs=list(rerun.get("runs") or []))
        if rerun_fd and mode == "lockstep" and entry["rerun_runs"]:  # which link of the step parts first, and how
            _walk_tensors(entry, search.specs[frozenset(fixed)], Path(entry["rerun_runs"][0]).parent, rerun_fd,
                          cell_dir / "tensor-walk", log)
        entries.insert(0, entry)
    elif len(causes) > 1:
        shares = search.shares(causes)
        for entry in entries:
            if entry["cause"] in shares:
                entry["share"] = shares[entry["cause"]]
    for entry in entries:
        entry["reruns"], entry["reused"] = search.reruns, search.reused
    entries.sort(key=lambda e: {"confirmed": 0, "suspected": 1}.get(e["status"], 2))
    return entries


_RERUNS: dict[str, dict] = {}  # resolved spec + mode -> comparison: a re-run made once serves every cell of a matrix
_INFLIGHT: dict[str, concurrent.futures.Future] = {}  # re-runs being made now (cells run in threads on a backend)
_LOCK = threading.Lock()


def _run_key(spec, mode: str) -> str:
    """A pair's identity: its resolved spec (scratch against TRL) and the mode."""
    return json.dumps([spec.to_dict(), mode], sort_keys=True, default=str)


def own_pair(spec, mode: str, make):
    """A cell's own scratch-against-TRL pair, `make()`, made where the re-runs of other cells find it: a re-run that
    resolves to its spec (a toggle aligned on another cell often gives the matched cell's spec) waits for it while it
    runs and takes it once made, instead of making the same pair again."""
    key = _run_key(spec, mode)
    _, fut, mine = _claim(key)
    if not mine:  # the same pair is made or known already: the cell still makes its own, in its own folder
        return make()
    return _made(key, fut, make)


def _claim(key: str) -> tuple[dict | None, concurrent.futures.Future | None, bool]:
    """Who makes the pair `key`: (its result when made earlier, the future of the one being made, whether this
    caller makes it). "Mine" registers a future that callers after it wait on until `_settle`."""
    with _LOCK:
        known, fut = _RERUNS.get(key), _INFLIGHT.get(key)
        mine = known is None and fut is None
        if mine:
            fut = _INFLIGHT[key] = concurrent.futures.Future()
        return known, fut, mine


def _made(key: str, fut: concurrent.futures.Future, make) -> dict:
    """`make()` for the pair `key` this caller claimed with `fut`, settled whatever happens: its result; None to the
    waiters when it failed (a waiting re-run reads it as failed, as its own would have), the error raised here; a
    WorkerDied or Ctrl-C / SIGTERM passed on to the waiters too (not a result: --resume makes it again)."""
    try:
        result = make()
    except WorkerDied as e:
        _settle(key, fut, error=e)
        raise
    except Exception:
        _settle(key, fut)
        raise
    except BaseException as e:
        _settle(key, fut, error=e)
        raise
    _settle(key, fut, result)
    return result


def _settle(key: str, fut: concurrent.futures.Future, result: dict | None = None,
            error: BaseException | None = None) -> None:
    """The pair `key` claimed with `fut` is made (`result`; None when it failed) or was stopped (`error`): keep the
    result, and tell whoever waits."""
    result = getattr(result, "comparison", result)  # a cell's own pair (CellData): its comparison serves re-runs
    with _LOCK:
        if result is not None:
            _RERUNS.setdefault(key, result)
        _INFLIGHT.pop(key, None)
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def reset_cache() -> None:
    """Forget earlier re-runs (a new matrix: the code or the folders may have changed since)."""
    _RERUNS.clear()
    _INFLIGHT.clear()


def _walk_tensors(entry: dict, spec, pair_dir: Path, fd: dict, out: Path, log) -> None:
    """An unexplained pair, tensor by tensor: both sides again on its rollouts saving the first steps' tensors up to
    the one where it parts, and the first link of TRL's dataflow that differs from the built-in loop's goes into the
    entry (`tensor_diff`) and its evidence. A failure here leaves the entry as it was, saying so."""
    from harness.diagnose.pairs import TENSOR_WALK_STEPS, tensor_walk
    from harness.diagnose.tensordiff import words

    steps = max(1, min(int(fd["step"]), TENSOR_WALK_STEPS))
    log(f"    the aligned re-run still parts: both sides again on its rollouts, their first {steps} steps' tensors "
        "compared link by link")
    try:
        found = tensor_walk(spec, pair_dir, steps, out)
    except Exception as e:  # noqa: BLE001 - a diagnosis that fails must not sink the cell
        entry["tensor_diff_error"] = f"{type(e).__name__}: {e}"
        return
    if found is None:
        return
    entry["tensor_diff"] = {"first": found["first"], "steps": found["steps"]}
    entry["evidence"] += ("; tensor by tensor, TRL's side (in the place of \"your loop\") against the built-in loop's: "
                          + (words(found) if found["first"] else _nothing_walked(steps, int(fd["step"]))))


def _nothing_walked(steps: int, parts_at: int) -> str:
    """What a tensor walk that found every tensor alike says, by whether it reached the step where the pair parts."""
    if parts_at > steps:  # the walk stops at TENSOR_WALK_STEPS: an H100 re-run parted at step 9, after 6 walked
        return (f"every saved tensor agrees over the first {steps} steps, and the re-run parts at step {parts_at}, "
                "after them: the walk did not reach it (`python -m harness run scratch|trl --rollouts "
                f"<the re-run's rollouts.jsonl> --tensor-steps {parts_at}` on the re-run's spec, then `tensordiff`, would)")
    return (f"every saved tensor agrees over the first {steps} steps (the difference is elsewhere: the optimizer or "
            "the schedule, or after them)")


class CauseSearch:
    """Re-runs of one cell with a subset of its differences aligned, cached by the resolved spec."""

    def __init__(self, spec, diffs, checks, cell_dir: Path, mode: str, progress: bool, log, store=None, backend=None):
        from harness.diagnose.backends import InProcess

        self.spec, self.diffs, self.checks, self.store = spec, diffs, checks, store
        self.pairs = store.pairs if store is not None else None  # re-runs kept across --resume
        self.backend = backend or InProcess()
        self.cell_dir, self.mode, self.progress, self.log = cell_dir, mode, progress, log
        self.reruns = 0  # new runs made for this cell
        self.reused = 0  # runs another cell of the matrix had made already
        self.errors: list[str] = []
        self.results: dict[frozenset, dict | None] = {}
        self.specs: dict[frozenset, object] = {}  # the resolved spec of each re-run
        self.cells: dict[frozenset, object] = {}  # the re-runs this cell made, as cells (CellData, their logs and
        # sketches, no records): read once

    def run(self, aligned: frozenset) -> dict | None:
        """The comparison with the checks in `aligned` aligned (None when the re-run failed)."""
        if aligned in self.results:
            return self.results[aligned]
        align = {"set": {}, "drop_trl": [], "set_trl": {}}
        for c in sorted(aligned):
            part = alignment_for(self.diffs, c)
            align["set"].update(part["set"])
            align["drop_trl"] += [k for k in part["drop_trl"] if k not in align["drop_trl"]]
            align["set_trl"].update(part.get("set_trl", {}))
        spec = self.specs[aligned] = apply_alignment(self.spec, align)
        key = _run_key(spec, self.mode)
        name = "aligned-" + "+".join(sorted(c.replace(":", "-") for c in aligned))
        known, fut, mine = _claim(key)  # this cell makes it, or waits for the cell making it (no run made twice)
        kept = None
        if mine and self.pairs:
            try:  # made by an earlier run of this matrix (before a --resume)
                kept = self.pairs.get(spec, self.mode)
            except Exception:  # noqa: BLE001 - an unreadable entry is no entry: the re-run is made again
                kept = None
            except BaseException as e:  # Ctrl-C / SIGTERM: whoever waits for this re-run stops too
                _settle(key, fut, error=e)
                raise
        if not mine or kept is not None:
            with _LOCK:
                self.reused += 1
            where = "another cell of this matrix" if not mine else "an earlier run of this matrix"
            self.log(f"    re-run with {', '.join(sorted(aligned))} aligned: made by {where}, reused")
            if mine:
                out = kept
                _settle(key, fut, kept)
            else:
                out = known if known is not None else fut.result()
            if out is None:
                self.errors.append("the same re-run failed in another cell of this matrix")
        else:
            with _LOCK:
                self.reruns += 1
                n = self.reruns
            def make():
                bound = f" (at most {2 * len(self.checks) + 1})" if self.backend.slots <= 1 else ""  # prefetch: more
                self.log(f"    re-run {n}{bound}: {', '.join(sorted(aligned))} aligned")
                return self.backend.run_pair(spec, self.cell_dir / name[:120], self.mode, self.progress,
                                             store=self.store, keep="logs")

            out = None
            try:
                out = _made(key, fut, make)
            except WorkerDied:  # not a result: the cell fails and --resume runs it again
                raise
            except Exception as e:  # a failing re-run must not sink the cell
                self.errors.append(f"{type(e).__name__}: {e}")
            if out is not None and self.pairs:
                try:
                    self.pairs.keep(spec, self.mode, getattr(out, "comparison", out))
                except (OSError, ValueError, TypeError) as e:  # the re-run stands; a --resume makes it again
                    self.log(f"    (the re-run could not be kept for --resume: {e})")
        if out is not None and not isinstance(out, dict):  # made here: a cell (its comparison serves the search)
            self.cells[aligned], out = out, out.comparison
        self.results[aligned] = out
        return out

    def prefetch(self, sets: list) -> None:
        """Run the re-runs not made yet at once, where the backend has room for more than one (else later, one by
        one, as the search asks for them)."""
        todo = list(dict.fromkeys(frozenset(a) for a in sets if a and frozenset(a) not in self.results))
        if self.backend.slots > 1 and len(todo) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=min(len(todo), self.backend.slots)) as ex:
                list(ex.map(self.run, todo))

    def parity(self, aligned) -> bool:
        out = self.run(frozenset(aligned))
        return out is not None and out["first_divergence"] is None

    def minimal_causes(self) -> list[str] | None:
        """A 1-minimal set of checks whose alignment gives parity; None when aligning all of them does not."""
        kept = list(self.checks)
        if not self.parity(kept):
            return None
        chunk = max(1, len(kept) // 2)
        while True:
            # this pass's candidates as they stand (a drop changes the later ones: those are asked for anew)
            self.prefetch([kept[:j] + kept[j + chunk:] for j in range(0, len(kept), chunk)])
            i, dropped = 0, False
            while i < len(kept):
                rest = kept[:i] + kept[i + chunk:]
                if rest and self.parity(rest):
                    kept, dropped = rest, True  # the dropped ones are not needed: parity holds without them
                else:
                    i += chunk
            # one by one until a whole pass drops nothing: each one left was tested against the final set
            if chunk == 1 and not dropped:
                return kept
            chunk = max(1, chunk // 2)

    def shares(self, causes: list[str]) -> dict[str, dict]:
        """Per cause, its share of the gap at the last step (weights, loss, reward), from a re-run with only it
        left different."""
        gaps = {}
        self.prefetch([frozenset(self.checks) - {c} for c in causes])
        for c in causes:
            out = self.run(frozenset(self.checks) - {c})
            gaps[c] = _last_gaps(out, self.cells.get(frozenset(self.checks) - {c})) if out is not None else {}
        shares = {c: {} for c in causes}
        for metric in ("weights", "loss", "reward"):
            total = sum(g.get(metric, 0.0) for g in gaps.values())
            if total > 0 and all(metric in g for g in gaps.values()):
                for c in causes:
                    shares[c][metric] = gaps[c][metric] / total
        return shares


def _last_gaps(result: dict, data=None) -> dict[str, float]:
    """|a - b| at the last shared step: the weights' relative L2 distance (lockstep), the loss and the reward.
    `data`: the re-run as a cell (CellData), when this cell made it: its logs and sketches, not read again (a re-run
    another cell made, or an earlier run of the matrix before --resume, is read from its folder)."""
    from harness.diagnose.cell import relative_l2
    from harness.diagnose.compare import load_any_run
    from harness.runlog.params import relative_l2 as relative_l2_of_folders

    runs = result.get("runs")
    if isinstance(runs, dict):  # free: each side's seeds, averaged at the last step
        sides = list(runs.values())
        frames = [[load_any_run(p) for p in paths] for paths in sides]
    elif runs:
        frames = [[data.runs[Path(p).name] if data is not None else load_any_run(p)] for p in runs[:2]]
    else:
        return {}
    out = {}
    for metric in ("loss", "reward"):
        ends = []
        for side in frames:
            vals = [float(f[metric].dropna().iloc[-1]) for f in side if metric in f and f[metric].notna().any()]
            ends.append(sum(vals) / len(vals) if vals else None)
        if None not in ends:
            out[metric] = abs(ends[0] - ends[1])
    if runs and not isinstance(runs, dict):
        rel = (relative_l2(*(data.sketches.get(str(p)) for p in runs[:2])) if data is not None
               else relative_l2_of_folders(runs[0], runs[1]))
        if rel:
            out["weights"] = float(rel[-1])
    return out


def _attribute_your_loop(cell, result: dict, cell_dir: Path, mode: str, log, data=None) -> list[dict]:
    """Your loop against TRL: the preflight cannot see inside your loop, so search TRL's settings for it instead."""
    if result["first_divergence"] is None:
        return []
    if cell.spec.PROCESSES > 1:
        text = ("the explanation search runs TRL on one process; with PROCESSES > 1 its answer might not hold: run "
                "the loop against TRL with PROCESSES = 1 to have it explained")
        return [{"cause": "your loop", "status": "suspected", "fields": [], "evidence": text,
                 "fix": {"trl": {}, "scratch": {}, "sentence": text}}]
    if mode != "lockstep" or "trl" not in cell.sides:
        hint = [f"{c}: {e}" for c in CHECK_ORDER if (e := evidence(c, result))]
        text = ("the explanation search needs lockstep mode against TRL (the same rollouts on both sides); "
                + ("; ".join(hint) if hint else "run --mode lockstep --against trl"))
        return [{"cause": "your loop", "status": "suspected", "fields": [], "evidence": text,
                 "fix": {"trl": {}, "scratch": {}, "sentence": text}}]
    from harness.diagnose.explain import explain

    log("    explaining your loop (the built-in loop, set up as TRL, re-run on the same rollouts with candidate "
        "settings)")
    return explain(cell.spec, cell_dir, result, log, data=data)
