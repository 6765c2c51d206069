"""Why your loop differs: loops that differ from TRL in 1, 2, 3 and 4 settings at once (TRL fields, optimizer fields,
settings read from the log, quirks TRL cannot set), each explained in full; the written [trl] table plus the named
quirks reproduce the loop. Also: a metric defined differently is not a divergence, a loop that skips steps is told
which, and the log's settings are read, not searched."""

from __future__ import annotations

import math

import json
import sys
import tomllib

import pandas as pd
import pytest

from conftest import DEFAULT_SPEC, ROOT
from first_screen import check_report
from harness.diagnose.as_trl import scratch_as_trl, trl_fields
from harness.diagnose.logged import settings_from_log
from harness.diagnose.matrix import run_matrix
from harness.diagnose.search import Trial, trl_moves
from harness.diagnose.verdict import format_verdict
from harness.experiment.spec import load_spec

EXAMPLE = f"{sys.executable} {ROOT / 'examples' / 'my_grpo.py'}"


def _cell_of(spec, folder):
    """A cell of your loop whose run is folder/yours (what a pair would hold), with no rollouts."""
    from harness.diagnose.cell import CellData
    from harness.diagnose.runs import load_any_run

    return CellData(spec, folder, ("yours", "trl"), runs={"yours": load_any_run(folder / "yours")})
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
    "two": ("--beta 0.01 --adam-beta2 0.999 --no-tensors", {"beta": 0.01, "adam_beta2": 0.999}, {}),
    # a schedule read from the log, an optimizer field, the eos out of the loss (weight decay 0.01 would be below
    # this 8-step run's noise: 3.7e-5 of the weights against a calibrated bound of 5.5e-5)
    "three": ("--lr-schedule linear --weight-decay 0.1 --no-eos-in-loss --no-tensors",
              {"lr_scheduler_type": "linear", "weight_decay": 0.1}, {"COMPLETION_MASK": "no_eos"}),
    # two quirks at step 1 at once (no single change explains step 1: the tensor diff names both), a KL penalty and
    # Adam's beta2 (cases two and three save no tensors: the search alone)
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
    assert "found settings that reproduce your loop within tolerance" in " ".join(text.split()), text
    assert all(k in text for k in [*trl, *quirks]), text
    check_report(tmp_path / "a", f"my_grpo-{case}")  # the report on it: the answer on its first screen
    # the table (and the quirks on the built-in loop) against the same loop: parity, checked from scratch
    sets = [f"trl.{k}={json.dumps(v)}" for k, v in trl.items()]
    if quirks:  # TRL cannot have them: the built-in loop, set up with the table's meaning and the quirks, is the side
        sets += ['loop.against="scratch"'] + [f"{k}={json.dumps(v)}" for k, v in quirks.items()]
        sets += [f"{k}={json.dumps(v)}" for k, v in _spec_of(trl).items()]
    again = run_matrix(loop_spec(flags, *sets), tmp_path / "b", "none", **QUIET)
    assert again["cells"][0]["verdict"] == "parity", again["cells"][0]["first_divergence"]


def test_a_loss_with_trls_gradient_and_another_value_is_explained_on_the_gradient(tmp_path):
    """-logp * A in place of TRL's -ratio * A (nano-aha-moment's form): at ratio 1 the gradient is TRL's, the logged
    loss another number. The search parts on the loss alone at step 1, searches again on what training computes
    (grad_norm, the final weights), finds the loop's real difference (the population std, from the tensors) and
    confirms it, saying the loss differs in value alone; without the second search it ended 'suspected'."""
    doc, found = explained(tmp_path, "--pg-loss logp --std population")
    assert found["status"] == "confirmed", found["evidence"]
    assert found["fix"]["scratch"] == {"STD": "population"} and not found["fix"]["trl"], found["fix"]
    text = " ".join(found["evidence"].split())
    assert "your logged loss is defined otherwise in value (outside tolerance from step 1)" in text, text
    assert "grad_norm and the final weights agree at every compared step" in text, text
    assert "training agrees (loss," not in text, text  # the loss is not said to agree anywhere


def _spec_of(trl: dict) -> dict:
    """The spec fields that mean these TRL fields (for the built-in loop as the other side)."""
    names = {"beta": "BETA", "adam_beta2": "ADAM_BETA2", "weight_decay": "WEIGHT_DECAY",
             "lr_scheduler_type": "LR_SCHEDULE"}
    return {names[k]: v for k, v in trl.items()}


def test_the_learning_rate_is_read_from_the_log_not_searched():
    spec = load_spec(DEFAULT_SPEC, ["STEPS=10"])
    steps = range(1, 11)
    linear = pd.DataFrame({"learning_rate": [5e-6 * (1 - (s - 1) / 10) for s in steps]}, index=list(steps))
    changes, said, _ = settings_from_log(linear, spec)
    assert changes == {"LR": 5e-06, "LR_SCHEDULE": "linear"} and "read from your loop's logged" in said[0]
    flat = pd.DataFrame({"learning_rate": [3e-3] * 10}, index=list(steps))
    assert settings_from_log(flat, spec) == ({}, [], False)  # the spec's own rate and schedule
    odd = pd.DataFrame({"learning_rate": [1e-3, 5e-4, 1e-3, 2e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]},
                       index=list(steps))
    changes, said, ahead = settings_from_log(odd, spec)
    assert changes == {"LR_STEPS": list(odd["learning_rate"])} and "replays it step by step" in said[0] and not ahead


