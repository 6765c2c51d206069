"""Known-answer tests for scratch_grpo.core, each value computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from scratch_grpo import core


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               rtol=tol, atol=tol)


# ---- advantages ---------------------------------------------------------------------------------------------
def test_group_advantages_bessel_by_hand():
    # group 1: [1, 0, 0, 1] mean 0.5, deviations +-0.5, sum of squares 1.0; Bessel std = sqrt(1/3) = 0.577350
    # group 2: [2, 2, 2, 2] std 0 -> advantages 0
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv, sd = core.group_advantages(r, 4, scale="group", std="bessel", eps=1e-4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    close(adv, [a, -a, -a, a, 0, 0, 0, 0])
    close(sd[:4], [math.sqrt(1 / 3)] * 4)


def test_group_advantages_population_differs():
    # population std of [1, 0, 0, 1] = sqrt(1/4) = 0.5 -> A = 0.5 / 0.5001 = 0.9998
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv, _ = core.group_advantages(r, 4, std="population", eps=1e-4)
    close(adv, [0.5 / 0.5001, -0.5 / 0.5001, -0.5 / 0.5001, 0.5 / 0.5001])
    bessel, _ = core.group_advantages(r, 4, std="bessel", eps=1e-4)
    assert not torch.allclose(adv, bessel)  # 0.9998 vs 0.8659: the estimator matters


def test_leave_one_out_advantages_by_hand():
    # group 1: [1, 0, 0, 0]. Completion 0: others [0, 0, 0], mean 0, std 0 -> not divided: A = 1 - 0 = 1.
    #   Completion 1: others [1, 0, 0], mean 1/3; Bessel variance ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std 0.577350
    #   -> A = (0 - 1/3) / (0.577350 + 1e-6) = -0.577349.
    # group 2: [2, 4, 6, 8]. Completion 0: others [4, 6, 8], mean 6, Bessel std 2 -> (2 - 6) / 2 = -2; completion 3:
    #   others [2, 4, 6], mean 4, std 2 -> (8 - 4) / 2 = 2; completion 1: others [2, 6, 8], mean 16/3, variance
    #   ((10/3)^2 + (2/3)^2 + (8/3)^2) / 2 = (100 + 4 + 64) / 18 = 28/3, std 3.055050 -> (4 - 16/3) / 3.055050 = -0.436436
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0])
    adv, own = core.group_advantages(r, 4, scale="group", std="bessel", eps=1e-6, baseline="loo")
    b = (1 / 3) / (math.sqrt(1 / 3) + 1e-6)
    c = (4 - 16 / 3) / (math.sqrt(28 / 3) + 1e-6)
    close(adv, [1.0, -b, -b, -b, -4 / (2 + 1e-6), c, -c, 4 / (2 + 1e-6)], tol=2e-6)
    close(own[:4], [0.5] * 4)  # the group's own std, as TRL counts zero-std groups (Bessel std of [1,0,0,0] = 0.5)
    adv_none, _ = core.group_advantages(r, 4, scale="none", baseline="loo")
    close(adv_none, [1.0, -1 / 3, -1 / 3, -1 / 3, -4.0, 4 - 16 / 3, 6 - 14 / 3, 4.0])


def test_group_advantages_batch_and_none():
    # rewards [0, 2 | 4, 6]; group means 1, 5; batch Bessel std of [0,2,4,6]: mean 3, squares 9+1+1+9 = 20,
    # 20/3 -> std 2.581989
    r = torch.tensor([0.0, 2.0, 4.0, 6.0])
    adv, _ = core.group_advantages(r, 2, scale="batch", eps=0.0)
    s = math.sqrt(20 / 3)
    close(adv, [-1 / s, 1 / s, -1 / s, 1 / s])
    adv_none, sd = core.group_advantages(r, 2, scale="none")
    close(adv_none, [-1, 1, -1, 1])
    close(sd, [math.sqrt(2)] * 4)  # group std still reported: each group [a, a+2] has Bessel std sqrt(2)


def test_group_advantages_nan_rewards_get_zero():
    r = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    adv, _ = core.group_advantages(r, 4, eps=0.0)
    # non-NaN [1, 0, 1]: mean 2/3, Bessel std sqrt(((1/3)^2*2 + (2/3)^2)/2) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    close(adv, [(1 / 3) / s, 0.0, (-2 / 3) / s, (1 / 3) / s])


def test_group_advantages_bit_for_bit_with_trl():
    """The group std in TRL's order of operations (trl.trainer.utils.nanstd), so the advantages agree to the bit:
    a std one ulp off moves every advantage of its group, and in a group of equal rewards a mean one ulp off is
    a std of ~1e-7 against the 1e-4 eps (the H100 case in tests/test_gpu.py). Random groups, one of equal rewards,
    a NaN reward; TRL's own lines (grpo_trainer.py, scale_rewards="group") give the expected values."""
    from trl.trainer.utils import nanstd

    for seed in range(50):
        r = torch.rand(64, generator=torch.Generator().manual_seed(seed)) * 3
        r[8:16] = r[8]
        r[3] = float("nan")
        adv, sd = core.group_advantages(r, 8, scale="group", std="bessel", eps=1e-4)
        mean = torch.nanmean(r.view(-1, 8), dim=1).repeat_interleave(8)
        std = nanstd(r.view(-1, 8), dim=1).repeat_interleave(8)
        assert torch.equal(sd, std), seed
        assert torch.equal(adv, torch.nan_to_num((r - mean) / (std + 1e-4))), seed


# ---- log-probs, entropy, KL ---------------------------------------------------------------------------------
def test_token_logprobs_uses_temperature():
    # logits [0, ln 3] -> at T=1 probs [1/4, 3/4]; at T=2 logits [0, ln3 / 2] -> probs 1/(1+sqrt3), sqrt3/(1+sqrt3)
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    target = torch.tensor([[1]])
    close(core.token_logprobs(logits, target, 1.0), [[math.log(0.75)]])
    s3 = math.sqrt(3)
    close(core.token_logprobs(logits, target, 2.0), [[math.log(s3 / (1 + s3))]])


