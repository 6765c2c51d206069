"""The GRPO math of OpenRLHF (OpenRLHF/OpenRLHF @ 3c3be6234e0cb353e76bb8019947db9dfe99fca7, Apache-2.0), run as a
one-process plain-PyTorch loop, with Ray, vLLM and DeepSpeed taken out.

A session that had not read the harness's diagnosis code adapted OpenRLHF's own functions to the harness's contract,
as a new user would, and wrote down before any run how it differs from TRL (docs/your-loop.md). That adaptation copied
OpenRLHF's code and stays outside this repository; this file restates the same choices in our own code, and trains
exactly as it does (same metrics and tensors at every step, checked side by side on CPU):
- the recipe: OpenRLHF's last GRPO script (examples/scripts/train_grpo_ray_hybrid_engine.sh, removed upstream in
  34ba2900) on train_ppo_ray.py's defaults, scaled to the spec: one optimizer step per round of PROMPTS_PER_STEP x
  GROUP_SIZE completions, in micro-batches of the spec's size (gradient accumulation 2 here), the spec's dtype;
- the reward: correctness only (OpenRLHF's math_reward_func scores 1 / 0), the rollout's reward_correct standing in;
- advantages: "group_norm", (r - group mean) / (group std + 1e-9), Bessel-corrected std, clipped to [-10, 10] and
  put on every token of the row (a return with gamma 1 and the reward on the last token);
- the per-token loss: PPO's clipped objective at 0.2 on both sides (no clip-higher, no dual clip), the log-ratio
  clamped to [-20, 20]; the old log-probs come from a separate no-grad pass in eval mode over the whole round;
- a k3 KL to a frozen reference copy (weight 0.001, clamped to [-10, 10]) added to the loss without TRL's
  importance ratio;
- aggregation: one token mean over the whole optimizer step ("dapo"-like): each micro-batch's masked sum is divided
  by the step's completion tokens / gradient accumulation, and the loss by gradient accumulation before backward
  (DeepSpeed's scaling); micro-batches come from a shuffling DataLoader (torch's global RNG, drop_last);
- the optimizer: AdamW, betas (0.9, 0.95), eps 1e-8, weight decay 0.0 (bias and norm weights grouped out), gradient
  clipping at 1.0; lr 5e-7 (the recipe's; --lr-spec: the spec's LR) warmed up linearly from 0 over ceil(3% of the
  horizon) steps, then a half cosine down to 0.1 x lr, the horizon being one pass over the data set (its size x
  GROUP_SIZE / completions per step = 64 steps here) rather than the run's STEPS;
- what it logs, reduced as OpenRLHF reduces it: `loss` the policy term alone and `kl` the KL term without its weight,
  each micro-batch's value weighted by its completion tokens; `grad_norm` before clipping; `learning_rate` read after
  the scheduler stepped (the next step's rate); reward, reward_std and the mean completion length of the round.
The lines marked `# parity` are the contract's. --lr-spec trains at the spec's LR, --no-log-lr leaves learning_rate
out of the log (a diagnostic), --model names the weights outside the harness.
"""

from __future__ import annotations

import argparse
import math
import random
import types

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import loop as parity  # parity: the contract's helpers

# ---------------------------------------------------------------- OpenRLHF's GRPO math, restated -----------------
# Our own code for the choices OpenRLHF's models/, utils/ and trainer/ make (read at the commit above); no OpenRLHF
# code is copied.


def group_norm(rewards: torch.Tensor, group_size: int, eps: float = 1e-9) -> torch.Tensor:
    """One scalar per completion: minus its group's mean, divided by the group's Bessel-corrected std plus eps."""
    g = rewards.reshape(-1, group_size)
    return ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + eps)).reshape(-1)


