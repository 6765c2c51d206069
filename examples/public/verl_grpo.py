"""The GRPO math of verl (volcengine/verl @ b178a3cd56f58b2d502255daba591e92833930a7, Apache-2.0), run as the
smallest one-process plain-PyTorch loop a user would write around it.

Licence: the vendored functions below are verl's, Copyright 2024 Bytedance Ltd. and/or its affiliates, licensed under
the Apache License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0); distributed on an "AS IS" BASIS,
WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND. Changes: their registry decorators dropped; the loop around them is
new. It was adapted to the harness's contract (the lines marked `# parity:`) by a session that had not read the
harness's diagnosis code, as a new user would; docs/your-loop.md lists what it differs in, written before any run.

The functions between the VENDORED markers are copied verbatim from verl/trainer/ppo/core_algos.py
(compute_grpo_outcome_advantage, agg_loss, compute_policy_loss, kl_penalty, kl_penalty_forward) and
verl/utils/torch_functional.py (masked_sum, masked_mean); only their registry decorators are dropped.
The loop around them follows verl/workers/actor/dp_actor.py:update_policy (mini-batches, micro-batches,
loss_scale_factor = 1 / gradient_accumulation, on-policy old_log_prob = log_prob.detach(), grad_norm from
clip_grad_norm_, a non-finite grad_norm skips the step) and verl's defaults for a GRPO run
(verl/trainer/config/actor/actor.yaml, docs' GRPO recipe: adv_estimator=grpo, use_kl_loss=True).
"""

from __future__ import annotations

import argparse
import math
import types
from collections import defaultdict
from typing import Optional

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import loop as parity  # parity: the contract's helpers

# ---------------------------------------------------------------- VENDORED from verl (verbatim) ---------------


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    s = masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


