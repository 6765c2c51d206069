"""The objective and weighting stages read together across steps (issue 47's random loops): a KL term shows only once
the policy has left the reference, a divisor of the loop's own (verl's seq-mean-token-sum: the sum over the step's
completions) is read with the KL term in it, and with a loss logged for the last micro-batch alone. The tensors are
made here the way a loop makes them, never from the stages' own formulas."""

from __future__ import annotations

import types

import pytest
import torch

from harness.diagnose import identify
from harness.diagnose.cell import CellData
from harness.diagnose.identify.weighting import last_micro_batch

SPEC = types.SimpleNamespace(ADV_SCALE="group", STD="bessel", STD_EPS=1e-4, STD_EPS_INSIDE=False, MASK_TRUNCATED=False,
                             COMPLETION_MASK="eos", LOSS_NORM="sequence", LOSS_SUM=False, BETA=0.0, KL_ESTIMATOR="k3",
                             KL_IS_CORRECTION=True, CLIP_LOW=0.2, CLIP_HIGH=0.2, LR=3e-3, LR_SCHEDULE="constant",
                             ADAM_BETA1=0.9, ADAM_BETA2=0.99, ADAM_EPS=1e-8, WEIGHT_DECAY=0.0, MAX_GRAD_NORM=1.0,
                             WEIGHT_DECAY_ALL=False, MICRO_BATCH_ORDER="shuffled", WARMUP_STEPS=0,
                             LR_SCHEDULER_KWARGS={}, STEPS_PER_GENERATION=1, NUM_ITERATIONS=1, GROUP_SIZE=2,
                             MAX_TOKENS=3, DTYPE="float32", GRAD_ACCUM=2, LOGP_OLD="auto",
                             rewards=types.SimpleNamespace(weights=[1.0]))
COMPS = [[3, 4, 2], [5, 2], [6, 7, 8], [4, 2]]  # eos id 2: lengths 3, 2, 3, 2 (10 tokens, the longest 3)


def _steps(beta: float, last_only: bool = False) -> dict:
    """Two steps of a loop with a k1 KL term of weight `beta` (no ratio factor), its loss the masked sum over its 4
    completions in 2 micro-batches: the reference is the policy at step 1 (the KL 0 in value), apart at step 2.
    `last_only`: what it saves as its loss is its last micro-batch's alone."""
    torch.manual_seed(5)
    mask = torch.tensor([[1.0 if t < len(c) else 0.0 for t in range(3)] for c in COMPS])
    mine = {}
    for step, adv in ((1, [1.0, -1.0, 0.4, -0.4]), (2, [-0.7, 0.7, 1.2, -1.2])):
        logp = -torch.rand(4, 3)
        ref = logp.clone() if step == 1 else logp + 0.05 * torch.randn(4, 3)
        ptl = -torch.tensor(adv)[:, None] * torch.ones(4, 3) + beta * (logp - ref)
        parts = [float((ptl[i:i + 2] * mask[i:i + 2]).sum() / 4) for i in (0, 2)]
        mine[step] = {"advantages": adv, "logps": logp.tolist(), "old_logps": logp.tolist(), "ref_logps": ref.tolist(),
                      "mask": mask.tolist(), "per_token_loss": ptl.tolist(), "loss": parts[-1] if last_only
                      else sum(parts)}
    return mine


def _found(mine: dict) -> dict:
    cell = CellData(spec=SPEC, records=({"completion_ids": COMPS}, {"completion_ids": COMPS}), tensors=mine,
                    eos_ids=(2,), pad_id=0, trained={1: [(0, i) for i in range(4)], 2: [(1, i) for i in range(4)]})
    return {f.stage: f for f in identify.identify(cell)}


