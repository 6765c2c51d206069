"""The weighting read from step 1's gradient (harness/diagnose/identify/gradient.py): the pure functions against
answers worked by hand, then the stage on a loop written here with plain transformers calls (its loss as such loops
write it, backward, the contract's Probe), never with the built-in loop's forward or the stage's own formulas."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import DEFAULT_SPEC
from harness.diagnose.identify import gradient as G


# ------------------------------------------------------------------ the forms' weights, by hand -------------------

def test_micro_batch_means_and_each_forms_weights_by_hand():
    a, t, sizes = [1.0, 3.0, -2.0, 0.0], [1.0, 3.0, 2.0, 2.0], [2, 2]
    assert G.micro_batch_means(a, sizes).tolist() == [2.0, 2.0, -1.0, -1.0]
    assert G.form_weights("own", a, t, sizes).tolist() == [-1.0, -3.0, 2.0, -0.0]
    assert G.form_weights("micro_batch_mean", a, t, sizes).tolist() == [-2.0, -2.0, 1.0, 1.0]
    assert G.form_weights("own_tokens", a, t, sizes).tolist() == [-1.0, -9.0, 4.0, -0.0]
    assert G.form_weights("micro_batch_mean_tokens", a, t, sizes).tolist() == [-2.0, -6.0, 2.0, 2.0]
    # a token mean per micro-batch: micro-batch 1 holds 1 + 3 = 4 tokens, micro-batch 2 holds 2 + 2 = 4
    assert G.form_weights("own_micro_batch_tokens", a, t, sizes).tolist() == [-0.25, -2.25, 1.0, -0.0]


def test_fit_scale_and_residual_by_hand():
    x = [[1.0, 0.0], [0.0, 1.0]]  # two probed elements, two completions: completion i moves element i alone
    assert G.fit_scale(x, [2.0, 4.0], [1.0, 2.0]) == (2.0, 0.0)
    c, res = G.fit_scale(x, [2.0, 4.0], [1.0, 0.0])  # only the first element: c = 2, the second left at 4
    assert c == 2.0 and res == pytest.approx(4 / np.sqrt(20))
    assert G.residual(x, [2.0, 4.0], [1.0, 2.0]) == pytest.approx(0.5)  # scale 1: [1, 2] for [2, 4], |[1, 2]| / |[2, 4]|


def test_implied_weights_of_each_loss_type_by_hand():
    a, t, sizes = [1.0, -1.0, 2.0, -2.0], [2.0, 1.0, 1.0, 4.0], [2, 2]
    spec = dataclasses.make_dataclass("S", [("LOSS_NORM", str), ("LOSS_SUM", bool), ("LOSS_DIVISOR", float),
                                            ("MICRO_BATCH_ORDER", str)])
    grpo = spec("sequence", False, 0.0, "shuffled")
    assert G.implied(grpo, a, t, sizes, 8).tolist() == [-0.25, 0.25, -0.5, 0.5]  # -A / 4 completions
    dapo = dataclasses.replace(grpo, LOSS_NORM="token_global")  # -A t / 8 tokens
    assert G.implied(dapo, a, t, sizes, 8).tolist() == [-0.25, 0.125, -0.25, 1.0]
    dr = dataclasses.replace(grpo, LOSS_NORM="constant")  # -A t / (4 x 8)
    assert G.implied(dr, a, t, sizes, 8).tolist() == [-2 / 32, 1 / 32, -2 / 32, 8 / 32]
    assert G.implied(dataclasses.replace(grpo, LOSS_DIVISOR=2.0), a, t, sizes, 8).tolist() == [-1.0, 0.5, -1.0, 4.0]
    bnpo = dataclasses.replace(grpo, LOSS_NORM="token_local")
    assert G.implied(bnpo, a, t, sizes, 8) is None  # a shuffled round's micro-batches: not these rows'
    # in order: micro-batch 1 has 3 tokens, micro-batch 2 has 5; each / 2 micro-batches
    got = G.implied(dataclasses.replace(bnpo, MICRO_BATCH_ORDER="rollout"), a, t, sizes, 8).tolist()
    assert got == pytest.approx([-2 / 6, 1 / 6, -2 / 10, 8 / 10])


def test_implied_weights_of_the_micro_batch_switches_by_hand():
    """ADV_MICRO_BATCH_MEAN (each completion weighted by its micro-batch's mean advantage) and ACCUM_DIVISOR (each
    micro-batch's loss over a constant, not over their number), worked by hand on two micro-batches of 2."""
    a, t, sizes = [1.0, 3.0, -2.0, 0.0], [1.0, 3.0, 2.0, 2.0], [2, 2]  # micro-batch means 2 and -1
    spec = dataclasses.make_dataclass("S", [("LOSS_NORM", str), ("LOSS_SUM", bool), ("LOSS_DIVISOR", float),
                                            ("MICRO_BATCH_ORDER", str), ("ADV_MICRO_BATCH_MEAN", bool),
                                            ("ACCUM_DIVISOR", float)])
    mean = spec("sequence", False, 0.0, "rollout", True, 0.0)
    assert G.implied(mean, a, t, sizes, 8).tolist() == [-0.5, -0.5, 0.25, 0.25]  # -mean / 4 completions
    assert G.implied(dataclasses.replace(mean, MICRO_BATCH_ORDER="shuffled"), a, t, sizes, 8) is None
    own8 = dataclasses.replace(mean, ADV_MICRO_BATCH_MEAN=False, ACCUM_DIVISOR=8.0)  # each mean of 2 over 8: -A / 16
    assert G.implied(own8, a, t, sizes, 8).tolist() == [-1 / 16, -3 / 16, 2 / 16, 0.0]
    assert G.implied(dataclasses.replace(mean, ACCUM_DIVISOR=8.0), a, t, sizes, 8).tolist() == \
        [-2 / 16, -2 / 16, 1 / 16, 1 / 16]
    # a token mean per micro-batch (4 tokens each) over 8: -A t / 32
    assert G.implied(dataclasses.replace(own8, LOSS_NORM="token_local"), a, t, sizes, 8).tolist() == \
        [-1 / 32, -9 / 32, 4 / 32, 0.0]
    # dr_grpo's per micro-batch: sum / (2 completions x 8 tokens), over 8: -A t / 128
    assert G.implied(dataclasses.replace(own8, LOSS_NORM="constant"), a, t, sizes, 8).tolist() == \
        [-1 / 128, -9 / 128, 4 / 128, 0.0]


def _rows(seed: int, elements: int = 60, n: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(elements, n))


ADV = [1.5, -0.5, -0.5, -0.5, 0.0, 1.0, -1.0, 0.0]  # two groups of 4, each centred
COUNTS = [5.0, 3.0, 8.0, 2.0, 4.0, 4.0, 6.0, 1.0]
SIZES = [2, 2, 2, 2]


@pytest.mark.parametrize("form, scale", [("micro_batch_mean", 1 / 64), ("own", 1 / 8), ("own", 1 / 32),
                                         ("own_tokens", 1 / 33), ("own_micro_batch_tokens", 1 / 4)])
def test_each_form_and_its_scale_are_read_back_through_noise(form, scale):
    x = _rows(1)
    g = x @ (scale * G.form_weights(form, ADV, COUNTS, SIZES))
    g = g * (1 + 1e-3 * np.random.default_rng(2).normal(size=g.shape))  # a batched recomputation's rounding
    r = G.read_weights(x, g, ADV, COUNTS, SIZES, noise=2e-3)
    assert r.form == form and r.scale == pytest.approx(scale, rel=1e-2), r


def test_forms_that_are_one_vector_are_alike_and_the_simplest_is_said():
    same = [4.0] * 8  # every completion as long: a token sum is a mean over completions times a constant
    x = _rows(3)
    r = G.read_weights(x, x @ G.form_weights("own_tokens", ADV, same, SIZES) / 32, ADV, same, SIZES, noise=2e-3)
    assert r.form == "own" and "own_tokens" in r.alike and r.scale == pytest.approx(4 / 32), r


def test_a_gradient_no_form_gives_is_left_unread():
    x = _rows(4)
    per_token = np.random.default_rng(5).normal(size=8)  # one weight per completion of no form (an IS ratio, say)
    r = G.read_weights(x, x @ per_token, ADV, COUNTS, SIZES, noise=2e-3)
    assert r.form is None, r


def test_the_words_name_the_broadcast_the_constant_divisor_and_the_count():
    spec = dataclasses.make_dataclass("S", [("MAX_TOKENS", int), ("LOSS_NORM", str), ("LOSS_SUM", bool),
                                            ("LOSS_DIVISOR", float), ("MICRO_BATCH_ORDER", str),
                                            ("GRAD_ACCUM", int)])(8, "sequence", False, 0.0, "shuffled", 8)
    sizes, counts = [2] * 8, [4.0] * 16
    mean = G.finding_of(G.Reading("micro_batch_mean", 1 / 64, 0.01, {}, ()), counts, sizes, spec, "")
    assert not mean.no_switch and "mean advantage of its micro-batch" in mean.rule, mean
    assert mean.settings == {"ADV_MICRO_BATCH_MEAN": True, "ACCUM_DIVISOR": 32.0, "MICRO_BATCH_ORDER": "rollout"}
    assert {"ADV_MICRO_BATCH_MEAN", "ACCUM_DIVISOR", "MICRO_BATCH_ORDER"} <= set(mean.settles), mean
    assert "divided by 32" in mean.rule and "8/32" in mean.rule, mean.rule
    own = G.finding_of(G.Reading("own", 1 / 64, 0.01, {}, ()), counts, sizes, spec, "the spec's loss type")
    assert not own.no_switch and own.settings == {"ACCUM_DIVISOR": 32.0}, own  # (any order: each mean over 32)
    assert "divided by 32" in own.rule and "mean advantage" not in own.rule, own.rule
    assert own.unsettled and "the spec's loss type" in own.unsettled[0], own
    fewer = G.finding_of(G.Reading("micro_batch_mean", 1 / 16, 0.01, {}, ()), counts, [4] * 4, spec, "")
    assert fewer.settings == {"ADV_MICRO_BATCH_MEAN": True, "MICRO_BATCH_ORDER": "rollout", "GRAD_ACCUM": 4}, fewer
    uneven = G.finding_of(G.Reading("micro_batch_mean", 1 / 16, 0.01, {}, ()), counts, [6, 10], spec, "")
    assert uneven.no_switch and not uneven.settings and "several sizes" in uneven.rule, uneven
    grpo = G.finding_of(G.Reading("own", 1 / 16, 0.01, {}, ()), counts, sizes, spec, "")
    assert not grpo.no_switch and grpo.settings == {} and "their number (8)" in grpo.rule, grpo  # the spec's grpo
    dapo = G.finding_of(G.Reading("own_tokens", 1 / 64, 0.01, {}, ()), counts, sizes, spec, "")
    assert dapo.settings == {"LOSS_NORM": "token_global"}, dapo  # 64 = the step's tokens (16 x 4)
    mine = G.finding_of(G.Reading("own_tokens", 1 / 57.3, 1e-5, {}, ()), counts, sizes, spec, "")
    assert mine.settings == {"LOSS_DIVISOR": 57.3}, mine
    rough = G.finding_of(G.Reading("own_tokens", 1 / 57.3, 0.01, {}, ()), counts, sizes, spec, "")
    assert rough.settings == {"LOSS_DIVISOR": 57.0}, rough  # known to +-2%: 57.3 +- 1.1, 57 the simplest within


def test_a_scale_is_a_count_only_within_the_fits_own_uncertainty():
    """numerics.snap at the fit's uncertainty (twice its relative residual): 32.3 known to +-3% is 32; 57.3 known
    to +-0.01% stays 57.3 (not "57": a per-micro-batch divisor of 57.3 is no count); 8.3 known to +-1% is 8.3, not
    TRL's 8 micro-batches."""
    assert G._round_count(32.3, G.fit_rel(0.015)) == 32.0
    assert G._round_count(57.3, G.fit_rel(1e-6)) == 57.3
    assert G._round_count(8.3, G.fit_rel(0.005)) == 8.3
    assert G.fit_rel(0.0) == 1e-4


def test_a_gradient_of_the_other_sign_or_of_no_advantage_reads_no_form():
    """A loss of +A x ratio (a sign flipped) fits a form with a negative scale: no form is read, `opposite` says
    why; every advantage 0 (every weight 0) reads nothing rather than failing."""
    x = _rows(6)
    r = G.read_weights(x, -(x @ G.form_weights("own", ADV, COUNTS, SIZES)) / 8, ADV, COUNTS, SIZES, noise=2e-3)
    assert r.form is None and r.opposite and r.scale == pytest.approx(-1 / 8), r
    z = G.read_weights(x, x @ np.ones(8), [0.0] * 8, COUNTS, SIZES, noise=2e-3)
    assert z.form is None and not z.opposite, z


# ------------------------------------------------------------------ the stage on a loop written here --------------

PROMPTS = [[1, 5, 9, 11, 4, 2], [1, 6, 8, 2]]
COMPLETIONS = [[7, 12, 8, 2], [14, 15, 2], [16, 9, 10, 11], [17, 2], [9, 9, 2], [13, 7, 8, 9], [10, 2], [12, 11, 2]]
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5]