def test_token_entropy_uniform_and_peaked():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    # uniform over 4: ln 4; [1/4, 3/4]: -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335
    close(core.token_entropy(logits), [[math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])


def test_kl_k3():
    # d = ref - logp = ln 2 - 0 -> exp(d) - d - 1 = 2 - 0.693147 - 1 = 0.306853; zero when equal
    close(core.kl_k3(torch.tensor([0.0, -1.0]), torch.tensor([math.log(2), -1.0])), [2 - math.log(2) - 1, 0.0])


# ---- clipped surrogate --------------------------------------------------------------------------------------
def test_clipped_surrogate_by_hand():
    # token ratios rho = exp(logp - old) = [1.5, 0.5, 1.1]; eps_low 0.2, eps_high 0.28
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    old = torch.zeros(1, 3)
    # A = +1: -min(rho, clip(rho, 0.8, 1.28)) = -[1.28, 0.5, 1.1]
    loss, rho = core.clipped_surrogate(logp, old, torch.tensor([1.0]), 0.2, 0.28)
    close(loss, [[-1.28, -0.5, -1.1]])
    close(rho, [[1.5, 0.5, 1.1]])
    # A = -1: -min(-rho, -clip) = max(rho, clip) = [1.5, 0.8, 1.1]
    loss, _ = core.clipped_surrogate(logp, old, torch.tensor([-1.0]), 0.2, 0.28)
    close(loss, [[1.5, 0.8, 1.1]])
    # two-sided clipping (delta = 1.3) caps the unclipped ratio for A < 0: max(min(rho, 1.3), clip) = [1.3, .8, 1.1]
    loss, _ = core.clipped_surrogate(logp, old, torch.tensor([-1.0]), 0.2, 0.28, delta=1.3)
    close(loss, [[1.3, 0.8, 1.1]])


# ---- aggregation ------------------------------------------------------------------------------------------
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_aggregate_each_normalization_by_hand():
    # sequence: means (1+2+3)/3 = 2 and 4/1 = 4 -> 3, / grad_accum 2 = 1.5
    close(core.aggregate_loss(PER_TOKEN, MASK, "sequence", grad_accum=2), 1.5)
    # token_local: (1+2+3+4)/4 tokens = 2.5, / 2 = 1.25
    close(core.aggregate_loss(PER_TOKEN, MASK, "token_local", grad_accum=2), 1.25)
    # constant: 10 / (2 sequences x 8 max tokens) = 0.625, / 2 = 0.3125
    close(core.aggregate_loss(PER_TOKEN, MASK, "constant", grad_accum=2, max_tokens=8), 0.3125)
    # token_global: 10 / 20 tokens in the whole step = 0.5 (no grad_accum division: the denominator spans it)
    close(core.aggregate_loss(PER_TOKEN, MASK, "token_global", grad_accum=2, step_tokens=20), 0.5)


def test_sequence_equals_token_local_when_lengths_are_equal():
    per_token = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    mask = torch.ones(2, 2)
    # sequence: (2 + 6)/2 = 4; token_local: 16/4 = 4
    close(core.aggregate_loss(per_token, mask, "sequence", 1), 4.0)
    close(core.aggregate_loss(per_token, mask, "token_local", 1), 4.0)
    # and differ when lengths differ (PER_TOKEN above: 3.0 vs 2.5)
    assert core.aggregate_loss(PER_TOKEN, MASK, "sequence", 1) != core.aggregate_loss(PER_TOKEN, MASK, "token_local", 1)


def test_step_sums_match_over_micro_batches():
    # token_global over two micro-batches sums to the token mean of the step: (10 + 6) / (4 + 2) tokens
    mb2 = torch.tensor([[6.0, 0.0]])
    m2 = torch.tensor([[1.0, 1.0]])
    total = core.aggregate_loss(PER_TOKEN, MASK, "token_global", 2, step_tokens=6) + \
        core.aggregate_loss(mb2, m2, "token_global", 2, step_tokens=6)
    close(total, 16 / 6)


def test_micro_batch_mean_advantage_by_hand():
    # a micro-batch's advantages [1.5, -0.5, 2.0]: mean (1.5 - 0.5 + 2) / 3 = 1.0, each completion's now 1.0
    a = torch.tensor([1.5, -0.5, 2.0])
    close(core.micro_batch_mean_advantage(a), [1.0, 1.0, 1.0])
    close(a, [1.5, -0.5, 2.0])  # (its own advantages untouched: a copy)
    # the (B, B) broadcast it reproduces: terms t = [2, 4, 6] (B,) against a (B, 1): (t * a).mean() is
    # mean(t) x mean(a) = 4 x 1 = 4, each term weighted by the mean advantage: (2 + 4 + 6) x 1 / 3 = 4 ...
    t = torch.tensor([2.0, 4.0, 6.0])
    close((t * a.view(-1, 1)).mean(), 4.0)
    close((t * core.micro_batch_mean_advantage(a)).mean(), 4.0)
    close((t * a).mean(), (3.0 - 2.0 + 12.0) / 3)  # ... not each by its own: 13 / 3
    # at a ratio of 1 the per-token loss is -mean(A) on every token of every completion
    loss, _ = core.clipped_surrogate(torch.zeros(3, 2), torch.zeros(3, 2), core.micro_batch_mean_advantage(a), 0.2, 0.2)
    close(loss, -torch.ones(3, 2))
    assert core.micro_batch_mean_advantage(torch.zeros(0)).numel() == 0  # an empty micro-batch stays empty


def test_accumulation_divisor_by_hand():
    assert core.accumulation_divisor(2) == 2.0 and core.accumulation_divisor(2, 0.0) == 2.0  # their number (TRL)
    assert core.accumulation_divisor(2, 8.0) == 8.0  # a constant of the loop's own
    # sequence over 8 in place of 2: means 2 and 4 -> 3, / 8 = 0.375 (a quarter of grad_accum 2's 1.5)
    close(core.aggregate_loss(PER_TOKEN, MASK, "sequence", core.accumulation_divisor(2, 8.0)), 0.375)
    # token_local: 10 / 4 tokens = 2.5, / 8 = 0.3125
    close(core.aggregate_loss(PER_TOKEN, MASK, "token_local", core.accumulation_divisor(2, 8.0)), 0.3125)


def test_aggregate_rejects_unknown():
    with pytest.raises(ValueError, match="unknown loss normalization"):
        core.aggregate_loss(PER_TOKEN, MASK, "tokens", 1)


# ---- importance sampling ------------------------------------------------------------------------------------
def test_is_weights_four_modes_by_hand():
    # per-token log differences trainer - sampler: [ln 2, ln 2, ln 0.1] on a mask [1, 1, 0] -> masked [ln2, ln2, 0]
    t = torch.log(torch.tensor([[2.0, 2.0, 0.1]]))
    s = torch.zeros(1, 3)
    m = torch.tensor([[1.0, 1.0, 0.0]])
    w, raw = core.is_weights(t, s, m, "token_truncate", None, 1.5)
    close(raw, [[2.0, 2.0, 1.0]])
    close(w, [[1.5, 1.5, 1.0]])  # clamped at 1.5
    w, _ = core.is_weights(t, s, m, "token_mask", None, 1.5)
    close(w, [[0.0, 0.0, 1.0]])  # 2 > 1.5 -> masked to 0
    w, raw = core.is_weights(t, s, m, "sequence_truncate", None, 3.0)
    close(raw, [[4.0]])  # product of ratios 2 x 2
    close(w, [[3.0]])
    w, _ = core.is_weights(t, s, m, "sequence_mask", None, 3.0)
    close(w, [[0.0]])
    w, _ = core.is_weights(t, s, m, "sequence_mask", 0.5, 5.0)
    close(w, [[4.0]])  # inside [0.5, 5]: kept


def test_is_weights_nan_sampler_logp_counts_as_one():
    t = torch.zeros(1, 2)
    s = torch.tensor([[float("nan"), 0.0]])
    w, _ = core.is_weights(t, s, torch.ones(1, 2), "token_truncate", None, 3.0)
    close(w, [[1.0, 1.0]])


def test_mismatch_stats_by_hand():
    t = torch.tensor([[0.0, 0.0]])
    s = torch.tensor([[math.log(2), 0.0]])  # d = t - s = [-ln2, 0]
    st = core.mismatch_stats(t, s, torch.ones(1, 2))
    assert st["mean_abs"] == pytest.approx(math.log(2) / 2)
    assert st["max_abs"] == pytest.approx(math.log(2))
    assert st["token_mult_prob_error"] == pytest.approx((2 + 1) / 2)  # mean exp|d| = (e^ln2 + 1) / 2
    assert st["k3_kl"] == pytest.approx((0.5 + math.log(2) - 1) / 2)  # exp(d) - d - 1 = 0.5 + ln2 - 1


def test_mismatch_spread_by_hand():
    nan = float("nan")
    t = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, -7.0]])
    s = torch.tensor([[-1.1, -1.5, -0.5], [-0.9, nan, 0.0]])  # NaN: no sampler log-prob; the last token masked
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    st = core.mismatch_spread(t, s, mask, clip_min=0.9, clip_max=1.5)
    # tokens: d = [0.1, -0.5, 0.0, -0.1]; |d| sorted [0, 0.1, 0.1, 0.5], quantiles by linear interpolation
    assert st["tokens"] == 4 and st["mean"] == pytest.approx(-0.125, abs=1e-6)
    assert st["abs_p50"] == pytest.approx(0.1, abs=1e-6)  # position 1.5
    assert st["abs_p90"] == pytest.approx(0.1 + 0.7 * 0.4, abs=1e-6)  # position 2.7
    assert st["abs_p99"] == pytest.approx(0.1 + 0.97 * 0.4, abs=1e-6)
    assert st["abs_max"] == pytest.approx(0.5, abs=1e-6)
    assert st["token_mult_prob_error"] == pytest.approx((2 * math.exp(0.1) + math.exp(0.5) + 1) / 4, abs=1e-6)
    assert st["token_out"] == pytest.approx(0.25)  # only exp(-0.5) < 0.9 (exp(-0.1) = 0.905 is inside)
    # sequences: sums -0.4 and -0.1
    assert st["sequences"] == 2 and st["seq_std"] == pytest.approx(0.15, abs=1e-6)
    assert st["seq_abs_p50"] == pytest.approx(0.25, abs=1e-6) and st["seq_abs_p90"] == pytest.approx(0.37, abs=1e-6)
    assert st["seq_abs_max"] == pytest.approx(0.4, abs=1e-6)
    assert (st["seq_ratio_min"], st["seq_ratio_max"]) == pytest.approx((math.exp(-0.4), math.exp(-0.1)), abs=1e-6)
    assert st["seq_out"] == pytest.approx(0.5)
    # no bounds: nothing outside
    assert core.mismatch_spread(t, s, mask, None, None)["seq_out"] == 0.0