def test_a_kl_term_read_where_it_shows_is_settled_and_its_divisor_read_with_it():
    """Step 1 (the reference is the policy) reads TRL's objective and says nothing of a KL weight; step 2 reads k1 of
    weight 0.04: the two do not contradict each other, so the KL is settled. The loss, the masked sum over the 4
    completions with the KL term in it, is a divisor of 4 at both steps (without the KL term step 2's would be a
    number of no count: that reading does not replace it)."""
    found = _found(_steps(0.04))
    obj, w = found["objective"], found["weighting"]
    assert obj.settings == {"BETA": 0.04, "KL_ESTIMATOR": "k1"} and {"BETA", "KL_ESTIMATOR"} <= set(obj.settles), obj
    assert not any("other steps read otherwise" in u for u in obj.unsettled), obj
    assert w.exact and w.settings == {"LOSS_DIVISOR": 4.0} and "LOSS_DIVISOR" in w.settles, w


def test_a_step_with_no_kl_term_where_the_reference_is_apart_still_contradicts():
    """A step whose reference is apart from the policy and whose loss has no KL term does say something of the
    weight: against a step that read one, the search decides (nothing settled)."""
    mine = _steps(0.04)
    other = _steps(0.0)
    mine[1] = {**other[2], "advantages": other[2]["advantages"]}  # step 1: the reference apart, no KL term
    obj = _found(mine)["objective"]
    assert any("other steps read otherwise" in u for u in obj.unsettled) and not obj.settles, obj


def test_a_divisor_of_completions_is_read_from_the_last_micro_batchs_loss():
    """Four completions in two micro-batches; per-token losses by hand (mask all 1): row sums 2, 3 | 3, 6. The last
    micro-batch's sum is 9: over 4 completions 2.25 (no loss type gives it: per completion 1.75, over its tokens
    1.8, over the step's 10 tokens 0.9, over 4 x 8 max tokens 0.28125, the sum 9); over 8 (4 completions x 2
    micro-batches) 1.125; over 3 no count of the step."""
    ptl = [[1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 2.0], [2.0, 2.0, 2.0]]
    mask = [[1, 1], [1, 1, 1], [1, 1], [1, 1, 1]]
    lengths = [2, 3, 2, 3]
    assert last_micro_batch(ptl, mask, lengths, 2.25, 2, 8, telling=True) == ("divisor:4", 1)
    assert last_micro_batch(ptl, mask, lengths, 1.125, 2, 8, telling=True) == ("divisor:8", 1)
    assert last_micro_batch(ptl, mask, lengths, 3.0, 2, 8, telling=True) is None


def test_a_divisor_with_the_last_micro_batch_logged_is_settled():
    """verl's seq-mean-token-sum (the sum over 4 completions), what it saves as its loss the last micro-batch's: the
    divisor 4 at every step, and said that the loss is the last micro-batch's."""
    w = _found(_steps(0.0, last_only=True))["weighting"]
    assert w.exact and w.settings == {"LOSS_DIVISOR": 4.0} and "LOSS_DIVISOR" in w.settles, w
    assert "last micro-batch" in w.rule, w


def test_a_run_whose_ratio_is_1_throughout_says_the_clip_bounds_cannot_show():
    """One pass per round (num_iterations 1, one step per generation): the policy ratio is 1 at every step, so no
    clip bound can act and the run cannot tell your loop's; said with TRL's names and values. Not said with two
    passes (TRL's ratio leaves 1 at the second), nor where your loop's saved old log-probs differ from its own (its
    ratio leaves 1), but said again with LOGP_OLD = "current" (old log-probs taken again before each pass)."""
    from harness.diagnose.showable import ratio_one_words

    spec = types.SimpleNamespace(NUM_ITERATIONS=1, STEPS_PER_GENERATION=1, LOGP_OLD="auto", CLIP_LOW=0.2,
                                 CLIP_HIGH=0.28, DELTA=0.0)
    same = {1: {"logps": [[-1.0, -2.0], [-0.5]], "old_logps": [[-1.0, -2.0], [-0.5]]}}
    said = ratio_one_words(spec, same)
    assert said and "could not tell" in said and "clip" in said and "epsilon_high = 0.28" in said, said
    assert "delta" not in said  # (off in the spec: not named)
    assert ratio_one_words(spec, {}) is not None  # no tensors saved: the spec's ratio alone
    apart = {1: same[1], 2: {"logps": [[-1.0, -2.0]], "old_logps": [[-1.1, -2.0]]}}
    assert ratio_one_words(spec, apart) is None
    two = types.SimpleNamespace(**{**vars(spec), "NUM_ITERATIONS": 2})
    assert ratio_one_words(two, same) is None
    assert ratio_one_words(types.SimpleNamespace(**{**vars(two), "LOGP_OLD": "current"}), same) is not None


