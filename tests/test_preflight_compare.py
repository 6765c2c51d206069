"""Preflight labels and exit codes; the comparator's tolerance rule, first divergence and odd inputs."""

import json
import subprocess
import sys

import pandas as pd
import pytest

from conftest import DEFAULT_SPEC, LESSON_SPEC, ROOT, small_spec
from harness.diagnose.compare import CompareInputError, compare_frames, load_any_run, load_tolerances
from harness.diagnose.preflight import alignment_for, apply_alignment, fix_for, preflight
from harness.experiment.spec import load_spec


def checks(spec):
    return [d.check for d in preflight(spec)[1]]


def test_matched_specs_are_aligned():
    assert checks(small_spec()) == []
    assert checks(load_spec(LESSON_SPEC)) == []  # the lesson, mapped as its scratch loop means it


@pytest.mark.parametrize("override, label", [
    ('BATCH_MAPPING="naive"', "batch"),
    ('trl.shuffle_dataset=true', "batch"),
    ('trl.loss_type="dapo"', "loss_type"),
    ('trl.vllm_importance_sampling_correction=true', None),  # no sampler to correct for: nothing changes
    ("trl.adam_beta2=0.999", "other:adam_beta2"),
    ('trl.optim="adamw_torch"', "other:optim"),  # the AdamW kernel: its own row, not a generic [trl] override
    ('trl.lr_scheduler_type="linear"', "other:lr_scheduler_type"),
    ('trl.scale_rewards="batch"', "other:scale_rewards"),
    ("trl.num_train_epochs=3", "other:num_train_epochs"),
    ('STD="population"', "other:STD"),
])
def test_each_difference_is_labelled(override, label):
    got = checks(small_spec(override))
    assert (got == []) if label is None else (label in got and got[0] == label), got


def test_a_learning_rate_at_the_same_schedule_is_named_learning_rate():
    """TRL's learning_rate x1.02 on the spec's own schedule differs at the first step and the last, and both are the
    learning rate (an H100 run named the last one lr_scheduler_type, which both sides had alike); a schedule of
    another shape is still the scheduler."""
    lr = small_spec().LR
    assert set(checks(small_spec(f"trl.learning_rate={lr * 1.02}"))) == {"other:learning_rate"}
    both = set(checks(small_spec(f"trl.learning_rate={lr * 1.02}", 'trl.lr_scheduler_type="linear"')))
    assert both == {"other:learning_rate", "other:lr_scheduler_type"}, both


def test_is_difference_needs_a_sampler():
    spec = small_spec('sampler.kind="emulated"', "trl.vllm_importance_sampling_correction=true")
    assert set(checks(spec)) == {"importance_sampling"}  # on/off, and the mode it then uses


def test_lessons_three_checks_come_first_and_alignment_removes_them():
    spec = small_spec("trl.adam_beta2=0.999", 'trl.loss_type="dapo"', 'BATCH_MAPPING="naive"')
    _tr, diffs, _ = preflight(spec)
    order = [d.check for d in diffs]
    assert order.index("batch") < order.index("loss_type") < order.index("other:adam_beta2")
    for check in ("batch", "loss_type", "other:adam_beta2"):
        left = [d.check for d in preflight(apply_alignment(spec, alignment_for(diffs, check)))[1]]
        assert check not in left and len(set(left)) == 2


@pytest.mark.parametrize("override, check, trl, scratch, words", [
    # small_spec: 4 prompts x 4 completions, accumulation 2 -> matched per_device_train_batch_size = 4 * 4 / 2 = 8
    ('BATCH_MAPPING="naive"', "batch", {"per_device_train_batch_size": 8}, {}, "counts completions, not prompts"),
    ('trl.loss_type="dapo"', "loss_type", {"loss_type": "grpo"}, {}, "TRL averages over tokens"),
    ("trl.adam_beta2=0.999", "other:adam_beta2", {"adam_beta2": 0.99}, {}, "adam beta2: TRL 0.999"),
    ('trl.optim="adamw_torch"', "other:optim", {"optim": "adamw_torch_fused"}, {}, "AdamW kernel (optim): TRL"),
    # TRL has no population std: the only way to match is on the scratch side, and the sentence says so
    ('STD="population"', "other:STD", {}, {"STD": "bessel"}, "TRL has no setting for it"),
])
def test_fix_names_the_setting_that_matches(override, check, trl, scratch, words):
    spec = small_spec(override)
    _tr, diffs, _ = preflight(spec)
    fix = fix_for(spec, diffs, check)
    assert (fix["trl"], fix["scratch"]) == (trl, scratch)
    assert words in fix["sentence"] and fix["sentence"].endswith("to match"), fix["sentence"]
    # applying the named [trl] fields removes that difference and no other
    if trl:
        fixed = load_spec(DEFAULT_SPEC, ["STEPS=4", override, *(f"trl.{k}={json.dumps(v)}" for k, v in trl.items())])
        assert check not in checks(fixed)