# ---- learning-rate schedule ---------------------------------------------------------------------------------
def test_lr_schedules_by_hand():
    # linear, 10 steps, no warmup: step k uses (10 - k)/10 -> 1.0, 0.9, ..., 0.1
    assert [core.lr_multiplier(k, "linear", 10) for k in (0, 1, 9)] == pytest.approx([1.0, 0.9, 0.1])
    # linear with 2 warmup steps over 10: 0, 0.5, then (10 - k)/8: k=2 -> 1.0, k=6 -> 0.5
    assert [core.lr_multiplier(k, "linear", 10, 2) for k in (0, 1, 2, 6)] == pytest.approx([0.0, 0.5, 1.0, 0.5])
    assert [core.lr_multiplier(k, "constant", 10, 2) for k in (0, 1, 2, 9)] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    with pytest.raises(ValueError, match="metric"):
        core.lr_multiplier(0, "reduce_lr_on_plateau", 10)
    with pytest.raises(ValueError, match="unknown"):
        core.lr_multiplier(0, "cosine_wave", 10)


def test_every_trl_schedule_by_hand():
    m = core.lr_multiplier
    # cosine over 10 steps, warmup 2: step 2 starts the half wave (1.0), step 6 is half way: 0.5 (1 + cos(pi/2)) = 0.5
    assert [m(k, "cosine", 10, 2) for k in (1, 2, 6)] == pytest.approx([0.5, 1.0, 0.5])
    # cosine to a floor of 0.1: half way 0.5 x 0.9 + 0.1 = 0.55; min_lr = 1e-7 at lr 1e-6 is the same floor
    assert m(5, "cosine_with_min_lr", 10, 0, {"min_lr_rate": 0.1}) == pytest.approx(0.55)
    assert m(5, "cosine_with_min_lr", 10, 0, {"min_lr": 1e-7}, lr=1e-6) == pytest.approx(0.55)
    # its warmup-first variant: warmup (k + 1) / w; after it progress (k - w + 1) / (n - w): k = 6, w = 2 -> 5/8
    assert m(0, "cosine_warmup_with_min_lr", 10, 2, {"min_lr_rate": 0.0}) == pytest.approx(0.5)
    assert m(6, "cosine_warmup_with_min_lr", 10, 2, {"min_lr_rate": 0.0}) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 5 / 8)))
    # a warmup from 0.1 over w - 1 = 50 steps (torch's LinearLR(start_factor=0.1, total_iters=50)): k = 10 -> 0.28
    assert m(10, "cosine_warmup_with_min_lr", 12, 51, {"min_lr_rate": 0.0, "warmup_lr_rate": 0.1}) == \
        pytest.approx(0.1 + 0.9 * 10 / 50)
    # restarts: 2 cycles over 10 steps, k = 5 starts the second (1.0), k = 10 is past the end (0)
    assert [m(k, "cosine_with_restarts", 10, 0, {"num_cycles": 2}) for k in (0, 5, 10)] == pytest.approx([1, 1, 0])
    # polynomial, power 2, lr 1e-6 to lr_end 1e-7 over 10: k = 5 -> (0.9e-6 x 0.25 + 1e-7) / 1e-6 = 0.325
    assert m(5, "polynomial", 10, 0, {"power": 2.0, "lr_end": 1e-7}, lr=1e-6) == pytest.approx(0.325)
    # inverse sqrt, warmup 4 (timescale 4): k = 12 -> 1 / sqrt(12 / 4)
    assert m(12, "inverse_sqrt", 20, 4) == pytest.approx(1 / math.sqrt(3))
    # warmup-stable-decay: w 2, 2 decay steps, linear decay to 0.1 over 10 steps: stable from 2 to 7, 8 -> 1.0, 9 -> 0.55
    wsd = {"num_decay_steps": 2, "decay_type": "linear", "min_lr_ratio": 0.1}
    assert [m(k, "warmup_stable_decay", 10, 2, wsd) for k in (0, 1, 5, 8, 9, 10)] == pytest.approx(
        [0.1, 0.55, 1.0, 1.0, 0.55, 0.1])
    # a warmup longer than the run: 50 steps over 12, step 11 at 11/50
    assert m(11, "linear", 12, 50) == pytest.approx(0.22)
    assert m(11, "constant_with_warmup", 12, 50) == pytest.approx(0.22)
    with pytest.raises(ValueError, match="min_lr_rate"):
        m(3, "cosine_with_min_lr", 10)