def test_a_divisor_is_not_read_from_the_last_micro_batch_where_the_others_sum_to_nearly_0():
    """The first micro-batch's sums cancel to within a count's margin (1e-3 of the last's): the step's loss and the
    last micro-batch's are the same divisor apart, so nothing tells what is logged."""
    ptl = [[1.0, 1.0], [-1.0, -1.0 + 1e-6], [1.0, 2.0, 3.0], [2.0, 2.0]]  # last: sums 6, 4 (no loss type gives 2.5)
    mask = [[1, 1], [1, 1], [1, 1, 1], [1, 1]]
    lengths = [2, 2, 3, 2]
    assert last_micro_batch(ptl, mask, lengths, 10.0 / 4, 2, 8, telling=True) is None
    ptl[1] = [-1.0, 0.0]  # the first micro-batch sums to 1: it tells
    assert last_micro_batch(ptl, mask, lengths, 10.0 / 4, 2, 8, telling=True) == ("divisor:4", 1)


def test_your_loop_at_parity_says_what_the_run_could_not_tell():
    """The headline of your loop at parity lists the cell's `untold` (the clip bounds at a ratio of 1), capitalised,
    one item each; a cell without it lists nothing."""
    from harness.diagnose.verdict import headline

    cell = {"name": "yours-vs-trl", "sides": ["yours", "trl"], "verdict": "parity", "first_divergence": None,
            "untold": ["this run could not tell your loop's clip bounds (TRL's epsilon = 0.2)"]}
    said = headline({"cells": [cell], "mode": "lockstep"})
    assert said["items"] == ["This run could not tell your loop's clip bounds (TRL's epsilon = 0.2)."], said
    assert headline({"cells": [{**cell, "untold": []}], "mode": "lockstep"})["items"] == []


def test_kl_resolution_is_the_smallest_weight_some_token_would_show():
    """Known answer: one token's reference 0.1 below the policy, one equal, a tolerance of 1e-3 each. k1 = 0.1 there:
    1e-3 / 0.1 = 0.01; k2 = 0.005: 0.2; k3 = exp(-0.1) + 0.1 - 1 = 0.0048374: 0.20672. With TRL's ratio factor the
    larger term counts (a ratio of 2 halves each). A reference equal to the policy shows no weight at all (inf)."""
    import math

    import numpy as np

    from harness.diagnose.identify.objective import kl_resolution

    lp, ref, tol = np.array([-1.0, -2.0]), np.array([-1.1, -2.0]), np.array([1e-3, 1e-3])
    got = kl_resolution(lp, ref, np.ones(2), tol)
    assert got["k1"] == pytest.approx(0.01) and got["k2"] == pytest.approx(0.2), got
    assert got["k3"] == pytest.approx(1e-3 / (math.exp(-0.1) + 0.1 - 1.0)), got
    assert kl_resolution(lp, ref, np.array([2.0, 1.0]), tol)["k1"] == pytest.approx(0.005)
    assert kl_resolution(lp, lp, np.ones(2), tol) == {"k1": math.inf, "k2": math.inf, "k3": math.inf}


def _kl_steps(beta: float, near: float, estimator: str = "k1") -> dict:
    """Two steps of a loop with a KL term of weight `beta` (no ratio factor) in its loss, its loss the masked sum
    over its 4 completions: step 1's reference `near` from the policy (apart, but so close the term may sit under the
    tolerance), step 2's 0.05 apart (the term shows)."""
    torch.manual_seed(7)
    mask = torch.tensor([[1.0 if t < len(c) else 0.0 for t in range(3)] for c in COMPS])
    mine = {}
    for step, adv, spread in ((1, [1.0, -1.0, 0.4, -0.4], near), (2, [-0.7, 0.7, 1.2, -1.2], 0.05)):
        logp = -torch.rand(4, 3)
        ref = logp + spread * torch.randn(4, 3)
        kl = logp - ref if estimator == "k1" else torch.exp(ref - logp) - (ref - logp) - 1
        ptl = -torch.tensor(adv)[:, None] * torch.ones(4, 3) + beta * kl
        mine[step] = {"advantages": adv, "logps": logp.tolist(), "old_logps": logp.tolist(), "ref_logps": ref.tolist(),
                      "mask": mask.tolist(), "per_token_loss": ptl.tolist(),
                      "loss": float((ptl * mask).sum() / 4)}
    return mine


