"""The GRPO math of open-instruct's grpo_fast (allenai/open-instruct @ e6c3044aa6201c8bfa4573c1b03142af599e730d,
Apache-2.0), run as a one-process plain-PyTorch loop, with Ray, vLLM and DeepSpeed taken out.

A session that had not read the harness's diagnosis code adapted open-instruct's own functions to the harness's
contract, as a new user would, and wrote down before any run how it differs from TRL (docs/your-loop.md). That
adaptation copied open-instruct's code and stays outside this repository; this file restates the same choices in our
own code, and trains exactly as it does (same metrics, tensors and trained completions at every step, checked side by
side on CPU):
- the recipe: the config dataclasses' defaults with scripts/train/debug/grpo_fast.sh's overrides (lr 1e-6, beta 0.01,
  one pack per micro-batch, pack_length 1024, seed 3), sized by the spec: PROMPTS_PER_STEP x GROUP_SIZE completions a
  round, one optimizer step per training step, STEPS steps;
- the reward: 10 x correctness + 1 x format, the verifiable reward with the R1 format reward switched on and added
  (the adapter's choice: with the verifiable reward alone nearly every group of the tiny model is flat and the filter
  below leaves nothing to train on); the rollout's reward_correct and reward_format stand in for its verifiers;
- the data loader: every group whose scores are all equal (numpy std 0) is dropped; a round with no group left is
  skipped and the step trains on the next one (resampled without advancing the step); the kept completions are named
  with parity.trained;
- advantages: "centered", score minus its group's mean, no division by a std;
- sequence packing: each kept prompt + completion is appended to a row of at most 1024 tokens, position ids restarting
  at 0 for each pair, no attention mask; every generated pad token (id 0) is removed from its completion first, so it
  leaves the loss and the forward pass; the rows are shuffled (numpy) and each is a micro-batch; per-token values are
  unpacked back per completion for parity.tensors, a removed token getting 0;
- the loss: PPO's clipped objective with bounds 1 - 0.2 and 1 + 0.272 against the current log-probs detached (one
  epoch, one mini-batch), times the rho correction min(exp(old - sampler), 2.0) (the sampler is the policy itself
  here, its log-probs from a no-grad pass before training, so rho = 1), plus 0.01 x k3 to the initial model
  (kl_estimator 2: expm1(-d) + d, d = logp - ref clamped to [-40, 40], without TRL's importance ratio); each
  micro-batch's masked sum is divided by the loss tokens of the whole step ("dapo" normalisation);
- the optimizer: torch's AdamW, fused, its default betas (0.9, 0.999) and eps 1e-8, weight decay 0 (bias and norm
  weights in a group of their own, without decay), no gradient clipping (the norm taken before), lr 1e-6 on
  transformers' "linear" schedule with warmup_ratio 0.1 (int(0.1 x STEPS) warmup steps: step 1 trains at lr 0),
  stepped once per optimizer step;
- what it logs: `loss` the step's loss, KL term included (rows weighted by their loss tokens), `kl` the k3 estimator's
  token mean, `learning_rate` read AFTER the scheduler stepped (the next step's rate), `reward` and
  `completions/mean_length` over the kept groups, and some of open-instruct's own statistics.
The lines marked `# parity` are the contract's. --lr-spec trains at the spec's LR; --keep-pad (a diagnostic, not
open-instruct's behaviour) leaves the pad tokens in; --model names the weights outside the harness.
"""

from __future__ import annotations

import argparse
import math
import types

import numpy as np
import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import loop as parity  # parity: the contract's helpers

# ---------------------------------------------------------------- open-instruct's GRPO math, restated -----------
# Our own code for the choices grpo_fast.py, grpo_utils.py, rl_utils.py, data_loader.py and model_utils.py make (read
# at the commit above); no open-instruct code is copied.

OFF = 1.0  # the log-prob open-instruct puts at every position that is not a completion token


def scores_of(rollout: dict, correct_weight: float, format_weight: float) -> list[float]:
    """Per completion: correct_weight x correctness + format_weight x format, a missing score counting 0."""
    def column(name):
        return [0.0 if v is None else float(v) for v in rollout["rewards"][name]]
    return [correct_weight * c + format_weight * f
            for c, f in zip(column("reward_correct"), column("reward_format"))]