_SCHEDULE_CASES = [  # (schedule, warmup, kwargs) over runs shorter and longer than the warmup
    ("constant", 0, {}), ("constant_with_warmup", 3, {}), ("linear", 0, {}), ("linear", 4, {}),
    ("cosine", 0, {}), ("cosine", 3, {"num_cycles": 0.25}), ("cosine", 2, {"num_cycles": 1.5}),
    ("cosine_with_restarts", 0, {}), ("cosine_with_restarts", 2, {"num_cycles": 3}),
    ("polynomial", 0, {}), ("polynomial", 2, {"power": 2.0, "lr_end": 1e-5}), ("polynomial", 3, {"power": 0.5}),
    ("inverse_sqrt", 0, {}), ("inverse_sqrt", 4, {}), ("inverse_sqrt", 2, {"timescale": 7}),
    ("cosine_with_min_lr", 0, {"min_lr_rate": 0.1}), ("cosine_with_min_lr", 3, {"min_lr": 2e-5, "num_cycles": 0.3}),
    ("cosine_warmup_with_min_lr", 0, {"min_lr_rate": 0.0}), ("cosine_warmup_with_min_lr", 3, {"min_lr_rate": 0.2}),
    ("cosine_warmup_with_min_lr", 5, {"min_lr_rate": 0.1, "warmup_lr_rate": 0.1}),
    ("warmup_stable_decay", 2, {"num_decay_steps": 3}), ("warmup_stable_decay", 0, {"num_decay_steps": 4,
                                                                                    "decay_type": "linear"}),
    ("warmup_stable_decay", 3, {"num_decay_steps": 2, "warmup_type": "cosine", "decay_type": "1-sqrt",
                                "min_lr_ratio": 0.05}),
    ("warmup_stable_decay", 2, {"num_decay_steps": 2, "num_stable_steps": 1, "warmup_type": "1-sqrt"}),
]