def test_a_step_whose_kl_term_is_below_its_resolution_does_not_outvote_the_step_that_reads_it():
    """Step 1's reference only 1e-5 from the policy: a KL of 0.04 moves its per-token loss by ~4e-7, under the
    tolerance, so it reads no KL term, and says a weight below ~10 would not show there. Step 2 reads k1 of weight
    0.04. Step 1 could not have shown that weight: it neither contradicts nor outvotes step 2 (the reading said is
    step 2's, settled, with no "other steps read otherwise"), and what served the comparison is not kept."""
    obj = _found(_kl_steps(0.04, 1e-5))["objective"]
    assert obj.step == 2 and obj.settings == {"BETA": 0.04, "KL_ESTIMATOR": "k1"}, obj
    assert {"BETA", "KL_ESTIMATOR"} <= set(obj.settles), obj
    assert not any("other steps read otherwise" in u for u in obj.unsettled), obj
    assert "kl_below" not in obj.evidence, obj.evidence


def test_a_kl_read_with_look_alike_estimators_is_not_outvoted_by_a_step_that_could_not_see_it():
    """k3 of 0.04, step 2's log-ratios small enough that k2 fits alike (its reading leaves more unsettled than step
    1's): step 1, whose KL term is below its resolution, still does not outvote it: the reading said is step 2's
    weight (a guess for the search, the estimator left open), not step 1's "no KL term"."""
    obj = _found(_kl_steps(0.04, 1e-5, "k3"))["objective"]
    assert obj.step == 2 and obj.settings.get("BETA") == 0.04, obj
    assert any("fit alike" in u for u in obj.unsettled), obj
    assert not any("other steps read otherwise" in u for u in obj.unsettled), obj


def test_a_weighting_step_whose_loss_types_give_the_same_number_does_not_contradict_one_that_tells():
    """Step 1's completions have 3, 2, 3, 3 loss tokens (micro-batches of 5 and 6): its loss, the masked sum over the
    step's tokens, is TRL's dapo alone. Step 2's have 3 each: grpo (the spec's) and dapo give the same number there,
    and it cannot tell them apart. So the reading is dapo, settled, and step 2 is no "other steps read otherwise"."""
    comps1, comps2 = [[3, 4, 2], [5, 2], [6, 7, 8], [4, 9, 2]], [[3, 4, 2], [5, 6, 2], [6, 7, 8], [4, 9, 2]]
    mine = {}
    for step, comps in ((1, comps1), (2, comps2)):
        mask = torch.tensor([[1.0 if t < len(c) else 0.0 for t in range(3)] for c in comps])
        ptl = -torch.rand(4, 3)
        mine[step] = {"advantages": [1.0, -1.0, 0.5, -0.5], "mask": mask.tolist(), "per_token_loss": ptl.tolist(),
                      "loss": float((ptl * mask).sum() / mask.sum())}
    cell = CellData(spec=SPEC, records=({"completion_ids": comps1}, {"completion_ids": comps2}), tensors=mine,
                    eos_ids=(2,), pad_id=0, trained={1: [(0, i) for i in range(4)], 2: [(1, i) for i in range(4)]})
    w = next(f for f in identify.identify(cell) if f.stage == "weighting")
    assert w.settings == {"LOSS_NORM": "token_global"} and "LOSS_NORM" in w.settles, w
    assert not any("other steps read otherwise" in u for u in w.unsettled), w
    assert "look_alikes" not in w.evidence, w.evidence
