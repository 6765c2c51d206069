"""The GRPO math of NVIDIA NeMo-RL (NVIDIA-NeMo/RL @ 7ea279abfbeb698b092856d0dab61e7cf39bc909, Apache-2.0), run as
one synchronous GRPO step per round in a one-process plain-PyTorch loop.

A session adapted NeMo-RL's own functions (grpo_train, the DTensor policy worker's train step, the clipped PG loss,
the GRPO advantage estimator) to the harness's contract, as a new user would, and wrote down before any run how it
differs from TRL (docs/your-loop.md). That adaptation copied NeMo-RL's code and stays outside this repository; this
file restates the same choices in our own code, and trains exactly as it does (same metrics and tensors at every
step, checked side by side on CPU):
- advantages: a leave-one-out baseline (the mean of the other completions' rewards of the prompt) and a leave-one-out
  Bessel-corrected std, both computed from the group's sums as NeMo-RL does; no division where that std is 0, else
  division by std + 1e-6; groups are the rows with identical (right-padded) prompt ids, not consecutive positions;
- the per-token loss: PPO's clipped objective (0.2 / 0.2, no dual clip) against log-probs from an extra no-grad pass,
  aggregated at the token level over the whole step: each micro-batch's masked sum divided by the step's valid
  completion tokens + 1e-8, the micro-batch losses summed through backward;
- a k3 KL to the initial policy, weight 0.01, its log-ratio clamped to [-20, 20] and its value to [-10, 10],
  multiplied by exp(logp - logp.detach()) (value 1, a gradient factor) and reduced like the policy term;
- the optimizer: torch AdamW over every parameter (no decay groups), lr 5e-6, betas (0.9, 0.999), eps 1e-8, weight
  decay 0.01; a LinearLR warmup from 0.1 x lr over 50 steps, then constant; gradient clipping at 1.0; micro-batches
  of 4 sequences in the rollout's order; sequences laid out as prompt + completion, right-padded, attention mask all
  ones, position ids 0..L-1;
- what it logs: the loss as the sum of the micro-batch losses (policy term + weighted KL), the pre-clip grad norm,
  the lr the step used (read before the scheduler steps), kl as the unweighted k3 mean over the step's tokens.
NeMo-RL's defaults are from examples/configs/grpo_math_1B.yaml (the DTensor path). The lines marked `# parity` are
the contract's.

    --lr-spec    use the spec's LR as the peak learning rate (the warmup kept) instead of 5e-6
    --no-loo     grpo.use_leave_one_out_baseline=false (NeMo-RL's own switch; its default is true)
    --is-correction  loss_fn.use_importance_sampling_correction=true (NeMo-RL's switch, default false; on with an
                 inference engine): the clipped policy term times exp(prev_logprobs - generation_logprobs) per token,
                 no truncation (truncated_importance_sampling_ratio unset), the KL term unweighted; the generation
                 log-probs are the sampler's that the rollouts carry (vLLM's, or the harness's stand-in's)
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import loop as parity  # parity: the contract's helpers

# ---------------------------------------------------------------- NeMo-RL's GRPO math, restated ------------------
# Our own code for the choices NeMo-RL makes (read at the commit above); no NeMo-RL code is copied.

STD_EPS = 1e-6  # the advantage estimator's epsilon
CLIP_LOW, CLIP_HIGH = 0.2, 0.2  # ratio_clip_min / ratio_clip_max
KL_WEIGHT = 0.01  # reference_policy_kl_penalty (k3)
KL_LOGR_CLAMP, KL_CLAMP = 20.0, 10.0


def token_level(values: torch.Tensor, mask: torch.Tensor, step_tokens: torch.Tensor) -> torch.Tensor:
    """The micro-batch's masked sum over the whole step's token count (plus 1e-8)."""
    return torch.sum(values * mask) / (step_tokens + 1e-8)


def group_stats(rewards: torch.Tensor, leave_one_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion: the mean of the rewards it is compared with (the others, or all) and their Bessel std, from
    the sums of rewards and squared rewards; a std that comes out NaN is 0."""
    n = len(rewards)
    if n <= 1:
        return rewards, torch.zeros_like(rewards)
    pick = 1 - torch.eye(n) if leave_one_out else torch.ones((n, n))
    count = torch.tensor(float(n - int(leave_one_out)))
    mean = torch.matmul(pick, rewards) / count
    mean_sq = torch.matmul(pick, rewards.pow(2)) / count
    std = ((mean_sq - mean.square()) * (count / (count - 1))).sqrt().nan_to_num(0)
    return mean, std


def grpo_advantages(prompt_ids: torch.Tensor, rewards: torch.Tensor, leave_one_out: bool) -> torch.Tensor:
    """One scalar per completion: reward minus its baseline, divided by std + epsilon only where the std is above
    0. A group is every row whose prompt ids are identical, wherever it sits in the round."""
    baseline, std = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for ids in torch.unique(prompt_ids, dim=0):
        rows = torch.arange(len(prompt_ids))[(prompt_ids == ids).all(1)]
        baseline[rows], std[rows] = group_stats(rewards[rows], leave_one_out)
    centred = rewards - baseline
    return torch.where(std > 0, centred / (std + STD_EPS), centred)


