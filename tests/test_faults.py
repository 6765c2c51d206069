"""Faults: non-finite losses, SIGTERM at a step boundary, SIGKILL mid-cell then --resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import DEFAULT_SPEC, ROOT, small_spec
from harness.diagnose.compare import compare_runs
from harness.runlog.log import read_metrics


def test_non_finite_loss_stops_with_status_and_log_intact(tmp_path, monkeypatch):
    from scratch_grpo import core
    from scratch_grpo.train import train

    real, calls = core.aggregate_loss, {"n": 0}

    def poisoned(*a, **k):
        calls["n"] += 1
        out = real(*a, **k)
        return out * float("nan") if calls["n"] > 4 else out  # 2 micro-batches per step: step 3 goes bad

    monkeypatch.setattr(core, "aggregate_loss", poisoned)
    with pytest.raises(FloatingPointError, match="non-finite loss at step 3"):
        train(small_spec("STEPS=6"), tmp_path / "nan", progress=False)
    manifest = json.loads((tmp_path / "nan" / "manifest.json").read_text())
    assert manifest["status"] == "failed: non-finite loss at step 3"
    rows, problems = read_metrics(tmp_path / "nan" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["loss"] is None and not problems
    # the comparator puts the divergence at that step
    monkeypatch.setattr(core, "aggregate_loss", real)
    train(small_spec("STEPS=6"), tmp_path / "ok", progress=False)
    result = compare_runs(tmp_path / "ok", tmp_path / "nan", mode="lockstep")
    assert result["first_divergence"]["step"] == 3 and "different lengths" in " ".join(result["notes"])


def spawn(*args, cache):
    env = {**os.environ, "GRPO_PARITY_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for_steps(path, n, proc, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        if path.exists() and len(read_metrics(path)[0]) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited early: {proc.stdout.read()}")
        time.sleep(0.05)
    raise AssertionError("timed out waiting for steps")


@pytest.mark.parametrize("sig, side", [(signal.SIGTERM, "scratch"), (signal.SIGINT, "trl")])
def test_signal_stops_at_a_step_boundary(sig, side, tmp_path, private_cache):
    out = tmp_path / "run"
    proc = spawn("run", side, "--spec", str(DEFAULT_SPEC), "--out", str(out), "--steps", "400", "--quiet",
                 cache=private_cache)
    wait_for_steps(out / "metrics.jsonl", 3, proc)
    proc.send_signal(sig)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 3, output  # a run that could not finish (README "Exit codes")
    rows, problems = read_metrics(out / "metrics.jsonl")
    assert problems == [] and 3 <= len(rows) < 400  # stopped early, every line whole
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_sigkill_mid_cell_then_resume(tmp_path, private_cache):
    out = tmp_path / "parity"
    args = ("parity", "--spec", str(DEFAULT_SPEC), "--out", str(out), "--quiet", "--set", "STEPS=12")
    proc = spawn(*args, cache=private_cache)
    # let the first cell finish and the second start, then kill in the middle of the second
    end = time.time() + 300
    while time.time() < end:
        v = out / "verdict.json"
        second = out / "batch-naive" / "scratch" / "metrics.jsonl"
        if v.exists() and second.exists() and len(read_metrics(second)[0]) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    finished = json.loads((out / "verdict.json").read_text())
    assert [c["name"] for c in finished["cells"]] == ["matched"]
    rows, _ = read_metrics(out / "matched" / "trl" / "metrics.jsonl")
    assert len(rows) == 12  # the finished cell lost nothing
    rows, _ = read_metrics(second)
    assert rows and [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # the killed one: whole lines
    resumed = subprocess.run([sys.executable, "-m", "harness", "parity", "--resume", str(out), "--quiet"], cwd=ROOT,
                             capture_output=True, text=True, timeout=600,
                             env={**os.environ, "GRPO_PARITY_CACHE": str(private_cache)})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "matched: finished earlier, kept" in resumed.stdout
    doc = json.loads((out / "verdict.json").read_text())
    assert doc["ok"] and len(doc["cells"]) == 10


def test_trl_side_non_finite_loss_stops_the_run(tmp_path, private_cache):
    """A learning rate of 1e30 blows TRL's weights up at step 1; step 2's gradient is not finite."""
    out = tmp_path / "trl"
    r = subprocess.run([sys.executable, "-m", "harness", "run", "trl", "--spec", str(DEFAULT_SPEC), "--out", str(out),
                        "--steps", "6", "--quiet", "--set", "trl.learning_rate=1e30"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "GRPO_PARITY_CACHE": str(private_cache)})
    assert r.returncode == 3 and "run failed: non-finite loss at step 2" in r.stderr and "Traceback" not in r.stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "failed: non-finite loss at step 2"
    rows, problems = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and problems == []


def test_a_run_cut_short_never_reads_ok(tmp_path, monkeypatch):
    """verdict.json after each cell: a killed or interrupted matrix is `complete: false` and not `ok`, however
    its finished cells went; the index says INCOMPLETE."""
    from harness.diagnose import matrix as M
    from harness.diagnose.verdict import format_verdict
    from reports.render import write_index

    real = M.run_cell
    calls = []

    def stop_after_one(cell, *a, **k):
        if calls:
            raise KeyboardInterrupt("SIGINT (simulated)")
        calls.append(cell.name)
        return real(cell, *a, **k)

    monkeypatch.setattr(M, "run_cell", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        M.run_matrix(small_spec("STEPS=2"), tmp_path / "cut", "default", log=lambda *_: None,
                     only=["matched", "loss_type=dapo"])
    doc = json.loads((tmp_path / "cut" / "verdict.json").read_text())
    assert doc["cells"][0]["ok"] and not doc["ok"] and not doc["complete"]
    assert (doc["cells_done"], doc["cells_total"]) == (1, 2)
    shutil.copytree(tmp_path / "cut", tmp_path / "also")
    assert "INCOMPLETE" in write_index(tmp_path).read_text()
    assert "parity INCOMPLETE" in format_verdict(doc)


def test_resume_with_another_spec_is_refused(tmp_path):
    from harness.cli import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "verdict.json").write_text(json.dumps({"base_spec": small_spec("STEPS=2").to_dict(), "matrix": "none",
                                                  "mode": "lockstep", "cells": []}))
    assert main(["parity", "--resume", str(out), "--spec", str(DEFAULT_SPEC), "--set", "STEPS=3"]) == 2
    (out / "verdict.json").write_bytes(b"\xff\xfe not json")
    assert main(["parity", "--resume", str(out)]) == 2


def test_a_finished_out_is_not_overwritten_without_force(tmp_path, capsys):
    from harness.cli import main

    (tmp_path / "verdict.json").write_text('{"ok": true, "cells": []}')
    assert main(["parity", "--spec", str(DEFAULT_SPEC), "--out", str(tmp_path), "--matrix", "none"]) == 2
    err = capsys.readouterr().err
    assert "already holds a parity run" in err and "--force" in err
    assert (tmp_path / "verdict.json").read_text() == '{"ok": true, "cells": []}'  # untouched
