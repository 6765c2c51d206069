"""Hidden defaults from the checkpoint and the environment: what a local checkpoint's config.json and
generation_config.json set (sampling defaults, dropout, tied embeddings, stored dtype) against what each side
does with it, read by the preflight without loading weights; and TRL's logging_steps windows in compare.
Small checkpoints and logs written here; no training."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, small_spec
from harness.diagnose.compare import compare_inputs, load_inputs
from harness.diagnose.checkpoint import _dropout_kind, checkpoint_facts
from harness.diagnose.preflight import alignment_for, apply_alignment, fix_for, format_preflight, preflight

# what Qwen3-0.6B ships in its generation_config.json (besides its token ids)
QWEN3_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny Qwen3 saved as Qwen3-0.6B is: bfloat16 weights, tied embeddings, no dropout, its sampling defaults,
    and a tokenizer with a chat template (the embedded default's word-level one)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from harness.experiment.embedded import build_tokenizer

    path = tmp_path_factory.mktemp("qwen3-tiny")
    tok = build_tokenizer(9, ["+"])
    config = Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(**QWEN3_SAMPLING, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def variant(src, dst, config=None, generation=None, drop=()):
    """A copy of checkpoint `src` with config.json / generation_config.json entries changed (None removes one)."""
    shutil.copytree(src, dst)
    for name, changes in (("config.json", config), ("generation_config.json", generation)):
        if changes:
            data = json.loads((dst / name).read_text())
            data.update(changes)
            (dst / name).write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    for name in drop:
        (dst / name).unlink()
    return dst


def local(path, *overrides):
    return small_spec('model.source="local"', f'model.path="{path}"', *overrides)


def facts_of(spec):
    _tr, diffs, facts = preflight(spec)
    return diffs, {(f.kind, f.check, f.who): f for f in facts.checkpoint}, facts


def cli_preflight(spec_file):
    return subprocess.run([sys.executable, "-m", "harness", "preflight", "--spec", str(spec_file)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


def write_spec(path, ckpt, *lines):
    text = (ROOT / "harness" / "specs" / "default.toml").read_text()
    text = text.replace('source = "embedded"', f'source = "local"\npath = "{ckpt}"')
    path.write_text("\n".join(lines) + "\n" + text if lines else text)
    return path


# ---------------------------------------------------------------------------------------------
# sampling defaults in generation_config.json
# ---------------------------------------------------------------------------------------------
def test_top_k_20_is_shadowed_on_both_sides_and_flagged_for_your_loop(qwen_dir, tmp_path):
    # both built-in sides pass their own top_k (the spec's 0): the checkpoint's 20 reaches neither
    diffs, facts, all_facts = facts_of(local(qwen_dir))
    assert diffs == []
    note = facts[("note", "other:top_k", "scratch")]
    assert (note.scratch, note.trl) == (0, 0) and "top_k = 20" in note.quantity and "shadowed" in note.why
    assert {("note", f"other:{k}", "scratch") for k in QWEN3_SAMPLING} <= set(facts)
    text = format_preflight(all_facts, diffs)
    assert "checkpoint defaults" in text and text.endswith("aligned: the two sides will compute the same thing")
    # a loop of yours that leaves top_k unset samples with 20 where TRL samples with 0: flagged on that side only
    _d, facts, all_facts = facts_of(local(qwen_dir, 'loop.command="python my_loop.py"'))
    warning = facts[("warning", "other:top_k", "your loop")]
    assert (warning.scratch, warning.trl) == (20, 0)
    assert "warning: [other:top_k] top_k in your loop's model.generate: your loop 20, TRL 0" in \
        format_preflight(all_facts, _d)
    assert ("warning", "other:do_sample", "your loop") not in facts  # TRL samples too: nothing differs
    # the command line: listed, exit 0 (no difference between the two sides)
    r = cli_preflight(write_spec(tmp_path / "spec.toml", qwen_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: [other:top_k] top_k = 20 in generation_config.json: scratch 0, TRL 0" in r.stdout


def test_the_harness_generation_config_leaves_only_unset_fields_to_the_checkpoint(qwen_dir, tmp_path):
    """What the preflight says of the scratch side's generate, checked against transformers itself."""
    from harness.experiment.models import load_model
    from harness.rollouts.generate import generate_completions

    ckpt = variant(qwen_dir, tmp_path / "ck", generation={"repetition_penalty": 1.1, "min_p": 0.05})
    model = load_model(ckpt, "float32", "cpu")
    seen = {}

    def fake_generate(input_ids, attention_mask, generation_config):
        seen["config"] = model._prepare_generation_config(generation_config)[0]
        return torch.cat([input_ids, torch.full((input_ids.size(0), 1), 2)], dim=1)

    model.generate = fake_generate
    generate_completions(model, [[3, 4]], eos_ids=[2], pad_id=0, max_tokens=1, temperature=1.0, top_p=1.0, top_k=0,
                         device="cpu")
    used = seen["config"]
    spec = local(ckpt)
    claimed = {f.field: f.scratch for f in checkpoint_facts(spec)}
    for key in ("top_k", "top_p", "temperature", "repetition_penalty", "min_p"):
        assert math.isclose(getattr(used, key), claimed[key]), (key, getattr(used, key), claimed[key])
    assert used.top_k == 0 and used.repetition_penalty == 1.1  # shadowed, and picked up