def k3_per_token(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """exp(ref - logp) - 1 - (ref - logp), the log-ratio clamped first and the product clamped last, times
    exp(logp - logp.detach()): 1 in value, the score-function gradient in backward (cut where the clamp acted)."""
    factor = torch.nan_to_num(torch.exp(logp - logp.detach()), nan=0.0, posinf=0.0, neginf=0.0)
    log_ratio = ref - logp
    clamped = log_ratio.clamp(min=-KL_LOGR_CLAMP, max=KL_LOGR_CLAMP)
    factor = torch.where(log_ratio == clamped, factor, factor.detach())
    return (factor * (torch.exp(clamped) - 1 - clamped)).clamp(min=-KL_CLAMP, max=KL_CLAMP)


def clipped_pg(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Per-token PPO loss: max(-A r, -A clip(r, 1 - low, 1 + high)), r = exp(logp - old)."""
    ratio = torch.exp(logp - old)
    return torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - CLIP_LOW, 1.0 + CLIP_HIGH))


def micro_batch_loss(logp, old, ref, adv, mask, step_tokens, is_weight=None):
    """(loss, the KL term's token-level value, the per-token loss): policy term + KL_WEIGHT x k3, both reduced at
    the token level over the step. The KL is built before the ratio, as NeMo-RL orders it (same rounding).
    `is_weight`: the actor importance weights, on the policy term only."""
    kl_tok = KL_WEIGHT * k3_per_token(logp, ref)
    kl = token_level(kl_tok, mask, step_tokens)
    pg_tok = clipped_pg(logp, old, adv)
    if is_weight is not None:
        pg_tok = is_weight * pg_tok
    return token_level(pg_tok, mask, step_tokens) + kl, kl, (pg_tok + kl_tok).detach()


# ---------------------------------------------------------------- configuration ----------------------------------
ap = argparse.ArgumentParser()
ap.add_argument("--lr-spec", action="store_true", help="the spec's LR as the peak learning rate (warmup kept)")
ap.add_argument("--no-loo", action="store_true", help="grpo.use_leave_one_out_baseline=false (a NeMo-RL switch)")
ap.add_argument("--is-correction", action="store_true",
                help="loss_fn.use_importance_sampling_correction=true, with the rollouts' sampler log-probs")
ap.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
args = ap.parse_args()

# grpo_math_1B.yaml's values for what one step reads
LEAVE_ONE_OUT = not args.no_loo
LR, BETAS, ADAM_EPS, WEIGHT_DECAY = 5e-6, (0.9, 0.999), 1e-8, 0.01
WARMUP_START, WARMUP_STEPS = 0.1, 50
MAX_GRAD_NORM = 1.0
MICRO_BATCH = 4  # train_micro_batch_size, also logprob_batch_size
SEED = 42
spec = parity.spec()  # parity
TEMPERATURE = spec.get("TEMPERATURE", 1.0)  # parity
DTYPE = spec.get("DTYPE", "float32")  # parity: fp32 on CPU unless the spec says bfloat16 (NeMo-RL: bf16)
STEPS = spec.get("STEPS", 10)  # parity: one optimizer step per round (global batch = prompts x generations)
DEVICE = spec.get("DEVICE", "cpu")  # parity
DEVICE = ("cuda" if torch.cuda.is_available() else "cpu") if DEVICE == "auto" else DEVICE
if args.lr_spec:  # parity: optional, the spec's peak learning rate
    LR = spec["LR"]

torch.manual_seed(parity.seed(SEED))  # parity: the run's seed
path = parity.init_dir(args.model)  # parity: the starting weights
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # the reference: the initial weights
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=ADAM_EPS,
                        weight_decay=WEIGHT_DECAY)
sched = torch.optim.lr_scheduler.SequentialLR(opt, [
    torch.optim.lr_scheduler.LinearLR(opt, start_factor=WARMUP_START, end_factor=1.0, total_iters=WARMUP_STEPS),
    torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=10**10)], milestones=[WARMUP_STEPS])
probe = parity.Probe(model)  # parity: a slice of the weights around each optimizer step


def next_token_logps(net, ids):
    """(b, s - 1): log p(ids[:, t + 1] | ids[:, :t + 1]) on logits / T in float32."""
    b, s = ids.shape
    with torch.autocast(DEVICE.split(":")[0], dtype=torch.bfloat16, enabled=DTYPE == "bfloat16"):
        logits = net(input_ids=ids, attention_mask=torch.ones((b, s), dtype=torch.bool, device=ids.device),
                     position_ids=torch.arange(s, device=ids.device).repeat(b, 1), use_cache=False).logits
    if TEMPERATURE != 1.0:
        logits = logits / TEMPERATURE
    logp = torch.log_softmax(logits.to(torch.float32)[:, :-1], dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def right_pad(rows, value):
    out = torch.full((len(rows), max(len(r) for r in rows)), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def completion_cols(t, prompt_lens, completion_lens):
    """parity: the completion tokens' columns of a (b, s - 1) next-token tensor, left-aligned."""
    out = torch.zeros((t.shape[0], max(completion_lens)), dtype=t.dtype)
    for i, (pl, cl) in enumerate(zip(prompt_lens, completion_lens)):
        out[i, :cl] = t[i, pl - 1:pl - 1 + cl].detach().cpu()
    return out


def in_chunks(net, ids):
    return torch.cat([next_token_logps(net, ids[s:s + MICRO_BATCH]) for s in range(0, len(ids), MICRO_BATCH)])


for step in range(1, STEPS + 1):
    rollout = parity.rollout(step - 1)  # parity: train on the harness's completions instead of sampling
    if rollout is None:
        raise SystemExit("this loop trains on the harness's lockstep rollouts only")  # parity
    # the reward: the spec's functions' weighted sum (float32, a missing score skipped)
    scores = torch.tensor([[float("nan") if v is None else v for v in vals] for vals in rollout["rewards"].values()])
    rewards = (scores.T * torch.tensor(rollout["reward_weights"])).nansum(dim=1)
    prompt_lens = [len(p) for p in rollout["prompt_ids"]]
    completion_lens = [len(c) for c in rollout["completion_ids"]]
    n = len(rewards)
    ids = right_pad([p + c for p, c in zip(rollout["prompt_ids"], rollout["completion_ids"])],
                    tok.pad_token_id).to(DEVICE)
    mask = right_pad([[0] * len(p) + [1] * len(c) for p, c in zip(rollout["prompt_ids"], rollout["completion_ids"])],
                     0)[:, 1:].to(torch.float32).to(DEVICE)  # the next-token positions that predict a completion
    step_tokens = mask.sum()

    model.eval()
    with torch.no_grad():  # the old and the reference log-probs, in chunks of MICRO_BATCH
        old_logps = in_chunks(model, ids)
        ref_logps = in_chunks(ref_model, ids)
    adv = grpo_advantages(right_pad(rollout["prompt_ids"], tok.pad_token_id), rewards, LEAVE_ONE_OUT).to(DEVICE)
    is_weight = None
    if args.is_correction:  # exp(prev - generation) per token, NaN and inf to 0, detached; no truncation
        if not rollout.get("logprobs"):
            raise SystemExit("--is-correction needs the sampler's log-probs in the rollouts (sampler.kind = \"vllm\" "
                             "or \"emulated\")")
        gen = torch.zeros_like(old_logps)  # the next-token layout: completion token j of row i at pl - 1 + j
        for i, (pl, lps) in enumerate(zip(prompt_lens, rollout["logprobs"])):
            gen[i, pl - 1:pl - 1 + len(lps)] = torch.tensor(lps, dtype=gen.dtype)
        is_weight = torch.nan_to_num(torch.exp(old_logps - gen), nan=0.0, posinf=0.0, neginf=0.0)

    model.train()
    opt.zero_grad()
    lr = opt.param_groups[0]["lr"]
    losses, kl_sum, seen_logp, seen_ptl = [], 0.0, [], []
    for s in range(0, n, MICRO_BATCH):
        mb = slice(s, s + MICRO_BATCH)
        logp = next_token_logps(model, ids[mb])
        loss, kl, ptl = micro_batch_loss(logp, old_logps[mb], ref_logps[mb], adv[mb, None], mask[mb], step_tokens,
                                         None if is_weight is None else is_weight[mb])
        loss.backward()
        losses.append(loss.item())
        kl_sum += kl.item() / KL_WEIGHT
        seen_logp.append(logp.detach())  # parity
        seen_ptl.append(ptl)  # parity
    probe.before(step)  # parity: the gradient before clipping
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM)
    opt.step()
    probe.after(step)  # parity: the weights after the step
    opt.zero_grad()
    sched.step()

    step_loss = float(torch.tensor(losses).sum().item())  # the micro-batch losses summed (in float32)
    print(f"step {step}: loss {step_loss:.6f} grad_norm {float(grad_norm):.6f} lr {lr:.3e} "
          f"reward {rewards.mean():.3f} kl {kl_sum:.3e}")
    cut = lambda t: completion_cols(t, prompt_lens, completion_lens)  # noqa: E731  # parity
    parity.tensors(step, rewards=rewards, advantages=adv.cpu(), mask=cut(mask),  # parity: the step's tensors
                   logps=cut(torch.cat(seen_logp)), old_logps=cut(old_logps), ref_logps=cut(ref_logps),  # parity
                   per_token_loss=cut(torch.cat(seen_ptl)), loss=step_loss, grad_norm=float(grad_norm))  # parity
    parity.log_step(step, loss=step_loss, grad_norm=float(grad_norm), learning_rate=lr, reward=rewards.mean(),  # parity
                    kl=kl_sum, **{"completions/mean_length": sum(completion_lens) / len(completion_lens)})  # parity

parity.save_weights(model)  # parity: the final weights
