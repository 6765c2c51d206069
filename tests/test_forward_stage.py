"""The forward stage (harness/diagnose/identify/forward.py): step 1's completions scored again at the initial weights
under candidate forward rules. The log-probs "your loop" saved are made here the way loops make them (an attention
mask built as `ids != pad_id`, position ids from its cumsum, cross_entropy with ignore_index, a sampler's completion
ended at the pad id), with plain transformers calls, never with the built-in loop's forward."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from conftest import DEFAULT_SPEC
from harness.diagnose.identify.forward import _scorer, forward
from harness.experiment.models import checkpoint_dir, eos_token_ids, load_model, load_tokenizer
from harness.experiment.spec import load_spec

PROMPTS = [[1, 5, 9, 11, 4, 2], [1, 6, 8, 2], [1, 5, 7, 12, 13, 2], [1, 9, 2]]
COMPLETIONS = [[7, 0, 12, 8, 2], [14, 15, 2], [16, 0, 0, 9, 10, 11], [0, 17, 2]]  # pad (0) generated inside three


@pytest.fixture(scope="module")
def setup():
    spec = load_spec(DEFAULT_SPEC)
    ckpt = checkpoint_dir(spec)
    model, tok = load_model(ckpt, "float32", "cpu").eval(), load_tokenizer(ckpt)
    eos = tuple(eos_token_ids(model.generation_config, tok))
    assert tok.pad_token_id == 0 and 0 not in eos  # the embedded tokenizer: pad <|endoftext|> 0, eos <|im_end|> 2
    return spec, model, tok.pad_token_id, eos


def _packed_logps(model, drop):
    """A loop that packs each sequence without the token `drop`: each kept token scored from the kept token before
    it, one sequence at a time; the dropped token's place holds 0 (out of its loss)."""
    out = []
    for p, c in zip(PROMPTS, COMPLETIONS):
        kept = [t for t in c if t != drop]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([p + kept])).logits[0, len(p) - 1:-1], -1)
        got = iter(lp.gather(-1, torch.tensor(kept).unsqueeze(-1)).squeeze(-1).tolist())
        out.append([0.0 if t == drop else next(got) for t in c])
    return out


def _loop_logps(model, hide=None, positions="plain", ignore=None, end=None, temperature=1.0, bf16=False,
                low_logits=False):
    """One row per completion, as a loop computes them: left-padded prompts, right-padded completions."""
    comps = [c[:c.index(end) + 1] if end is not None and end in c else c for c in COMPLETIONS]
    P, T = max(map(len, PROMPTS)), max(map(len, comps))
    ids = torch.tensor([[0] * (P - len(p)) + p + c + [0] * (T - len(c)) for p, c in zip(PROMPTS, comps)])
    attention = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (T - len(c))
                              for p, c in zip(PROMPTS, comps)])
    if hide is not None:
        attention = attention * (ids != hide).long()
    extra = {"position_ids": (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)} if positions == "mask" else {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids, attention_mask=attention, **extra).logits[:, P - 1:-1].float() / temperature
    targets = ids[:, P:]
    if low_logits:  # `log_softmax(logits.to(torch.bfloat16))`, the model in float32
        lp = torch.log_softmax(logits.to(torch.bfloat16), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
    elif ignore is not None:
        lp = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=ignore, reduction="none")
    else:
        lp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp.tolist()  # (padding past a cut completion: what the loop computed there, none of its tokens)


def _read(spec, logps, pad, eos):
    cell = types.SimpleNamespace(spec=spec, eos_ids=eos, pad_id=pad)
    return forward(logps, PROMPTS, COMPLETIONS, _scorer(cell, PROMPTS, COMPLETIONS), spec, pad, eos)


@pytest.mark.parametrize("rule, loop, want", [
    ("mask from ids", {"hide": 0}, {"ATTENTION_HIDE_ID": 0}),
    ("mask from ids, counted positions", {"hide": 0, "positions": "mask"}, {"ATTENTION_HIDE_ID": 0, "POSITIONS": "mask"}),
    ("ignore_index", {"ignore": 0}, {"LOGP_ZERO_ID": 0}),
    ("ended at the pad", {"end": 0}, {"END_AT_ID": 0}),
    ("mask from ids and ignore_index", {"hide": 0, "ignore": 0}, {"ATTENTION_HIDE_ID": 0, "LOGP_ZERO_ID": 0}),
])
def test_forward_rule_is_read(setup, rule, loop, want):
    spec, model, pad, eos = setup
    f = _read(spec, _loop_logps(model, **loop), pad, eos)
    assert f is not None and f.exact and f.settings == want, (rule, f)
    assert set(f.settles) == set(want) and not f.unsettled, (rule, f)