verl_F = types.SimpleNamespace(masked_sum=masked_sum, masked_mean=masked_mean)


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[AlgoConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Compute advantage for GRPO, operating only on Outcome reward
    (with only one scalar reward for each response).

    Args:
        token_level_rewards: `(torch.Tensor)`
            shape is (bs, response_length)
        response_mask: `(torch.Tensor)`
            shape is (bs, response_length)
        index: `(np.ndarray)`
            index array for grouping
        epsilon: `(float)`
            small value to avoid division by zero
        norm_adv_by_std_in_grpo: `(bool)`
            whether to scale the GRPO advantage
        config: `(Optional[AlgoConfig])`
            algorithm configuration object

    Note:
        If norm_adv_by_std_in_grpo is True, the advantage is scaled by the std, as in the original GRPO.
        If False, the advantage is not scaled, as in Dr.GRPO (https://arxiv.org/abs/2503.20783).

    Returns:
        advantages: `(torch.Tensor)`
            shape is (bs, response_length)
        Returns: `(torch.Tensor)`
            shape is (bs, response_length)
    """
    scores = token_level_rewards.sum(dim=-1)

    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}

    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask

    return scores, scores


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
):
    """
    Aggregate the loss across global batch to ensure the loss is invariant to fsdp/megatron parallelism.

    NOTE: The returned loss has different behaviors for different backend:
    - FSDP: the loss is directly used for backward.
    - Megatron: the loss should be scaled by `num_microbatches` and `cp_size` for pp schedule.

    Args:
        loss_mat: micro batch loss matrix, (bs, response_length)
        loss_mask: micro batch loss mask, (bs, response_length)
        loss_agg_mode: method to aggregate the loss matrix into a scalar
        dp_size: data parallel size
        batch_num_tokens: number of valid tokens in global batch
        global_batch_size: global batch size
        loss_scale_factor: scale factor for "seq-mean-token-sum-norm" mode. If None, uses loss_mask.shape[-1].
            Set this to a constant value to ensure consistent normalization throughout training.

    Returns:
        loss: `a scalar torch.Tensor`
            aggregated loss
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = verl_F.masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_F.masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_F.masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        loss = torch.sum(seq_losses) / loss_scale_factor
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")

    return loss


def compute_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    cliprange=None,
    cliprange_low=None,
    cliprange_high=None,
    clip_ratio_c=3.0,
    loss_agg_mode: str = "token-mean",
):
    """
    Compute the clipped policy objective and related metrics for PPO.

    Adapted from
    https://github.com/huggingface/trl/blob/main/trl/trainer/ppo_trainer.py#L1122

    Args:
        old_log_prob (torch.Tensor):
            Log-probabilities of actions under the old policy, shape (batch_size, response_length).
        log_prob (torch.Tensor):
            Log-probabilities of actions under the current policy, shape (batch_size, response_length).
        advantages (torch.Tensor):
            Advantage estimates for each action, shape (batch_size, response_length).
        response_mask (torch.Tensor):
            Mask indicating which tokens to include in the loss, shape (batch_size, response_length).
        cliprange (float, optional):
            Clipping parameter ε for standard PPO. See https://arxiv.org/abs/1707.06347.
            Defaults to None (must be provided).
        cliprange_low (float, optional):
            Lower clip range for dual-clip PPO. Defaults to same as `cliprange`.
        cliprange_high (float, optional):
            Upper clip range for dual-clip PPO. Defaults to same as `cliprange`.
        clip_ratio_c (float, optional):
            Lower bound of the ratio for dual-clip PPO. See https://arxiv.org/pdf/1912.09729.
            Defaults to 3.0.
        loss_agg_mode (str, optional):
            Aggregation mode for `agg_loss`. Defaults to "token-mean".
    """
    assert clip_ratio_c > 1.0, (
        "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
        + f" but get the value: {clip_ratio_c}."
    )

    negative_approx_kl = log_prob - old_log_prob
    # Clamp negative_approx_kl for stability
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    pg_losses2 = -advantages * torch.clamp(
        ratio, 1 - cliprange_low, 1 + cliprange_high
    )  # - clip(ratio, 1-cliprange, 1+cliprange) * A
    clip_pg_losses1 = torch.maximum(
        pg_losses1, pg_losses2
    )  # max(-ratio * A, -clip(ratio, 1-cliprange, 1+cliprange) * A)
    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_F.masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)

    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def kl_penalty(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """Compute KL divergence given logprob and ref_logprob. Optionally using straight through to bind k2 on other
    kl penalty compute method for unbiased KL gradient estimation.
    See more description in http://joschu.net/blog/kl-approx.html

    Args:
        logprob:
        ref_logprob:

    Returns:
        kl_estimate
    """
    forward_score = kl_penalty_forward(logprob, ref_logprob, kl_penalty)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score

    """
    The expectation of k1 and k3 estimator is the expectaed value of KL, but the expected gradient of k1 and k3
    estimator is not the expectaed gradient of KL. On the other hand k2 estimator gives right gradient estimator, 
    so we use a straight through trick here if the kl_penalty method ends with '+', .e.g., k3+. 
    """
    backward_score = 0.5 * (logprob - ref_logprob).square()

    return backward_score - backward_score.detach() + forward_score.detach()


def kl_penalty_forward(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """Compute KL divergence given logprob and ref_logprob.
    Copied from https://github.com/huggingface/trl/blob/main/trl/trainer/ppo_trainer.py#L1104
    See more description in http://joschu.net/blog/kl-approx.html

    Args:
        logprob:
        ref_logprob:

    Returns:
        kl_estimate
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob

    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()

    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()

    # J. Schulman. Approximating kl divergence, 2020.
    # # URL http://joschu.net/blog/kl-approx.html.
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        # For numerical stability
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)

    if kl_penalty == "full":
        # so, here logprob and ref_logprob should contain the logits for every token in vocabulary
        raise NotImplementedError

    raise NotImplementedError


# ---------------------------------------------------------------- end VENDORED --------------------------------

# verl's defaults (actor.yaml, optim/fsdp.yaml as the actor uses it, algorithm: grpo) for a GRPO run
config = dict(
    lr=1e-6, weight_decay=0.01, betas=(0.9, 0.999), clip_grad=1.0, lr_scheduler_type="constant",
    clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
    loss_agg_mode="token-mean", entropy_coeff=0.0,
    use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl",
    norm_adv_by_std_in_grpo=True, adv_epsilon=1e-6,
    train_batch_size=1024, rollout_n=5, ppo_mini_batch_size=256, ppo_micro_batch_size_per_gpu=8, ppo_epochs=1,
    temperature=1.0, total_training_steps=100, model_path="Qwen/Qwen2.5-0.5B-Instruct", seed=42,
)
# parity: map the harness's spec onto the config keys a verl user sets on the command line
ap = argparse.ArgumentParser()  # parity: --lr verl keeps verl's own 1e-6 instead of the spec's LR
ap.add_argument("--lr", choices=("spec", "verl"), default="spec")  # parity
spec = parity.spec()
if spec:
    config.update(
        train_batch_size=spec["PROMPTS_PER_STEP"], ppo_mini_batch_size=spec["PROMPTS_PER_STEP"],  # parity
        rollout_n=spec["GROUP_SIZE"], ppo_micro_batch_size_per_gpu=spec["derived"]["micro_batch_size"],  # parity
        ppo_epochs=spec.get("NUM_ITERATIONS", 1), lr=spec["LR"], temperature=spec["TEMPERATURE"],  # parity
        total_training_steps=spec["STEPS"],  # parity
    )
    if ap.parse_args().lr == "verl":  # parity
        config["lr"] = 1e-6  # parity
C = types.SimpleNamespace(**config)

torch.manual_seed(parity.seed(C.seed))  # parity: the run's seed
path = parity.init_dir(C.model_path)  # parity: the starting weights
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # parity: CPU, float32
tok = AutoTokenizer.from_pretrained(path)
pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
# verl's FSDP worker: AdamW over all actor parameters (no decay groups), a constant schedule
opt = torch.optim.AdamW(model.parameters(), lr=C.lr, betas=C.betas, weight_decay=C.weight_decay)
probe = parity.Probe(model)  # parity: a slice of the weights around each optimizer step


def make_batch(rollout):
    """verl's DataProto fields: left-padded prompts, right-padded responses, attention mask, position ids."""
    P = max(len(p) for p in rollout["prompt_ids"])
    R = max(len(c) for c in rollout["completion_ids"])
    n = len(rollout["completion_ids"])
    prompts = torch.full((n, P), pad_id, dtype=torch.long)
    responses = torch.full((n, R), pad_id, dtype=torch.long)
    pmask = torch.zeros((n, P), dtype=torch.long)
    rmask = torch.zeros((n, R), dtype=torch.long)
    for i, (p, c) in enumerate(zip(rollout["prompt_ids"], rollout["completion_ids"])):
        prompts[i, P - len(p):], pmask[i, P - len(p):] = torch.tensor(p), 1
        responses[i, :len(c)], rmask[i, :len(c)] = torch.tensor(c), 1
    attention = torch.cat([pmask, rmask], 1)
    return dict(input_ids=torch.cat([prompts, responses], 1), attention_mask=attention,
                position_ids=torch.clip(torch.cumsum(attention, dim=-1) - 1, min=0, max=None),
                responses=responses, response_mask=rmask.float())


def forward_logp(net, mb, temperature):
    """dp_actor._forward_micro_batch without remove-padding: logits / temperature, log_softmax, gather."""
    logits = net(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                 position_ids=mb["position_ids"], use_cache=False).logits
    logits = logits / temperature
    R = mb["responses"].size(1)
    logits = logits[:, -R - 1:-1, :]
    return torch.log_softmax(logits, dim=-1).gather(-1, mb["responses"].unsqueeze(-1)).squeeze(-1)


def per_token_pg(old, logp, adv, c_low, c_high, c3):  # parity: compute_policy_loss's pg_losses before agg_loss
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))  # parity
    c1 = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - c_low, 1 + c_high))  # parity
    return torch.where(adv < 0, torch.min(-adv * c3, c1), c1)  # parity