@pytest.mark.parametrize("schedule,warmup,kwargs", _SCHEDULE_CASES)
@pytest.mark.parametrize("scale", [1, 10])  # a warmup shorter than the run, and (scaled x10) longer than it
def test_every_schedule_as_transformers(schedule, warmup, kwargs, scale):
    """Each rate the built-in loop's multiplier gives is transformers' own get_scheduler's, step by step."""
    from transformers import get_scheduler

    warmup, steps, lr = warmup * scale, 12, 1e-4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(schedule, opt, num_warmup_steps=warmup, num_training_steps=steps,
                          scheduler_specific_kwargs=dict(kwargs) or None)
    theirs = []
    for _ in range(steps + 2):  # (two steps past the run: what a schedule does after its horizon)
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = [lr * core.lr_multiplier(k, schedule, steps, warmup, kwargs, lr=lr) for k in range(steps + 2)]
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-15)


def test_clip_stats_by_hand():
    rho = torch.tensor([[0.5, 1.0, 1.5], [1.5, 1.5, 1.0]])
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    st = core.clip_stats(rho, adv, mask, 0.2, 0.2)
    # low-clipped: seq 0 token 0 (0.5 < 0.8, A<0) -> 1 of 5 tokens; high: seq 1 tokens 0,1 (1.5 > 1.2, A>0) -> 2 of 5
    assert st["clip_ratio/low_mean"] == pytest.approx(0.2)
    assert st["clip_ratio/high_mean"] == pytest.approx(0.4)
    assert st["clip_ratio/region_mean"] == pytest.approx(0.6)
    assert st["clip_ratio/low_min"] == pytest.approx(0.0)  # per-seq low fractions 1/3 and 0
    assert st["clip_ratio/high_max"] == pytest.approx(1.0)  # per-seq high fractions 0 and 2/2


