"""The toggle matrix on the embedded default: the matched cells at parity, each mismatched cell diverged and
attributed to its toggle, confirmed by a re-run; [trl] fields outside the toggles attributed by name; a
failing cell does not take the others down."""

import json

import pytest

from conftest import DEFAULT_SPEC, small_spec
from harness.diagnose import matrix as M
from harness.diagnose.verdict import format_verdict


@pytest.mark.slow
def test_default_matrix_is_ok(tmp_path):
    spec = small_spec("STEPS=20")
    doc = M.run_matrix(spec, tmp_path, "default", log=lambda *_: None)
    by_name = {c["name"]: c for c in doc["cells"]}
    assert doc["ok"], format_verdict(doc)
    assert by_name["matched"]["verdict"] == "parity"
    for name, cause in (("batch=naive", "batch"), ("loss_type=dapo", "loss_type"), ("loss_type=bnpo", "loss_type"),
                        ("loss_type=dr_grpo", "loss_type"), ("is=sequence_mask", "importance_sampling")):
        cell = by_name[name]
        assert cell["verdict"] == "diverged" and cell["attribution"][0] == cause
        assert cell["attribution_detail"][0]["status"] == "confirmed"
    for name in ("matched:loss_type=dapo", "matched:loss_type=bnpo", "matched:loss_type=dr_grpo",
                 "matched:is=sequence_mask"):
        assert by_name[name]["verdict"] == "parity"
    assert by_name["batch=naive"]["first_divergence"] == {"step": 1, "metric": "prompts_in_step"}
    saved = json.loads((tmp_path / "verdict.json").read_text())
    assert saved["ok"] and len(saved["cells"]) == 10
    for cell in saved["cells"]:
        assert {"name", "toggles", "expected", "verdict", "first_divergence", "attribution", "metrics"} <= set(cell)
        assert all({"max_abs", "max_rel", "mean_delta"} <= set(m) for m in cell["metrics"].values())


@pytest.mark.slow
@pytest.mark.parametrize("override, cause, step_metric", [
    ("trl.adam_beta2=0.999", "other:adam_beta2", (2, "param_rel_l2")),
    ('trl.lr_scheduler_type="linear"', "other:lr_scheduler_type", (2, "learning_rate")),
    ('trl.scale_rewards="batch"', "other:scale_rewards", (1, "grad_norm")),
    ("trl.max_grad_norm=0.1", "other:max_grad_norm", (1, "param_rel_l2")),
    ("trl.weight_decay=0.1", "other:weight_decay", (1, "param_rel_l2")),
])
def test_trl_field_outside_the_toggles_is_named_and_confirmed(override, cause, step_metric, tmp_path):
    spec = small_spec("STEPS=6", override)
    doc = M.run_matrix(spec, tmp_path, "none", log=lambda *_: None)
    cell = doc["cells"][0]
    assert cell["expected"] == "diverged" and cell["verdict"] == "diverged" and doc["ok"]
    assert cell["attribution"] == [cause] and cell["attribution_detail"][0]["status"] == "confirmed"
    assert (cell["first_divergence"]["step"], cell["first_divergence"]["metric"]) == step_metric


def test_a_difference_without_effect_is_reported_not_hidden(tmp_path):
    doc = M.run_matrix(small_spec("STEPS=3", "trl.epsilon_high=0.2"), tmp_path, "none", log=lambda *_: None)
    cell = doc["cells"][0]
    assert cell["verdict"] == "parity" and cell["expected"] == "diverged"  # the preflight said diverged; they agree
    assert cell["attribution_detail"][0]["status"] == "no measured effect"
    assert "ratio is exactly 1" in cell["attribution_detail"][0]["evidence"]
    # the harness can tell why: "cannot show here" with that reason, not a failed cell (issue 18)
    assert cell["ok"] and doc["ok"] and "ratio is exactly 1" in cell["cannot_show"]
    assert "cannot show here" in format_verdict(doc)


def test_a_failing_cell_does_not_sink_the_matrix(tmp_path, monkeypatch):
    from harness.diagnose import pairs

    real = pairs.run_pair

    def flaky(spec, out_dir, mode="lockstep", progress=False, **kwargs):
        if spec.LOSS_NORM == "token_local":
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(spec, out_dir, mode, progress, **kwargs)

    monkeypatch.setattr(pairs, "run_pair", flaky)
    doc = M.run_matrix(small_spec("STEPS=2"), tmp_path, "default", log=lambda *_: None,
                       only=["matched", "matched:loss_type=bnpo", "loss_type=dapo"])
    by_name = {c["name"]: c for c in doc["cells"]}
    assert by_name["matched:loss_type=bnpo"]["verdict"] == "failed"
    assert "CUDA out of memory" in by_name["matched:loss_type=bnpo"]["error"]
    assert by_name["matched"]["verdict"] == "parity" and by_name["loss_type=dapo"]["verdict"] == "diverged"
    assert not doc["ok"]
    from reports.render import write_parity_report

    html = write_parity_report(tmp_path).read_text()  # the report shows the failed cell and its error
    assert "failed: RuntimeError: CUDA out of memory (simulated)" in html


def test_full_matrix_cells_and_expectations():
    cells = M.build_cells(small_spec(), "full")
    assert len(cells) == 2 * 4 * 5
    parity = [c.name for c in cells if c.expected == "parity"]
    assert parity == ["matched"]
    naive_dapo = next(c for c in cells if c.name == "batch=naive,loss_type=dapo")
    assert naive_dapo.expected_cause == "batch"  # the lesson's order: batch first


def test_jobs_run_cells_in_parallel_workers_with_the_same_verdicts(tmp_path):
    """--jobs K: independent cells in K worker processes (one GPU each on a GPU host); same answers as one by one."""
    only = ["matched", "batch=naive", "loss_type=dapo"]
    spec = small_spec("STEPS=3")
    one = M.run_matrix(spec, tmp_path / "one", "default", log=lambda *_: None, only=only)
    two = M.run_matrix(spec, tmp_path / "two", "default", log=lambda *_: None, only=only, jobs=2)
    strip = lambda doc: [(c["name"], c["verdict"], c["first_divergence"], c["attribution"]) for c in doc["cells"]]  # noqa: E731
    assert strip(one) == strip(two) and two["ok"]
    assert [c["name"] for c in json.loads((tmp_path / "two" / "verdict.json").read_text())["cells"]] == only


def test_cells_flag_runs_only_the_named_cells_and_refuses_unknown_ones(tmp_path, capsys):
    import json

    from harness.cli import main

    out = tmp_path / "p"
    assert main(["parity", "--spec", str(DEFAULT_SPEC), "--set", "STEPS=3", "--cells", "matched,loss_type=dapo",
                 "--quiet", "--out", str(out)]) == 0
    doc = json.loads((out / "verdict.json").read_text())
    assert [c["name"] for c in doc["cells"]] == ["matched", "loss_type=dapo"]
    assert doc["cells_selected"] == ["matched", "loss_type=dapo"]
    assert main(["parity", "--spec", str(DEFAULT_SPEC), "--cells", "matched,loss_type=nope", "--out",
                 str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "no cell named loss_type=nope" in err and "batch=naive" in err