def ppo_clip_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Per token: -min(r A, clip(r, 1 - low, 1 + high) A), r = exp(logp - old) with the log-ratio clamped to
    [-20, 20]."""
    ratio = (logp - old).clamp(-20.0, 20.0).exp()
    return -torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)


def k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """exp(ref - logp) - 1 + (logp - ref) per token, clamped to [-10, 10]; no importance ratio in front."""
    d = logp.float() - ref.float()
    return ((-d).exp() - 1 + d).clamp(-10, 10)


def step_token_norm(masks: list[torch.Tensor], gas: int) -> torch.Tensor:
    """The optimizer step's completion tokens (all its micro-batches) over the accumulation steps: a micro-batch's
    masked sum divided by it, then by `gas` before backward, is one token mean over the whole step."""
    return sum(m.float().sum() for m in masks) / gas


def masked_sum_over(values: torch.Tensor, mask: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / norm


def token_weighted(values: list[float], tokens: list[float]) -> float:
    """How OpenRLHF reduces a logged loss over a step's micro-batches: each value is scaled to a token sum and back
    (its all-reduce, one process here), then the micro-batches are weighted by their completion tokens."""
    per_micro = [v * t / t for v, t in zip(values, tokens)]
    return sum(v * t for v, t in zip(per_micro, tokens)) / sum(tokens)


def warmup_cosine(step: int, warmup: int, horizon: int, min_rate: float) -> float:
    """transformers' "cosine_with_min_lr" factor: linear from 0 over the warmup, then half a cosine from 1 down to
    min_rate at the horizon."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, horizon - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)) * (1 - min_rate) + min_rate)


NO_DECAY = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")


def adamw_groups(model, weight_decay: float) -> list[dict]:
    """Two parameter groups: decayed weights, and bias / norm weights without decay."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    exempt = [any(key in n for key in NO_DECAY) for n, _ in named]
    return [{"params": [p for (_, p), e in zip(named, exempt) if not e], "weight_decay": weight_decay},
            {"params": [p for (_, p), e in zip(named, exempt) if e], "weight_decay": 0.0}]


# OpenRLHF's GRPO recipe on train_ppo_ray.py's defaults
config = dict(
    lr=5e-7, betas=(0.9, 0.95), adam_eps=1e-8, weight_decay=0.0, max_norm=1.0,
    warmup_ratio=0.03, min_lr_ratio=0.1, eps_clip=0.2, kl_coef=1e-3, reward_clip=10.0, gamma=1.0,
    prompts=128, n_samples=8, micro_rollout_batch=16, micro_train_batch=8, temperature=1.0, max_tokens=1024,
    steps=30, data_size=256, device="cpu", dtype="float32", seed=42,
)
ap = argparse.ArgumentParser()
ap.add_argument("--lr-spec", action="store_true", help="the spec's LR instead of the recipe's 5e-7")  # parity
ap.add_argument("--model", default="./models/Qwen3-0.6B")  # parity: used outside the harness
ap.add_argument("--no-log-lr", action="store_true", help="leave learning_rate out of the metric log")  # parity
cli = ap.parse_args()
spec = parity.spec()
if spec:  # parity: map the harness's spec onto the recipe's sizes
    config.update(
        prompts=spec["PROMPTS_PER_STEP"], n_samples=spec["GROUP_SIZE"],  # parity
        micro_train_batch=spec["derived"]["micro_batch_size"], temperature=spec["TEMPERATURE"],  # parity
        max_tokens=spec["MAX_TOKENS"], steps=spec["STEPS"], data_size=spec["data"]["size"],  # parity
        device=spec.get("DEVICE", "cpu"), dtype=spec.get("DTYPE", "float32"),  # parity
    )
    if cli.lr_spec:  # parity
        config["lr"] = spec["LR"]  # parity
C = types.SimpleNamespace(**config)
C.train_batch = C.prompts * C.n_samples  # one optimizer step per round
C.gas = C.train_batch // C.micro_train_batch
C.horizon = C.data_size * C.n_samples // C.train_batch  # OpenRLHF's max_steps: one pass over the prompts
DEVICE = ("cuda" if torch.cuda.is_available() else "cpu") if C.device == "auto" else C.device
BF16 = C.dtype == "bfloat16"  # DeepSpeed's bf16 as autocast

torch.manual_seed(parity.seed(C.seed))  # parity: the run's seed (python's random seeded too, as OpenRLHF does)
random.seed(parity.seed(C.seed))  # parity
path = parity.init_dir(cli.model)  # parity: the starting weights
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
model.config.use_cache = False
ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval().requires_grad_(False)
eos_ids = model.generation_config.eos_token_id
eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
opt = torch.optim.AdamW(adamw_groups(model, C.weight_decay), lr=C.lr, betas=C.betas, eps=C.adam_eps,
                        weight_decay=C.weight_decay)
sched = LambdaLR(opt, lambda s: warmup_cosine(s, math.ceil(C.horizon * C.warmup_ratio), C.horizon, C.min_lr_ratio))
probe = parity.Probe(model)  # parity: a slice of the weights around each optimizer step


def token_logps(net, b: dict) -> torch.Tensor:
    """Log-prob of every next token of right-padded prompt+completion rows, in fp32, as its logit minus the row's
    logsumexp; position ids count the attended tokens (padding gets 1); zero outside the completion tokens."""
    attn = b["attention_mask"].to(DEVICE)
    pos = (attn.long().cumsum(-1) - 1).masked_fill(attn == 0, 1)
    seqs = b["sequences"].to(DEVICE)
    with torch.autocast(DEVICE.split(":")[0], dtype=torch.bfloat16, enabled=BF16):
        logits = net(seqs, attention_mask=attn, position_ids=pos).logits.float()
    if C.temperature != 1.0:
        logits = logits / C.temperature
    logp = logits.gather(-1, seqs.roll(-1, dims=1).unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return logp[:, :-1] * b["action_mask"].to(DEVICE).float()


def collate(samples: list[dict], pad_id: int = 0) -> dict:
    """Right-pad every per-sample field to the widest row. The replay buffer pads with 0 (token ids too); the
    experience pass pads the ids with the tokenizer's pad token."""
    out = {k: pad_sequence([s[k] for s in samples], batch_first=True, padding_value=pad_id if k == "sequences" else 0)
           for k in ("sequences", "attention_mask", "action_mask", "old", "ref", "adv") if k in samples[0]}
    out["rows"] = [s["row"] for s in samples]
    return out