def test_a_learning_rate_logged_a_step_ahead_is_read_with_the_rates_the_weights_show():
    """Many loops log the rate after their scheduler stepped (the next step's). A named schedule: TRL's linear decay
    after a one-step warmup from 0, logged a step ahead, fits a linear decay without warmup too; the weights' step-1
    rate (0) tells them apart. A schedule of its own (a warmup to steps that halve the rate, torch's StepLR): the
    weights show each logged rate one step later, so the replayed rates are the log's shifted by one, the first from
    the weights."""
    spec = load_spec(DEFAULT_SPEC, ["STEPS=12"])
    steps = list(range(1, 13))
    own = [0.0] + [1e-6 * (12 - s) / 11 for s in range(1, 12)]  # the rate step s trains at (TRL: linear, warmup 1)
    logged = pd.DataFrame({"learning_rate": own[1:] + [0.0]}, index=steps)
    weights = [r * (1 + 0.002 * (-1) ** i) for i, r in enumerate(own)]  # as the optimizer stage reads them
    changes, said, ahead = settings_from_log(logged, spec, weights)
    assert changes == {"LR": 1e-06, "LR_SCHEDULE": "linear", "WARMUP_STEPS": 1} and ahead, (changes, said)
    changes, _, _ = settings_from_log(logged, spec)  # without the weights: the warmup's first step is not seen
    assert changes.get("WARMUP_STEPS") is None
    cosine = [0.0, 1.5e-3] + [3e-3 * 0.5 ** (s // 4) for s in range(10)]
    logged = pd.DataFrame({"learning_rate": cosine[1:] + [cosine[-1]]}, index=steps)
    weights = [None, *[r * (1 + 0.002 * (-1) ** i) for i, r in enumerate(cosine[1:], 1)]]  # (step 1: no gradient)
    changes, said, ahead = settings_from_log(logged, spec, weights)
    assert changes["LR_STEPS"] == pytest.approx(cosine, rel=1e-5) and ahead, (changes, said)
    as_logged = list(logged["learning_rate"])  # weights that agree with the log as it is: no shift
    changes, _, ahead = settings_from_log(logged, spec, as_logged)
    assert changes["LR_STEPS"] == pytest.approx(as_logged, rel=1e-5) and not ahead


def test_a_logged_schedule_is_written_in_trls_fields():
    """Schedules hand-written loops use, read from the logged rates as the TRL fields that reproduce them over the
    run: a cosine to a floor after a warmup, a linear decay over a horizon longer than the run (polynomial, lr_end
    = LR (H - STEPS) / H), a cosine over a longer horizon (num_cycles = 0.5 STEPS / H), a warmup longer than the run
    (the spec check refused it before: exit 3), torch's LinearLR warmup from 0.1 x LR over 50 steps (warmup_stable_
    decay's warmup from min_lr_ratio)."""
    spec = load_spec(DEFAULT_SPEC, ["STEPS=12", "LR=1e-6"])
    steps = list(range(1, 13))
    cases = {  # the rate of step s (0-based) -> the changes
        "cosine to 0.1 after 2": ([0.0, 5e-7] + [1e-7 + 9e-7 * 0.5 * (1 + math.cos(math.pi * s / 10)) for s in range(10)],
                                  {"LR_SCHEDULE": "cosine_with_min_lr", "WARMUP_STEPS": 2,
                                   "LR_SCHEDULER_KWARGS": {"min_lr_rate": 0.1}}),
        "linear over 20": ([1e-6 * (20 - s) / 20 for s in range(12)],
                           {"LR_SCHEDULE": "polynomial", "LR_SCHEDULER_KWARGS": {"power": 1.0, "lr_end": 4e-7}}),
        "cosine over 20": ([1e-6 * 0.5 * (1 + math.cos(math.pi * s / 20)) for s in range(12)],
                           {"LR_SCHEDULE": "cosine", "LR_SCHEDULER_KWARGS": {"num_cycles": 0.3}}),
        "warmup of 50": ([1e-6 * s / 50 for s in range(12)], {"WARMUP_STEPS": 50}),
        "LinearLR from 0.1 over 50": ([1e-6 * (0.1 + 0.9 * s / 50) for s in range(12)],
                                      {"LR_SCHEDULE": "warmup_stable_decay", "WARMUP_STEPS": 50,
                                       "LR_SCHEDULER_KWARGS": {"num_decay_steps": 0, "min_lr_ratio": 0.1}}),
    }
    for name, (rates, want) in cases.items():
        changes, said, ahead = settings_from_log(pd.DataFrame({"learning_rate": rates}, index=steps), spec)
        assert changes == want and not ahead, (name, changes, said)


def test_trl_fields_name_what_trl_can_be_set_to_and_nothing_for_a_quirk():
    spec = load_spec(DEFAULT_SPEC)
    assert trl_fields(spec, {"BETA": 0.01, "KL_IS_CORRECTION": False}) == {"beta": 0.01, "use_bias_correction_kl": False}
    assert trl_fields(spec, {"LOSS_NORM": "token_global"}) == {"loss_type": "dapo"}
    assert trl_fields(spec, {"STD_EPS": 1e-8}) == {} and trl_fields(spec, {"COMPLETION_MASK": "no_eos"}) == {}


TRL_TABLE = ("trl.learning_rate=1e-3", "trl.beta=0.01", "trl.reward_weights=[1.0, 1.0]")


def test_the_search_starts_from_trl_as_its_trl_table_sets_it_up():
    """`[trl]` overrides the built-in loop has a field for move into that field (TRL's configuration unchanged), and
    a change of one is the GRPOConfig field it sets, whether or not `[trl]` sets it: relative to the table, and
    nothing where the table already has the value (it was a quirk: `[trl] learning_rate` made LR move nothing)."""
    spec = load_spec(DEFAULT_SPEC, list(TRL_TABLE))
    base = scratch_as_trl(spec)
    assert (base.LR, base.BETA, list(base.rewards.weights), dict(base.trl)) == (1e-3, 0.01, [1.0, 1.0], {})
    assert trl_fields(spec, {"LR": 2e-3}) == {"learning_rate": 2e-3} == trl_fields(base, {"LR": 2e-3})
    assert trl_fields(spec, {"LR": 1e-3}) == {} and trl_moves(spec, {"LR": 1e-3}) == {"learning_rate": 1e-3}
    warm = load_spec(DEFAULT_SPEC, ['trl.lr_scheduler_type="constant_with_warmup"', "trl.warmup_steps=2"])
    assert (scratch_as_trl(warm).LR_SCHEDULE, scratch_as_trl(warm).WARMUP_STEPS, dict(scratch_as_trl(warm).trl)) == \
        ("constant", 2, {})  # the schedule moves once the warmup has


def test_a_loop_with_the_trl_tables_values_is_explained_relative_to_the_table(tmp_path):
    """A loop with the spec's `[trl]` learning rate, KL weight and reward weights, and Adam's beta2 0.999: the table
    written holds adam_beta2 alone, TRL run with it confirms, and nothing the table sets is named (the search
    started from the spec's own fields said LR, BETA and the weights were quirks TRL had no setting for)."""
    doc, found = explained(tmp_path, "--lr 1e-3 --beta 0.01 --reward-weights 1,1 --adam-beta2 0.999", *TRL_TABLE,
                           "STEPS=6")
    assert found["status"] == "confirmed", found["evidence"]
    assert found["fix"]["trl"] == {"adam_beta2": 0.999} and found["fix"]["scratch"] == {}, found["fix"]
    assert found["confirmed_by"]["trl"] is True
    assert [d["field"] for d in found["differences"]] == ["ADAM_BETA2"], found["differences"]
    assert "no setting" not in found["evidence"], found["evidence"]
    table = (tmp_path / "your_loop_in_trl.toml").read_text()
    assert tomllib.loads(table)["trl"] == {"adam_beta2": 0.999}, table
    assert "# confirmed, read from what your loop saved\nadam_beta2 = 0.999" in table, table  # (the Probe)


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


def test_a_one_difference_loop_is_identified_from_its_own_tensors(tmp_path):
    """The loop saves its first steps' tensors (harness.loop.tensors): its advantages, read against its own rewards,
    are the group's Bessel std + an epsilon below the run's resolution, said as such, and 1e-8 (the commonest such
    value) is the search's first guess (not settled: the run cannot tell it from values that small), confirmed over
    every step: nothing else searched, no TRL re-run (a quirk). The report lists the stages read."""
    doc, found = explained(tmp_path, "--std-eps 1e-8")
    adv = next(f for f in found["identified"] if f["stage"] == "advantages")
    assert adv["step"] == 1 and adv["settings"] == {"STD_EPS": 1e-08} and "cannot tell" in adv["unsettled"][0], adv
    assert "STD_EPS" not in adv["settles"]  # not settled: the search may still change it
    assert found["status"] == "confirmed" and found["fix"]["scratch"] == {"STD_EPS": 1e-08}
    assert found["differences"][0]["identified"]
    assert found["cost"]["runs"] <= 4  # the tensors, the spec as TRL, the guess over every step
    from reports.render import write_parity_report

    html = write_parity_report(tmp_path).read_text()
    assert "read from what your loop saved" in html and 'class="checks identified"' in html


def test_a_one_difference_loop_is_explained_by_the_tensor_diff_without_its_tensors_read(tmp_path, monkeypatch):
    """With the stages not read (identify finds nothing), the tensor diff names the advantages as the first link
    that differs, recomputes them with the std epsilon that gives the loop's, and that one guess is confirmed over
    every step: no candidate searched, no TRL re-run (a quirk). The report draws the chain."""
    from harness.diagnose import identify

    monkeypatch.setattr(identify, "identify", lambda *a, **k: [])
    doc, found = explained(tmp_path, "--std-eps 1e-8")
    diff = found["tensor_diff"]
    assert diff["first"]["tensor"] == "advantages" and diff["first"]["step"] == 1, diff["first"]
    assert {"STD_EPS": 1e-08} in diff["guesses"]
    assert [(c["tensor"], c["status"]) for c in diff["chain"][:3]] == [("rewards", "same"), ("advantages", "differs"),
                                                                      ("mask", "same")]
    assert found["status"] == "confirmed" and found["fix"]["scratch"] == {"STD_EPS": 1e-08}
    assert found["differences"][0]["from_tensors"] and found["trace"][0]["from_tensors"]
    assert found["confirmed_by"]["trl"] is None and not (tmp_path / "yours-vs-trl" / "explain" / "trl-with-table").exists()
    # the tensors, the spec as it is, the guess, and the run that reads the logged loss at every step (issue 47 item
    # 6: the step's sum or one micro-batch's): no candidate searched
    assert found["cost"]["runs"] <= 6
    from reports.render import write_parity_report

    html = write_parity_report(tmp_path).read_text()
    assert '<span class="link first">advantages' in html and "by the tensor diff" in html


def test_several_passes_over_a_round_are_explained_from_the_tensors_and_name_the_clip_bound(tmp_path, monkeypatch):
    """NUM_ITERATIONS = 2 (GRPO's mu; tiny-grpo's epochs_per_step): every step trains on the whole round, so the
    tensor diff compares them (it was skipped for any NUM_ITERATIONS > 1, and the search alone then kept a std
    epsilon of 1e-3 on a partial match and ended 'suspected'), and the second pass moves the ratio off 1, so an upper
    clip bound of 0.2 against the spec's 0.28 acts from step 2 and is named as TRL's epsilon_high. The example itself
    takes the two passes as TRL does (parity). Read from the loop's own tensors, the bound is the ratio its clipped
    tokens' terms use at step 2 (its old log-probs saved); without the stages read, the search names it at step 2."""
    from harness.diagnose import identify

    plain = run_matrix(loop_spec("", "NUM_ITERATIONS=2"), tmp_path / "plain", "none", **QUIET)
    assert plain["cells"][0]["verdict"] == "parity", plain["cells"][0]["first_divergence"]
    flags = "--std-eps 1e-8 --no-eos-in-loss --clip-high 0.2"
    doc, found = explained(tmp_path / "read", flags, "NUM_ITERATIONS=2")
    objective = next(f for f in found["identified"] if f["stage"] == "objective")
    assert objective["step"] == 2 and objective["settings"] == {"CLIP_HIGH": 0.2}, objective
    assert found["status"] == "confirmed" and found["fix"]["trl"] == {"epsilon_high": 0.2}, found["fix"]
    assert found["fix"]["scratch"] == {"STD_EPS": 1e-08, "COMPLETION_MASK": "no_eos"}, found["fix"]
    monkeypatch.setattr(identify, "identify", lambda *a, **k: [])
    doc, found = explained(tmp_path / "a", flags, "NUM_ITERATIONS=2")
    assert found["tensor_diff"]["first"]["tensor"] == "advantages", found.get("tensor_diff")
    assert found["status"] == "confirmed", found["evidence"]
    assert found["fix"]["trl"] == {"epsilon_high": 0.2}, found["fix"]
    assert found["fix"]["scratch"] == {"STD_EPS": 1e-08, "COMPLETION_MASK": "no_eos"}, found["fix"]
    clip = next(t for t in found["trace"] if "CLIP_HIGH" in t["changes"])
    assert clip["at_step"] == 2  # the first step whose policy is not the one that generated


def test_a_clip_bound_is_a_candidate_from_the_first_step_after_an_update():
    """With the ratio able to leave 1 (several passes or slices per round), a clip bound still cannot act at step 1:
    that step trains the policy that generated its round (ratio exactly 1). Offered there, the bounds took two of
    the pair search's eight places with changes that move nothing."""
    from harness.diagnose.search import options

    for sets in (["NUM_ITERATIONS=2"], ["STEPS_PER_GENERATION=2"]):
        clips = [o for o in options(load_spec(DEFAULT_SPEC, sets), set()) if o.key in ("CLIP_HIGH", "CLIP_LOW")]
        assert clips and all(o.acts_from == 2 for o in clips), (sets, clips)
    assert not [o for o in options(load_spec(DEFAULT_SPEC), set()) if o.key.startswith("CLIP_")]  # ratio 1 throughout


def test_what_counts_as_truncated_is_searched_only_with_truncated_completions_masked():
    """TRUNCATED_IF acts only through mask_truncated_completions: tried where it is on, never otherwise."""
    from harness.diagnose.search import options

    assert not [o for o in options(load_spec(DEFAULT_SPEC), set()) if o.key == "TRUNCATED_IF"]
    masked = [o for o in options(load_spec(DEFAULT_SPEC, ["MASK_TRUNCATED=true"]), set()) if o.key == "TRUNCATED_IF"]
    assert [(o.value, o.acts_from) for o in masked] == [("no_eos", 1)], masked


def test_tensor_patterns_name_the_mask_and_the_loss_normalisation():
    """Known answers: the eos dropped from the loss, and a loss aggregated over tokens, from hand-made tensors."""
    from harness.diagnose.tensordiff import diff

    spec = load_spec(DEFAULT_SPEC, ["GROUP_SIZE=2", "GRAD_ACCUM=1"])
    lengths = {1: [3, 2]}
    ref = {1: {"rewards": [1.0, 0.0], "mask": [[1, 1, 1], [1, 1, 0]], "logps": [[-1.0, -2.0, -0.5], [-1.5, -0.25, 0.0]]}}
    mine = {1: {"rewards": [1.0, 0.0], "mask": [[1, 1, 0], [1, 0, 0]], "logps": ref[1]["logps"]}}
    found = diff(mine, ref, spec, lengths, [2], False, ends_with_eos={1: [True, True]})
    assert found["first"]["tensor"] == "mask" and found["guesses"][0] == {"COMPLETION_MASK": "no_eos"}
    # the same mask, but those completions do not end with an eos: an off-by-one, not the eos left out
    off_by_one = diff(mine, ref, spec, lengths, [2], False, ends_with_eos={1: [False, False]})
    assert off_by_one["first"]["tensor"] == "mask" and {"COMPLETION_MASK": "no_eos"} not in off_by_one["guesses"]
    assert found["first"]["where"]["rows"] == 2 and found["first"]["where"]["first"] == {"group": 0, "sequence": 0,
                                                                                          "token": 2}
    per_token = [[0.5, -0.5, 1.0], [2.0, 1.0, 0.0]]
    token_mean = (0.5 - 0.5 + 1.0 + 2.0 + 1.0) / 5  # dapo: over every token of the step
    ref = {1: {"per_token_loss": per_token, "mask": [[1, 1, 1], [1, 1, 0]], "loss": (1.0 / 3 + 3.0 / 2) / 2}}
    mine = {1: {"per_token_loss": per_token, "mask": [[1, 1, 1], [1, 1, 0]], "loss": token_mean}}
    found = diff(mine, ref, spec, lengths, [2], False)
    assert found["first"]["tensor"] == "loss" and {"LOSS_NORM": "token_global"} in found["guesses"]
    assert diff(ref, ref, spec, lengths, [2], False)["first"] is None


def test_empty_skip_drops_the_micro_batch_that_holds_an_eos_only_completion(tmp_path):
    """EMPTY_SKIP (tiny-grpo's `if not loss.isfinite(): continue`): with the eos out of the loss an eos-only
    completion has no loss token; with one micro-batch per step the whole step's backward is skipped (grad_norm 0,
    loss 0), while without the quirk the step trains on the other completions."""
    from harness.experiment.models import checkpoint_dir, eos_token_ids, generation_config, load_tokenizer
    from harness.runlog.log import read_run
    from scratch_grpo.train import train

    sets = ["STEPS=2", "GRAD_ACCUM=1", 'COMPLETION_MASK="no_eos"', 'rewards.functions=["noise"]', "rewards.weights=[1.0]"]
    ckpt = checkpoint_dir(load_spec(DEFAULT_SPEC, sets))  # a seeded noise reward: every group has advantages
    eos = eos_token_ids(generation_config(ckpt), load_tokenizer(ckpt))[0]

    def source(round_idx, prompt_ids, policy):  # the first completion of round 0 is the eos alone
        return [[eos] if (round_idx, i) == (0, 0) else [5 + i % 7, 6, eos] for i in range(len(prompt_ids))], None

    runs = {}
    for skip in (False, True):
        quirk = load_spec(DEFAULT_SPEC, [*sets, f"EMPTY_SKIP={str(skip).lower()}"])
        runs[skip] = read_run(train(quirk, tmp_path / str(skip), rollout_source=source, progress=False))
    assert runs[True]["grad_norm"].iloc[0] == 0.0 and runs[True]["loss"].iloc[0] == 0.0
    assert runs[False]["grad_norm"].iloc[0] > 0.0
    assert runs[True]["grad_norm"].iloc[1] > 0.0  # round 1 has no empty completion: it trains


def test_a_trial_is_judged_over_the_steps_asked_not_over_the_steps_it_ran():
    """A trial run earlier to step 5 and asked again for 3 steps is judged over 3 (its parting, how far); asked to
    stop where it parts, over the steps until then."""
    from harness.diagnose.search import _judged

    per_step = (([], 0.0, 0.2), ([], 0.0, 0.3), (["loss"], 1.5, 0.0), ([], 0.0, 0.1), (["grad_norm"], 2.0, 0.0))
    t = Trial({"a": 1}, agree=-1, outside=[], far=0.0, ran=5, folder="", per_step=per_step)
    two = _judged(t, 2, False)
    assert (two.agree, two.outside, two.far, round(two.near, 6)) == (2, [], 0.0, 0.5)
    five = _judged(t, 5, False)
    assert (five.agree, five.outside, five.far) == (2, ["loss"], 3.5)
    parted = _judged(t, 5, True)
    assert (parted.agree, parted.outside, parted.far) == (2, ["loss"], 1.5)


def test_tensor_diff_takes_column_tensors_and_leaves_an_upstream_loss_alone():
    """(N, 1) advantages compare as (N,); a loss that your own per-token losses give under the spec's own loss_type
    is not named as a normalisation (the difference is upstream)."""
    from harness.diagnose.tensordiff import diff

    spec = load_spec(DEFAULT_SPEC, ["GROUP_SIZE=2", "GRAD_ACCUM=1", 'LOSS_NORM="token_global"'])
    same = {1: {"advantages": [[0.5], [-0.5]]}}
    assert diff(same, {1: {"advantages": [0.5, -0.5]}}, spec, {1: [2, 2]}, [2], False)["first"] is None
    per_token, mask = [[0.5, 1.0], [2.0, 0.0]], [[1, 1], [1, 0]]
    mine = {1: {"per_token_loss": per_token, "mask": mask, "loss": 3.5 / 3}}
    ref = {1: {"per_token_loss": [[0.5, 1.0], [1.0, 0.0]], "mask": mask, "loss": 2.5 / 3}}
    found = diff(mine, ref, spec, {1: [2, 2]}, [2], False)
    assert found["first"]["tensor"] == "per_token_loss"
    loss_link = next(c for c in found["chain"] if c["tensor"] == "loss")
    assert not loss_link.get("exact") and not loss_link.get("candidates")


def test_a_log_prob_your_loss_does_not_count_is_not_compared():
    """nanochat scores no eos token (its loss leaves it out) and a user saves 0 there: the forward pass agrees on every
    token the loss counts, so the log-probs are the same link; the mask is the one that differs (the eos left out)."""
    from harness.diagnose.tensordiff import diff

    spec = load_spec(DEFAULT_SPEC, ["GROUP_SIZE=2", "GRAD_ACCUM=1"])
    mine = {1: {"mask": [[1, 1, 0], [1, 1, 1]], "logps": [[-1.0, -2.0, 0.0], [-0.5, -0.25, -3.0]]}}
    ref = {1: {"mask": [[1, 1, 1], [1, 1, 1]], "logps": [[-1.0, -2.0, -3.5], [-0.5, -0.25, -3.0]]}}
    found = diff(mine, ref, spec, {1: [3, 3]}, [2], False, ends_with_eos={1: [True, False]})
    links = {c["tensor"]: c["status"] for c in found["chain"]}
    assert links["logps"] == "same" and links["mask"] == "differs" and found["first"]["tensor"] == "mask", found
    mine[1]["logps"][0][1] = -2.5  # a counted token that differs still does
    assert {c["tensor"]: c["status"] for c in diff(mine, ref, spec, {1: [3, 3]}, [2], False)["chain"]}["logps"] == \
        "differs"


def test_a_loss_divided_by_positions_outside_the_completions_is_named_with_its_divisor():
    """nano-aha-moment divides the masked per-token losses' sum by every position of its padded batch (prompt and
    padding included) and logs the mean of its micro-batches' losses: the divisor is named from your own tensors,
    by hand here (sum 3.5 over 3 tokens, 2 completions, 5 positions each: 10, and 20 logged over 2 micro-batches),
    even when the per-token losses before it differ too (nano's -logp * A is not TRL's -ratio * A in value)."""
    from harness.diagnose.tensordiff import diff, divisor_words

    spec = load_spec(DEFAULT_SPEC, ["GROUP_SIZE=2", "GRAD_ACCUM=2", 'LOSS_NORM="token_global"'])
    per_token, mask = [[0.5, 1.0], [2.0, 0.0]], [[1, 1], [1, 0]]
    mine = {1: {"per_token_loss": per_token, "mask": mask, "loss": 3.5 / 20}}
    ref = {1: {"per_token_loss": [[0.5, 1.0], [1.0, 0.0]], "mask": mask, "loss": 2.5 / 3}}
    found = diff(mine, ref, spec, {1: [2, 2]}, [2], False)
    loss_link = next(c for c in found["chain"] if c["tensor"] == "loss")
    assert loss_link.get("independent") and not loss_link.get("candidates"), loss_link
    how = loss_link["how"]
    assert "divided by 20 (10 if what you log is the mean of your 2 micro-batches' losses)" in how, how
    assert "the mask holds 3 tokens in 2 completions, the longest 2" in how, how
    assert "10 is 5 per completion, more than the longest completion" in how, how
    assert "token_local, is not recomputed with GRAD_ACCUM above 1" in how, how
    within = diff({1: {**mine[1], "loss": 3.5 / 6}}, ref, spec, {1: [2, 2]}, [2], False)  # 1.5 per completion
    how = next(c for c in within["chain"] if c["tensor"] == "loss")["how"]
    assert "divided by 6 (3 if" in how and "more than the longest" not in how, how
    for loss, words in ((0.0, "your loss is 0: no divisor"), (float("nan"), "your loss is nan: no divisor")):
        assert divisor_words([0.5, 2.0], [2, 1], loss, 1) == (f"{words} can be read from it", False)
        link = next(c for c in diff({1: {**mine[1], "loss": loss}}, ref, spec, {1: [2, 2]}, [2], False)["chain"]
                    if c["tensor"] == "loss")
        assert not link.get("independent"), link  # nothing read: left as a consequence of what differs upstream
    said, read = divisor_words([0.5, 1.0, -1.5], [2, 1, 1], 1e-3, 1)  # the sum cancels: 0 / 1e-3 is no divisor
    assert "sum to nearly 0 (they cancel)" in said and not read, said


def test_what_the_tensors_recompute_exactly_is_not_searched_again():
    """An exact finding settles its fields: advantages recomputed with the population std leave scale_rewards out of
    the search (nano-aha-moment divides by a population std, and the search once also kept scale_rewards = "none"
    because it shrank a gradient that the loop's own divisor had shrunk)."""
    from harness.diagnose.explain import SETTLES, settled_by

    chain = [{"tensor": "advantages", "status": "differs", "exact": True, "candidates": [{"STD": "population"}]},
             {"tensor": "loss", "status": "differs", "how": "...", "candidates": [], "own_inputs": True},
             {"tensor": "mask", "status": "differs", "candidates": [{"COMPLETION_MASK": "all"}]}]
    assert set(settled_by({"chain": chain})) == set(SETTLES["advantages"]) and "ADV_SCALE" in SETTLES["advantages"]
    assert settled_by(None) == () and settled_by({"chain": chain[1:]}) == ()
    # candidates the diff found alike settle only what they agree on: the epsilon stays open to the search
    alike = [{**chain[0], "candidates": [{"STD": "population"}, {"STD": "population", "STD_EPS": 1e-8}]}]
    assert set(settled_by({"chain": alike})) == {"ADV_SCALE", "STD", "STD_EPS_INSIDE"}


def test_a_warm_model_starts_each_run_from_the_checkpoint_as_a_fresh_load(tmp_path):
    """The search keeps one loaded model across candidates (`Warm`): a run after another run with other settings
    (a KL reference, a higher lr, its weights trained away from the checkpoint and gradients left mid-way by an
    early stop) logs exactly what a run on a freshly loaded model logs, step by step and weight by weight."""
    import numpy as np

    from harness.experiment.models import Warm
    from harness.runlog.log import read_run
    from harness.runlog.params import SKETCH_FILE
    from scratch_grpo.train import train

    spec = load_spec(DEFAULT_SPEC, ["STEPS=3"])
    other = load_spec(DEFAULT_SPEC, ["STEPS=3", "LR=0.05", "BETA=0.04"])
    fresh = train(spec, tmp_path / "fresh", progress=False)
    warm = Warm()
    train(other, tmp_path / "other", progress=False, warm=warm, stop_when=lambda row: int(row["step"]) >= 2)
    again = train(spec, tmp_path / "again", progress=False, warm=warm)
    assert warm.loads == 1  # the second run did not load the checkpoint
    a, b = read_run(fresh), read_run(again)
    for col in ("loss", "grad_norm", "kl", "reward"):
        if col in a:
            assert a[col].tolist() == b[col].tolist(), col
    sketch = [np.fromfile(run / SKETCH_FILE, dtype=np.float32) for run in (fresh, again)]
    assert sketch[0].size > 0 and np.array_equal(sketch[0], sketch[1])


def test_a_change_below_the_runs_rounding_is_not_kept_though_it_brings_a_step_inside(tmp_path, monkeypatch):
    """In bf16 a change that only perturbs the rounding can push a step back inside tolerance. The search keeps a
    field only if it moves some metric beyond the bound from the current set: in a world where beta = 0.04 moves
    the loss by 0.1 from step 2 and a std epsilon of 1e-8 moves it by 0.8 of the bound at step 4, where your loop is
    1.5 bounds away, beta is kept and the epsilon is not; the search says where it stopped and why."""
    import scratch_grpo.train
    from harness.diagnose.compare import load_tolerances, tolerance_for
    from harness.diagnose.explain_words import below_rounding_words
    from harness.diagnose.search import Search

    t = tolerance_for(load_tolerances(), "lockstep", "float32", "loss")
    bound = t.get("atol", 0.0) + t.get("rtol", 0.0) * 1.1

    def loss(step, beta, std_eps):
        return 1.0 + (0.1 if beta == 0.04 and step >= 2 else 0.0) + (0.8 * bound if std_eps == 1e-8 and step == 4
                                                                     else 0.0)

    def fake_train(spec, folder, rollout_source=None, progress=False, stop_when=None, warm=None, **_):
        for step in range(1, spec.STEPS + 1):
            if stop_when({"step": step, "loss": loss(step, spec.BETA, spec.STD_EPS), "grad_norm": 1.0}):
                return

    monkeypatch.setattr(scratch_grpo.train, "train", fake_train)
    base = load_spec(DEFAULT_SPEC, ["STEPS=5", "BETA=0.0"])
    yours = pd.DataFrame([{"step": s, "loss": loss(s, 0.04, 1e-4) + (1.5 * bound if s == 4 else 0.0),
                           "grad_norm": 1.0} for s in range(1, 6)]).set_index("step", drop=False)
    search = Search(base, yours, [], tmp_path, log=lambda *_: None)
    state, trace = search.run({})
    assert state.changes == {"BETA": 0.04} and state.agree == 3, (state.changes, state.agree)
    assert [t["changes"] for t in trace] == [{"BETA": 0.04}] and trace[0]["moves"]
    assert search.below_rounding["at_step"] == 4 and {"STD_EPS": 1e-8} in search.below_rounding["changes"]
    assert "cannot be told from rounding" in below_rounding_words(search.below_rounding, "bfloat16")
    record = json.loads((tmp_path / "search.json").read_text())
    assert [r["at_step"] for r in record["rounds"]] == [2, 4] and record["stopped_below_rounding"]["at_step"] == 4


def test_a_search_stopped_below_bf16_rounding_is_run_again_in_float32(tmp_path, monkeypatch):
    """The world of the test above, with your loop in bf16 (its 1.5 bounds at step 4 are its own rounding) and in
    float32 (none): the bf16 search keeps beta and stops below rounding at step 4; in_float32 re-runs your loop and
    the search in float32 on the same rollouts, starting from beta, and reaches parity with beta alone."""
    import dataclasses

    import loop_runner.run
    import scratch_grpo.train
    from harness.diagnose.compare import load_tolerances, tolerance_for
    from harness.diagnose.explain import in_float32
    from harness.diagnose.explain_words import escalated_words
    from harness.diagnose.search import Search

    t = tolerance_for(load_tolerances(), "lockstep", "float32", "loss")
    bound = t.get("atol", 0.0) + t.get("rtol", 0.0) * 1.1

    def loss(step, beta, std_eps, rounding=0.0):
        return (1.0 + (0.1 if beta == 0.04 and step >= 2 else 0.0)
                + (0.8 * bound if std_eps == 1e-8 and step == 4 else 0.0) + (rounding if step == 4 else 0.0))

    def fake_train(spec, folder, rollout_source=None, progress=False, stop_when=None, warm=None, **_):
        for step in range(1, spec.STEPS + 1):
            if stop_when({"step": step, "loss": loss(step, spec.BETA, spec.STD_EPS), "grad_norm": 1.0}):
                return

    def fake_loop(spec, out_dir, rollouts=None, progress=False, log=print):  # your loop, as it runs in spec.DTYPE
        assert spec.DTYPE == "float32" and rollouts.name == "loop_rollouts.jsonl"
        out_dir.mkdir(parents=True)
        (out_dir / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": loss(s, 0.04, 1e-4), "grad_norm": 1.0}) + "\n" for s in range(1, 6)))
        return out_dir

    monkeypatch.setattr(scratch_grpo.train, "train", fake_train)
    monkeypatch.setattr(loop_runner.run, "train", fake_loop)
    spec = load_spec(DEFAULT_SPEC, ["STEPS=5", "BETA=0.0", 'TOLERANCE="static"'])
    bf16 = dataclasses.replace(spec, DTYPE="bfloat16")  # as on a GPU (the spec's check refuses bf16 on a CPU)
    (tmp_path / "yours").mkdir()
    rows = [{"step": s, "loss": loss(s, 0.04, 1e-4, 1.5 * bound), "grad_norm": 1.0} for s in range(1, 6)]
    (tmp_path / "yours" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    yours = pd.DataFrame(rows).set_index("step", drop=False)
    search = Search(spec, yours, [], tmp_path / "explain", log=lambda *_: None)
    state, _trace = search.run({})
    assert state.changes == {"BETA": 0.04} and search.below_rounding["at_step"] == 4
    cell = _cell_of(spec, tmp_path)
    assert in_float32(spec, cell, search, state, {}, log=lambda *_: None) is None  # float32 already
    out = in_float32(bf16, cell, search, state, {}, log=lambda *_: None)
    assert out is not None
    spec32, again, state32, _trace32, cell32 = out
    assert spec32.DTYPE == "float32" and cell32.folder == tmp_path / "explain" / "float32"
    assert cell32.yours is not None and cell32.spec.DTYPE == "float32"
    assert state32.changes == {"BETA": 0.04} and state32.agree == 5, (state32.changes, state32.agree)
    assert again.escalated_from["at_step"] == 4 and again.escalated_from["agree"] == 3
    assert again.escalated_from["loop_ignores_dtype"] is False  # the same step-1 loss in any dtype is no sign
    assert "re-run in float32" in escalated_words(again.escalated_from, "bfloat16")


def test_reward_weights_are_fitted_from_each_functions_scores():
    """Known answers: rewards = 2 * a + 0.5 * b gives [2, 0.5]; rewards no weighting gives, or scores that cannot
    tell the weights apart (b a copy of a), give None. In the diff, rewards weighted otherwise are TRL's
    reward_weights, an exact guess (it was 'TRL has no setting')."""
    from harness.diagnose.tensordiff import diff, fit_reward_weights

    a, b = [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]
    rewards = [2 * x + 0.5 * y for x, y in zip(a, b)]
    assert fit_reward_weights(rewards, {"a": a, "b": b}, 1e-6, 1e-6) == [2.0, 0.5]
    assert fit_reward_weights([1.0, 0.0, 0.0, 1.0], {"a": a, "b": b}, 1e-6, 1e-6) is None  # xor: no weighting
    assert fit_reward_weights(rewards, {"a": a, "b": list(a)}, 1e-6, 1e-6) is None
    spec = load_spec(DEFAULT_SPEC, ["GROUP_SIZE=2", "GRAD_ACCUM=1"])  # weights [1.0, 0.5]
    scores = {1: {"reward_correct": a, "reward_format": b}}
    mine = {1: {"rewards": [x + y for x, y in zip(a, b)]}}
    ref = {1: {"rewards": [x + 0.5 * y for x, y in zip(a, b)]}}
    found = diff(mine, ref, spec, {1: [2] * 4}, [2], False, scores=scores)
    assert found["first"]["tensor"] == "rewards" and found["first"]["exact"], found["first"]
    assert found["guesses"][0] == {"rewards.weights": [1.0, 1.0]}
    other = diff({1: {"rewards": [1.0, 0.0, 0.0, 1.0]}}, ref, spec, {1: [2] * 4}, [2], False, scores=scores)
    assert not other["first"].get("exact") and other["first"]["trl_setting"].startswith("none")


def test_a_loops_reward_weights_are_read_from_its_logged_reward(tmp_path):
    """A loop that weighs the spec's two reward functions 1:1 (the spec 1:0.5; aburkov/theLMbook's GRPO.py adds its
    two scores) is TRL with reward_weights = [1.0, 1.0], read from its logged mean reward, confirmed by TRL."""
    doc, found = explained(tmp_path, "--reward-weights 1,1 --no-tensors")
    assert found["status"] == "confirmed", found["evidence"]
    assert found["fix"]["trl"] == {"reward_weights": [1.0, 1.0]} and found["fix"]["scratch"] == {}, found["fix"]
    assert found["differences"][0]["read_from_log"] and found["confirmed_by"]["trl"] is True
    assert "reward_weights = [1.0, 1.0]" in (tmp_path / "your_loop_in_trl.toml").read_text()


def test_a_logged_reward_that_is_the_spec_weights_times_a_factor_is_not_read_as_weights():
    """A loop that logs the sum of its rewards (16x the mean) fits weights 16 x [1, 0.5]: that is how it logs, not
    how it weighs (group-scaled advantages ignore the factor); other proportions are weights."""
    from harness.diagnose.logged import reward_weights_from_log

    spec = load_spec(DEFAULT_SPEC)  # weights [1.0, 0.5]
    rounds = [{"reward_correct": [1.0, 0.0, 1.0, 1.0], "reward_format": [1.0, 1.0, 0.0, 1.0]},
              {"reward_correct": [0.0, 0.0, 1.0, 0.0], "reward_format": [1.0, 1.0, 1.0, 1.0]}]
    means = [(sum(r["reward_correct"]) / 4, sum(r["reward_format"]) / 4) for r in rounds]
    summed = pd.DataFrame({"reward": [16 * (c + 0.5 * f) for c, f in means]}, index=[1, 2])
    assert reward_weights_from_log(summed, spec, rounds) == ({}, [])
    other = pd.DataFrame({"reward": [c + f for c, f in means]}, index=[1, 2])
    assert reward_weights_from_log(other, spec, rounds)[0] == {"rewards.weights": [1.0, 1.0]}


def test_log_probs_parting_after_a_clean_step_are_checked_at_that_step(tmp_path):
    """Weight decay 0.1 leaves step 1's tensors alone and moves step 2's log-probs. Each candidate for the first
    update is checked at step 2, where it acts: at step 1 every candidate agrees, and the first of them (weight decay
    0.01) was taken as exact."""
    doc, found = explained(tmp_path, "--weight-decay 0.1 --no-probe")  # (with the probe: identified, below)
    first = found["tensor_diff"]["first"]
    assert (first["step"], first["tensor"]) == (2, "logps"), first
    assert first.get("exact") and first["candidates"] == [{"WEIGHT_DECAY": 0.1}], first
    assert found["status"] == "confirmed" and found["fix"]["trl"] == {"weight_decay": 0.1}, found["fix"]


def test_old_log_probs_equal_to_the_current_ones_are_not_named():
    """A loop that saves old log-probs from an extra pass at the same weights (equal to its log-probs) takes what
    TRL takes: no 'a pass of their own' link; old log-probs that differ still are one."""
    from harness.diagnose.tensordiff import diff

    spec = load_spec(DEFAULT_SPEC, ["GROUP_SIZE=2", "GRAD_ACCUM=1"])
    logps = [[-1.0, -2.0], [-0.5, -0.25]]
    ref = {1: {"rewards": [1.0, 0.0], "logps": logps}}
    same = diff({1: {**ref[1], "old_logps": logps}}, ref, spec, {1: [2, 2]}, [2], False)
    assert not any(c.get("only_yours") for c in same["chain"])
    apart = diff({1: {**ref[1], "old_logps": [[-1.0, -2.5], [-0.5, -0.25]]}}, ref, spec, {1: [2, 2]}, [2], False)
    assert any(c.get("only_yours") and c["tensor"] == "old_logps" for c in apart["chain"])


def test_clip_thresholds_that_reproduce_the_loop_alike_are_all_named():
    """Known answer: logged norms 0.007, 0.58, 0.9, 2.0; 0.1 and 0.5 both reproduce the loop (theLMbook's clips at
    0.1; the search keeps 0.5): both named, with the steps each clips, and which one the table holds."""
    from harness.diagnose.explain_words import clip_alike_words

    said = clip_alike_words(0.5, [0.1], [0.9, 0.007, 2.0, 0.58], 30)
    assert said.startswith("max_grad_norm: 0.1 and 0.5 each reproduce your loop over all 30 steps"), said
    assert "of the 4 your loop logged: 0.1: 3, 0.5: 3" in said and said.endswith("the table says 0.5"), said
    assert "0: 0, 0.1: 3" in clip_alike_words(0.1, [0.0], [0.9, 0.007, 2.0, 0.58], 30)


@pytest.mark.parametrize("settle", [True, False])
def test_a_settled_field_is_never_offered_to_the_search(tmp_path, monkeypatch, settle):
    """At the Search level: the exact guess (the population std) is kept and settles the advantages' fields, so no
    later round tries ADV_SCALE, STD_EPS or STD_EPS_INSIDE, though the search goes on to a later step (beta from step
    2). Without `settles` the same rounds do try them (what the nano-aha-moment search once kept by mistake)."""
    import scratch_grpo.train
    from harness.diagnose.explain import SETTLES
    from harness.diagnose.search import Search

    tried: list[dict] = []

    def loss(step, spec):
        return 1.0 + (0.3 if spec.STD == "population" else 0.0) + (0.1 if spec.BETA == 0.04 and step >= 2 else 0.0)

    def fake_train(spec, folder, rollout_source=None, progress=False, stop_when=None, warm=None, **_):
        tried.append({k: getattr(spec, k) for k in SETTLES["advantages"]})
        for step in range(1, spec.STEPS + 1):
            if stop_when({"step": step, "loss": loss(step, spec), "grad_norm": 1.0}):
                return

    monkeypatch.setattr(scratch_grpo.train, "train", fake_train)
    base = load_spec(DEFAULT_SPEC, ["STEPS=4", "BETA=0.0", 'STD="bessel"'])
    yours_spec = load_spec(DEFAULT_SPEC, ["STEPS=4", "BETA=0.04", 'STD="population"'])
    yours = pd.DataFrame([{"step": s, "loss": loss(s, yours_spec), "grad_norm": 1.0}
                          for s in range(1, 5)]).set_index("step", drop=False)
    search = Search(base, yours, [], tmp_path, log=lambda *_: None)
    state, trace = search.run({}, [{"STD": "population"}], exact_first=True,
                              settles=SETTLES["advantages"] if settle else ())
    assert state.changes == {"STD": "population", "BETA": 0.04} and state.agree == 4, state.changes
    assert trace[0]["from_tensors"] and trace[1]["changes"] == {"BETA": 0.04}
    others = {(k, v) for t in tried for k, v in t.items() if k != "STD" and v != getattr(base, k)}
    if settle:
        assert search.settled == set(SETTLES["advantages"]) and not others, others
    else:
        assert {k for k, _ in others} >= {"ADV_SCALE", "STD_EPS", "STD_EPS_INSIDE"}, others


def test_a_float32_search_after_the_loss_in_value_only_pass_also_judges_without_the_loss(tmp_path, monkeypatch):
    """Your loop's loss is 3 higher than TRL's from step 2 in value alone (its grad_norm agrees); beta acts on the
    grad_norm from step 2 and a std epsilon moves it by 0.8 bounds at step 4, where your bf16 run is 1.5 bounds off
    by its own rounding. The bf16 search (judged without the loss from step 2) keeps beta and stops below rounding;
    the float32 re-run judges as it did (no loss column), so it reaches parity with beta alone, where a float32
    search judged on the loss would part at step 2."""
    import dataclasses

    import loop_runner.run
    import scratch_grpo.train
    from harness.diagnose.compare import load_tolerances, tolerance_for
    from harness.diagnose.explain import in_float32
    from harness.diagnose.search import Search

    t = tolerance_for(load_tolerances(), "lockstep", "float32", "grad_norm")
    bound = t.get("atol", 0.0) + t.get("rtol", 0.0) * 1.1

    def grad_norm(step, beta, std_eps, rounding=0.0):
        return (1.0 + (0.1 if beta == 0.04 and step >= 2 else 0.0)
                + (0.8 * bound if std_eps == 1e-8 and step == 4 else 0.0) + (rounding if step == 4 else 0.0))

    def yours_rows(rounding):
        return [{"step": s, "loss": 1.0 + (3.0 if s >= 2 else 0.0), "grad_norm": grad_norm(s, 0.04, 1e-4, rounding)}
                for s in range(1, 6)]

    def fake_train(spec, folder, rollout_source=None, progress=False, stop_when=None, warm=None, **_):
        for step in range(1, spec.STEPS + 1):
            if stop_when({"step": step, "loss": 1.0, "grad_norm": grad_norm(step, spec.BETA, spec.STD_EPS)}):
                return

    def fake_loop(spec, out_dir, rollouts=None, progress=False, log=print):  # your loop in float32: no rounding
        out_dir.mkdir(parents=True)
        (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in yours_rows(0.0)))
        return out_dir

    monkeypatch.setattr(scratch_grpo.train, "train", fake_train)
    monkeypatch.setattr(loop_runner.run, "train", fake_loop)
    spec = load_spec(DEFAULT_SPEC, ["STEPS=5", "BETA=0.0", 'TOLERANCE="static"'])  # judged on float32's bound
    (tmp_path / "yours").mkdir()
    rows = yours_rows(1.5 * bound)
    (tmp_path / "yours" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    search = Search(spec, pd.DataFrame(rows).set_index("step", drop=False), [], tmp_path / "explain",
                    log=lambda *_: None)
    search.without_loss(2)
    state, _trace = search.run({})
    assert state.changes == {"BETA": 0.04} and search.below_rounding["at_step"] == 4, state.changes
    out = in_float32(dataclasses.replace(spec, DTYPE="bfloat16"), _cell_of(spec, tmp_path), search, state, {},
                     log=lambda *_: None)
    assert out is not None
    _spec32, again, state32, _trace32, _cell32 = out
    assert again.value_only == 2 and "loss" not in again.judge.columns
    assert state32.changes == {"BETA": 0.04} and state32.agree == 5, (state32.changes, state32.agree)
    assert json.loads((tmp_path / "explain" / "float32" / "search" / "search.json").read_text())[
        "loss_in_value_only_from"] == 2


def test_the_float32_check_settles_a_field_only_at_exactly_the_value_it_starts_from():
    """A beta2 of 0.9999 read from your float32 tensors is not TRL's 0.999 (2e-3 apart: alike for a fitted rate, not
    for a setting); a value that differs in its last bits only is the same setting. (`_same`: the search's own
    comparison of settings, which float32_settles calls.)"""
    from harness.diagnose.explain import _same as _same_value

    assert not _same_value(0.9999, 0.999) and not _same_value(1e-4, 1e-6)
    assert _same_value(1e-6, 1.0000000000000002e-06) and _same_value("sequence", "sequence") and _same_value(1.0, 1)
    assert not _same_value("group", "batch") and not _same_value(False, True)
