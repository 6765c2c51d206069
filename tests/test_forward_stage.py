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


# ---- a rule on the pad id whose evidence lies beyond step 1 (a loop that trains one prompt group per step) -------
CLEAN = [[7, 5, 12, 8, 2], [14, 15, 2]]  # step 1's two completions: no pad id before their end
LATER = [[7, 0, 12, 8, 2], [14, 15, 2]]  # step 2's: a sampled pad id (0) inside the first


def _rows_logps(model, prompts, comps, hide=None):
    """A loop's log-probs of `comps` after `prompts` at `model`'s weights, the attention mask `ids != hide` where
    given (left-padded prompts, right-padded completions)."""
    P, T = max(map(len, prompts)), max(map(len, comps))
    ids = torch.tensor([[0] * (P - len(p)) + p + c + [0] * (T - len(c)) for p, c in zip(prompts, comps)])
    attention = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (T - len(c))
                              for p, c in zip(prompts, comps)])
    if hide is not None:
        attention = attention * (ids != hide).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, P - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1).tolist()


def _group_cell(spec, model, pad, eos, ref: str | None):
    """One round of four completions trained two per step (harness.loop.trained): step 1 on CLEAN, step 2 on LATER,
    the loop's attention mask built as `ids != pad`. `ref`: what it saves as reference log-probs at step 2: "initial"
    (the initial model's, as a KL to it takes them), "moved" (another model's: every row off), "moved_all" (the row
    with the pad id off, the other TRL's: no rule reproduces it), None (none saved), "unsaved" (no tensors at all at
    step 2: a loop that saves only its first steps' tensors).
    Its step-2 log-probs are a moved policy's (off in every row): only the reference can be read there."""
    from harness.diagnose.cell import CellData

    prompts = [PROMPTS[0], PROMPTS[1]]
    first = _rows_logps(model, prompts, CLEAN, hide=0)
    second = _rows_logps(model, prompts, LATER, hide=0)
    step2 = {"logps": [[x + 0.3 for x in row] for row in second]}
    if ref == "initial":
        step2["ref_logps"] = second
    elif ref == "moved":
        step2["ref_logps"] = [[x - 0.2 for x in row] for row in second]
    elif ref == "moved_all":  # only the row with the pad id off: no untouched row to check the reference by
        step2["ref_logps"] = [[x - 0.2 for x in second[0]], second[1]]
    record = {"prompt_ids": prompts + prompts, "completion_ids": CLEAN + LATER}
    tensors = {1: {"logps": first}, **({} if ref == "unsaved" else {2: step2})}
    return CellData(spec=dataclasses.replace(spec, GROUP_SIZE=2), records=(record,), eos_ids=eos, pad_id=pad,
                    tensors=tensors, trained={1: [(0, 0), (0, 1)], 2: [(0, 2), (0, 3)]})


def test_a_pad_id_attention_mask_is_read_from_the_reference_log_probs_of_the_first_step_that_holds_one(setup):
    """Step 1 holds no pad id: TRL's rule reproduces it, and no rule on the pad id can show there. Step 2 holds one;
    its policy has moved, but its reference log-probs are the initial weights' (its row without the pad id is TRL's
    rule's there): scored again there, hiding the pad id from attention reproduces them, and is settled."""
    from harness.diagnose.identify.forward import read

    spec, model, pad, eos = setup
    [f] = read(_group_cell(spec, model, pad, eos, "initial"), {})
    assert f.exact and f.step == 2 and f.settings == {"ATTENTION_HIDE_ID": 0}, f
    assert "ATTENTION_HIDE_ID" in f.settles and "reference model's log-probs" in f.rule, f
    assert "step 1 could not show it" in f.rule, f


def test_without_a_reference_at_known_weights_the_pad_id_rule_is_a_candidate_for_the_search(setup):
    """No reference log-probs at step 2, a reference that moved (its row without the pad id is off too), or one no
    rule reproduces (it may not be the initial weights): the weights there are not known before the search, so
    nothing is claimed of the forward pass; what step 1 could not show is said, and hiding the pad id is handed on as
    a candidate (evidence["candidate"], no setting)."""
    from harness.diagnose.identify.forward import read

    spec, model, pad, eos = setup
    for ref in (None, "moved", "moved_all", "unsaved"):
        [f] = read(_group_cell(spec, model, pad, eos, ref), {})
        assert f.exact and f.same_as_spec and f.settings == {} and not f.settles, (ref, f)
        assert f.evidence["candidate"] == {"ATTENTION_HIDE_ID": 0} and f.evidence["candidate_step"] == 2, (ref, f)
        assert any("could not show there" in u and "step 2" in u for u in f.unsettled), (ref, f)