def test_lean_logprobs_and_entropy_match_the_plain_expressions():
    """The memory-lean paths (bf16 logits on a GPU run) give the plain fp32 expressions' values and gradients."""
    from scratch_grpo import core

    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 1400, 50, generator=g) * 3
    logits = full[:, :1300]
    targets = torch.randint(0, 50, (3, 1300), generator=g)
    weights = torch.randn(3, 1300, generator=g)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        leaf = full.detach().to(dtype).clone().requires_grad_(True)
        x = leaf[:, :1300]  # as the loop hands it over: a non-contiguous slice of the model output, 2 chunks a row
        lean = core._LeanLogprobs.apply(x, targets, 0.7, False)[0]
        (lean * weights).sum().backward()
        ref_x = x.detach().float().requires_grad_(True)
        ref = torch.log_softmax(ref_x / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
        (ref * weights).sum().backward()
        assert lean.dtype == torch.float32
        torch.testing.assert_close(lean, ref, rtol=0, atol=1e-5)  # fp32 math on the same inputs
        torch.testing.assert_close(leaf.grad[:, :1300].float(), ref_x.grad, rtol=tol, atol=tol)
        assert not leaf.grad[:, 1300:].any()
    bf = logits.bfloat16()
    assert core._lean(bf) and not core._lean(logits)
    plain = -(torch.log_softmax(bf.float() / 0.7, -1).exp() * torch.log_softmax(bf.float() / 0.7, -1)).sum(-1)
    torch.testing.assert_close(core.token_entropy(bf, 0.7), plain, rtol=1e-6, atol=1e-6)
    plain_logp = torch.log_softmax(bf.float() / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(core.token_logprobs(bf, targets, 0.7), plain_logp, rtol=0, atol=1e-5)
    # both from one pass (the training loop's call), and each on its own when the temperatures differ
    logp, ent = core.token_logprobs_and_entropy(bf, targets, 0.7)
    torch.testing.assert_close(logp, plain_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, plain, rtol=1e-6, atol=1e-6)
    logp, ent = core.token_logprobs_and_entropy(bf, targets, 0.7, entropy_temperature=1.0)
    torch.testing.assert_close(logp, plain_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, core.token_entropy(bf.float(), 1.0), rtol=1e-6, atol=1e-6)
    logp, ent = core.token_logprobs_and_entropy(logits, targets, 0.7)  # small fp32: the plain expressions
    assert torch.equal(logp, torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1))
    assert torch.equal(ent, core.token_entropy(logits, 0.7))


def test_compiled_lean_kernels_compute_the_eager_values(monkeypatch):
    """On a GPU the lean path's chunk functions run compiled (fused, no fp32 copy of the logits); compiled here on
    the CPU, they give the eager functions' log-probs, entropies and gradients."""
    from scratch_grpo import core

    g = torch.Generator().manual_seed(1)
    base = (torch.randn(2, 300, 64, generator=g) * 3).bfloat16()
    targets = torch.randint(0, 64, (2, 300), generator=g)
    weights = torch.randn(2, 300, generator=g)
    out = {}
    for devices in ((), ("cpu",)):
        monkeypatch.setattr(core, "KERNELS", core._Kernels(devices))
        x = base.clone().requires_grad_(True)
        logp, ent = core.token_logprobs_and_entropy(x, targets, 0.9)
        (logp * weights).sum().backward()
        out[devices] = (logp, ent, x.grad)
        assert len(core.KERNELS.compiled) == (2 if devices else 0) and not core.KERNELS.failed
    for eager, compiled in zip(out[()], out[("cpu",)]):
        torch.testing.assert_close(compiled.float(), eager.float(), rtol=1e-5, atol=1e-5)


# ---- quirks of hand-written loops ------------------------------------------------------------------------------
def test_std_eps_inside_the_square_root():
    # [1, 0, 0, 1]: Bessel var = 1/3; eps 0.01 inside: A = 0.5 / sqrt(1/3 + 0.01) = 0.5 / 0.585947 = 0.853320
    # outside (TRL): 0.5 / (0.577350 + 0.01) = 0.851283
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    inside, _ = core.group_advantages(r, 4, eps=0.01, eps_inside=True)
    outside, _ = core.group_advantages(r, 4, eps=0.01)
    close(inside[0], 0.5 / math.sqrt(1 / 3 + 0.01))
    close(outside[0], 0.5 / (math.sqrt(1 / 3) + 0.01))
    assert abs(float(inside[0]) - 0.853320) < 1e-5 and abs(float(outside[0]) - 0.851283) < 1e-5


def test_kl_estimators_by_hand():
    # logp = -1, ref = -2: d = ref - logp = -1; k1 = logp - ref = 1; k2 = 1^2 / 2 = 0.5;
    # k3 = exp(-1) - (-1) - 1 = 0.367879
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    close(core.kl_estimate(logp, ref, "k1"), [1.0])
    close(core.kl_estimate(logp, ref, "k2"), [0.5])
    close(core.kl_estimate(logp, ref, "k3"), [math.exp(-1)])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        core.kl_estimate(logp, ref, "k4")


def test_loss_mask_eos_and_padding():
    # completion A: 3 tokens ending with eos; B: 2 tokens cut at the limit (no eos), then one pad
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    eos = torch.tensor([True, False])
    assert core.loss_mask(mask, eos, "eos").tolist() == [[1, 1, 1], [1, 1, 0]]
    assert core.loss_mask(mask, eos, "no_eos").tolist() == [[1, 1, 0], [1, 1, 0]]  # only A had an eos to drop
    assert core.loss_mask(mask, eos, "all").tolist() == [[1, 1, 1], [1, 1, 1]]  # the pad counts too


def test_summed_loss_has_no_normaliser():
    # per-token [[1, 2, 3], [4, 5, 0]] with mask [[1,1,1],[1,1,0]]: sum = 15 (vs the sequence mean (2 + 4.5)/2 = 3.25)
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    close(core.aggregate_loss(per_token, mask, "sum", grad_accum=2), 15.0)
    close(core.aggregate_loss(per_token, mask, "sequence", grad_accum=1), 3.25)


def test_log_probs_on_raw_logits_differ_from_tempered_ones():
    # logits [0, ln 3]: raw softmax [1/4, 3/4] -> log(3/4) = -0.287682; at temperature 0.5 the logits become
    # [0, 2 ln 3], softmax [1/10, 9/10] -> log(9/10) = -0.105361 (the LOGP_ON_RAW_LOGITS quirk takes the first)
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    target = torch.tensor([[1]])
    close(core.token_logprobs(logits, target, 1.0), [[math.log(0.75)]])
    close(core.token_logprobs(logits, target, 0.5), [[math.log(0.9)]])


def test_shape_rewards_clip_and_kl_in_the_reward():
    # rewards [1.5, -0.2, 0.4] clipped to 0.5: [0.5, -0.2, 0.4]; then minus beta 0.1 x summed KL [2, 0, 1]:
    # [0.5 - 0.2, -0.2 - 0, 0.4 - 0.1] = [0.3, -0.2, 0.3]
    r = torch.tensor([1.5, -0.2, 0.4])
    close(core.shape_rewards(r, clip=0.5), [0.5, -0.2, 0.4])
    close(core.shape_rewards(r, clip=0.5, seq_kl=torch.tensor([2.0, 0.0, 1.0]), beta=0.1), [0.3, -0.2, 0.3])
    close(core.shape_rewards(r), r)  # TRL's: the sum as it is


@pytest.mark.gpu
def test_lean_kernels_compile_on_the_gpu_and_match_the_plain_expressions():
    """The GPU default: the chunk functions compile (no fallback) and give the plain fp32 expressions' values."""
    from scratch_grpo import core

    g = torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(4, 700, 151936, device="cuda", generator=g) * 3).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 151936, (4, 700), device="cuda", generator=g)
    logp, ent = core.token_logprobs_and_entropy(logits, targets, 0.9)
    logp.sum().backward()
    assert len(core.KERNELS.compiled) == 2 and not core.KERNELS.failed
    ref = torch.log_softmax(logits.detach().float() / 0.9, -1)
    torch.testing.assert_close(logp, ref.gather(-1, targets[..., None]).squeeze(-1), rtol=0, atol=1e-4)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), rtol=1e-5, atol=1e-4)
    onehot = torch.zeros_like(ref).scatter_(-1, targets[..., None], 1.0)
    torch.testing.assert_close(logits.grad.float(), (onehot - ref.exp()) / 0.9, rtol=1e-2, atol=1e-2)


def test_lean_kernels_fall_back_to_eager_when_compiling_fails(monkeypatch):
    from scratch_grpo import core

    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("inductor: no C++ compiler")
        return run

    monkeypatch.setattr(core, "KERNELS", core._Kernels(("cpu",)))
    monkeypatch.setattr(torch, "compile", broken)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 30, generator=g).bfloat16()
    targets = torch.randint(0, 30, (2, 40), generator=g)
    with pytest.warns(UserWarning, match="torch.compile of the log-prob kernels failed .*no C\\+\\+ compiler"):
        logp, ent = core.token_logprobs_and_entropy(x, targets, 1.0)
    assert core.KERNELS.failed and not core.KERNELS.compiled
    ref = torch.log_softmax(x.float(), -1)
    torch.testing.assert_close(logp, ref.gather(-1, targets[..., None]).squeeze(-1), rtol=0, atol=1e-5)