@pytest.mark.parametrize("generation, overrides, check, scratch, trl", [
    # the scratch loop's generate leaves repetition_penalty unset (picks up 1.1), TRL passes its own 1.0
    ({"repetition_penalty": 1.1}, (), "other:repetition_penalty", 1.1, 1.0),
    # the static decoder applies no min_p; TRL leaves min_p None, so generate picks up the checkpoint's
    ({"min_p": 0.05}, ('GENERATION="static"',), "other:min_p", 0.0, 0.05),
])
def test_a_sampling_default_one_side_picks_up_is_a_difference_with_its_fix(qwen_dir, tmp_path, generation, overrides,
                                                                          check, scratch, trl):
    spec = local(variant(qwen_dir, tmp_path / "ck", generation=generation), *overrides)
    diffs, facts, _ = facts_of(spec)
    assert [(d.check, d.scratch, d.trl) for d in diffs] == [(check, scratch, trl)]
    assert "in lockstep it has no effect on the loss" in facts[("difference", check, "scratch")].why
    key = check.split(":")[1]
    fix = fix_for(spec, diffs, check)
    assert fix["trl"] == {key: scratch} and fix["sentence"].endswith("in [trl] to match"), fix
    aligned = apply_alignment(spec, alignment_for(diffs, check))
    assert preflight(aligned)[1] == []  # TRL set as the scratch loop samples: no difference, no generic [trl] entry


def test_both_sides_picking_up_the_same_default_is_a_note(qwen_dir, tmp_path):
    spec = local(variant(qwen_dir, tmp_path / "ck", generation={"min_p": 0.05}))  # CPU: both sides use generate
    diffs, facts, _ = facts_of(spec)
    note = facts[("note", "other:min_p", "scratch")]
    assert diffs == [] and (note.scratch, note.trl) == (0.05, 0.05) and "both sides sample with it" in note.why


@pytest.mark.parametrize("generation", ["auto", "static"])
def test_the_emulated_sampler_samples_alike_on_both_sides(qwen_dir, tmp_path, generation):
    """The emulated sampler fills TRL's vLLM slot and samples for the scratch side too: through generate (CPU's
    auto: both pick up the checkpoint's min_p) or through the static decoder (neither applies it); a note either way."""
    from harness.diagnose.checkpoint import _scratch_sampling, _trl_sampling

    spec = local(variant(qwen_dir, tmp_path / "ck", generation={"min_p": 0.05}), 'sampler.kind="emulated"',
                 f'GENERATION="{generation}"')
    path = "hf" if generation == "auto" else "static"
    assert _scratch_sampling(spec)[0] == _trl_sampling(spec, None)[0] == path
    diffs, facts, _ = facts_of(spec)
    assert [d.check for d in diffs if d.check.startswith("other:")] == []
    note = facts[("note", "other:min_p", "scratch")]
    if path == "hf":
        assert (note.scratch, note.trl) == (0.05, 0.05) and "both sides sample with it" in note.why
    else:
        assert (note.scratch, note.trl) == (0.0, 0.0) and "shadowed on both sides" in note.why
        assert "emulated sampler, on the static-cache decoder" in note.why


