"""The GRPO math of verl (volcengine/verl @ b178a3cd56f58b2d502255daba591e92833930a7, Apache-2.0), run as the
smallest one-process plain-PyTorch loop a user would write around it.

A session that had not read the harness's diagnosis code adapted verl's own functions to the harness's contract, as a
new user would, and wrote down before any run how it differs from TRL (docs/your-loop.md). That adaptation copied
verl's code and stays outside this repository; this file restates the same choices in our own code, and trains
exactly as it does (same metrics at every step, checked side by side on CPU):
- advantages: core_algos' GRPO outcome advantage, (score - group mean) / (group std + 1e-6), Bessel-corrected std;
- the per-token loss: PPO's clipped objective with verl's dual clip (c = 3) and log-ratio clamp, "token-mean"
  aggregation per micro-batch, micro-batches cut in the rollout's order, each scaled by 1 / gradient accumulation;
- a k3 KL ("low_var_kl", weight 0.001) added to the loss, without TRL's importance ratio;
- the actor's optimizer: AdamW over every parameter (no decay groups), betas (0.9, 0.999), weight decay 0.01,
  gradient clipping at 1.0, a non-finite gradient norm skipping the step (dp_actor.update_policy);
- what it logs: actor/pg_loss (the KL term apart) and actor/grad_norm.
verl's defaults for a GRPO run are from verl/trainer/config/actor/actor.yaml and its GRPO recipe (adv_estimator=grpo,
use_kl_loss=True). The lines marked `# parity` are the contract's.
"""

from __future__ import annotations

import argparse
import types

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import loop as parity  # parity: the contract's helpers

# ---------------------------------------------------------------- verl's GRPO math, restated ---------------------
# Our own code for the choices verl's core_algos.py makes (read at the commit above); no verl code is copied.


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl divides by the mask's sum plus 1e-8."""
    return masked_sum(values, mask) / (mask.sum() + 1e-8)


def grpo_advantages(scores: torch.Tensor, index: np.ndarray, epsilon: float, by_std: bool) -> torch.Tensor:
    """One scalar per completion: minus its prompt group's mean, divided by the group's Bessel-corrected std plus
    epsilon (outside the square root). A group of one gets mean 0 and std 1."""
    out = scores.clone()
    for uid in dict.fromkeys(index.tolist()):
        rows = torch.as_tensor(np.flatnonzero(index == uid))
        group = scores[rows]
        mean, std = (group.mean(), group.std()) if len(rows) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        out[rows] = (group - mean) / (std + epsilon) if by_std else group - mean
    return out


def token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's default aggregation, "token-mean": the masked sum over the micro-batch's own token count."""
    return masked_sum(loss_mat, mask) / mask.sum()


def clipped_pg(old: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, low: float, high: float,
               c: float) -> torch.Tensor:
    """Per-token PPO loss with verl's dual clip: the log-ratio clamped to [-20, 20], max(-A r, -A clip(r, 1-low,
    1+high)), and for negative advantages that capped at -A c."""
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
    return torch.where(adv < 0, torch.min(-adv * c, clipped), clipped)


def k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """verl's "low_var_kl": exp(ref - logp) - (ref - logp) - 1, the log-ratio clamped to [-20, 20] and the result
    to [-10, 10]; no importance ratio in front (TRL multiplies its k3 by the policy ratio)."""
    d = torch.clamp(ref - logp, min=-20, max=20)
    return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)


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
    advantages = grpo_advantages(token_level_rewards.sum(-1), index, C.adv_epsilon,
                                 C.norm_adv_by_std_in_grpo)[:, None] * batch["response_mask"]
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
                pg = clipped_pg(old_log_prob, log_prob, mb["advantages"], C.clip_ratio_low, C.clip_ratio_high,
                                C.clip_ratio_c)
                pg_loss = token_mean(pg, mb["response_mask"])
                policy_loss = pg_loss
                if C.use_kl_loss:
                    kld = k3(log_prob, mb["ref_log_prob"])
                    kl_loss = token_mean(kld, mb["response_mask"])
                    policy_loss = policy_loss + kl_loss * C.kl_loss_coef
                    kl_loss_sum += kl_loss.detach().item() * loss_scale_factor
                loss = policy_loss * loss_scale_factor
                loss.backward()
                pg_loss_sum += pg_loss.detach().item() * loss_scale_factor
                seen_logp.append(log_prob.detach())
                seen_ptl.append((pg + (C.kl_loss_coef * kld if C.use_kl_loss else 0.0)).detach())  # parity
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