def test_eos_masked_out_of_attention_is_the_same_as_deleting_it():
    """EOS_ATTENTION = "mask" (a loop whose pad is its eos): every eos out of attention, positions counting only
    attended tokens. Known answer: the completion's log-probs equal those of the same rows with the prompt's eos
    tokens deleted (RoPE sees the same positions, attention the same tokens), left padding included."""
    from conftest import DEFAULT_SPEC
    from harness.experiment.models import checkpoint_dir, eos_token_ids, load_model, load_tokenizer
    from harness.experiment.spec import load_spec
    from harness.rollouts.generate import pad_left, pad_right
    from scratch_grpo.train import completion_forward

    spec = load_spec(DEFAULT_SPEC)
    ckpt = checkpoint_dir(spec)
    model, tok = load_model(ckpt, "float32", "cpu").eval(), load_tokenizer(ckpt)
    eos = eos_token_ids(model.generation_config, tok)
    prompts = [[5, 9, eos[0], 7, 11, eos[0], 13], [6, eos[0], 8]]  # eos inside the prompt, two lengths
    completions = [[14, 15, eos[0]], [16, eos[0]]]
    p_ids, p_mask = pad_left(prompts, tok.pad_token_id)
    c_ids, c_mask = pad_right(completions, tok.pad_token_id)
    with torch.no_grad():
        masked, _ = completion_forward(model, p_ids, p_mask, c_ids, c_mask, 1.0, masked_eos=tuple(eos))
        plain, _ = completion_forward(model, p_ids, p_mask, c_ids, c_mask, 1.0)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            kept = [t for t in p if t not in eos]
            logits = model(input_ids=torch.tensor([kept + c[:-1]])).logits[0, len(kept) - 1:]
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(masked[i, :len(c)], want, atol=1e-5), (i, masked[i], want)
    assert not torch.allclose(masked, plain, atol=1e-3)  # attending to the eos tokens gives other numbers


def test_forward_rules_by_hand():
    """The forward pass's quirks as pure functions: an attention mask built from token ids, positions counted over
    the mask, a log-prob of 0 at an ignored id, a completion ended at its first token of an id."""
    attention = torch.tensor([[0, 1, 1, 1, 1]])
    ids = torch.tensor([[0, 5, 0, 7, 2]])  # left padding, then a generated pad token (id 0) in the middle
    assert core.hide_ids(attention, ids, (0,)).tolist() == [[0, 1, 0, 1, 1]]
    assert core.hide_ids(attention, ids, (0, 2)).tolist() == [[0, 1, 0, 1, 0]]
    assert core.hide_ids(attention, ids, ()).tolist() == attention.tolist()
    # cumsum(mask) - 1 = [-1, 0, 0, 1, 2]; 1 where the mask is 0
    assert core.position_ids(torch.tensor([[0, 1, 0, 1, 1]])).tolist() == [[1, 0, 1, 1, 2]]
    logps = torch.tensor([[-1.0, -2.0, -3.0]])
    targets = torch.tensor([[4, 0, 4]])
    assert core.zero_logps_at(logps, targets, 4).tolist() == [[0.0, -2.0, 0.0]]
    assert core.zero_logps_at(logps, targets, -1).tolist() == [[-1.0, -2.0, -3.0]]
    assert core.end_at_id([[3, 0, 5, 0], [3, 4], [0, 6]], 0) == [[3, 0], [3, 4], [0]]
    assert core.end_at_id([[3, 0, 5]], -1) == [[3, 0, 5]]


def test_truncated_completions_by_hand():
    """TRL counts a completion as ended where its last token is an eos or the pad id; TRUNCATED_IF = "no_eos" only
    where it is an eos (a loop that checks `eos in ids`). eos 2, pad 0."""
    rows = [[5, 2], [5, 0], [5, 7], [], [0, 5]]
    assert core.truncated_rows(rows, (2,), 0) == [False, False, True, True, True]
    assert core.truncated_rows(rows, (2,), 0, "no_eos") == [False, True, True, True, True]
    assert core.truncated_rows(rows, (2,), None) == [False, True, True, True, True]  # no pad token


def test_log_softmax_on_low_precision_logits_by_hand():
    """LOGITS_DTYPE: the logits cast before the temperature and the log_softmax, both in that dtype. bfloat16 keeps 8
    significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 and rounds to even, 1.0; so logits (1 + 2^-8, 1)
    give log-probs -ln 2 = -0.693147..., rounded to bfloat16's nearest, 177/256 = 0.69140625, where float32 gives
    -ln(1 + e^(-2^-8)) = -0.691194 (the logits apart by 2^-8). The temperature divides in bfloat16 too: (2, 2) / 2."""
    logits = torch.tensor([[[1.00390625, 1.0]]])
    target = torch.tensor([[0]])
    assert core.token_logprobs(logits, target, 1.0, "bfloat16").tolist() == [[-0.69140625]]
    assert core.token_logprobs(logits, target, 1.0, "bfloat16").dtype == torch.float32
    assert core.token_logprobs(logits, target).item() == pytest.approx(-math.log1p(math.exp(-2 ** -8)), abs=1e-6)
    assert core.token_logprobs(torch.tensor([[[2.0, 2.0]]]), target, 2.0, "bfloat16").tolist() == [[-0.69140625]]
    logp, entropy = core.token_logprobs_and_entropy(logits, target, 1.0, None, "bfloat16")
    assert logp.tolist() == [[-0.69140625]] and entropy.item() == pytest.approx(math.log(2), abs=1e-4)  # fp32 entropy