def test_no_candidate_where_step_1_could_show_the_rule_or_no_step_holds_the_pad_id(setup):
    """Step 1 holding the pad id inside a completion read TRL's rule there (the rule refuted, nothing beyond it);
    completions without any pad id give nothing to say."""
    from harness.diagnose.cell import CellData
    from harness.diagnose.identify.forward import read

    spec, model, pad, eos = setup
    prompts = [PROMPTS[0], PROMPTS[1]]
    for one, two in ((LATER, LATER), (CLEAN, CLEAN)):
        cell = CellData(spec=dataclasses.replace(spec, GROUP_SIZE=2), eos_ids=eos, pad_id=pad,
                        records=({"prompt_ids": prompts + prompts, "completion_ids": one + two},),
                        tensors={1: {"logps": _rows_logps(model, prompts, one)}},
                        trained={1: [(0, 0), (0, 1)], 2: [(0, 2), (0, 3)]})
        assert read(cell, {}) == [], (one, two)


def test_a_rule_on_an_id_can_act_only_where_the_id_stands_before_a_completions_end():
    from harness.diagnose.identify.forward import shows_id

    assert shows_id([[5, 6, 2], [1, 0, 2]], 0) and shows_id([[0, 3]], 0)
    assert not shows_id([[5, 6, 0]], 0) and not shows_id([[0]], 0) and not shows_id([], 0)


def test_what_the_search_made_of_a_candidate_is_said():
    """The forward stage's candidate (step 1 held no pad id) said as the search left it: kept; not kept with the
    kept set agreeing through the first step it could act at (the loop does not do it, or its effect stays under
    the tolerance: not claimed either way); the search stopped before that step (the stage's "could not tell"
    stands)."""
    from harness.diagnose.explain import candidate_notes
    from harness.diagnose.identify import Finding, words

    f = Finding("forward", 1, "your loop's log-probs at step 1 are TRL's rule's", {}, True, same_as_spec=True,
                unsettled=("no completion of step 1 holds the pad id (0) before its end",),
                evidence={"candidate": {"ATTENTION_HIDE_ID": 0}, "candidate_step": 3})
    notes = ["selection: ...", *words([f])]
    assert notes[1] == "forward: this run could not tell: no completion of step 1 holds the pad id (0) before its end"
    kept = candidate_notes(notes, [f], {"ATTENTION_HIDE_ID": 0, "LR": 1e-5}, 12)
    assert kept[0] == notes[0] and kept[1].startswith("forward, found by the search: your loop hides every token with "
                                                      "id 0 from attention") and "step 3" in kept[1], kept
    told = candidate_notes(notes, [f], {"LR": 1e-5}, 12)[1]
    assert told.startswith("forward: this run could not tell: whether your loop hides every token with id 0 from "
                           "attention, wherever it stands: without it the built-in loop agrees with your loop through "
                           "step 12 (from step 3 on") and "or its effect stays under the tolerance here" in told, told
    assert "through step 3 (from step 3 on" in candidate_notes(notes, [f], {"LR": 1e-5}, 3)[1]
    assert candidate_notes(notes, [f], {"LR": 1e-5}, 2) == notes  # stopped at step 2: it could not act yet


def test_a_stages_candidate_is_a_first_guess_and_an_option_from_the_step_it_can_act_at():
    """The forward stage's candidate goes to the search twice: as a first guess (with the unsure readings, and
    alone: an unsure reading that does not fit must not sink it) and as an option from its first step (with another
    change acting at that step it is found in a pair); a field your log or tensors settle is neither."""
    import dataclasses as dc

    from harness.diagnose.explain import Start, candidate_options, candidates
    from harness.diagnose.identify import Finding
    from harness.diagnose.search import Option

    f = Finding("forward", 1, "your loop's log-probs at step 1 are TRL's rule's", {}, True, same_as_spec=True,
                unsettled=("...",), evidence={"candidate": {"ATTENTION_HIDE_ID": 0}, "candidate_step": 3})
    start = Start(base=None, read={"LR": 1e-5}, unsure={"LR_SCHEDULE": "linear"}, identified={}, settles=(),
                  settled=frozenset(), findings=(f,), lr_ahead=False, notes=())
    assert candidates(start) == {"ATTENTION_HIDE_ID": 0}
    assert candidate_options(start) == [Option("ATTENTION_HIDE_ID", 0, 3)]
    for settled in (dc.replace(start, read={"ATTENTION_HIDE_ID": 0}), dc.replace(start, settles=("ATTENTION_HIDE_ID",))):
        assert candidates(settled) == {} and candidate_options(settled) == []


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
