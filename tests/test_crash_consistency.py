"""Crash consistency: a parity run SIGKILLed at 20 moments never leaves a folder that reads as a pass it did not
make, and `--resume` finishes it with the verdicts of an uninterrupted run (issue 19, item 4).

The run: the default spec, STEPS=2, cells `matched` and `is=sequence_mask` (one pair, then one pair and its
confirmation re-run), 3-13 s on 2 cores. Its phases, told apart by the files it writes:
  0 starting (no verdict.json of this process yet)   1 the first cell   2 the second cell's pair
  3 the confirmation re-run                           4 the report and the runs index
An uninterrupted run (the second of two: the first pays the one-time costs) measures each phase. Then 5 chains
of 4 kills each: chain c kills once in every phase but c, in order; a kill lands at a seeded random fraction of
the phase's measured length after the phase starts. After a kill the next process is `--resume DIR` (a fresh
`--spec` run where the kill left no verdict.json, or where a resume would not pass through the next target: in an
emptied folder when the target is the confirmation re-run and an earlier process kept it),
and it is killed in turn; the chain's last resume runs to the end. A kill that lands past its phase (this run
went through it faster than the measured one) is checked like any other and its target tried again, sooner. So
at least 20 kills, at least 4 in each phase, most of them of a resumed run, and 5 resumes to completion, each
compared with the uninterrupted run.

After every kill: verdict.json is absent, or whole and `complete: false` and not `ok`, or complete with the
uninterrupted run's verdicts; report.html and summary.txt exist only beside a complete verdict, and report.html
and index.html are whole; the index calls no run OK that is not complete and ok.

To keep this to 30-80 s, every run is a fork of one server process that has already imported torch,
transformers and TRL (about 10 s a process otherwise): the child runs `harness.cli.main([...])`, the code
`python -m harness` runs, and gets SIGKILL to its process group.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import DEFAULT_SPEC, ROOT
from harness.diagnose.pairs import SHARED_DIR

KILLS = 20
CHAINS = 5
PHASES = 5
SEED = 19
ARGS = ["--steps", "2", "--cells", "matched,is=sequence_mask", "--quiet"]

SERVER = r"""
import json, os, sys, traceback
import harness.cli
import torch, transformers, trl  # noqa: F401  (what a parity run imports, once, before any fork)
import harness.diagnose.matrix, reports.render, scratch_grpo.train, trl_runner.runner  # noqa: F401
import matplotlib.pyplot  # noqa: F401
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid == 0:
        rc = 99
        try:
            os.setpgid(0, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            sys.stdout.reconfigure(line_buffering=True)
            rc = harness.cli.main(job["argv"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            rc = 98
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    os.close(log)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class Server:
    def __init__(self, env: dict):
        self.p = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert json.loads(self._line(120)) == {"ready": True}

    def _line(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.p.stdout.readline()
        assert line, "the fork server died"
        return line

    def start(self, argv: list[str], log: Path) -> int:
        self.p.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.p.stdin.flush()
        return json.loads(self._line(30))["pid"]

    def poll(self, timeout: float = 0.0) -> int | None:
        line = self._line(timeout)
        return None if line is None else json.loads(line)["rc"]

    def close(self) -> None:
        self.p.stdin.close()
        self.p.kill()
        self.p.wait()


def _fresh(path: Path, t0: float) -> bool:
    try:
        return any(p.stat().st_mtime >= t0 for p in (path, *path.iterdir()))
    except FileNotFoundError:
        return False


def phase(out: Path, t0: float) -> int:
    """Where the process started at t0 is, from its files (see the module's docstring)."""
    v = out / "verdict.json"
    try:
        if v.stat().st_mtime < t0:
            return 0
        doc = json.loads(v.read_text())
    except FileNotFoundError:
        return 0
    if doc.get("complete"):
        return 4
    if doc["cells_done"] == 0:
        return 1
    return 3 if any(_fresh(d, t0) for d in out.glob("*/aligned-*")) else 2


def run(server: Server, argv: list[str], log: Path, out: Path, target: int | None = None,
        offsets: list[float] | None = None, timeout: float = 240) -> tuple[int | None, dict]:
    """Run argv; with `target`, SIGKILL it `offsets[target]` s after it enters that phase (or at once if it passed
    it). Returns (exit code or None when killed, {phase: seconds it entered it, "end": seconds it ran})."""
    time.sleep(0.06)  # what the last process wrote is older than t0 ...
    t0 = time.time() - 0.02  # ... and what this one writes newer (file times lag the clock by up to a tick)
    pid = server.start(argv, log)
    entered: dict[int, float] = {}
    while time.time() - t0 < timeout:
        rc = server.poll(0.02)
        if rc is not None:
            entered["end"] = time.time() - t0
            return rc, entered
        ph = phase(out, t0)
        entered.setdefault(ph, time.time() - t0)
        if target is not None and ph >= target and time.time() - t0 - entered[ph] >= (offsets[ph] if ph == target
                                                                                        else 0.0):
            os.killpg(pid, signal.SIGKILL)
            rc = server.poll(30)
            entered["end"] = time.time() - t0
            return (None if rc == -signal.SIGKILL else rc), entered
    os.killpg(pid, signal.SIGKILL)
    raise AssertionError(f"{argv} did not end in {timeout} s; log: {log.read_text()[-2000:]}")


def verdicts(doc: dict) -> dict:
    return {c["name"]: (c["verdict"], c["ok"], c.get("attribution"), (c.get("first_divergence") or {}).get("step"),
                        (c.get("first_divergence") or {}).get("metric")) for c in doc["cells"]}


def check_after_kill(out: Path, ref: dict, what: str) -> dict | None:
    """The invariants of a folder a kill left; returns its verdict.json (None when absent)."""
    doc = None
    if (out / "verdict.json").exists():
        doc = json.loads((out / "verdict.json").read_text())  # whole: written atomically
        if doc["complete"]:
            assert verdicts(doc) == verdicts(ref), what
            assert doc["ok"] == ref["ok"], what
        else:
            assert doc["ok"] is False and doc["cells_done"] < doc["cells_total"], what
            for name, v in verdicts(doc).items():  # the cells it did finish are right
                assert v == verdicts(ref)[name], (what, name)
    for name in ("report.html", "summary.txt"):  # only beside the verdict they describe
        if (out / name).exists():
            assert doc is not None and doc["complete"], (what, name)
    if (out / "report.html").exists():
        assert (out / "report.html").read_text().rstrip().endswith("</html>"), what
    index = out.parent / "index.html"
    if index.exists():
        html = index.read_text()
        assert html.rstrip().endswith("</html>"), what
        row = re.search(rf'>{re.escape(out.name)}</a></td>\s*<td>([^<]*)</td>', html)
        if row and row.group(1) == "OK":
            assert doc is not None and doc["complete"] and doc["ok"], what
    return doc


def reachable(out: Path, target: int) -> bool:
    """Whether `--resume out` passes through phase `target` (else a fresh run must): a resume keeps the cells
    already finished, so it never enters the phase of a cell it kept, and takes a confirmation re-run an earlier
    process of this folder finished (kept under shared-scratch/pairs) instead of making it."""
    try:
        doc = json.loads((out / "verdict.json").read_text())
    except FileNotFoundError:
        return True  # nothing to resume: a fresh run, which enters every phase
    if target in (0, PHASES - 1):
        return True
    if doc["complete"] or (target == 3 and kept_reruns(out)):
        return False
    return target != 1 or doc["cells_done"] == 0


def kept_reruns(out: Path) -> list[Path]:
    return list((out / SHARED_DIR / "pairs").glob("*.json"))


def test_sigkill_at_20_moments_then_resume(tmp_path, private_cache):
    env = {**os.environ, "GRPO_PARITY_CACHE": str(private_cache), "OMP_NUM_THREADS": "1"}
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    runs.mkdir()
    logs.mkdir()
    rng = random.Random(SEED)
    server = Server(env)
    kills, phases_killed, missed, t_all = 0, [], [], time.perf_counter()
    try:
        # the reference run, twice: the first fills the model cache and pays one-time costs, so the phase lengths
        # the kills are timed by come from the second (a kill timed by a cold run's lengths lands too late)
        for name in ("reference-cold", "reference"):
            ref_out = runs / name
            rc, entered = run(server, ["parity", "--spec", str(DEFAULT_SPEC), *ARGS, "--out", str(ref_out)],
                              logs / f"{name}.log", ref_out)
            assert rc == 0, (logs / f"{name}.log").read_text()[-3000:]
            ref = json.loads((ref_out / "verdict.json").read_text())
            assert ref["complete"] and ref["ok"] and len(ref["cells"]) == 2
            assert [p for p in entered if p != "end"] == list(range(PHASES)), f"phases of the run: {entered}"
        ends = [entered[p] for p in range(1, PHASES)] + [entered["end"]]
        lengths = [max(0.02, ends[p] - entered[p]) for p in range(PHASES)]

        for c in range(CHAINS):
            out = runs / f"chain-{c}"
            for n, target in enumerate([p for p in range(PHASES) if p != c]):
                offsets = [rng.random() * 0.8 * length for length in lengths]
                log = logs / f"chain-{c}-kill-{n}.log"
                # A kill lands in a later phase when the run passed the target before the kill moment (a phase
                # shorter this time than in the reference): it still counts and is checked, and the target is
                # tried again, sooner, from a folder that passes through it (a fresh run where a resume would not).
                for attempt in range(4):
                    fresh = not (out / "verdict.json").exists()
                    if fresh and n and not attempt:  # a kill before verdict.json: nothing to resume, one line says so
                        err = logs / f"chain-{c}-resume-refused.log"
                        assert run(server, ["parity", "--resume", str(out)], err, out)[0] == 2
                        assert len(err.read_text().strip().splitlines()) == 1, err.read_text()
                    resume = not fresh and reachable(out, target)
                    if not resume and target == 3:  # a run in this folder would take the kept re-run: start clean
                        shutil.rmtree(out, ignore_errors=True)
                    argv = ["parity", "--resume", str(out), "--quiet"] if resume else \
                        ["parity", "--spec", str(DEFAULT_SPEC), *ARGS, "--out", str(out), "--force"]
                    rc, entered = run(server, argv, log, out, target, offsets)
                    if rc is not None:  # it ended before a late moment in its last phase
                        assert rc == 0, log.read_text()[-3000:]
                        check_after_kill(out, ref, f"chain {c}, kill {n}: finished")
                        offsets[target] /= 2
                        continue
                    kills += 1
                    killed_in = max(p for p in entered if p != "end")
                    phases_killed.append(killed_in)
                    check_after_kill(out, ref, f"chain {c}, kill {n} (phase {killed_in}); log {log}")
                    if killed_in == target:
                        break
                    missed.append((target, killed_in))
                    offsets[target] /= 2
                else:
                    raise AssertionError(f"chain {c}: no kill landed in phase {target} in 4 tries; missed {missed}")
            # the chain's last resume runs to the end: the uninterrupted run's verdicts
            log = logs / f"chain-{c}-final.log"
            argv = ["parity", "--resume", str(out), "--quiet"] if (out / "verdict.json").exists() else \
                ["parity", "--spec", str(DEFAULT_SPEC), *ARGS, "--out", str(out)]
            rc, _ = run(server, argv, log, out)
            assert rc == 0, log.read_text()[-3000:]
            doc = check_after_kill(out, ref, f"chain {c}: resumed")
            assert doc["complete"] and doc["ok"] and verdicts(doc) == verdicts(ref)
            assert (out / "report.html").exists() and (out / "summary.txt").exists()
    finally:
        server.close()
    assert kills >= KILLS
    assert all(phases_killed.count(p) >= KILLS // PHASES for p in range(PHASES)), phases_killed
    print(f"{kills} kills in phases {phases_killed} (lengths {[round(x, 2) for x in lengths]} s; kills that landed "
          f"past their phase, as (target, landed): {missed}), {time.perf_counter() - t_all:.0f} s")


# ---------------------------------------------------------------------------------------------
# the pieces the kills rely on, each alone
# ---------------------------------------------------------------------------------------------
def test_an_atomic_write_cut_short_leaves_the_old_file(tmp_path):
    from harness.runlog.atomic import atomic_open, atomic_write_text

    path = atomic_write_text(tmp_path / "verdict.json", '{"old": true}\n')
    try:
        with atomic_open(path) as fh:
            fh.write('{"new": ')
            raise KeyboardInterrupt  # a kill between two writes of one document
    except KeyboardInterrupt:
        pass
    assert path.read_text() == '{"old": true}\n' and [p.name for p in tmp_path.iterdir()] == ["verdict.json"]
    atomic_write_text(path, "new\n")
    (tmp_path / "plain").write_text("x")  # the mode open() gives a new file, not mkstemp's 0600
    assert path.read_text() == "new\n" and path.stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_a_rerun_cut_short_does_not_show_the_run_it_replaces(tmp_path, monkeypatch):
    """`--force` over a finished run, killed in its first cell: the old verdict (ok), report and summary must not
    stand beside the cell folders the new run is overwriting."""
    from conftest import small_spec
    from harness.diagnose import matrix as M

    out = tmp_path / "run"
    out.mkdir()
    (out / "verdict.json").write_text(json.dumps({"ok": True, "complete": True, "cells": []}))
    (out / "report.html").write_text("<html>old</html>")
    (out / "summary.txt").write_text("parity OK")

    def killed(*a, **k):
        raise KeyboardInterrupt("SIGTERM (simulated)")

    monkeypatch.setattr(M, "run_cell", killed)
    try:
        M.run_matrix(small_spec("STEPS=2"), out, "default", log=lambda *_: None, only=["matched"])
    except KeyboardInterrupt:
        pass
    doc = json.loads((out / "verdict.json").read_text())
    assert doc["complete"] is False and doc["ok"] is False and doc["cells"] == []
    assert not (out / "report.html").exists() and not (out / "summary.txt").exists()


def test_readers_skip_a_truncated_last_line(tmp_path):
    from harness.rollouts.lockstep import ReplaySource
    from harness.runlog.log import read_metrics

    rec = {"round": 0, "prompt_ids": [[1, 2]], "completion_ids": [[3]], "logprobs": None}
    (tmp_path / "rollouts.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec)[:25])
    assert ReplaySource.from_file(tmp_path / "rollouts.jsonl").records == [rec]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    rows, problems = read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 1, "loss": 0.5}] and "last line" in problems[0]