# ---------------------------------------------------------------------------------------------
# dropout against TRL's disable_dropout
# ---------------------------------------------------------------------------------------------
def test_dropout_kind_matches_what_disable_dropout_reaches():
    """The preflight reads the modeling code; TRL's disable_dropout_in_model really reaches only nn.Dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import disable_dropout_in_model

    assert _dropout_kind("qwen3", "attention_dropout") == "functional"
    assert _dropout_kind("gpt2", "resid_pdrop") == "module" and _dropout_kind("gpt2", "attn_pdrop") == "module"
    x = torch.randint(0, 32, (1, 12))
    for model, reached in ((Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2,
                                                         num_key_value_heads=1, head_dim=8, attention_dropout=0.5,
                                                         attn_implementation="eager")), False),
                           (GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2)), True)):
        disable_dropout_in_model(model)
        model.train()
        assert torch.equal(model(x).logits, model(x).logits) == reached


def test_dropout_in_a_qwen3_checkpoint_is_flagged_and_disable_dropout_does_not_reach_it(qwen_dir, tmp_path):
    spec = local(variant(qwen_dir, tmp_path / "ck", config={"attention_dropout": 0.1}))
    diffs, facts, _ = facts_of(spec)
    # both train with it (each its own masks); TRL samples in train mode, the scratch loop in eval mode
    assert [(d.check, d.quantity) for d in diffs] == [("other:attention_dropout", "dropout while sampling")]
    assert "lockstep parity cannot hold" in facts[("warning", "other:attention_dropout", "scratch")].why
    diffs, facts, all_facts = facts_of(local(tmp_path / "ck", "trl.disable_dropout=true"))
    warning = facts[("warning", "other:attention_dropout", "scratch")]
    assert "does not reach attention_dropout=0.1" in warning.why and warning.trl == "on (attention_dropout=0.1)"
    assert "[trl] disable_dropout" not in all_facts and "other:disable_dropout" not in [d.check for d in diffs]


def test_disable_dropout_against_nn_dropout_modules_is_a_difference(tmp_path):
    # a GPT-2 config: dropout in torch.nn.Dropout modules; the preflight reads config.json only (no weights here)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "resid_pdrop": 0.1,
                                                               "embd_pdrop": 0.1, "attn_pdrop": 0.1,
                                                               "summary_first_dropout": 0.1}))
    spec = local(tmp_path / "gpt2", "trl.disable_dropout=true")
    diffs, facts, _ = facts_of(spec)
    assert [(d.check, d.quantity) for d in diffs] == [("other:disable_dropout", "dropout in training forward passes")]
    assert diffs[0].scratch.startswith("on (resid_pdrop=0.1") and diffs[0].trl.startswith("off (")
    assert "summary_first_dropout" not in diffs[0].scratch  # a head the causal LM does not run
    # aligned (both train with dropout): what remains is that TRL then samples with it too (train mode)
    left = preflight(apply_alignment(spec, alignment_for(diffs, "other:disable_dropout")))[1]
    assert [(d.check, d.quantity) for d in left] == [("other:resid_pdrop", "dropout while sampling")]


def test_disable_dropout_on_a_checkpoint_without_dropout_changes_nothing(qwen_dir, tmp_path):
    diffs, facts, _ = facts_of(local(qwen_dir, "trl.disable_dropout=true"))
    assert diffs == [] and "changes nothing" in facts[("note", "other:disable_dropout", "scratch")].why
    # without the checkpoint's word (not on disk yet), an override is a difference of its own (as before)
    missing = local(tmp_path / "not-downloaded-yet", "trl.disable_dropout=true")
    assert "other:disable_dropout" in [d.check for d in preflight(missing)[1]]


# ---------------------------------------------------------------------------------------------
# stored dtype, model_init_kwargs, tied embeddings
# ---------------------------------------------------------------------------------------------
def test_model_init_kwargs_dtype_auto(qwen_dir):
    # BETA > 0: TRL builds its reference model with model_init_kwargs: dtype="auto" -> the stored bfloat16
    spec = local(qwen_dir, "BETA=0.04", 'trl.model_init_kwargs={dtype="auto"}')
    diffs, facts, all_facts = facts_of(spec)
    assert [(d.check, d.trl) for d in diffs] == [("other:model_init_kwargs", "bfloat16 (model_init_kwargs)")]
    assert "[trl] model_init_kwargs" not in all_facts  # said exactly by the checkpoint fact, not twice
    assert preflight(apply_alignment(spec, alignment_for(diffs, "other:model_init_kwargs")))[1] == []
    # BETA = 0: the harness hands TRL a loaded model, so TRL ignores model_init_kwargs: a warning, no difference
    diffs, facts, _ = facts_of(local(qwen_dir, 'trl.model_init_kwargs={dtype="auto"}'))
    assert diffs == [] and "ignored" in facts[("warning", "other:model_init_kwargs", "scratch")].trl
    # float32 asked: the reference model is float32 as the scratch loop's copy
    assert preflight(local(qwen_dir, "BETA=0.04", 'trl.model_init_kwargs={dtype="float32"}'))[1] == []


def test_stored_dtype_and_tied_embeddings_are_notes(qwen_dir):
    diffs, facts, _ = facts_of(local(qwen_dir))
    assert diffs == []
    dtype = facts[("note", "other:dtype", "scratch")]
    assert "bfloat16" in dtype.quantity and (dtype.scratch, dtype.trl) == ("float32", "float32")
    assert "one tensor" in facts[("note", "other:tie_word_embeddings", "scratch")].scratch


# ---------------------------------------------------------------------------------------------
# the embedded default, and what cannot be read
# ---------------------------------------------------------------------------------------------
def test_the_embedded_default_stays_aligned_with_its_checkpoint_built():
    from harness.experiment.models import checkpoint_dir

    spec = small_spec()
    checkpoint_dir(spec)  # built in this session's private cache: now the preflight reads it
    _tr, diffs, facts = preflight(spec)
    assert diffs == [] and facts.checkpoint_dir is not None and facts.checkpoint == []
    assert "checkpoint defaults" not in format_preflight(facts, diffs)


def test_a_broken_generation_config_is_one_line(qwen_dir, tmp_path):
    ckpt = variant(qwen_dir, tmp_path / "ck")
    (ckpt / "generation_config.json").write_text("{not json")
    diffs, facts, _ = facts_of(local(ckpt))
    warning = facts[("warning", "other:checkpoint", "scratch")]
    assert diffs == [] and "generation_config.json: cannot be read as JSON" in warning.why and "\n" not in warning.why


# ---------------------------------------------------------------------------------------------
# TRL's logging_steps windows in compare
# ---------------------------------------------------------------------------------------------
def per_step_rows(n=20):
    return [{"step": k, "loss": 0.5 - 0.01 * k + 0.003 * math.sin(k), "reward": 0.1 + 0.02 * k + 0.01 * math.cos(k),
             "grad_norm": 1.0 + 0.1 * math.sin(3 * k), "learning_rate": 1e-3 * (1 - k / 40)} for k in range(1, n + 1)]


def trainer_state(rows, every, first_step=False):
    """TRL's log_history with logging_steps = `every`: loss and metrics averaged over the steps since the last
    row, grad_norm and learning_rate those of the logged step (transformers' Trainer, GRPOTrainer.log)."""
    logged = [r["step"] for r in rows if r["step"] % every == 0 or (first_step and r["step"] == 1)]
    out, prev = [], 0
    for k in logged:
        window = [r for r in rows if prev < r["step"] <= k]
        prev = k
        out.append({"step": k, "loss": sum(r["loss"] for r in window) / len(window),
                    "reward": sum(r["reward"] for r in window) / len(window),
                    "grad_norm": window[-1]["grad_norm"], "learning_rate": window[-1]["learning_rate"],
                    "epoch": k / 20})
    return {"global_step": rows[-1]["step"], "log_history": out}


def write_logs(tmp_path, state):
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps(r) + "\n" for r in per_step_rows()))
    (tmp_path / "trl").mkdir(exist_ok=True)
    (tmp_path / "trl" / "trainer_state.json").write_text(json.dumps(state))
    return mine, tmp_path / "trl"