def to_samples(rollout: dict) -> list[dict]:
    """One sample per completion: prompt + completion ids, attention all ones, and the action mask over the next-token
    positions (length - 1) that predict completion tokens; the reward is correctness alone."""
    correct = rollout["rewards"].get("reward_correct") or next(iter(rollout["rewards"].values()))
    samples = []
    for i, (p, c) in enumerate(zip(rollout["prompt_ids"], rollout["completion_ids"])):
        ids = torch.tensor(list(p) + list(c), dtype=torch.long)
        amask = torch.zeros(len(ids) - 1, dtype=torch.long)
        amask[len(p) - 1:] = 1
        samples.append(dict(sequences=ids, attention_mask=torch.ones_like(ids), action_mask=amask, row=i,
                            start=len(p) - 1, length=len(c), reward=0.0 if correct[i] is None else float(correct[i])))
    return samples


@torch.no_grad()
def make_experience(samples: list[dict]) -> None:
    """Old and reference log-probs per micro rollout batch (the policy in eval mode), then the clipped group_norm
    advantage on every position of each row."""
    for s0 in range(0, len(samples), C.micro_rollout_batch):
        chunk = samples[s0:s0 + C.micro_rollout_batch]
        b = collate(chunk, tok.pad_token_id)
        model.eval()
        old = token_logps(model, b).cpu()
        model.train()
        ref_logp = token_logps(ref, b).cpu()
        for j, s in enumerate(chunk):
            width = s["action_mask"].numel()
            s["old"], s["ref"] = old[j, :width], ref_logp[j, :width]
    rewards = torch.tensor([s["reward"] for s in samples])
    advantages = group_norm(rewards, C.n_samples)
    for s, a in zip(samples, advantages):
        s["advantage"] = float(a)
        s["adv"] = a.clamp(-C.reward_clip, C.reward_clip).repeat(s["action_mask"].numel())


def sample_round(r: int) -> dict:
    """Free runs only: HF generate for vLLM, at least one new token (OpenRLHF's min_tokens=1), cut after the first
    eos, scored by the spec's reward functions."""
    from harness.experiment.data import encode_prompts, load_rows, prompt_schedule, to_prompt_rows
    from harness.experiment.rewards import reward_functions
    from harness.experiment.spec import parse_spec

    s = parse_spec({k: v for k, v in spec.items() if k != "derived"})
    rows = to_prompt_rows(load_rows(s.data), s.data.system_prompt)
    group = [rows[i] for i in prompt_schedule(len(rows), r + 1, C.prompts, s.SEED)[r] for _ in range(C.n_samples)]
    prompt_ids = encode_prompts(tok, [g["prompt"] for g in group], s.MAX_PROMPT_TOKENS)
    completion_ids = []
    with torch.no_grad():
        for ids in prompt_ids:
            new = model.generate(input_ids=torch.tensor([ids], device=DEVICE), do_sample=True, top_p=1.0, top_k=0,
                                 temperature=C.temperature, min_new_tokens=1, max_new_tokens=C.max_tokens,
                                 pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            completion_ids.append(new[:next((k + 1 for k, t in enumerate(new) if t in eos_ids), len(new))])
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    columns = {k: [g[k] for g in group] for k in group[0] if k != "prompt"}
    scores = {fn.__name__: fn(prompts=[g["prompt"] for g in group], completion_ids=completion_ids,
                              completions=[[{"role": "assistant", "content": t}] for t in texts], **columns)
              for fn in reward_functions(s)}
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "rewards": scores}