@pytest.fixture(scope="module")
def setup():
    from harness.experiment.models import checkpoint_dir, eos_token_ids, load_model, load_tokenizer
    from harness.experiment.spec import load_spec

    spec = load_spec(DEFAULT_SPEC)
    ckpt = checkpoint_dir(spec)
    tok = load_tokenizer(ckpt)
    eos = tuple(eos_token_ids(load_model(ckpt, "float32", "cpu").generation_config, tok))
    return spec, ckpt, tok.pad_token_id, eos


def _loop_step(ckpt, loss_of, micro: int = 2):
    """One step as a loop writes it: the model in float32, each completion after its group's prompt, its log-probs
    by log_softmax, advantages (r - mean) / std of each group of 4, the loss `loss_of(term (B,), adv (B, 1))` of each
    micro-batch of `micro` completions backward; the Probe's slice before the optimizer would step."""
    from harness.experiment.models import load_model
    from harness.loop import Probe

    model = load_model(ckpt, "float32", "cpu")
    probe = Probe(model, steps=1)
    r = torch.tensor(REWARDS).view(-1, 4)
    adv = ((r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True).clamp(min=1e-8)).view(-1)
    total = 0.0
    for start in range(0, len(COMPLETIONS), micro):
        terms = []
        for i in range(start, start + micro):
            p, c = PROMPTS[i // 4], COMPLETIONS[i]
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)
            terms.append((-torch.exp(logp - logp.detach())).mean())
        loss = loss_of(torch.stack(terms), adv[start:start + micro].view(-1, 1))
        loss.backward()
        total += float(loss.detach())
    read = probe.read(grads=True)
    return {"advantages": adv.tolist(), "mask": [[1.0] * len(c) for c in COMPLETIONS], "loss": total,
            "micro_batches": [micro] * (len(COMPLETIONS) // micro), "probe": {**read, "after": read["before"]}}


def _cell(setup, saved, **spec_changes):
    from harness.diagnose.cell import CellData

    spec, _ckpt, pad, eos = setup
    spec = dataclasses.replace(spec, **spec_changes)
    record = {"prompt_ids": [PROMPTS[i // 4] for i in range(8)], "completion_ids": COMPLETIONS}
    return CellData(spec=spec, records=(record,), tensors={1: saved}, eos_ids=eos, pad_id=pad)


def test_a_micro_batch_mean_advantage_over_a_constant_is_read_from_the_gradient(setup):
    """Atropos' loss: `(term * advantages).mean()` with advantages (B, 1), a (B, B) broadcast, over 32."""
    saved = _loop_step(setup[1], lambda term, adv: (term * adv).mean() / 32)
    assert abs(saved["loss"]) < 1e-6  # (its value: 0, whatever the weighting)
    found = G.read(_cell(setup, saved), {})
    assert len(found) == 1 and not found[0].no_switch and found[0].exact, found
    assert found[0].settings == {"ADV_MICRO_BATCH_MEAN": True, "ACCUM_DIVISOR": 32.0, "MICRO_BATCH_ORDER": "rollout",
                                 "GRAD_ACCUM": 4}, found[0]  # (its 4 micro-batches, the spec's 2)
    rule = found[0].rule
    assert "mean advantage of its micro-batch" in rule and "divided by 32" in rule and "4/32" in rule, rule


def test_grpo_as_the_spec_says_nothing_and_a_constant_accumulation_divisor_is_named(setup):
    grpo = _loop_step(setup[1], lambda term, adv: (term * adv.view(-1)).mean() / 4)  # 4 micro-batches: grpo
    assert G.read(_cell(setup, grpo), {}) == []  # the spec's grpo gives this gradient: nothing to say
    const = _loop_step(setup[1], lambda term, adv: (term * adv.view(-1)).mean() / 16)  # / 16 for 4 micro-batches
    found = G.read(_cell(setup, const), {})
    assert len(found) == 1 and not found[0].no_switch and "divided by 16" in found[0].rule, found
    assert found[0].settings == {"ACCUM_DIVISOR": 16.0, "GRAD_ACCUM": 4}, found[0]
    assert "mean advantage" not in found[0].rule and "4/16" in found[0].rule, found[0].rule


def test_a_token_mean_the_value_could_not_tell_is_read_as_dapo(setup):
    """A token sum over the step's 24 tokens: with the spec at grpo, the gradient names dapo (a switch)."""
    tokens = float(sum(map(len, COMPLETIONS)))

    def dapo(term, adv):  # each term is a completion's token mean: times its length is its token sum
        lengths = torch.tensor([float(len(c)) for c in COMPLETIONS])
        return (term * adv.view(-1) * lengths).sum() / tokens

    saved = _loop_step(setup[1], dapo, micro=8)  # one micro-batch of the 8
    found = G.read(_cell(setup, saved), {})
    assert [f.settings for f in found] == [{"LOSS_NORM": "token_global"}] and not found[0].no_switch, found


def test_the_reading_needs_the_per_token_loss_read_from_the_advantages_saved(setup):
    """Where the loop saved its per-token loss, the forms' weights are its only if the objective stage read that loss
    exactly from the advantages saved (else they may not be the ones trained on), with nothing whose gradient a
    per-completion weight leaves out at step 1 (a k1 KL term, an importance-sampling weight)."""
    from harness.diagnose.identify.finding import Finding

    saved = _loop_step(setup[1], lambda term, adv: (term * adv).mean() / 32)
    saved["per_token_loss"] = [[-a] * len(c) for a, c in zip(saved["advantages"], COMPLETIONS)]
    read = Finding("objective", 1, "your loop has TRL's per-token objective", {}, True, evidence={"form": "ratio"})
    assert len(G.read(_cell(setup, saved), {"objective": [read]})) == 1
    assert G.read(_cell(setup, saved), {}) == []  # not read
    assert G.read(_cell(setup, saved), {"objective": [dataclasses.replace(read, exact=False)]}) == []
    k1 = dataclasses.replace(read, evidence={"form": "ratio", "kl": ("k1", 0.04, False)})
    assert G.read(_cell(setup, saved), {"objective": [k1]}) == []
    assert G.read(_cell(setup, saved), {"objective": [dataclasses.replace(read, settings={"IS_CORRECTION": True})]}) == []


def test_a_broadcast_over_micro_batches_of_whole_groups_has_no_gradient_and_is_named(setup):
    """Micro-batches of 4 hold whole groups: each micro-batch's mean advantage is 0, so the broadcast loss trains on
    nothing (its gradient is rounding) where grpo's would not: named, not read as the spec's grpo."""
    saved = _loop_step(setup[1], lambda term, adv: (term * adv).mean() / 2, micro=4)
    found = G.read(_cell(setup, saved), {})
    assert len(found) == 1 and not found[0].no_switch and found[0].evidence["vanishing"] < 1e-3, found
    assert found[0].settings == {"ADV_MICRO_BATCH_MEAN": True, "MICRO_BATCH_ORDER": "rollout"}, found[0]
    assert set(found[0].settles) == {"ADV_MICRO_BATCH_MEAN", "MICRO_BATCH_ORDER"}, found[0]  # (no divisor to read)
    assert "mean advantage of its micro-batch" in found[0].rule and "whole groups" in found[0].rule, found[0].rule


def test_a_step_after_steps_with_no_gradient_is_read_at_the_initial_weights(setup):
    """Step 1's advantages all 0 (no reward spread: nothing to train, a gradient norm of 0): the weights at step 2 are
    still the initial ones, so step 2's gradient is read; a step 1 that trained leaves step 2 unread."""
    import pandas as pd

    from harness.diagnose.cell import CellData

    spec, _ckpt, pad, eos = setup
    idle = _loop_step(setup[1], lambda term, adv: (term * adv.view(-1)).mean() * 0.0)
    idle["advantages"] = [0.0] * len(COMPLETIONS)
    const = _loop_step(setup[1], lambda term, adv: (term * adv.view(-1)).mean() / 16)
    record = {"prompt_ids": [PROMPTS[i // 4] for i in range(8)], "completion_ids": COMPLETIONS}

    def cell(norm1):
        log = pd.DataFrame({"grad_norm": [norm1, 0.5]}, index=pd.Index([1, 2], name="step"))
        return CellData(spec=spec, records=(record, record), tensors={1: idle, 2: const}, eos_ids=eos, pad_id=pad,
                        runs={"yours": log})

    found = G.read(cell(0.0), {})
    assert len(found) == 1 and found[0].step == 2 and "divided by 16" in found[0].rule, found
    assert G.read(cell(0.3), {}) == []  # step 1 trained (somewhere off the probed slice): step 2's weights unknown


def test_final_weights_apart_on_a_gradient_of_rounding_are_said_as_such(tmp_path):
    """A confirmed set whose final weights still part: where the gradient stage read a broadcast over whole groups (a
    gradient of rounding alone at every step), the words say the weights move on rounding, not 'log grad_norm'."""
    from harness.diagnose.explain_words import confirmed_words
    from harness.diagnose.identify.finding import Finding

    final = {"outside": ["param_rel_l2"], "first_divergence": {"step": 12, "metric": "param_rel_l2"}}
    vanishing = Finding("weighting", 1, "all but 0", {"ADV_MICRO_BATCH_MEAN": True}, True,
                        evidence={"from_gradient": True, "form": "micro_batch_mean", "vanishing": 2e-8})
    quirks = {"ADV_MICRO_BATCH_MEAN": True}
    said = confirmed_words({}, quirks, tmp_path / "t.toml", final, None, None, "float32", (vanishing,))
    assert "rounding alone" in said and "log grad_norm" not in said, said
    plain = confirmed_words({}, quirks, tmp_path / "t.toml", final, None, None, "float32")
    assert "log grad_norm" in plain and "rounding alone" not in plain, plain