def split(batch, size):
    n = batch["input_ids"].size(0)
    return [{k: v[s:s + size] for k, v in batch.items()} for s in range(0, n, size)]


step = 0
rnd = 0
while step < C.total_training_steps:
    rollout = parity.rollout(rnd)  # parity: train on the harness's completions instead of sampling
    rnd += 1
    batch = make_batch(rollout)
    # reward: the user's compute_score, the reward functions' weighted sum, put on the last response token
    names = list(rollout["rewards"])
    weights = rollout["reward_weights"]
    n = len(rollout["completion_ids"])
    scores = torch.tensor([sum(w * (rollout["rewards"][k][i] or 0.0) for k, w in zip(names, weights))
                           for i in range(n)], dtype=torch.float32)
    token_level_rewards = torch.zeros_like(batch["response_mask"])
    lengths = batch["response_mask"].sum(-1).long()
    token_level_rewards[torch.arange(n), lengths - 1] = scores
    index = np.array([i // C.rollout_n for i in range(n)])  # uid per prompt
    with torch.no_grad():  # verl: compute_log_prob (old) and compute_ref_log_prob before the update
        model.eval()
        old_log_probs = torch.cat([forward_logp(model, mb, C.temperature)
                                   for mb in split(batch, C.ppo_micro_batch_size_per_gpu)])
        ref_log_prob = torch.cat([forward_logp(ref, mb, C.temperature)
                                  for mb in split(batch, C.ppo_micro_batch_size_per_gpu)])
        model.train()
    advantages, returns = compute_grpo_outcome_advantage(
        token_level_rewards, batch["response_mask"], index, epsilon=C.adv_epsilon,
        norm_adv_by_std_in_grpo=C.norm_adv_by_std_in_grpo)
    batch.update(old_log_probs=old_log_probs, ref_log_prob=ref_log_prob, advantages=advantages)

    # ---- dp_actor.update_policy ----
    mini_batches = split(batch, C.ppo_mini_batch_size * C.rollout_n)
    on_policy = len(mini_batches) == 1 and C.ppo_epochs == 1
    for _ in range(C.ppo_epochs):
        for mini_batch in mini_batches:
            if step >= C.total_training_steps:
                break
            gradient_accumulation = (C.ppo_mini_batch_size * C.rollout_n) // C.ppo_micro_batch_size_per_gpu
            micro_batches = split(mini_batch, C.ppo_micro_batch_size_per_gpu)
            opt.zero_grad()
            pg_loss_sum, kl_loss_sum, seen_logp, seen_ptl = 0.0, 0.0, [], []
            for mb in micro_batches:
                loss_scale_factor = 1 / gradient_accumulation
                log_prob = forward_logp(model, mb, C.temperature)
                old_log_prob = log_prob.detach() if on_policy else mb["old_log_probs"]
                pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = compute_policy_loss(
                    old_log_prob=old_log_prob, log_prob=log_prob, advantages=mb["advantages"],
                    response_mask=mb["response_mask"], cliprange=C.clip_ratio, cliprange_low=C.clip_ratio_low,
                    cliprange_high=C.clip_ratio_high, clip_ratio_c=C.clip_ratio_c, loss_agg_mode=C.loss_agg_mode)
                policy_loss = pg_loss
                if C.use_kl_loss:
                    kld = kl_penalty(logprob=log_prob, ref_logprob=mb["ref_log_prob"], kl_penalty=C.kl_loss_type)
                    kl_loss = agg_loss(loss_mat=kld, loss_mask=mb["response_mask"], loss_agg_mode=C.loss_agg_mode)
                    policy_loss = policy_loss + kl_loss * C.kl_loss_coef
                    kl_loss_sum += kl_loss.detach().item() * loss_scale_factor
                loss = policy_loss * loss_scale_factor
                loss.backward()
                pg_loss_sum += pg_loss.detach().item() * loss_scale_factor
                seen_logp.append(log_prob.detach())
                seen_ptl.append((per_token_pg(old_log_prob, log_prob, mb["advantages"], C.clip_ratio_low,  # parity
                                              C.clip_ratio_high, C.clip_ratio_c)  # parity
                                 + (C.kl_loss_coef * kld if C.use_kl_loss else 0.0)).detach())  # parity
            probe.before(step + 1)  # parity: the gradient before clipping
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=C.clip_grad)
            step += 1
            if len(mini_batches) == 1:  # parity: the step's tensors (rows in the rollout's order)
                parity.tensors(step, rewards=scores, advantages=advantages[:, 0], mask=batch["response_mask"],
                               logps=torch.cat(seen_logp), old_logps=batch["old_log_probs"],
                               ref_logps=batch["ref_log_prob"], per_token_loss=torch.cat(seen_ptl),  # parity
                               loss=pg_loss_sum, grad_norm=grad_norm)
            if not torch.isfinite(grad_norm):
                opt.zero_grad()
            else:
                opt.step()
            probe.after(step)  # parity: the weights after the step
            # verl logs actor/pg_loss (the KL term apart, as actor/kl_loss) and actor/grad_norm
            parity.log_step(step, loss=pg_loss_sum, grad_norm=grad_norm, learning_rate=opt.param_groups[0]["lr"],  # parity
                            kl=kl_loss_sum, reward=scores.mean())  # parity
    opt.zero_grad()

parity.save_weights(model)  # parity: the final weights
