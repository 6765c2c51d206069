"""The metric-tolerance plugin (assert_metrics_close, pytest --parity-runs) and the golden references."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from conftest import DEFAULT_SPEC, ROOT
from harness.pytest_plugin import MetricMismatch, assert_metrics_close
from harness.record import RecordError, check_against_reference, record

GOLDEN = ROOT / "tests" / "golden" / "default"


def frame(**cols):
    n = len(next(iter(cols.values())))
    df = pd.DataFrame({"step": list(range(1, n + 1)), **cols}).set_index("step", drop=False)
    df.attrs["manifest"] = {}
    return df


def test_assert_metrics_close_message_names_metric_step_values_tolerance_and_worst():
    a = frame(loss=[0.5, 0.5, 0.5], grad_norm=[1.0, 1.0, 1.0])
    b = frame(loss=[0.5, 0.6, 0.9], grad_norm=[1.0, 1.0, 1.0])
    assert_metrics_close(a, a)
    with pytest.raises(MetricMismatch) as err:
        assert_metrics_close(a, b, metrics=["loss", "grad_norm"])
    msg = str(err.value)
    assert "loss: first outside tolerance at step 2: A=0.5, B=0.6" in msg
    assert "atol 1e-05 + rtol 1.3e-06" in msg and "worst at step 3: |A-B|=0.4" in msg and "2 of 3 steps" in msg
    assert "grad_norm" not in msg
    assert_metrics_close(a, b, metrics=["loss"], atol=0.5)  # a wider tolerance the caller asked for
    assert_metrics_close(a, b, metrics=["loss"], steps=[1])


def test_exact_fields_and_missing_metrics():
    a, b = frame(prompts_in_step=[4, 4]), frame(prompts_in_step=[4, 2])
    with pytest.raises(MetricMismatch, match="prompts_in_step: first outside tolerance at step 2: A=4, B=2"):
        assert_metrics_close(a, b, rtol=1.0)  # counts stay exact whatever the overrides
    with pytest.raises(MetricMismatch, match="epoch: first outside tolerance at step 1"):
        assert_metrics_close(frame(epoch=[0.5]), frame(epoch=[0.500001]))  # inside atol 1e-5, but exact
    with pytest.raises(MetricMismatch, match="kl: not logged by run B"):
        assert_metrics_close(frame(kl=[0.1]), frame(loss=[0.1]), metrics=["kl"])


def test_nan_on_both_sides_is_outside_tolerance_and_one_sided_metrics_are_skipped(tmp_path):
    """NaN the runs computed is never parity; `pytest --parity-runs` lists a one-sided metric as skipped."""
    with pytest.raises(MetricMismatch, match="loss: first outside tolerance at step 2"):
        assert_metrics_close(frame(loss=[0.1, float("nan")]), frame(loss=[0.1, float("nan")]))
    for name, rows in (("a", [{"step": 1, "loss": 0.1, "kl": 0.2}]), ("b", [{"step": 1, "loss": 0.1}])):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = pytest_parity(tmp_path, tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    assert r.returncode == 0 and "1 passed, 1 skipped" in r.stdout, r.stdout


def harness_run(tmp_path, name, *sets):
    r = subprocess.run([sys.executable, "-m", "harness", "run", "scratch", "--spec", str(DEFAULT_SPEC), "--out",
                        str(tmp_path / name), "--steps", "4", "--quiet", *[a for s in sets for a in ("--set", s)]],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return tmp_path / name


def pytest_parity(tmp_path, a, b):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--parity-runs", str(a),
                           str(b)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_pytest_parity_runs_on_harness_runs(tmp_path):
    a = harness_run(tmp_path, "a")
    same = harness_run(tmp_path, "same")
    other = harness_run(tmp_path, "other", "ADAM_BETA2=0.9")
    ok = pytest_parity(tmp_path, a, same)
    assert ok.returncode == 0 and " passed" in ok.stdout and "failed" not in ok.stdout, ok.stdout
    bad = pytest_parity(tmp_path, a, other)
    assert bad.returncode == 1, bad.stdout
    # beta2 first changes the update of step 2, so the curves part at step 3
    assert "grad_norm: first outside tolerance at step 3" in bad.stdout and "parity[grad_norm]" in bad.stdout


def test_golden_reference_replays_within_fp32_tolerance(tmp_path):
    check_against_reference(GOLDEN, tmp_path)


def test_golden_reference_catches_a_changed_loss_and_explains(tmp_path, monkeypatch):
    from scratch_grpo import core

    real = core.aggregate_loss
    monkeypatch.setattr(core, "aggregate_loss", lambda *a, **k: real(*a, **k) * 1.01)
    with pytest.raises(MetricMismatch) as err:
        check_against_reference(GOLDEN, tmp_path)
    msg = str(err.value)
    assert "[scratch vs its reference]" in msg and "[trl vs its reference]" not in msg
    assert "library versions differ" in msg or "the change is in this code" in msg


def test_record_refuses_overwrite(tmp_path):
    from conftest import small_spec

    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "reference.json").write_text("{}")
    with pytest.raises(RecordError, match="--force"):
        record(small_spec(), "default.toml", tmp_path / "ref", allow_dirty=True)


def test_record_refuses_a_dirty_tree(tmp_path, monkeypatch):
    from conftest import small_spec
    from harness import record as R

    monkeypatch.setattr(R, "_dirty", lambda: [" M scratch_grpo/core.py"])
    with pytest.raises(RecordError, match="uncommitted changes"):
        record(small_spec(), "default.toml", tmp_path / "new")