def test_a_token_packed_out_of_the_sequence_is_read(setup):
    spec, model, pad, eos = setup
    f = _read(spec, _packed_logps(model, 0), pad, eos)
    assert f is not None and f.exact and f.settings == {"MASK_TOKEN_ID": 0, "MASK_TOKEN_DROP": True}, f


def test_trl_forward_is_nothing_to_say_raw_logits_and_a_dtype_are_read(setup):
    spec, model, pad, eos = setup
    assert _read(spec, _loop_logps(model), pad, eos) is None  # TRL's forward pass: one pass, nothing said
    hot = dataclasses.replace(spec, TEMPERATURE=0.7)
    f = _read(hot, _loop_logps(model), pad, eos)  # (raw logits, the spec's temperature 0.7)
    assert f is not None and f.exact and f.settings == {"LOGP_ON_RAW_LOGITS": True}, f
    assert _read(hot, _loop_logps(model, temperature=0.7), pad, eos) is None
    f = _read(spec, _loop_logps(model, bf16=True), pad, eos)  # a loop under bf16 autocast, the spec in float32
    assert f is not None and f.exact and f.settings == {"DTYPE": "bfloat16"}, f


def test_a_log_softmax_on_bfloat16_logits_is_read_as_such_not_as_a_dtype(setup):
    """The model in float32, its logits cast to bfloat16 for the log_softmax: LOGITS_DTYPE reproduces the log-probs
    exactly (at float32's tolerance), and wins over a bfloat16 compute dtype, which only comes near."""
    spec, model, pad, eos = setup
    f = _read(spec, _loop_logps(model, low_logits=True), pad, eos)
    assert f is not None and f.exact and f.settings == {"LOGITS_DTYPE": "bfloat16"}, f
    assert f.settles == ("LOGITS_DTYPE",) and not f.unsettled, f
    assert f.evidence["max_abs"] > 1e-3  # (TRL's float32 log_softmax is visibly off)


def test_a_forward_pass_no_rule_reproduces_is_said_so(setup):
    spec, model, pad, eos = setup
    rows = _loop_logps(model)
    rows[1][1] += 0.05  # one log-prob off, after no token any rule hides
    f = _read(spec, rows, pad, eos)
    assert f is not None and not f.exact and f.settings == {} and f.no_switch and "no forward rule" in f.rule, f


@pytest.mark.parametrize("cast, want", [
    (False, {"DTYPE": "bfloat16", "MASTER_WEIGHTS": "bfloat16", "LOGITS_DTYPE": "bfloat16"}),
    (True, {"DTYPE": "bfloat16", "MASTER_WEIGHTS": "bfloat16"}),
])
def test_a_model_loaded_in_bfloat16_is_read_as_bf16_weights(setup, cast, want):
    """A loop that loads its model in bf16 (`from_pretrained(..., torch_dtype=torch.bfloat16)`, Atropos' trainer) and
    scores the bf16 logits it returns as they come (`cross_entropy(model(ids).logits, ...)`), or after a cast to
    float32: no rule with the spec's float32 weights reproduces its log-probs; the weights loaded in bf16 do."""
    spec, _model, pad, eos = setup
    bf16 = load_model(checkpoint_dir(spec), "bfloat16", "cpu").eval()
    rows = []
    for p, c in zip(PROMPTS, COMPLETIONS):
        with torch.no_grad():
            logits = bf16(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1]
        logits = logits.float() if cast else logits
        ce = torch.nn.functional.cross_entropy(logits, torch.tensor(c), reduction="none")
        rows.append((-ce).float().tolist())
    f = _read(spec, rows, pad, eos)
    assert f is not None and f.exact and f.settings == want, f
    assert set(want) <= set(f.settles), f
