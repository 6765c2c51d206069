"""Several processes on CPU (gloo): TRL on 2 processes x accumulation 1 against the one-process scratch loop
at accumulation 2, in lockstep; what the ranks consumed is merged into each step's log line."""

import os
import subprocess
import sys

import pytest

from conftest import DEFAULT_SPEC, ROOT, small_spec
from harness.diagnose import matrix as M
from harness.diagnose.preflight import preflight
from harness.diagnose.verdict import format_verdict
from harness.runlog.log import read_run


@pytest.mark.slow
def test_two_processes_match_one_for_grpo_dr_grpo_dapo(tmp_path):
    doc = M.run_matrix(small_spec("STEPS=8"), tmp_path, "none", processes=2, log=lambda *_: None)
    by_name = {c["name"]: c for c in doc["cells"]}
    assert doc["ok"], format_verdict(doc)
    for lt in ("grpo", "dr_grpo", "dapo"):
        cell = by_name[f"processes=2:loss_type={lt}"]
        assert cell["verdict"] == "parity"
        assert cell["metrics"]["grad_norm"]["max_rel"] < 1e-5 and cell["metrics"]["param_rel_l2"]["max_abs"] < 1e-5
        trl = read_run(tmp_path / M._dirname(cell["name"]) / "trl")
        assert trl.attrs["manifest"]["processes"] == 2
        assert list(trl["prompts_in_step"]) == [4] * 8 and list(trl["sequences_in_step"]) == [16] * 8
    bnpo = by_name["processes=2:loss_type=bnpo"]
    assert bnpo["verdict"] == "diverged" and bnpo["attribution"] == ["loss_type"]


def test_preflight_says_bnpo_differs_across_world_sizes():
    diffs = preflight(small_spec("PROCESSES=2", 'LOSS_NORM="token_local"'))[1]
    assert [(d.check, d.trl) for d in diffs] == [("loss_type", "token_local per process (2 processes)")]
    assert preflight(small_spec("PROCESSES=2", 'LOSS_NORM="token_global"'))[1] == []
    tr = preflight(small_spec("PROCESSES=2"))[0]
    assert (tr.kwargs["per_device_train_batch_size"], tr.kwargs["gradient_accumulation_steps"]) == (8, 1)
    assert (tr.prompts_per_step, tr.sequences_per_step) == (4, 16)


def test_processes_must_divide_accumulation_and_prompts():
    from harness.experiment.spec import SpecError

    with pytest.raises(SpecError, match="must divide GRAD_ACCUM"):
        small_spec("PROCESSES=3")
    with pytest.raises(SpecError, match="must divide PROMPTS_PER_STEP"):
        small_spec("PROCESSES=4", "GRAD_ACCUM=4", "PROMPTS_PER_STEP=2")


def test_cli_run_trl_on_two_processes(tmp_path, private_cache):
    r = subprocess.run([sys.executable, "-m", "harness", "run", "trl", "--spec", str(DEFAULT_SPEC), "--out",
                        str(tmp_path / "t"), "--steps", "3", "--processes", "2", "--quiet"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "GRPO_PARITY_CACHE": str(private_cache)})
    assert r.returncode == 0, r.stdout + r.stderr
    df = read_run(tmp_path / "t")
    assert len(df) == 3 and df.attrs["manifest"]["status"] == "finished"
    assert list(df["prompts_in_step"]) == [4, 4, 4]