def test_trl_logging_steps_windows_are_aligned_not_divergent(tmp_path):
    state = trainer_state(per_step_rows(), every=5)
    mine, trl = write_logs(tmp_path, state)
    for a, b in ((mine, trl), (trl, mine)):
        result = compare_inputs(load_inputs(a, b))
        assert result["first_divergence"] is None, result
        assert result["steps"] == [4, 4] and result["metrics"]["loss"]["steps_compared"] == 4
        assert any(n.startswith("TRL logged every 5 steps") and "the per-step log" in n for n in result["notes"])
    # one window's value shifted: diverged at that window's logged step
    state["log_history"][2]["reward"] += 0.01
    mine, trl = write_logs(tmp_path, state)
    result = compare_inputs(load_inputs(mine, trl))
    assert result["first_divergence"] == {"step": 15, "metric": "reward"}


def test_logging_first_step_window_and_per_step_logs_unchanged(tmp_path):
    # logging_first_step: rows at 1, 5, 10, ...: the first window is step 1, the next steps 2..5
    mine, trl = write_logs(tmp_path, trainer_state(per_step_rows(), every=5, first_step=True))
    result = compare_inputs(load_inputs(mine, trl))
    assert result["first_divergence"] is None and result["steps"] == [5, 5]
    # a trainer_state logged every step: no windows, no note
    mine, trl = write_logs(tmp_path, trainer_state(per_step_rows(), every=1))
    result = compare_inputs(load_inputs(mine, trl))
    assert result["first_divergence"] is None and not any("TRL logged every" in n for n in result["notes"])