def run(*args):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_preflight_cli_exit_codes(tmp_path):
    r = run("preflight", "--spec", str(DEFAULT_SPEC))
    assert r.returncode == 0 and "set GENERATION" not in r.stdout  # CPU: both sides sample through generate
    r = run("preflight", "--spec", str(ROOT / "harness" / "specs" / "bench.toml"))
    assert r.returncode == 0 and 'set GENERATION = "hf"' in r.stdout  # GPU: the scratch decoder's copy is stated
    r = run("preflight", "--spec", str(DEFAULT_SPEC), "--set", 'trl.loss_type="dapo"')
    assert r.returncode == 1 and "[loss_type] loss normalizer: scratch 'sequence' vs TRL 'token_global'" in r.stdout
    assert "per_device_train_batch_size" in r.stdout  # the mapping table comes first
    assert run("preflight", "--spec", str(DEFAULT_SPEC), "--set", "STEPS=0").returncode == 2
    # the lesson's GPU spec is checked here without its model, data or GPU
    r = run("preflight", "--spec", str(LESSON_SPEC))
    assert r.returncode == 0 and "aligned" in r.stdout and "no GPU" in r.stdout
    from harness.rollouts.samplers import vllm_available

    if not vllm_available():  # refused before any model loads, saying what to install
        assert "vLLM is not installed here" in r.stdout
        r = run("run", "scratch", "--spec", str(LESSON_SPEC), "--out", str(tmp_path / "x"))
        assert r.returncode == 2 and "needs vLLM" in r.stderr and "pip install -e '.[vllm]'" in r.stderr


# ---- comparator ---------------------------------------------------------------------------------------------
def frame(**cols):
    n = len(next(iter(cols.values())))
    df = pd.DataFrame({"step": list(range(1, n + 1)), **cols}).set_index("step", drop=False)
    df.attrs["problems"] = []
    return df


def test_tolerance_rule_and_first_divergence():
    a = frame(loss=[1.0, 1.0, 1.0], grad_norm=[2.0, 2.0, 2.0], prompts_in_step=[4, 4, 4])
    # loss: 1e-5 + 1.3e-6 * 1 = 1.13e-5 allowed; step 2 is inside (1e-5), step 3 outside (2e-5)
    b = frame(loss=[1.0, 1.00001, 1.00002], grad_norm=[2.0, 2.0, 2.5], prompts_in_step=[4, 4, 4])
    r = compare_frames(a, b)
    assert r["first_divergence"] == {"step": 3, "metric": "loss"}  # loss before grad_norm at the same step
    assert r["metrics"]["loss"]["first_outside"] == 3
    assert r["metrics"]["grad_norm"]["max_abs"] == pytest.approx(0.5)
    assert r["metrics"]["grad_norm"]["step_max_abs"] == 3
    assert r["metrics"]["grad_norm"]["mean_delta"] == pytest.approx(-0.5 / 3)
    assert compare_frames(a, a)["first_divergence"] is None


def test_exact_fields_and_one_sided_metrics():
    a = frame(prompts_in_step=[4, 4], prompt_ids_hash=["x", "y"], loss=[0.0, 0.0])
    b = frame(prompts_in_step=[4, 2], prompt_ids_hash=["x", "z"], loss=[0.0, 0.0],
              **{"sampling/importance_sampling_ratio/mean": [1.0, 1.0]})
    r = compare_frames(a, b)
    # a TRL metric on one side only is listed, never a divergence (nothing to hold it against)
    assert r["first_divergence"] == {"step": 2, "metric": "prompts_in_step"}
    assert {"prompt_ids_hash", "prompts_in_step"} == set(r["outside"])
    assert r["metrics"]["prompts_in_step"]["first_outside"] == 2
    assert r["only_in_b"] == ["sampling/importance_sampling_ratio/mean"]
    # the scratch loop's own mismatch figures are one-sided by design
    assert compare_frames(frame(loss=[0.0], **{"mismatch/k3_kl": [0.1]}), frame(loss=[0.0]))["first_divergence"] is None


def test_different_lengths_compare_the_shared_steps():
    r = compare_frames(frame(loss=[1.0, 1.0, 1.0]), frame(loss=[1.0, 1.0]))
    assert r["first_divergence"] is None and "different lengths" in r["notes"][0]


def test_bfloat16_tolerances_are_wider():
    tol = load_tolerances()
    assert tol["lockstep"]["bfloat16"]["default"]["rtol"] > tol["lockstep"]["float32"]["default"]["rtol"]
    a, b = frame(loss=[1.0]), frame(loss=[1.01])
    assert compare_frames(a, b, dtype="float32")["first_divergence"] is not None
    assert compare_frames(a, b, dtype="bfloat16")["first_divergence"] is None


def test_trainer_state_json_and_bad_inputs(tmp_path):
    state = {"log_history": [{"step": 1, "loss": 0.5, "grad_norm": 1.0, "epoch": 0.1},
                             {"step": 2, "loss": 0.4, "grad_norm": 0.9, "epoch": 0.2},
                             {"step": 2, "train_runtime": 3.0, "train_loss": 0.45}]}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    df = load_any_run(tmp_path)
    assert list(df["loss"]) == [0.5, 0.4] and "trl/epoch" in df.columns
    with pytest.raises(CompareInputError, match="neither a harness run"):
        load_any_run(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(CompareInputError, match="no logged steps"):
        load_any_run(tmp_path / "empty")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CompareInputError, match="not a trainer_state.json"):
        load_any_run(bad)


def test_compare_cli_on_trainer_state_and_corrupt_line(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    b = tmp_path / "b"
    b.mkdir()
    (b / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 0.5},
                                                                      {"step": 2, "loss": 0.4}]}))
    r = run("compare", str(a), str(b), "--out", str(tmp_path / "cmp"))
    assert r.returncode == 0, r.stderr
    assert "verdict: parity" in r.stdout and "not complete JSON" in r.stdout
    assert "Traceback" not in r.stderr
    r = run("compare", str(a), str(tmp_path / "missing"))
    assert r.returncode == 2 and "neither a harness run" in r.stderr and "Traceback" not in r.stderr
