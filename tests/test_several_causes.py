"""Several differences at once: attribution aligns them all, keeps by delta debugging the ones each needed for
parity (confirmed), calls the rest no measured effect, and gives each confirmed cause its share of the gap."""

from __future__ import annotations

import pytest

from conftest import small_spec
from harness.diagnose.matrix import run_matrix
from harness.diagnose.verdict import format_verdict

QUIET = {"log": lambda *_: None}


def causes(doc):
    detail = doc["cells"][0]["attribution_detail"]
    return ({d["cause"] for d in detail if d["status"] == "confirmed"},
            {d["cause"] for d in detail if d["status"] == "no measured effect"}, detail)


@pytest.mark.parametrize("overrides, confirmed, no_effect", [
    (['trl.loss_type="dapo"', 'trl.scale_rewards="none"'], {"loss_type", "other:scale_rewards"}, set()),
    # three real ones, and top_k: a sampling setting, which in lockstep TRL never uses (the shared sampler draws)
    (['BATCH_MAPPING="naive"', 'trl.loss_type="dapo"', "trl.adam_beta2=0.9", "trl.top_k=5"],
     {"batch", "loss_type", "other:adam_beta2"}, {"other:top_k"}),
    (['trl.loss_type="dapo"', 'trl.scale_rewards="batch"', "trl.adam_beta2=0.9", 'trl.lr_scheduler_type="linear"',
      "trl.weight_decay=0.1"],
     {"loss_type", "other:scale_rewards", "other:adam_beta2", "other:lr_scheduler_type", "other:weight_decay"}, set()),
])
def test_each_real_difference_is_confirmed(tmp_path, overrides, confirmed, no_effect):
    doc = run_matrix(small_spec(*overrides), tmp_path, "none", **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "diverged" and doc["ok"]
    got, none, detail = causes(doc)
    assert got == confirmed and none == no_effect, detail
    n = len(confirmed | no_effect)
    assert 1 <= detail[0]["reruns"] <= 2 * n + 1  # the stated bound
    shares = [d["share"]["weights"] for d in detail if d["status"] == "confirmed"]
    assert len(shares) == len(confirmed) and abs(sum(shares) - 1) < 1e-9 and all(0 <= s <= 1 for s in shares)
    if no_effect:
        assert "TRL does not sample" in next(d["evidence"] for d in detail if d["cause"] == "other:top_k")
    text = format_verdict(doc)
    assert f"{len(confirmed)} differences together explain it" in text and "% of the weight distance" in text


def test_one_difference_costs_one_rerun(tmp_path):
    doc = run_matrix(small_spec('trl.loss_type="dapo"'), tmp_path, "none", **QUIET)
    got, none, detail = causes(doc)
    assert got == {"loss_type"} and detail[0]["reruns"] == 1 and "share" not in detail[0]


def test_a_divergence_no_difference_explains_is_unexplained(tmp_path, monkeypatch):
    """A bug on one side: with every listed difference aligned the runs still part."""
    from scratch_grpo import core

    real = core.aggregate_loss
    monkeypatch.setattr(core, "aggregate_loss", lambda *a, **k: real(*a, **k) * 1.5)  # the scratch loop's bug
    doc = run_matrix(small_spec('trl.adam_beta2=0.9'), tmp_path, "none", **QUIET)
    detail = doc["cells"][0]["attribution_detail"]
    assert detail[0]["cause"] == "unexplained" and "still part" in detail[0]["evidence"]
    assert all(d["status"] != "confirmed" for d in detail)
    # where the all-aligned re-run parts, and its folders: what a remote (GPU) run's verdict must say to be followed
    fd = detail[0]["rerun_first_divergence"]
    assert fd and f"the re-run parts at step {fd['step']} on {fd['metric']}" in detail[0]["evidence"]
    assert fd["metric"] in detail[0]["rerun_outside"]
    assert [p.split("/")[-1] for p in detail[0]["rerun_runs"]] == ["scratch", "trl"]
    assert all("aligned-" in p for p in detail[0]["rerun_runs"])
    # and tensor by tensor: the first link of TRL's step that differs from the built-in loop's is the gradient, at
    # step 1 (the bug multiplies the aggregated loss, whose value is ~0 at a ratio of 1; rewards, advantages, mask,
    # log-probs, per-token losses and the loss's value agree), TRL's 1/1.5 of the built-in loop's
    first = detail[0]["tensor_diff"]["first"]
    assert (first["tensor"], first["step"]) == ("grad_norm", 1), detail[0]["tensor_diff"]
    assert "tensor by tensor" in detail[0]["evidence"] and "yours is 0.6667x the other's" in detail[0]["evidence"]


@pytest.mark.parametrize("overrides, quirk", [
    (['COMPLETION_MASK="no_eos"'], "COMPLETION_MASK"),
    (['COMPLETION_MASK="all"'], "COMPLETION_MASK"),
    (["LOGP_ON_RAW_LOGITS=true", "TEMPERATURE=0.7"], "LOGP_ON_RAW_LOGITS"),
    (['KL_ESTIMATOR="k1"', "BETA=0.5"], "KL_ESTIMATOR"),
    (["KL_IN_REWARD=true", "BETA=0.5"], "KL_IN_REWARD"),
    (["STD_EPS_INSIDE=true"], "STD_EPS_INSIDE"),  # at TRL's eps 1e-4: sqrt(var + 1e-4) vs std + 1e-4
    (["LOSS_SUM=true"], "LOSS_SUM"),
    (["REWARD_CLIP=0.2"], "REWARD_CLIP"),
])
def test_a_scratch_quirk_against_trl_is_explained_as_that_quirk(tmp_path, overrides, quirk):
    doc = run_matrix(small_spec(*overrides), tmp_path, "none", **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "diverged", cell.get("error")
    lead = cell["attribution_detail"][0]
    assert (lead["cause"], lead["status"]) == (f"quirk:{quirk}", "confirmed"), cell["attribution_detail"]
    assert "TRL" in lead["fix"]["sentence"] and lead["fix"]["trl"] == {}  # TRL has no setting: said plainly


def test_a_quirk_that_cannot_show_has_no_measured_effect(tmp_path):
    doc = run_matrix(small_spec("LOGP_ON_RAW_LOGITS=true"), tmp_path, "none", **QUIET)  # TEMPERATURE = 1
    detail = doc["cells"][0]["attribution_detail"]
    assert doc["cells"][0]["verdict"] == "parity"
    assert detail[0]["status"] == "no measured effect" and "TEMPERATURE = 1" in detail[0]["evidence"]


def test_a_tensor_walk_that_stops_short_says_so():
    """A walk that finds every tensor alike says whether it reached the step where the re-run parts: an H100 re-run
    parted at step 9 after 6 steps walked, and "the difference is elsewhere: the optimizer" was not what it showed."""
    from harness.diagnose.attribution import _nothing_walked

    short = _nothing_walked(6, 9)
    assert "parts at step 9, after them: the walk did not reach it" in short and "--tensor-steps 9" in short
    assert "elsewhere" not in short
    assert "elsewhere: the optimizer" in _nothing_walked(6, 4) and "did not reach" not in _nothing_walked(6, 6)
