"""Every TRL schedule, end to end (issue 47, items 2 and 3): the spec's LR_SCHEDULER_KWARGS checked by field, and
loops with schedules of public loops (copies of examples/my_grpo.py with its rate line replaced) explained as the TRL
fields that reproduce them: a warmup longer than the run (it crashed the harness: exit 3), a cosine to a floor
(it was told "TRL has no setting" and given a rate 3% off). TRL with the written table is at parity with the loop."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import DEFAULT_SPEC, ROOT
from harness.diagnose.matrix import run_matrix
from harness.experiment.spec import SpecError, load_spec

QUIET = {"log": lambda *_: None}
RATE_LINE = "    lr = LR * (1 - step / STEPS) if LINEAR_LR else LR\n"


@pytest.mark.parametrize("overrides,words", [
    (['LR_SCHEDULE="cosine_with_min_lr"'], "needs one of min_lr_rate or min_lr"),
    (['LR_SCHEDULE="linear"', "LR_SCHEDULER_KWARGS={power = 2}"], "LR_SCHEDULER_KWARGS.power: linear takes no"),
    (['LR_SCHEDULE="polynomial"', "LR_SCHEDULER_KWARGS={lr_end = 1.0}"], "LR_SCHEDULER_KWARGS.lr_end: 1.0 must be below"),
    (['LR_SCHEDULE="warmup_stable_decay"'], "needs num_decay_steps"),
    (['LR_SCHEDULE="reduce_lr_on_plateau"'], "steps the rate on a metric"),
])
def test_schedule_parameters_are_checked_by_field(overrides, words):
    with pytest.raises(SpecError, match=words):
        load_spec(DEFAULT_SPEC, overrides)
    assert load_spec(DEFAULT_SPEC, ["WARMUP_STEPS=50", "STEPS=12"]).WARMUP_STEPS == 50  # (refused before)


def _loop(tmp_path, name: str, rate: str) -> str:
    source = (ROOT / "examples" / "my_grpo.py").read_text()
    assert RATE_LINE in source
    path = tmp_path / f"{name}.py"
    path.write_text(source.replace(RATE_LINE, f"    lr = {rate}\n"))
    return f"{sys.executable} {path}"


def _spec(command: str, *overrides: str):
    return load_spec(DEFAULT_SPEC, [f"loop.command={json.dumps(command)}", "STEPS=8", *overrides])


@pytest.mark.parametrize("name,rate,want", [
    ("warmup50", "LR * step / 50", {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 50}),
    ("cosine_floor", "LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / STEPS)))",
     {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}),
])
def test_a_public_loops_schedule_is_written_in_trls_fields_and_trl_follows_it(tmp_path, name, rate, want):
    command = _loop(tmp_path, name, rate)
    doc = run_matrix(_spec(command), tmp_path / "a", "none", **QUIET)
    cell = doc["cells"][0]
    found = cell["attribution_detail"][0]
    assert found["status"] == "confirmed", found
    assert found["fix"]["trl"] == want, found["fix"]
    table = (tmp_path / "a" / "your_loop_in_trl.toml").read_text()
    fields = [line.replace(" = ", "=", 1) for line in table.splitlines() if " = " in line and not line.startswith("#")]
    again = run_matrix(_spec(command, *(f"trl.{f}" for f in fields)), tmp_path / "b", "none", **QUIET)
    assert again["cells"][0]["verdict"] == "parity", (table, again["cells"][0]["first_divergence"])


_KNOWN = [  # (schedule, warmup, kwargs): the rates each gives over 12 steps at 1e-6, fitted back to the same fields
    ("constant", 0, {}), ("linear", 0, {}), ("constant", 3, {}), ("linear", 2, {}), ("constant", 50, {}),
    ("cosine", 0, {}), ("cosine", 2, {"num_cycles": 0.3}), ("cosine_with_min_lr", 3, {"min_lr_rate": 0.1}),
    ("polynomial", 0, {"power": 1.0, "lr_end": 4e-7}), ("polynomial", 2, {"power": 2.0, "lr_end": 1e-7}),
    ("inverse_sqrt", 3, {}), ("cosine_with_restarts", 0, {"num_cycles": 3}),
    ("warmup_stable_decay", 2, {"num_decay_steps": 4, "decay_type": "linear", "min_lr_ratio": 0.1}),
    ("warmup_stable_decay", 50, {"num_decay_steps": 0, "min_lr_ratio": 0.1}),
    ("cosine_warmup_with_min_lr", 3, {"min_lr_rate": 0.2, "num_cycles": 0.5}),
    ("cosine_warmup_with_min_lr", 4, {"min_lr_rate": 0.0, "warmup_lr_rate": 0.1, "num_cycles": 0.5}),
]


@pytest.mark.parametrize("schedule,warmup,kwargs", _KNOWN)
def test_each_family_is_fitted_back_to_its_own_fields(schedule, warmup, kwargs):
    from harness.diagnose.schedules import fit_schedule
    from scratch_grpo.core import lr_multiplier

    rates = {s: 1e-6 * lr_multiplier(s, schedule, 12, warmup, kwargs, lr=1e-6) for s in range(12)}
    fit = fit_schedule(rates, 12, 1e-5, {"LR": 1e-6, "LR_SCHEDULE": "constant", "WARMUP_STEPS": 0})
    assert fit is not None and (fit.peak, fit.schedule, fit.warmup) == (1e-6, schedule, warmup), fit
    assert fit.kwargs == kwargs, fit


def test_rates_no_trl_schedule_gives_are_not_fitted_and_two_rates_tell_no_shape():
    from harness.diagnose.schedules import fit_schedule

    halving = {s: 1e-6 * 0.5 ** (s // 4) for s in range(12)}  # torch's StepLR: no TRL schedule
    assert fit_schedule(halving, 12, 1e-5, {"LR": 1e-6}) is None
    two = {0: 1e-6, 1: 0.9e-6}  # linear over 10 steps? a cosine? two rates say only that they fall
    fit = fit_schedule(two, 12, 1e-3, {"LR": 1e-6})
    assert fit is None or fit.schedule in ("constant", "linear"), fit


def test_a_warmup_through_the_run_read_from_noisy_rates_is_written_with_its_round_peak():
    """A 23-step warmup to 1e-5 (align-anything's cosine over 768 steps, 3% warmup) seen over 12 steps through rates
    read from the weights, each off by up to 0.9%: only the rise per step is told, and of the peaks and warmups that
    give it the roundest is written: 1e-5 over 23 steps (the slope fitted to every rate, not the first rate alone,
    which gave 5.2e-6 over 12)."""
    from harness.diagnose.schedules import fit_schedule

    noise = [0.0087, -0.002, 0.0001, 0.0015, -0.0016, 0.0002, 0.0009, 0.0006, -0.0003, -0.0022, -0.0012]
    rates = {s: 1e-5 * s / 23 * (1 + e) for s, e in zip(range(1, 12), noise)}
    fit = fit_schedule(rates, 12, 0.01, {"LR": 3e-3, "LR_SCHEDULE": "constant", "WARMUP_STEPS": 0})
    assert fit is not None and (fit.peak, fit.schedule, fit.warmup) == (1e-5, "constant", 23), fit
