"""Why your loop differs: loops that differ from TRL in 1, 2, 3 and 4 settings at once (TRL fields, optimizer fields,
settings read from the log, quirks TRL cannot set), each explained in full; the written [trl] table plus the named
quirks reproduce the loop. Also: a metric defined differently is not a divergence, a loop that skips steps is told
which, and the log's settings are read, not searched."""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest

from conftest import DEFAULT_SPEC, ROOT
from harness.diagnose.explain import Trial, settings_from_log, trl_fields
from harness.diagnose.matrix import format_verdict, run_matrix
from harness.experiment.spec import load_spec

EXAMPLE = f"{sys.executable} {ROOT / 'examples' / 'my_grpo.py'}"
QUIET = {"log": lambda *_: None}


def loop_spec(flags: str, *overrides: str):
    return load_spec(DEFAULT_SPEC, [f"loop.command={json.dumps(f'{EXAMPLE} {flags}')}", "STEPS=8", *overrides])


def explained(tmp_path, flags: str, *overrides: str) -> tuple[dict, dict]:
    doc = run_matrix(loop_spec(flags, *overrides), tmp_path, "none", **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "diverged", cell.get("error")
    return doc, cell["attribution_detail"][0]


CASES = {
    # one quirk TRL cannot set: found from the step-1 gradient alone
    "one": ("--std-eps 1e-8", {}, {"STD_EPS": 1e-08}),
    # the two-field loop: beta acts from step 2, adam_beta2 only from step 3
    "two": ("--beta 0.01 --adam-beta2 0.999", {"beta": 0.01, "adam_beta2": 0.999}, {}),
    # a schedule read from the log, an optimizer field, the eos out of the loss (weight decay 0.01 would be below
    # this 8-step run's noise: 3.7e-5 of the weights against a calibrated bound of 5.5e-5)
    "three": ("--lr-schedule linear --weight-decay 0.1 --no-eos-in-loss",
              {"lr_scheduler_type": "linear", "weight_decay": 0.1}, {"COMPLETION_MASK": "no_eos"}),
    # two quirks at step 1 at once (no single change explains step 1), a KL penalty and Adam's beta2
    "four": ("--std-eps 1e-8 --no-eos-in-loss --beta 0.01 --adam-beta2 0.999",
             {"beta": 0.01, "adam_beta2": 0.999}, {"STD_EPS": 1e-08, "COMPLETION_MASK": "no_eos"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_difference_is_found_and_the_table_plus_quirks_reproduce_the_loop(tmp_path, case):
    flags, trl, quirks = CASES[case]
    doc, found = explained(tmp_path / "a", flags)
    assert found["status"] == "confirmed", found["evidence"]
    assert found["fix"]["trl"] == trl and found["fix"]["scratch"] == quirks, found
    assert found["confirmed_by"]["scratch"] is True
    assert found["confirmed_by"]["trl"] is (True if not quirks else None)  # TRL itself, where no quirk is left
    table = (tmp_path / "a" / "your_loop_in_trl.toml").read_text()
    for key, value in trl.items():
        assert f"{key} = {json.dumps(value)}" in table, table
    for key in quirks:
        assert f"# {key} = " in table  # named, with the built-in loop's switch, not as a [trl] field
    text = format_verdict(doc)
    assert "found every difference" in text and all(k in text for k in [*trl, *quirks]), text
    # the table (and the quirks on the built-in loop) against the same loop: parity, checked from scratch
    sets = [f"trl.{k}={json.dumps(v)}" for k, v in trl.items()]
    if quirks:  # TRL cannot have them: the built-in loop, set up with the table's meaning and the quirks, is the side
        sets += ['loop.against="scratch"'] + [f"{k}={json.dumps(v)}" for k, v in quirks.items()]
        sets += [f"{k}={json.dumps(v)}" for k, v in _spec_of(trl).items()]
    again = run_matrix(loop_spec(flags, *sets), tmp_path / "b", "none", **QUIET)
    assert again["cells"][0]["verdict"] == "parity", again["cells"][0]["first_divergence"]


def _spec_of(trl: dict) -> dict:
    """The spec fields that mean these TRL fields (for the built-in loop as the other side)."""
    names = {"beta": "BETA", "adam_beta2": "ADAM_BETA2", "weight_decay": "WEIGHT_DECAY",
             "lr_scheduler_type": "LR_SCHEDULE"}
    return {names[k]: v for k, v in trl.items()}


def test_the_learning_rate_is_read_from_the_log_not_searched():
    spec = load_spec(DEFAULT_SPEC, ["STEPS=10"])
    steps = range(1, 11)
    linear = pd.DataFrame({"learning_rate": [5e-6 * (1 - (s - 1) / 10) for s in steps]}, index=list(steps))
    changes, said = settings_from_log(linear, spec)
    assert changes == {"LR": 5e-06, "LR_SCHEDULE": "linear"} and "read from your loop's logged" in said[0]
    flat = pd.DataFrame({"learning_rate": [3e-3] * 10}, index=list(steps))
    assert settings_from_log(flat, spec) == ({}, [])  # the spec's own rate and schedule
    odd = pd.DataFrame({"learning_rate": [1e-3, 5e-4, 1e-3, 2e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]},
                       index=list(steps))
    changes, said = settings_from_log(odd, spec)
    assert changes == {} and "follows no schedule" in said[0]


def test_trl_fields_name_what_trl_can_be_set_to_and_nothing_for_a_quirk():
    spec = load_spec(DEFAULT_SPEC)
    assert trl_fields(spec, {"BETA": 0.01, "KL_IS_CORRECTION": False}) == {"beta": 0.01, "use_bias_correction_kl": False}
    assert trl_fields(spec, {"LOSS_NORM": "token_global"}) == {"loss_type": "dapo"}
    assert trl_fields(spec, {"STD_EPS": 1e-8}) == {} and trl_fields(spec, {"COMPLETION_MASK": "no_eos"}) == {}


def test_a_candidate_is_judged_by_agreement_first():
    parts_late = Trial({"a": 1}, agree=3, outside=["loss"], far=9.0, ran=4, folder="")
    parts_early = Trial({"b": 1}, agree=1, outside=["loss"], far=0.1, ran=4, folder="")
    assert parts_late.better_than(parts_early) and not parts_early.better_than(parts_late)
    fewer = Trial({"c": 1}, agree=1, outside=["loss"], far=5.0, ran=4, folder="")
    more = Trial({"d": 1}, agree=1, outside=["loss", "grad_norm"], far=1.0, ran=4, folder="")
    assert fewer.better_than(more)
    barely = Trial({"e": 1}, agree=1, outside=["loss"], far=4.9, ran=4, folder="")
    assert not barely.better_than(fewer)  # a hair nearer is no reason to keep a field


def test_a_kl_averaged_otherwise_is_defined_differently_not_a_divergence(tmp_path):
    """The loop has TRL's KL penalty (the spec's BETA) but logs kl over its own, unshuffled micro-batches: loss,
    grad_norm and the weights agree, only kl parts."""
    doc = run_matrix(loop_spec("--kl-log round", "BETA=0.01"), tmp_path, "none", **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "parity", cell["first_divergence"]
    assert cell["defined_differently"] == ["kl"]
    assert "param_rel_l2" in cell["metrics"] and "grad_norm" in cell["metrics"]
    text = " ".join(format_verdict(doc).split())
    assert "kl (TRL's: a mean over each micro-batch's completion tokens" in text and "training agrees" in text, text


def test_a_loop_that_stops_short_is_told_the_steps_it_logged(tmp_path):
    from loop_runner.run import LoopError, train

    loop = tmp_path / "short.py"
    loop.write_text("from harness import loop as parity\n"
                    "for s in (1, 2, 4, 5):\n    parity.log_step(s, loss=0.0)\n")
    spec = load_spec(DEFAULT_SPEC, [f"loop.command={json.dumps(f'{sys.executable} {loop}')}", "STEPS=8"])
    with pytest.raises(LoopError, match=r"logged 4 steps \(1-2, 4-5; none for step 3\) and exited after step 5"):
        train(spec, tmp_path / "run")
