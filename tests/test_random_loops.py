"""The random-loop generator and its scorer (issue 47 item 7; tests/random_loops, tools/random_loops.py).

(a) The generator: deterministic per seed; every drawn loop compiles, and a sample covering every choice of the
vocabulary runs standalone (no harness: the contract's helpers fall back to defaults); the answer is checked against
the loop's own source, not against the table that made it; the schedules' TRL fields give the loop's rates.
(b) The scorer on outputs built by hand (what a right and a wrong explanation look like), and ten fixed seeds
through the harness's explanation (slow, run once for two tests): no run may crash and a choice drawn on purpose as
inexpressible is a failure whatever the verdict says (passes); the share right is measured, not recorded, against
the issue's 95% (10 of 10 on 2026-12-07; a strict xfail while it was 5 and 6 of 10).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.random_loops.generator import draw, generate
from tests.random_loops.score import schedule_rates, score, score_seed, table_rates
from tests.random_loops.vocab import SCHEDULES, STAGES

SEEDS = range(200)


def test_each_seed_draws_one_loop_and_seeds_differ():
    assert generate(7) == generate(7)
    sources = {generate(s)[0] for s in range(40)}
    assert len(sources) == 40


def test_most_loops_differ_from_trl_in_a_few_places_and_every_choice_is_drawn():
    counts = [len(generate(s)[1]["differences"]) for s in SEEDS]
    assert sum(c <= 4 for c in counts) >= 0.8 * len(counts)
    seen = {(stage, name) for s in SEEDS for stage, name in draw(s).items()}
    for stage, choices in STAGES.items():
        for name, _, _ in choices:
            assert (stage, name) in seen, f"{stage}={name} is never drawn in 200 seeds"


def test_every_drawn_loop_compiles():
    for s in SEEDS:
        compile(generate(s)[0], f"seed-{s}", "exec")


# what the loop's source must hold for each part of the answer: read from the code, not from the vocabulary
SOURCE_OF_TRL = {
    "loss_type": {"dapo": "/ all_tokens", "bnpo": "/ mask.sum().clamp(min=1) / len(micro)",
                  "dr_grpo": "/ (n * MAX_TOKENS)"},
    "scale_rewards": {"none": None, "batch": "rewards.std("},
    "mask_truncated_completions": {True: "completions cut at MAX_TOKENS do not count"},
    "num_iterations": {2: "PASSES = 2"},
    "use_bias_correction_kl": {False: None},
}
SOURCE_OF_QUIRK = {
    "ADV_BASELINE": "(grouped.sum(1, keepdim=True) - grouped) / (G - 1)",
    "STD": "correction=0", "STD_EPS_INSIDE": "torch.sqrt(", "COMPLETION_MASK": "the eos does not count",
    "MASK_TOKEN_ID": "(completion_ids != PAD)", "EOS_ATTENTION": "(ids != EOS)", "MICRO_BATCH_ORDER": "len(micro)",
    "LOSS_DIVISOR": "seq-mean-token-sum", "LOSS_SUM": "loss = (per_token * mask).sum()\n", "LOGP_OLD": "this pass",
    "WEIGHT_DECAY_ALL": "AdamW(model.parameters()", "SELECTION": "parity.trained(", "KL_ESTIMATOR": "kl = ",
    "STD_EPS": "+ STD_EPS", "LOGP_ZERO_ID": "ignore_index=PAD", "LOGITS_DTYPE": "logits.to(torch.bfloat16)",
    "TRUNCATED_IF": "EOS in batch['completion_ids']", "ADV_STATS_DTYPE": "rewards.to(torch.float16)",
    "ADV_RENORM": "(adv_rows - tok_adv.mean()) / (tok_adv.std() + 1e-8)", "ADV_CLAMP": "adv.clamp(-1.0, 1.0)",
    "DROP_ZERO_ADV": "* (adv_rows != 0)", "ATTENTION_HIDE_ID": "attention = (ids != PAD).long()",
    "ADV_MICRO_BATCH_MEAN": "* a).mean() * len(a) / n", "ACCUM_DIVISOR": "/ ACCUM_STEPS",
}


def _const(source: str, name: str):
    """The value a loop's top-level `NAME = literal` line gives (a literal only: the spec's fallbacks are not)."""
    import ast

    line = next(x for x in source.splitlines() if x.startswith(f"{name} = "))
    return ast.literal_eval(line.split("=", 1)[1].split("#")[0].strip())


@pytest.mark.parametrize("seed", range(0, 200, 3))
def test_the_answer_is_what_the_loop_does(seed):
    source, answer = generate(seed)
    trl, quirks = answer["trl"], answer["quirks"]
    for key, value in trl.items():
        if key == "learning_rate":
            assert _const(source, "LR") == value
        elif key == "beta":
            assert _const(source, "BETA") == value and "ref_logp" in source
        elif key == "adam_beta2":
            assert _const(source, "BETAS") == (0.9, value)
        elif key == "weight_decay":
            assert _const(source, "WEIGHT_DECAY") == value
        elif key == "max_grad_norm":
            assert f"clip_grad_norm_(model.parameters(), {'math.inf' if value == 0 else value})" in source
        elif key == "reward_weights":
            assert f"torch.tensor({value})" in source
        elif key in ("epsilon", "epsilon_high"):
            low, high = answer["choices"]["clip"].split("_")
            assert f"CLIP_LOW, CLIP_HIGH = {low}, {high}" in source and value == float(low if key == "epsilon" else high)
        elif key in ("lr_scheduler_type",):
            assert "transformers.get_scheduler(" in source
        elif key in SOURCE_OF_TRL and SOURCE_OF_TRL[key].get(value):
            assert SOURCE_OF_TRL[key][value] in source, key
    if "scale_rewards" in trl and trl["scale_rewards"] == "none":
        assert ".std(" not in source.split("def advantages")[1].split("return adv")[0]
    if "use_bias_correction_kl" in trl:
        assert "kl = kl * ratio" not in source
    elif "beta" in trl:
        assert "kl = kl * ratio" in source
    for key, value in quirks.items():
        assert SOURCE_OF_QUIRK[key] in source, key
        if key == "STD_EPS":
            assert _const(source, "STD_EPS") == value
        if key == "KL_ESTIMATOR":
            assert {"k1": "kl = logp - ref_logp", "k2": "kl = 0.5 * (logp - ref_logp) ** 2"}[value] in source
    agg = answer["choices"]["agg"]  # the micro-batch switches (ADV_MICRO_BATCH_MEAN, ACCUM_DIVISOR), as written
    assert ("* a).mean() * len(a) / n" in source) == (agg == "mean_advantage_broadcast")
    assert ("/ ACCUM_STEPS" in source and _const(source, "ACCUM_STEPS") == 8) == (agg == "grpo_over_constant_8")
    assert ("ADV_MICRO_BATCH_MEAN" in quirks) == (agg == "mean_advantage_broadcast")
    assert ("ACCUM_DIVISOR" in quirks) == (agg == "grpo_over_constant_8")
    if "ACCUM_DIVISOR" in quirks:
        assert quirks["ACCUM_DIVISOR"] == _const(source, "ACCUM_STEPS")
    assert ("parity.trained(" in source) == ("SELECTION" in quirks)
    assert ("AdamW(model.parameters()" in source) == ("WEIGHT_DECAY_ALL" in quirks)


def test_the_schedules_trl_fields_give_the_loops_rates():
    """The TRL fields each drawn schedule is written as give the rates the loop's own get_scheduler call gives over
    the run (a cosine over 64 steps is TRL's cosine with num_cycles = 12 / 128 over 12); and one known value."""
    for name, (kind, warmup, horizon, kwargs) in SCHEDULES.items():
        trl = next(c[2].get("trl", {}) for c in STAGES["schedule"] if c[0] == name)
        loop = schedule_rates(kind, 3e-3, warmup, horizon, kwargs)
        assert table_rates({"learning_rate": 3e-3, **trl}) == pytest.approx(loop, rel=1e-9), name
    # cosine over 64 steps at step 5 (0-based 4): 0.5 * (1 + cos(pi / 16)) * 3e-3 = 0.5 * 1.980785 * 3e-3
    assert schedule_rates("cosine", 3e-3, 0, 64, {})[4] == pytest.approx(2.971178e-3, rel=1e-6)


def _standalone_sample() -> list[int]:
    """Few seeds that together draw every choice of every stage (greedy cover over 200 seeds)."""
    want = {(stage, c[0]) for stage, choices in STAGES.items() for c in choices}
    drawn = {s: set(draw(s).items()) for s in SEEDS}
    picked = []
    while want:
        best = max(SEEDS, key=lambda s: len(drawn[s] & want))
        picked.append(best)
        want -= drawn[best]
    return picked


@pytest.mark.slow
def test_a_sample_covering_every_choice_runs_standalone(tmp_path):
    from harness.experiment.embedded import ensure_embedded_checkpoint
    from harness.experiment.spec import load_spec

    from tests.conftest import DEFAULT_SPEC

    spec = load_spec(DEFAULT_SPEC)
    checkpoint = ensure_embedded_checkpoint(spec.model, spec.data)
    (tmp_path / "spec.json").write_text(json.dumps({"STEPS": 2}))  # two steps: the code paths, not the training
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARITY_")}
    env["PARITY_SPEC"] = str(tmp_path / "spec.json")
    env["PYTHONPATH"] = str(DEFAULT_SPEC.parents[2])
    for seed in _standalone_sample():
        loop = tmp_path / f"loop{seed}.py"
        loop.write_text(generate(seed)[0])
        proc = subprocess.run([sys.executable, str(loop), str(checkpoint)], capture_output=True, text=True, env=env,
                              timeout=600)
        assert proc.returncode == 0, f"seed {seed}: {proc.stderr[-2000:]}"
        assert proc.stdout.count("step ") == 2


# ---- the scorer on outputs built by hand ---------------------------------------------------------------------
def _out(trl=None, quirks=None, status="confirmed", verdict="diverged", text=""):
    return {"verdict": verdict, "status": status, "trl": trl or {}, "quirks": quirks or {}, "text": text,
            "metrics": []}


def _answer(seed_choices: dict) -> dict:
    from tests.random_loops.generator import answer_of

    picked = {stage: choices[0][0] for stage, choices in STAGES.items()}
    picked.update(seed_choices)
    return answer_of(picked, 0)


RUN = {"rc": 1, "wall_s": 1.0, "tail": ""}


def test_the_scorer_takes_a_right_explanation_and_names_each_kind_of_miss():
    answer = _answer({"agg": "dapo", "std_eps": "1e-2", "lr": "1e-3"})
    right = _out({"loss_type": "dapo", "learning_rate": 1e-3}, {"STD_EPS": 0.01})
    assert score(answer, right, RUN) == {"right": True, "misses": []}
    assert score(answer, _out({"loss_type": "dapo", "learning_rate": 9.988e-4}, {"STD_EPS": 0.01}), RUN)["misses"] \
        == ["trl_value:learning_rate", "schedule_rates"]
    assert score(answer, _out({"loss_type": "dapo", "learning_rate": 1e-3, "beta": 0.01}, {"STD_EPS": 0.01}),
                 RUN)["misses"] == ["trl_extra:beta"]
    assert score(answer, _out({"loss_type": "dapo", "learning_rate": 1e-3}, {}), RUN)["misses"] \
        == ["quirk_missing:STD_EPS"]
    assert score(answer, _out({"loss_type": "dapo", "learning_rate": 1e-3}, {"STD_EPS": 0.01},
                              status="suspected"), RUN)["misses"] == ["not_confirmed:suspected"]
    assert score(answer, None, {"rc": 3, "wall_s": 1.0, "tail": ""})["misses"] == ["crash:rc=3"]
    assert score(answer, _out(verdict="parity", status=None), RUN)["misses"][0] == "parity_claimed"


def test_a_drawn_choice_that_cannot_act_in_this_loop_is_not_asked_for():
    """Completions with A = 0 left out change nothing where each completion's mean is divided by the round's count
    and there is no KL (grpo's form): they add 0 either way (the switch may be named or not: the saved mask shows
    it); under dapo's token count they change the divisor: the switch is asked for."""
    moot = _answer({"adv_extra": "drop_zero_adv"})
    assert moot["inexpressible"] == [] and "DROP_ZERO_ADV" in moot["unsure"] and moot["moot"]
    acts = _answer({"adv_extra": "drop_zero_adv", "agg": "dapo"})
    assert acts["quirks"] == {"DROP_ZERO_ADV": True} and "DROP_ZERO_ADV" not in acts["unsure"]
    assert score(acts, _out({"loss_type": "dapo"}, verdict="parity", status=None), RUN)["misses"] == \
        ["parity_claimed", "quirk_missing:DROP_ZERO_ADV"]
    assert score(moot, _out(quirks={"DROP_ZERO_ADV": True}, verdict="parity", status=None), RUN)["right"]
    assert _answer({"forward": "ce_ignore_pad", "mask": "ids_ne_pad"})["inexpressible"] == []
    assert "LOGP_ZERO_ID" not in _answer({"forward": "ce_ignore_pad", "mask": "ids_ne_pad"})["quirks"]
    assert _answer({"forward": "ce_ignore_pad"})["quirks"] == {"LOGP_ZERO_ID": 0}  # the pad id, a switch since 47


def test_the_scorer_fails_an_inexpressible_choice_whatever_the_verdict():
    answer = _answer({"adv_extra": "range_scale", "adv_scale": "none"})  # on purpose: no switch divides by a range
    assert answer["inexpressible"] == [["adv_extra=range_scale",
                                        "advantages divided by the group's reward range (max - min)"]]
    assert answer["trl"] == {"scale_rewards": "none"}  # the range in place of the std
    assert score(answer, _out({"scale_rewards": "none"}, status="suspected"), RUN)["misses"] == [
        "inexpressible:adv_extra=range_scale"]
    clamp = _answer({"adv_extra": "clamp_1"})  # a switch since issue 47: ADV_CLAMP
    assert clamp["inexpressible"] == [] and clamp["quirks"] == {"ADV_CLAMP": 1.0}


def test_the_scorer_wants_what_cannot_show_said_and_lets_unsure_fields_be_left_out():
    answer = _answer({"clip": "0.2_0.2", "std_eps": "1e-8"})  # one pass: the clip bound cannot act
    assert answer["trl"] == {} and answer["quirks"] == {"STD_EPS": 1e-8}
    said = "objective: this run could not tell: the ratio is exactly 1: the clip bounds cannot act"
    assert score(answer, _out(text=said, verdict="parity", status=None), RUN)["right"]
    assert score(answer, _out(verdict="parity", status=None), RUN)["misses"] == ["cannot_show_unsaid:clip"]
    logged = _answer({"loss_logged": "last_micro_batch"})
    generic = "your logged loss is defined otherwise in value: or a mean over micro-batches logged in place of their sum"
    assert score(logged, _out(verdict="parity", status=None, text=generic), RUN)["misses"] == \
        ["logged_unsaid:last_micro-batch"]
    assert score(logged, _out(verdict="parity", status=None, text="your loop logs the loss of its last\n    "
                              "micro-batch only"), RUN)["right"]
    assert score(answer, _out(quirks={"STD_EPS": 1e-6}, text=said), RUN)["right"]  # both under the resolution
    assert score(answer, _out(quirks={"STD_EPS": 1e-3}, text=said), RUN)["misses"] == ["quirk_value:STD_EPS"]
    warm = _answer({"schedule": "constant_warmup_20"})
    table = {"lr_scheduler_type": "linear", "warmup_steps": 20}  # alike over 12 steps: all of them warm up
    assert score(warm, _out(table, text="warmup of 20 steps: this run could not tell what follows"), RUN)["right"]
    assert score(warm, _out({"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 12}), RUN)["misses"] == \
        ["schedule_rates", "cannot_show_unsaid:warmup"]
    assert score(warm, _out({"lr_scheduler_type": "constant"}, {"LR_STEPS": [0.0]}), RUN)["misses"][0] == \
        "schedule_as_lr_steps"
    # a run that ends inside the warmup shows its rise per step only: 5e-3 over 20 steps is 3e-3 (the spec's) over 12
    hot = _answer({"schedule": "constant_warmup_20", "lr": "5e-3"})
    said = "the learning rate rises through every probed step: this run could not tell its warmup"
    assert score(hot, _out({"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 12}, text=said), RUN)["right"]
    assert score(hot, _out({"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 20}, text=said),
                 RUN)["misses"] == ["schedule_rates"]


def test_the_rollout_order_every_drawn_loop_cuts_in_may_be_named_where_it_does_not_act():
    """template.py cuts every loop's micro-batches in the rollout's order: naming it is true (right) where the
    loss does not depend on it; another order is wrong; where it acts (bnpo in order) it must be named."""
    plain = _answer({})
    assert score(plain, _out(quirks={"MICRO_BATCH_ORDER": "rollout"}), RUN)["right"]
    assert score(plain, _out(quirks={"MICRO_BATCH_ORDER": "length"}), RUN)["misses"] == ["quirk_extra:MICRO_BATCH_ORDER"]
    bnpo = _answer({"agg": "bnpo_in_order"})
    assert "quirk_missing:MICRO_BATCH_ORDER" in score(bnpo, _out({"loss_type": "bnpo"}), RUN)["misses"]


# ---- a sample through the harness's explanation ------------------------------------------------------------------
CI_SEEDS = [int(s) for s in os.environ.get("RANDOM_LOOPS_CI_SEEDS", "0,1,2,3,4,5,6,7,8,9").split(",")]


@pytest.fixture(scope="module")
def sample_rows(tmp_path_factory):
    """Ten fixed seeds through the harness's explanation (about 30 s each on 2 free cores, 5 min loaded): the answers
    are computed from the drawn code, the verdicts come from the runs; nothing here is a recorded result."""
    work = tmp_path_factory.mktemp("random-loops")
    rows = [score_seed(s, work) for s in CI_SEEDS]
    return rows, "\n".join(f"seed {r['seed']}: {'right' if r['right'] else '; '.join(r['misses'])}" for r in rows)


@pytest.mark.slow
def test_a_sample_of_random_loops_runs_and_names_what_no_switch_reproduces(sample_rows):
    """No explanation may crash (exit 0 or 1, a verdict written), and a seed drawn with a choice no switch
    reproduces is scored wrong with that choice named, whatever the verdict says."""
    rows, report = sample_rows
    assert not [r for r in rows if any(m.startswith("crash") for m in r["misses"])], report
    for r in rows:
        inexpressible = generate(r["seed"])[1]["inexpressible"]
        assert all(f"inexpressible:{code}" in r["misses"] for code, _ in inexpressible), report
        assert r["right"] == (not r["misses"]), report


@pytest.mark.slow
def test_a_sample_of_random_loops_reaches_the_issues_target(sample_rows):
    """Issue 47's bar: 95% of random loops right. Measured on the sample each run, not recorded (5 of 10 with the
    harness at 99ed853, 6 of 10 once the forward, schedule and passes stages landed, 10 of 10 once the advantage
    extras, LOGITS_DTYPE, TRUNCATED_IF, passes a loop does not name and the objective's readings across steps landed,
    2026-12-07: docs/benchmarks.md)."""
    rows, report = sample_rows
    assert sum(r["right"] for r in rows) >= 0.95 * len(rows), report


@pytest.mark.slow
def test_a_decaying_rate_logged_after_the_scheduler_stepped_is_confirmed(tmp_path):
    """Seed 132: batch-scaled advantages and a cosine schedule whose rate the loop logs after its scheduler stepped (a
    step ahead, as OpenRLHF does). The log is said as logged otherwise, so the confirmation's whole comparison must not
    part on it either (it did: "suspected" on learning_rate with training agreeing at every step)."""
    picked = generate(132)[1]["choices"]
    assert picked["lr_logged"] == "after_scheduler_step" and picked["schedule"] == "cosine", picked
    row = score_seed(132, tmp_path)
    assert row["right"], row["misses"]


def test_a_clip_no_norm_reaches_is_left_to_the_run():
    """A loop that clips nothing against TRL's max_grad_norm of 1: where no logged norm reaches 1 the two cannot be
    told apart (max_grad_norm unsure); where one does, the table must say 0. The same for a loop's own 0.5."""
    from tests.random_loops.score import decide_from_run

    for clip, below, above in (("none", 0.9, 1.3), ("0.5", 0.4, 0.7)):
        answer = {"choices": {"grad_clip": clip}, "unsure": ["max_grad_norm"]}
        runs = lambda top: {"metrics": [{"grad_norm": 0.1}, {"grad_norm": top}]}  # noqa: E731
        assert decide_from_run(answer, runs(below))["unsure"] == ["max_grad_norm"]
        assert decide_from_run(answer, runs(above))["unsure"] == []


def test_a_loop_training_on_rounding_alone_is_right_only_where_the_verdict_says_so():
    """A loop whose logged gradient is rounding at every step (the broadcast over micro-batches of whole centred
    groups: each micro-batch's mean advantage is 0): Adam turns that rounding into whole steps, which no other loop
    reproduces, so its final weights cannot be confirmed. Right where every setting is named and the verdict says the
    final weights part because the gradient is rounding; not where it says nothing, nor for a loop with a real
    gradient."""
    answer = _answer({"agg": "mean_advantage_broadcast"})
    quirks = dict(answer["quirks"])
    said = ("your loop is ...; but the final weights still differ beyond tolerance: your loop's gradient is rounding "
            "alone (each micro-batch's mean advantage is 0 to rounding)")

    def out(norm, text):
        o = _out({}, quirks, status="suspected", text=text)
        o["metrics"] = [{"grad_norm": norm}, {"grad_norm": norm / 2}]
        return o

    assert score(answer, out(2e-8, said), RUN) == {"right": True, "misses": []}
    assert score(answer, out(2e-8, "but the final weights still differ beyond tolerance"), RUN)["misses"] == [
        "not_confirmed:suspected"]
    assert score(answer, out(0.3, said), RUN)["misses"] == ["not_confirmed:suspected"]
    wrong = _out({}, {**quirks, "STD": "population"}, status="suspected", text=said)
    wrong["metrics"] = [{"grad_norm": 2e-8}]
    assert score(answer, wrong, RUN)["misses"] == ["quirk_extra:STD"]
