"""Checked before any model loads: `[trl]` values against the installed GRPOConfig's field types, choices and
ranges; the longest prompt plus MAX_TOKENS against the model's positions; a floor of the peak memory against the
machine. Each over the limit is exit 2 naming the key."""

import json

import pytest

from conftest import DEFAULT_SPEC, small_spec
from harness.cli import main
from harness.experiment import limits
from harness.experiment.spec import SpecError
from trl_runner.translate import in_interval, translate


@pytest.mark.parametrize("override, key, words", [
    ('trl.learning_rate="abc"', "trl.learning_rate", "float"),
    ("trl.disable_dropout=1", "trl.disable_dropout", "bool"),
    ("trl.seed=1.5", "trl.seed", "int"),
    ('trl.reward_weights=["x", 1]', "trl.reward_weights", "list[float]"),
    ("trl.model_init_kwargs=3", "trl.model_init_kwargs", "dict"),
    ('trl.lr_scheduler_type="cosinus"', "trl.lr_scheduler_type", "'cosine'"),
    ('trl.loss_type="dapo2"', "trl.loss_type", "'dapo'"),
    ('trl.importance_sampling_level="word"', "trl.importance_sampling_level", "'sequence'"),
    ('trl.log_level="loud"', "trl.log_level", "'warning'"),
])
def test_a_trl_value_of_the_wrong_type_or_choice_is_refused(override, key, words):
    with pytest.raises(SpecError) as e:
        translate(small_spec(override))
    assert e.value.key == key and words in str(e.value)


@pytest.mark.parametrize("override, key", [
    ("trl.learning_rate=-1e-6", "trl.learning_rate"),
    ("trl.learning_rate=0", "trl.learning_rate"),
    ("trl.num_generations=1", "trl.num_generations"),
    ("trl.max_completion_length=-5", "trl.max_completion_length"),
    ("trl.temperature=0.0", "trl.temperature"),
    ("trl.top_p=1.5", "trl.top_p"),
    ("trl.adam_beta2=1.0", "trl.adam_beta2"),
    ("trl.epsilon=nan", "trl.epsilon"),
    ("trl.reward_weights=[nan, 1.0]", "trl.reward_weights"),
    ("trl.num_iterations=0", "trl.num_iterations"),
])
def test_a_trl_value_out_of_range_is_refused(override, key):
    with pytest.raises(SpecError) as e:
        translate(small_spec(override))
    assert e.value.key == key


@pytest.mark.parametrize("override", [
    "trl.learning_rate=1", "trl.scale_rewards=false", 'trl.scale_rewards="batch"', 'trl.loss_type="grpo"',
    "trl.max_grad_norm=inf", 'trl.lr_scheduler_type="cosine"', 'trl.report_to="none"', 'trl.report_to=["none"]',
    'trl.model_init_kwargs={dtype="auto"}', "trl.reward_weights=[1, 0.5]", "trl.disable_dropout=true",
])
def test_good_trl_values_pass(override):
    translate(small_spec(override))