def test_a_token_hidden_from_attention_scores_as_if_deleted_at_its_positions():
    """ATTENTION_HIDE_ID with POSITIONS: the tokens after a hidden one score as the sequence without it, at positions
    counted over the mask (POSITIONS = "mask") or at the model's own, which skip its place ("plain"), from the
    token after it on; the hidden token itself still has its log-prob. LOGP_ZERO_ID: that id's log-prob is 0, the
    others unchanged."""
    from conftest import DEFAULT_SPEC
    from harness.experiment.models import checkpoint_dir, load_model
    from harness.experiment.spec import load_spec
    from scratch_grpo.train import completion_forward

    model = load_model(checkpoint_dir(load_spec(DEFAULT_SPEC)), "float32", "cpu").eval()
    prompt, comp = [5, 9, 11, 4], [7, 0, 12, 8]  # a generated pad token (id 0) inside the completion
    p, c = torch.tensor([prompt]), torch.tensor([comp])
    ones = torch.ones_like
    with torch.no_grad():
        counted = completion_forward(model, p, ones(p), c, ones(c), 1.0, hidden=(0,), positions="mask")[0][0]
        plain = completion_forward(model, p, ones(p), c, ones(c), 1.0, hidden=(0,), positions="plain")[0][0]
        seen = completion_forward(model, p, ones(p), c, ones(c), 1.0)[0][0]
        zeroed = completion_forward(model, p, ones(p), c, ones(c), 1.0, zero_id=0)[0][0]
        kept = torch.tensor([prompt + [7, 12]])  # the sequence without the pad token (12 itself is scored from the
        # hidden token's place, which sees the tokens before it: no deleted sequence has that place)
        at = {"mask": torch.arange(6)[None], "plain": torch.tensor([[0, 1, 2, 3, 4, 6]])}
        for how, got in (("mask", counted), ("plain", plain)):
            logits = model(input_ids=kept, position_ids=at[how]).logits[0, -1]  # (12's place scores 8)
            torch.testing.assert_close(got[3], torch.log_softmax(logits, -1)[8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(counted[:2], seen[:2], rtol=1e-5, atol=1e-5)  # before it and at it: as seen
    assert (counted[2:] - plain[2:]).abs().max() > 1e-4 and (seen[2:] - plain[2:]).abs().max() > 1e-4
    assert zeroed[1] == 0 and torch.equal(zeroed[[0, 2, 3]], seen[[0, 2, 3]])


def test_float16_group_statistics_by_hand():
    """rewards 0, 0.5, 1.5, 1.5: mean 0.875, Bessel std 0.75; in float16 0.75 + 1e-4 rounds back to 0.75 (spacing
    2^-11), so A = -0.875 / 0.75 = -1.1667 -> -1.1669921875 (nearest float16, spacing 2^-10), -0.5, and 0.625 / 0.75 =
    0.8333 -> 0.83349609375 (spacing 2^-11); float32 divides by 0.7501: -1.16651, -0.49993, 0.83322."""
    r = torch.tensor([0.0, 0.5, 1.5, 1.5])
    adv, sd = core.group_advantages(r, 4, stats_dtype="float16")
    assert adv.dtype == torch.float32
    assert adv.tolist() == [-1.1669921875, -0.5, 0.83349609375, 0.83349609375]
    assert sd.tolist() == [0.75] * 4
    adv32, _ = core.group_advantages(r, 4)
    assert adv32[0].item() == pytest.approx(-0.875 / 0.7501, rel=1e-6)


def test_float16_statistics_batch_and_none():
    """batch: the mean per group, the std of all 8 (float16); none: only the centring (exact here)."""
    r = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # group 1 mean 0.5, group 2 mean 0; batch std: 8
    # values, mean 0.25, squares' sum 2 x 0.5625 + 6 x 0.0625 = 1.5, /7 -> var 0.2142857, std 0.46291
    adv, _ = core.group_advantages(r, 4, scale="none", stats_dtype="float16")
    assert adv.tolist() == [-0.5, 0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    adv, sd = core.group_advantages(r, 4, scale="batch", eps=0.0, stats_dtype="float16")
    assert sd[0].item() == pytest.approx(math.sqrt(1.5 / 7), abs=5e-4)  # float16's precision
    assert adv[1].item() == pytest.approx(0.5 / math.sqrt(1.5 / 7), abs=2e-3) and adv[4].item() == 0.0


def test_drop_zero_advantages_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    out = core.drop_zero_advantages(mask, torch.tensor([0.5, 0.0, -0.5]))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]


def test_renorm_over_tokens_by_hand():
    """A = 1, -1, 0 over 3, 1, 2 loss tokens: the tokens 1, 1, 1, -1, 0, 0 have mean 1/3, squares' sum of the
    deviations 3 x 4/9 + 16/9 + 2 x 1/9 = 10/3, Bessel's variance 2/3: (1 - 1/3) / sqrt(2/3) = sqrt(2/3),
    (-1 - 1/3) / sqrt(2/3) = -2 sqrt(2/3), (0 - 1/3) / sqrt(2/3) = -sqrt(2/3) / 2 (per completion it would be 1, -1, 0)."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    s = math.sqrt(2 / 3)
    out = core.renorm_over_tokens(torch.tensor([1.0, -1.0, 0.0]), mask)
    assert out.tolist() == pytest.approx([s, -2 * s, -s / 2], rel=1e-6)
    one = torch.tensor([[1, 0, 0], [0, 0, 0], [0, 0, 0]])  # a single loss token: nothing to normalise over
    assert core.renorm_over_tokens(torch.tensor([1.0, -1.0, 0.0]), one).tolist() == [1.0, -1.0, 0.0]


def test_shape_advantages_order_by_hand():
    """drop first, then the renorm over the tokens left, then the clamp: A = 1, -1, 0 with the third out of the
    loss leaves the tokens 1, 1, 1, -1: mean 0.5, deviations' squares 3 x 0.25 + 2.25 = 3, variance 1, so A = 0.5,
    -1.5, -0.5 (the dropped one renormalised too), then clamped to +-1.2."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    adv, m = core.shape_advantages(torch.tensor([1.0, -1.0, 0.0]), mask, drop_zero=True, renorm="tokens")
    assert adv.tolist() == pytest.approx([0.5, -1.5, -0.5], rel=1e-6) and m.tolist()[2] == [0, 0, 0]
    adv, _ = core.shape_advantages(torch.tensor([1.0, -1.0, 0.0]), mask, drop_zero=True, renorm="tokens", clamp=1.2)
    assert adv.tolist() == pytest.approx([0.5, -1.2, -0.5], rel=1e-6)
    adv, m = core.shape_advantages(torch.tensor([2.5, -0.3, -1.7]), mask, clamp=1.0)
    assert adv.tolist() == pytest.approx([1.0, -0.3, -1.0]) and m is mask