def varied_groups(scores: list[float], size: int) -> list[int]:
    """The groups the data loader keeps: those whose scores are not all equal (numpy's std is not 0)."""
    return [g for g in range(len(scores) // size) if np.std(scores[g * size:(g + 1) * size]) != 0]


def centred(scores: np.ndarray, size: int) -> np.ndarray:
    """Each score minus its group's mean."""
    groups = scores.reshape(-1, size)
    return (groups - groups.mean(axis=-1, keepdims=True)).reshape(-1)


def pack(prompts: list, completions: list, drop, sampler: list | None, length: int) -> list[dict]:
    """Prompt + completion pairs appended to rows of at most `length` tokens (a pair that does not fit starts a new
    row). Every `drop` token is taken out of the pair first. Per row, each (1, L): the ids, the position ids (from 0 in
    each pair), `doc` (k + 1 on the completion tokens of pair k, 0 elsewhere) and `lp`, the sampler's log-probs on the
    completion tokens (nan elsewhere)."""
    rows, cur = [], None
    for k, (prompt, completion) in enumerate(zip(prompts, completions)):
        prompt = [t for t in prompt if t != drop]
        kept = [j for j, t in enumerate(completion) if t != drop]
        ids = prompt + [completion[j] for j in kept]
        if cur is not None and len(cur["ids"]) + len(ids) > length:
            rows.append(cur)
            cur = None
        cur = cur or dict(ids=[], pos=[], doc=[], lp=[])
        cur["ids"] += ids
        cur["pos"] += range(len(ids))
        cur["doc"] += [0] * len(prompt) + [k + 1] * len(kept)
        cur["lp"] += [math.nan] * len(prompt) + [sampler[k][j] if sampler else math.nan for j in kept]
    rows.append(cur)
    return [dict(ids=torch.tensor([r["ids"]]), pos=torch.tensor([r["pos"]]), doc=torch.tensor([r["doc"]]),
                 lp=torch.tensor([r["lp"]], dtype=torch.float32)) for r in rows]


def token_logps(net, row: dict, temperature: float) -> torch.Tensor:
    """Log-prob of every next token of a packed row, (1, L - 1): no attention mask (the position ids tell the pairs
    apart), fp32 logits over the temperature."""
    logits = net(input_ids=row["ids"], attention_mask=None, position_ids=row["pos"]).logits
    logits = (logits.float() / temperature)[:, :-1]
    return logits.log_softmax(-1).gather(-1, row["ids"][:, 1:].unsqueeze(-1)).squeeze(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the mask's tokens, 0 for an empty mask."""
    count = mask.sum()
    return (values * mask).sum() / count if count > 0 else torch.zeros(())


def rho_weights(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """The correction pi_old / pi_sampler per completion token, the log-ratio clamped to [-10, 10] and the ratio
    capped at `cap`; 0 elsewhere."""
    d = torch.where(mask, (old - sampler).clamp(-10.0, 10.0), torch.zeros_like(old))
    return torch.where(mask, torch.exp(d).clamp(max=cap), torch.zeros_like(old))


def clipped_pg(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token max(-A r, -A clip(r, 1 - low, 1 + high)), and where the clipped term is the larger."""
    plain = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.max(plain, clipped), (clipped > plain).float()


def k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """expm1(-d) + d with d = logp - ref clamped to [-40, 40]; no importance ratio in front."""
    d = (logp - ref).clamp(-40.0, 40.0)
    return torch.expm1(-d) + d


def token_weighted(values: list[torch.Tensor], tokens: torch.Tensor) -> float:
    """A step's statistic: the micro-batches' values weighted by their share of the step's loss tokens."""
    return (torch.stack(values) * (tokens / tokens.sum())).sum().item()


def linear_warmup(step: int, warmup: int, total: int) -> float:
    """transformers' "linear" factor: up from 0 over the warmup, then down to 0 at `total`."""
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


NO_DECAY = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")


def adamw_groups(model, weight_decay: float) -> list[dict]:
    """Two parameter groups: the decayed weights, then bias and norm weights without decay (empty ones left out)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    exempt = [any(key in n for key in NO_DECAY) for n, _ in named]
    groups = [{"params": [p for (_, p), e in zip(named, exempt) if not e], "weight_decay": weight_decay},
              {"params": [p for (_, p), e in zip(named, exempt) if e], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def unpack(per_row: dict, rows: list[dict], completions: list, drop) -> list[list[float]]:
    """Per completion, a per-token tensor of the rows ((1, L - 1), position t - 1 predicting token t) back in the
    completion's own coordinates: the value for each kept token, 0 for a dropped one."""
    out = []
    for k, completion in enumerate(completions):
        values = []
        for b, row in enumerate(rows):
            where = (row["doc"][0] == k + 1).nonzero().flatten()
            if where.numel():
                values = per_row[b][0, where - 1].detach().float().tolist()
        line = [0.0] * len(completion)
        for j, v in zip([j for j, t in enumerate(completion) if t != drop], values):
            line[j] = v
        out.append(line)
    return out


# open-instruct's defaults (GRPOExperimentConfig, TrainingConfig, StreamingDataLoaderConfig) with the debug script's
# overrides
config = dict(
    lr=1e-6, warmup_ratio=0.1, weight_decay=0.0, beta=0.01, clip_low=0.2, clip_high=0.272, rho_cap=2.0,
    verification_reward=10.0, format_reward=1.0, pack_length=1024, prompts=8, group=4, temperature=1.0, steps=4,
    seed=3,
)
ap = argparse.ArgumentParser()
ap.add_argument("--lr-spec", action="store_true", help="the spec's LR instead of open-instruct's 1e-6")  # parity
ap.add_argument("--keep-pad", action="store_true",  # parity: a diagnostic, not open-instruct's behaviour
                help="leave the generated pad tokens in the packed sequences")
ap.add_argument("--model", default="Qwen/Qwen3.5-0.8B")  # parity: used outside the harness
cli = ap.parse_args()
spec = parity.spec()
if spec:  # parity: the spec's sizes
    config.update(prompts=spec["PROMPTS_PER_STEP"], group=spec["GROUP_SIZE"], steps=spec["STEPS"],  # parity
                  temperature=spec.get("TEMPERATURE", 1.0))  # parity
    if cli.lr_spec:  # parity
        config["lr"] = spec["LR"]  # parity
C = types.SimpleNamespace(**config)

seed = parity.seed(C.seed)  # parity: the run's seed
torch.manual_seed(seed)
np.random.seed(seed)
path = parity.init_dir(cli.model)  # parity: the starting weights
tok = AutoTokenizer.from_pretrained(path)
drop = None if cli.keep_pad else tok.pad_token_id
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # parity: CPU, float32
ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
for net in (model, ref):
    net.config.use_cache = False
    for m in net.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
opt = torch.optim.AdamW(adamw_groups(model, C.weight_decay), lr=C.lr, fused=True)
sched = LambdaLR(opt, lambda s: linear_warmup(s, int(C.steps * C.warmup_ratio), C.steps))
model.train()
probe = parity.Probe(model)  # parity: a slice of the weights around each optimizer step
round_idx = 0


def next_round() -> tuple[int, dict, list[float], list[int]]:
    """The next round that keeps a group; a round that keeps none is passed over."""
    global round_idx
    while True:
        r, round_idx = round_idx, round_idx + 1
        rollout = parity.rollout(r)  # parity: the harness's completions instead of vLLM's
        scores = scores_of(rollout, C.verification_reward, C.format_reward)
        groups = varied_groups(scores, C.group)
        if groups:
            return r, rollout, scores, groups


for step in range(1, C.steps + 1):
    r, rollout, all_scores, groups = next_round()
    picks = [g * C.group + j for g in groups for j in range(C.group)]
    parity.trained(step, [(r, i) for i in picks])  # parity: the completions this step trains on
    completions = [list(rollout["completion_ids"][i]) for i in picks]
    scores = np.array([all_scores[i] for i in picks])
    advantages = centred(scores, C.group)
    per_token_adv = np.concatenate([[0.0], advantages]).astype(np.float32)
    sampled = rollout.get("logprobs")
    rows = pack([rollout["prompt_ids"][i] for i in picks], completions, drop,
                [sampled[i] for i in picks] if sampled is not None else None, C.pack_length)
    for row in rows:
        row["mask"] = row["doc"][:, 1:] > 0
        row["adv"] = torch.from_numpy(per_token_adv[row["doc"][:, 1:].numpy()])
        with torch.no_grad():
            lp = token_logps(model, row, C.temperature) if sampled is None else row["lp"][:, 1:]
            row["sampler"] = torch.nan_to_num(torch.where(row["mask"], lp, OFF), nan=OFF)
    order = np.random.permutation(len(rows))
    with torch.no_grad():
        for row in rows:
            row["ref"] = torch.where(row["mask"], token_logps(ref, row, C.temperature), OFF)
    tokens = torch.stack([rows[b]["mask"].sum().float() for b in order])
    denominator = sum(t.item() for t in tokens)

    stats = {k: [] for k in ("loss", "kl", "clip", "policy", "ratio", "rho")}
    seen = {k: {} for k in ("mask", "logps", "ref_logps", "per_token_loss")}
    loss_sum, grad_norm = 0.0, 0.0
    for n, b in enumerate(order):
        row, mask = rows[b], rows[b]["mask"]
        logp = torch.where(mask, token_logps(model, row, C.temperature), OFF)
        old = logp.detach()
        ratio = torch.exp(logp - old)
        rho = rho_weights(old, row["sampler"], mask, C.rho_cap)
        pg, clipped = clipped_pg(ratio, row["adv"], C.clip_low, C.clip_high)
        pg, clipped = pg * rho, clipped * (rho != 0).float()
        per_token_loss = pg + C.beta * k3(logp, row["ref"])
        loss = (per_token_loss * mask).sum() / denominator
        loss.backward()
        loss_sum += loss.item()
        if n == len(order) - 1:
            probe.before(step)  # parity: the gradient before the norm
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            probe.after(step)  # parity: the weights after the step
        with torch.no_grad():
            for key, value in (("loss", loss), ("kl", masked_mean(k3(logp, row["ref"]), mask)),
                               ("clip", masked_mean(clipped, mask)), ("policy", masked_mean(pg, mask)),
                               ("ratio", masked_mean(ratio, mask)), ("rho", masked_mean(rho.float(), mask))):
                stats[key].append(value.detach())
        for key, value in (("mask", mask.float()), ("logps", logp), ("ref_logps", row["ref"]),
                           ("per_token_loss", per_token_loss)):  # parity
            seen[key][b] = value.detach()  # parity

    m = {k: token_weighted(v, tokens) for k, v in stats.items()}
    m["kl_loss"] = token_weighted([v * C.beta for v in stats["kl"]], tokens)
    lr = sched.get_last_lr()[0]
    parity.tensors(step, rewards=scores.tolist(), advantages=advantages.tolist(),  # parity
                   **{k: unpack(v, rows, completions, drop) for k, v in seen.items()},  # parity
                   loss=loss_sum, grad_norm=grad_norm)  # parity
    print(f"step {step}: round {r} completions {len(picks)} loss {m['loss']:.6f} grad_norm {grad_norm:.6f} "
          f"lr {lr:.3g}")
    parity.log_step(step, loss=m["loss"], grad_norm=grad_norm, learning_rate=lr, reward=float(scores.mean()),  # parity
                    kl=m["kl"], **{"clip_ratio/region_mean": m["clip"],  # parity
                                   "completions/mean_length": float(np.mean([len(c) for c in completions])),
                                   "loss/policy_avg": m["policy"], "loss/kl_avg": m["kl_loss"],
                                   "val/ratio": m["ratio"], "val/rho_weight": m["rho"],
                                   "real_batch_size_ratio": len(picks) / (C.prompts * C.group),
                                   "val/advantages_mean": float(advantages.mean())})

parity.save_weights(model)  # parity: the final weights
