"""The metric log: one line per step, flushed; a killed writer loses no finished step."""

import json
import os
import signal
import subprocess
import sys
import textwrap

from conftest import ROOT, small_spec
from harness.runlog.log import RunWriter, read_metrics, read_run


def test_writer_statuses(tmp_path):
    spec = small_spec()
    with RunWriter(tmp_path / "ok", "scratch", spec, "cpu") as w:
        w.log_step({"step": 1, "loss": 0.5, "reward": float("nan")})
    m = json.loads((tmp_path / "ok" / "manifest.json").read_text())
    assert m["status"] == "finished" and m["steps_logged"] == 1 and m["spec"]["SEED"] == spec.SEED
    assert {"torch", "transformers", "trl"} <= set(m["versions"]) and m["device"].startswith("CPU")
    df = read_run(tmp_path / "ok")
    assert df.loc[1, "loss"] == 0.5 and df["reward"].isna().all()  # NaN is written as null
    try:
        with RunWriter(tmp_path / "bad", "trl", spec, "cpu") as w:
            raise FloatingPointError("non-finite loss at step 3")
    except FloatingPointError:
        pass
    m = json.loads((tmp_path / "bad" / "manifest.json").read_text())
    assert m["status"] == "failed: non-finite loss at step 3"


def test_killed_writer_keeps_every_finished_step(tmp_path):
    # a child writes 3 steps, starts a 4th line, and is SIGKILLed mid-line
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r})
        from conftest import small_spec
        from harness.runlog.log import RunWriter
        w = RunWriter({str(tmp_path)!r}, "scratch", small_spec(), "cpu")
        for s in (1, 2, 3):
            w.log_step({{"step": s, "loss": s / 10}})
        w._fh.write('{{"step": 4, "lo')
        w._fh.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ})
    assert r.returncode == -signal.SIGKILL, r.stderr
    rows, problems = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert len(problems) == 1 and "last line is not complete JSON" in problems[0]
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "running"  # never got to finish
    import pytest

    with pytest.warns(UserWarning, match="not complete JSON"):
        df = read_run(tmp_path)
    assert list(df["step"]) == [1, 2, 3] and df.attrs["problems"] == problems