micro_steps, opt_steps, grad_norm = 0, 0, None


def optimizer_step() -> None:
    """What DeepSpeed's engine does at the accumulation boundary: clip (the pre-clip norm kept), AdamW, scheduler."""
    global opt_steps, grad_norm
    opt_steps += 1
    probe.before(opt_steps)  # parity: the gradient before clipping
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), C.max_norm).item()
    opt.step()
    probe.after(opt_steps)  # parity: the weights after the step
    sched.step()
    opt.zero_grad(set_to_none=True)


for step in range(1, C.steps + 1):
    model.eval()
    rollout = parity.rollout(step - 1) or sample_round(step - 1)  # parity: the harness's completions in lockstep
    model.train()
    samples = to_samples(rollout)
    make_experience(samples)

    # ---- one pass over the round in shuffled micro-batches, one optimizer step per `gas` of them ----
    micro_batches = list(DataLoader(samples, batch_size=C.micro_train_batch, shuffle=True, drop_last=True,
                                    collate_fn=collate))
    pg_values, kl_values, tokens, seen = [], [], [], {}
    for w in range(0, len(micro_batches), C.gas):
        window = micro_batches[w:w + C.gas]
        norm = step_token_norm([b["action_mask"] for b in window], C.gas)
        for b in window:
            model.train()
            mask = b["action_mask"].to(DEVICE)
            logp = token_logps(model, b)
            pg = ppo_clip_loss(logp, b["old"].to(DEVICE), b["adv"].to(DEVICE), C.eps_clip, C.eps_clip)
            kl = k3(logp, b["ref"].to(DEVICE)) if C.kl_coef > 0 else torch.zeros_like(logp)
            pg_loss, kl_loss = masked_sum_over(pg, mask, norm), masked_sum_over(kl, mask, norm)
            ((pg_loss + kl_loss * C.kl_coef) / C.gas).backward()
            ptl = pg.detach() + C.kl_coef * kl.detach()
            for j, r in enumerate(b["rows"]):  # parity: each row's completion part
                a, n = samples[r]["start"], samples[r]["length"]
                seen[r] = [t[j, a:a + n].tolist() for t in (mask.float(), logp.detach(), b["old"], b["ref"], ptl)]
            micro_steps += 1
            if micro_steps % C.gas == 0:
                optimizer_step()
            pg_values.append(pg_loss.item())
            kl_values.append(kl_loss.item())
            tokens.append(float(mask.sum().item()))

    loss, kl_mean = token_weighted(pg_values, tokens), token_weighted(kl_values, tokens)
    gn = grad_norm if grad_norm is not None else 0.0
    rewards = torch.tensor([s["reward"] for s in samples])
    rows = sorted(seen)  # parity: back in the rollout's order
    parity.tensors(step, rewards=rewards, advantages=[s["advantage"] for s in samples],  # parity
                   **{k: [seen[r][i] for r in rows] for i, k in enumerate(  # parity
                       ("mask", "logps", "old_logps", "ref_logps", "per_token_loss"))},  # parity
                   loss=loss, grad_norm=gn)  # parity
    lr = {} if cli.no_log_lr else {"learning_rate": sched.get_last_lr()[0]}  # parity: after the scheduler's step
    stats = dict(loss=loss, grad_norm=gn, kl=kl_mean, reward=rewards.mean().item(), **lr,
                 reward_std=rewards.std().item() if len(rewards) > 1 else 0.0,
                 **{"completions/mean_length": torch.tensor([s["length"] for s in samples]).float().mean().item()})
    print(f"step {step}: " + ", ".join(f"{k}={v:.6g}" for k, v in stats.items()))
    parity.log_step(step, **stats)  # parity

parity.save_weights(model)  # parity: the final weights