def test_validate_refuses_a_bad_trl_value_in_one_line(capsys):
    assert main(["validate", "--spec", str(DEFAULT_SPEC), "--set", "trl.learning_rate=-1.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trl.learning_rate" in err and "(0, inf)" in err


def test_in_interval():
    assert in_interval(1, "[1, inf)") and not in_interval(1, "(1, inf)") and in_interval(float("inf"), "[0, inf]")
    assert not in_interval(1.0, "[0, 1)") and in_interval(1.0, "(0, 1]") and not in_interval(float("nan"), "[0, inf]")


def test_peak_memory_floor_known_answer():
    parts = limits.peak_memory_floor(n_params=1000, dtype_bytes=2, micro_batch=3, prompt_tokens=5,
                                     completion_tokens=7, vocab=11, hidden=13, layers=2, frozen_copies=1)
    assert parts == {"weights, gradients and AdamW states": 8000, "frozen model copies": 2000,
                     "logits": 3 * 8 * 11 * 4, "activations": 3 * 12 * 13 * 2 * 2}
    # the lesson's run: Qwen3-0.6B in bf16, 8 x 8 completions in 4 micro-batches, a 200-token prompt, 512 tokens
    qwen = limits.peak_memory_floor(596049920, 2, 16, 200, 512, 151936, 1024, 28)
    assert qwen["weights, gradients and AdamW states"] == 4768399360
    assert qwen["logits"] == 4988362752 and qwen["activations"] == 653262848
    assert limits.format_bytes(sum(qwen.values())) == "9.7 GiB"


def test_memory_over_the_machine_names_the_setting():
    small = {"weights, gradients and AdamW states": 10, "frozen model copies": 0, "logits": 900, "activations": 90}
    with pytest.raises(SpecError) as e:
        limits.check_memory(small, (500, "the 500 B here"), batch=8, device="cpu")
    assert e.value.key == "GRAD_ACCUM" and "1000 B" in str(e.value) and "8 sequences" in str(e.value)
    with pytest.raises(SpecError) as e:
        limits.check_memory(small, (500, "the 500 B here"), batch=1, device="cpu")
    assert e.value.key == "MAX_TOKENS"
    big_model = {**small, "weights, gradients and AdamW states": 5000}
    with pytest.raises(SpecError) as e:
        limits.check_memory(big_model, (500, "the 500 B here"), batch=8, device="cpu")
    assert e.value.key == "model"
    limits.check_memory(small, (1000, "the 1000 B here"), batch=8, device="cpu")
    limits.check_memory(big_model, None, batch=8, device="cuda")  # a GPU spec on a machine without one: not judged


def test_a_cuda_spec_is_not_judged_by_this_machines_ram(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert limits.machine_memory("cuda") is None
    assert limits.machine_memory("cpu")[0] > 0 and limits.machine_memory("auto")[0] > 0


def test_validate_refuses_a_micro_batch_over_the_machine(monkeypatch, capsys):
    monkeypatch.setattr(limits, "machine_memory", lambda device, share=0.0, gpu_gib=0.0: (2 ** 20, "the 1.0 MiB here"))
    assert main(["validate", "--spec", str(DEFAULT_SPEC), "--set", "PROMPTS_PER_STEP=64", "--set",
                 "GROUP_SIZE=64", "--set", "GRAD_ACCUM=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "GRAD_ACCUM" in err and "1.0 MiB" in err


def test_a_prompt_longer_than_the_positions_is_refused_before_allocation(tmp_path, capsys):
    """A 20 MB question: refused by validate in one line naming MAX_PROMPT_TOKENS, and fine once it is set."""
    rows = [{"question": "What is 1 + 1 ?" + " 1 + 1" * 40000, "answer": "2 #### 2"},
            {"question": "What is 2 + 2 ?", "answer": "4 #### 4"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tmp_path / "spec.toml"
    spec.write_text(DEFAULT_SPEC.read_text().replace('source = "synthetic"', 'source = "file"\npath = "rows.jsonl"'))
    assert main(["validate", "--spec", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "MAX_PROMPT_TOKENS" in err and "data row 0" in err and "512" in err
    assert main(["validate", "--spec", str(spec), "--set", "MAX_PROMPT_TOKENS=100"]) == 0
    assert main(["validate", "--spec", str(DEFAULT_SPEC), "--set", "MAX_TOKENS=512"]) == 2
    assert "MAX_TOKENS" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["default", "lengths", "lesson-mistakes"])
def test_the_shipped_cpu_specs_pass_the_limits(name):
    from harness.experiment.data import load_rows, to_prompt_rows
    from harness.experiment.spec import load_spec

    spec = load_spec(DEFAULT_SPEC.parent / f"{name}.toml")
    limits.check_limits(spec, to_prompt_rows(load_rows(spec.data), spec.data.system_prompt))
