"""GRPO's math as small pure functions on tensors. No model, no optimizer, no TRL.

Shapes: B completions (sequences), T completion positions, `mask` (B, T) is 1 on real completion
tokens and 0 on padding. Symbols follow the GRPO / DAPO papers where it helps:
r_i reward, A_i advantage, rho_it = pi_theta / pi_old, eps_low / eps_high clip bounds.
Each function has known-answer tests computed by hand in tests/test_core.py.
"""

from __future__ import annotations

import math

import torch

from harness.experiment.models import CompileOnFirstCall

LOSS_NORMS = ("sequence", "token_local", "token_global", "constant")  # TRL's grpo, bnpo, dapo, dr_grpo
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# ---------------------------------------------------------------------------------------------
# rewards -> advantages
# ---------------------------------------------------------------------------------------------
def nanstd(x: torch.Tensor, dim: int | None = None, unbiased: bool = True, keepdim: bool = False) -> torch.Tensor:
    """Std ignoring NaN; Bessel-corrected (n-1) when `unbiased`, else the population std (n). In TRL's order of
    operations (trl.trainer.utils.nanstd: the mean square, then times n / (n - 1)), so that the two loops' group
    stds agree to the bit: a std that differs in its last bit moves every advantage of the group."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim)
    if unbiased:
        n = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim)
        variance = variance * (n / (n - 1))  # one value: 0 x inf = NaN, as TRL (and as n - 1 = 0 before)
    return torch.sqrt(variance)


def loo_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", std: str = "bessel",
                   eps: float = 1e-4, eps_inside: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out (a quirk; TRL centres on the group's own mean): A_i = r_i - mean of the group's other
    completions, divided (`scale = group`) by the std of those others (Bessel's or the population's) + eps, and not
    divided where their std computes as 0 (others alike in float32 can leave a rounding residue from the sums of
    squares, and that residue divides, as in NeMo-RL). `scale = batch` divides by the batch's std as group_advantages
    does. Computed from the group's sums, as NeMo-RL does: the others' mean (S - r_i) / (G - 1), their variance from the
    mean of squares. Returns (advantages, each group's own std per element: the
    std TRL's frac_reward_zero_std counts). NaN rewards count 0 and their advantage is 0."""
    grouped = torch.nan_to_num(rewards.view(-1, group_size))
    n = group_size - 1
    mean = (grouped.sum(1, keepdim=True) - grouped) / n
    square = ((grouped * grouped).sum(1, keepdim=True) - grouped * grouped) / n
    var = (square - mean * mean) * (n / (n - 1) if std == "bessel" and n > 1 else 1.0)
    sd = torch.sqrt(var.clamp(min=0.0)).reshape(-1)
    adv = (grouped - mean).reshape(-1)
    if scale == "batch":
        sd = nanstd(rewards, unbiased=std == "bessel").expand_as(rewards)
    if scale != "none":
        div = torch.sqrt(sd * sd + eps) if eps_inside else sd + eps
        adv = torch.where(sd > 0, adv / div, adv)
    own = nanstd(rewards.view(-1, group_size), dim=1, unbiased=std == "bessel").repeat_interleave(group_size)
    return torch.where(torch.isnan(rewards), torch.zeros_like(adv), adv), own


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", std: str = "bessel",
                     eps: float = 1e-4, eps_inside: bool = False, baseline: str = "group",
                     stats_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = (r_i - mean(group)) / (std + eps), or / sqrt(var + eps) with `eps_inside` (a quirk; TRL adds eps).

    `rewards` (B,) are grouped in consecutive runs of `group_size`. `scale`: `group` divides by the
    group's std, `batch` by the std of all B rewards (the mean stays per group, as TRL), `none` not at
    all. Returns (advantages, the std used per element), the std also when `scale = none` (TRL uses
    it to count zero-std groups). NaN rewards are left out of mean and std; their advantage is 0. `baseline = loo`:
    loo_advantages (a quirk). `stats_dtype = float16`: half_stats_advantages (a quirk).
    """
    if baseline == "loo":
        return loo_advantages(rewards, group_size, scale, std, eps, eps_inside)
    if stats_dtype == "float16":
        return half_stats_advantages(rewards, group_size, scale, std, eps, eps_inside)
    unbiased = std == "bessel"
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale == "batch":
        sd = nanstd(rewards, unbiased=unbiased).expand_as(rewards)
    else:
        sd = nanstd(grouped, dim=1, unbiased=unbiased).repeat_interleave(group_size)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (torch.sqrt(sd * sd + eps) if eps_inside else sd + eps)
    return torch.nan_to_num(adv, nan=0.0), sd


def half_stats_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", std: str = "bessel",
                          eps: float = 1e-4, eps_inside: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """group_advantages with the group statistics in float16 (a quirk: a loop that casts its rewards to half
    precision first): torch's own mean and std (or var, with `eps_inside`) on the float16 rewards, the centring,
    the `+ eps` and the division in float16 too, as such a loop writes them; the advantages come back in float32.
    Returns (advantages, the std used per element, in float32). The rewards must hold no NaN (a weighted nansum)."""
    half = rewards.to(torch.float16)
    grouped = half.view(-1, group_size)
    correction = int(std == "bessel")
    src, dims = (half, {}) if scale == "batch" else (grouped, {"dim": 1, "keepdim": True})
    sd = src.std(correction=correction, **dims)
    adv = grouped - grouped.mean(1, keepdim=True)
    if scale != "none":
        adv = adv / (torch.sqrt(src.var(correction=correction, **dims) + eps) if eps_inside else sd + eps)
    sd = sd.float().expand(grouped.shape).reshape(-1) if scale == "batch" else sd.float().repeat_interleave(group_size)
    return adv.reshape(-1).float(), sd


def drop_zero_advantages(l_mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """The loss mask (B, T) with every completion whose advantage is exactly 0 left out (a quirk: TRL trains on
    them, their policy-gradient term 0 and their tokens still counted in a token-mean and a KL)."""
    return l_mask * (advantages != 0).unsqueeze(1).to(l_mask.dtype)


def renorm_over_tokens(advantages: torch.Tensor, l_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The advantages (B,) normalised a second time over the loss's tokens (a quirk): each completion's advantage
    counted once per loss token it has, A_i <- (A_i - mean) / (std + eps), Bessel's std over those tokens; left as
    they are where fewer than 2 tokens count."""
    per_token = advantages.unsqueeze(1).expand_as(l_mask)[l_mask > 0]
    if per_token.numel() < 2:
        return advantages
    return (advantages - per_token.mean()) / (per_token.std() + eps)


def shape_advantages(advantages: torch.Tensor, l_mask: torch.Tensor, drop_zero: bool = False, renorm: str = "none",
                     clamp: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three quirks after the group advantages, in the order loops write them (TRL does none): the completions
    whose advantage is exactly 0 out of the loss mask (`drop_zero`), a second normalisation over the loss's tokens
    (`renorm = tokens`), then a clamp to [-clamp, clamp] (0 = off). Returns (advantages, loss mask)."""
    if drop_zero:
        l_mask = drop_zero_advantages(l_mask, advantages)
    if renorm == "tokens":
        advantages = renorm_over_tokens(advantages, l_mask)
    if clamp > 0:
        advantages = advantages.clamp(-clamp, clamp)
    return advantages, l_mask


def micro_batch_mean_advantage(advantages: torch.Tensor) -> torch.Tensor:
    """A quirk (TRL has none like it): one micro-batch's advantages, each replaced by their mean (a loop whose
    advantages (B, 1) meet a per-completion term (B,): `(term * advantages).mean()` is mean(term) x mean(advantages),
    every completion weighted by the micro-batch's mean advantage). The same shape as `advantages`."""
    return advantages.mean().expand_as(advantages).clone() if advantages.numel() else advantages


def accumulation_divisor(micro_batches: int, constant: float = 0.0) -> float:
    """What each micro-batch's loss is divided by: the number of micro-batches (TRL's gradient_accumulation_steps),
    or a constant of the loop's own where one is given (> 0, a quirk)."""
    return float(constant) if constant > 0 else float(micro_batches)


def shape_rewards(rewards: torch.Tensor, clip: float = 0.0, seq_kl: torch.Tensor | None = None,
                  beta: float = 0.0) -> torch.Tensor:
    """Two quirks of hand-written loops on the summed reward r_i (TRL does neither): clip it to [-clip, clip]
    (0 = off), then subtract beta x the completion's summed KL when the KL penalty goes in the reward."""
    if clip > 0:
        rewards = rewards.clamp(-clip, clip)
    if seq_kl is not None:
        rewards = rewards - beta * seq_kl
    return rewards


# ---------------------------------------------------------------------------------------------
# log-probs, entropy, KL
# ---------------------------------------------------------------------------------------------
CHUNK_ROWS = 1024  # rows of (B*T, V) logits handled at once by the memory-lean paths
LEAN_NUMEL = 1 << 28  # fp32 logits larger than this also take the lean paths


def _lean(logits: torch.Tensor) -> bool:
    """bf16/fp16 logits (a GPU run under autocast) or very large ones: never materialise an fp32 (B, T, V) copy.
    Small fp32 logits keep the plain expressions, whose rounding the CPU parity figures were measured with."""
    return logits.dtype != torch.float32 or logits.numel() > LEAN_NUMEL


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   logits_dtype: str = "float32") -> torch.Tensor:
    """log pi(target | prefix) from logits (B, T, V) on logits / temperature, as TRL scores tokens (in fp32).
    `logits_dtype` (LOGITS_DTYPE) other than float32: low_precision_logprobs (a quirk)."""
    if logits_dtype != "float32":
        return low_precision_logprobs(logits, targets, temperature, logits_dtype)
    if _lean(logits) and logits.dim() == 3:
        return _LeanLogprobs.apply(logits, targets, temperature, False)[0]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def low_precision_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                           logits_dtype: str) -> torch.Tensor:
    """log pi(target | prefix) with the logits cast to `logits_dtype` ("bfloat16", "float16") before the temperature
    and the log_softmax, both computed in that dtype, the result back in fp32: a loop that writes
    `log_softmax(logits.to(torch.bfloat16) / T)` (LOGITS_DTYPE; TRL takes its log_softmax in fp32)."""
    low = getattr(torch, logits_dtype)
    logp = torch.log_softmax(logits.to(low) / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                               entropy_temperature: float | None = None,
                               logits_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """token_logprobs and token_entropy (of softmax(logits / entropy_temperature), no gradient) together: on the
    lean path one pass over the logits gives both when the two temperatures agree. The entropy stays in fp32 at any
    `logits_dtype` (a logged metric only)."""
    t_ent = temperature if entropy_temperature is None else entropy_temperature
    if logits_dtype != "float32":
        return low_precision_logprobs(logits, targets, temperature, logits_dtype), token_entropy(logits.detach(), t_ent)
    if _lean(logits) and logits.dim() == 3 and t_ent == temperature:
        return _LeanLogprobs.apply(logits, targets, temperature, True)
    return token_logprobs(logits, targets, temperature), token_entropy(logits.detach(), t_ent)


def _row_chunks(logits: torch.Tensor):
    """(batch row, position slice) pieces of at most CHUNK_ROWS positions: views, never a copy of `logits`
    (which is usually a non-contiguous slice of the model's output)."""
    B, T = logits.shape[:2]
    for b in range(B):
        for s in range(0, T, CHUNK_ROWS):
            yield b, slice(s, s + CHUNK_ROWS)


def _chunk_stats(x: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    """One chunk (R, V) of logits: log-prob of each target, log-sum-exp and (with `entropy`) the entropy, in fp32."""
    z = x.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not entropy:
        return logp, lse, None
    logp_all = z - lse[:, None]
    return logp, lse, -(logp_all.exp() * logp_all).sum(-1)


def _chunk_grad(x: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, temperature: float):
    """d loss / d logits of one chunk: g * (onehot(target) - softmax(x / T)) / T, in the logits' dtype."""
    d = torch.exp(x.float() / temperature - lse[:, None]).mul_(-g[:, None])
    d.scatter_add_(-1, targets[:, None], g[:, None])
    return (d / temperature).to(x.dtype)


class _Kernels:
    """The lean path's two chunk functions, compiled by torch.compile on a GPU (each fused into a few kernels that
    read the bf16 logits without writing an fp32 copy), eager elsewhere. When either one's first compiled call
    fails (no compiler, say) both run eagerly from then on, with a warning; later failures are the computation's own."""

    def __init__(self, devices=("cuda",)):
        self.devices = devices  # where to compile (the tests add "cpu")
        self.kernels = {fn: CompileOnFirstCall(fn, "the log-prob kernels", "computing them eagerly", dynamic=True)
                        for fn in (_chunk_stats, _chunk_grad)}

    @property
    def compiled(self) -> dict:
        """function -> its compiled form, once that has run"""
        return {fn: k.compiled for fn, k in self.kernels.items() if k.state == "ok"}

    @property
    def failed(self) -> bool:
        return any(k.state == "failed" for k in self.kernels.values())

    def __call__(self, fn, *args):
        if args[0].device.type not in self.devices or self.failed:
            return fn(*args)
        return self.kernels[fn](*args)


KERNELS = _Kernels()


class _LeanLogprobs(torch.autograd.Function):
    """token_logprobs (and, asked for, the entropy) without an fp32 (B, T, V) tensor: over row chunks.

    forward:  logp = x[target] - logsumexp(x),  x = logits.float() / T      (saved: logits, targets, lse)
              entropy = -sum_v p_v log p_v (no gradient)
    backward: d logits = g * (onehot(target) - softmax(x)) / T               (in the logits' dtype)"""

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy):
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        ent = torch.empty_like(out) if entropy else out.new_empty(0)
        for b, t in _row_chunks(logits):
            lp, ls, h = KERNELS(_chunk_stats, logits[b, t], targets[b, t], temperature, entropy)
            out[b, t], lse[b, t] = lp, ls
            if entropy:
                ent[b, t] = h
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        g = grad_out.float()
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for b, t in _row_chunks(logits):
            grad[b, t] = KERNELS(_chunk_grad, logits[b, t], targets[b, t], lse[b, t], g[b, t], ctx.temperature)
        return grad, None, None, None


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = -sum_v p_v log p_v per position, of softmax(logits / temperature)."""
    if _lean(logits) and not logits.requires_grad and logits.dim() == 3:
        out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        zeros = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        for b, t in _row_chunks(logits):
            out[b, t] = KERNELS(_chunk_stats, logits[b, t], zeros[b, t], temperature, True)[2]
        return out
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: exp(d) - d - 1, d = ref - logp."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate from samples of pi_theta (Schulman's k1, k2, k3; TRL uses k3):
    k1 = log r' = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(d) - d - 1 with d = ref - logp."""
    if estimator == "k3":
        return kl_k3(logp, ref_logp)
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff * diff
    raise ValueError(f"unknown KL estimator {estimator!r}; one of {KL_ESTIMATORS}")


# ---------------------------------------------------------------------------------------------
# what the forward pass sees (TRL: the padding mask, the model's own positions, every generated token)
# ---------------------------------------------------------------------------------------------
POSITIONS = ("auto", "plain", "mask")


def hide_ids(attention: torch.Tensor, input_ids: torch.Tensor, ids: tuple[int, ...]) -> torch.Tensor:
    """The attention mask with every token whose id is in `ids` hidden, wherever it stands (a mask built as
    `input_ids != pad_id`: a generated pad token is hidden from the tokens after it). `ids` empty: unchanged."""
    if not ids:
        return attention
    return attention * ~torch.isin(input_ids, torch.tensor(ids, device=input_ids.device))


def position_ids(attention: torch.Tensor) -> torch.Tensor:
    """Positions counted over the attention mask: cumsum(mask) - 1, and 1 where the mask is 0 (as transformers'
    generate counts them). The model's own positions (TRL) are plain: 0, 1, 2, ... over every column."""
    return (attention.long().cumsum(-1) - 1).masked_fill(attention == 0, 1)


def truncated_rows(completion_ids: list[list[int]], eos_ids, pad_id: int | None, rule: str = "no_eos_or_pad") -> list[bool]:
    """Which completions count as truncated: `no_eos_or_pad` (TRL: the last token is neither an eos nor the pad id, so
    a completion ending in a sampled pad id counts as ended) or `no_eos` (TRUNCATED_IF: no eos at the end, as a loop
    that checks `eos in ids` reads it). An empty completion is truncated."""
    ends = set(eos_ids) | ({pad_id} if rule == "no_eos_or_pad" and pad_id is not None else set())
    return [not ids or ids[-1] not in ends for ids in completion_ids]


def zero_logps_at(logps: torch.Tensor, targets: torch.Tensor, token_id: int) -> torch.Tensor:
    """Log-probs with 0 at every target of id `token_id` (a loop scoring with cross_entropy(ignore_index=token_id):
    that token's term is 0, with no gradient); -1: unchanged."""
    if token_id < 0:
        return logps
    return logps.masked_fill(targets == token_id, 0.0)


def end_at_id(completion_ids: list[list[int]], token_id: int) -> list[list[int]]:
    """Each completion through its first token of id `token_id`, that token included, as a sampler that stops there
    (one that takes the pad id for a stop token) writes it; -1: unchanged."""
    if token_id < 0:
        return completion_ids
    return [ids[:ids.index(token_id) + 1] if token_id in ids else ids for ids in completion_ids]


# ---------------------------------------------------------------------------------------------
# which tokens the loss counts
# ---------------------------------------------------------------------------------------------
COMPLETION_MASKS = ("eos", "no_eos", "all")


def loss_mask(mask: torch.Tensor, ends_with_eos: torch.Tensor, mode: str = "eos") -> torch.Tensor:
    """The tokens the loss counts, from the completion mask (B, T; 1 on each completion's tokens, its eos
    included) and whether each completion ends with an eos (B,): `eos` counts every completion token (TRL),
    `no_eos` leaves the eos token out, `all` counts the padding after short completions too."""
    if mode == "eos":
        return mask
    if mode == "all":
        return torch.ones_like(mask)
    if mode == "no_eos":
        lengths = mask.sum(-1)
        last = (lengths - 1).clamp(min=0)
        drop = torch.zeros_like(mask)
        drop[torch.arange(mask.size(0), device=mask.device), last] = ends_with_eos.to(mask.dtype) * (lengths > 0)
        return mask - drop
    raise ValueError(f"unknown completion mask {mode!r}; one of {COMPLETION_MASKS}")


# ---------------------------------------------------------------------------------------------
# the clipped surrogate
# ---------------------------------------------------------------------------------------------
def clipped_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, clip_low: float,
                      clip_high: float, delta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A); returns (loss, rho).

    `adv` is (B,) or (B, 1). `delta` (two-sided clipping) caps the unclipped ratio.
    """
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    rho = torch.exp(logp - logp_old)
    rho_clipped = torch.clamp(rho, 1 - clip_low, 1 + clip_high)
    rho_capped = torch.clamp(rho, max=delta) if delta else rho
    loss = -torch.min(rho_capped * adv, rho_clipped * adv)
    return loss, rho


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, norm: str, grad_accum: float,
                   max_tokens: int | None = None, step_tokens: float | None = None) -> torch.Tensor:
    """One micro-batch's share of the step loss; summed over the step's micro-batches it is the step loss.

    - `sequence`     (TRL grpo):    mean over sequences of each one's token mean, / grad_accum
    - `token_local`  (TRL bnpo):    sum / this micro-batch's active tokens, / grad_accum
    - `constant`     (TRL dr_grpo): sum / (sequences x max_tokens), / grad_accum
    - `token_global` (TRL dapo):    sum / active tokens of the whole step (`step_tokens`)
    - `sum`          (no TRL match): the per-token losses summed, a quirk of some hand-written loops
    """
    masked = per_token * mask
    if norm == "sequence":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / grad_accum
    if norm == "token_local":
        return masked.sum() / mask.sum().clamp(min=1.0) / grad_accum
    if norm == "constant":
        if not max_tokens:
            raise ValueError("norm='constant' needs max_tokens")
        return masked.sum() / (per_token.size(0) * max_tokens) / grad_accum
    if norm == "token_global":
        if step_tokens is None:
            raise ValueError("norm='token_global' needs step_tokens")
        return masked.sum() / max(float(step_tokens), 1.0)
    if norm == "sum":  # a quirk: no normalisation at all (TRL has none like it)
        return masked.sum()
    raise ValueError(f"unknown loss normalization {norm!r}; one of {LOSS_NORMS}")


# ---------------------------------------------------------------------------------------------
# importance-sampling correction against a separate sampler
# ---------------------------------------------------------------------------------------------
def is_weights(logp_trainer: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor, mode: str,
               clip_min: float | None, clip_max: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights w = pi_trainer / pi_sampler, per token (B, T) or per sequence (B, 1).

    Sequence modes use the sum of per-token log-ratio differences (the product of token ratios).
    `*_truncate` clamps w to [clip_min, clip_max]; `*_mask` sets w to 0 outside it. Tokens whose
    sampler log-prob is NaN count as a ratio of 1. Returns (weights, raw weights before bounds).
    """
    diff = torch.nan_to_num((logp_trainer - logp_sampler) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    raw = torch.exp(diff)
    if mode.endswith("truncate"):
        w = torch.clamp(raw, min=clip_min, max=clip_max)
    elif mode.endswith("mask"):
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        w = raw.masked_fill((raw < lo) | (raw > hi), 0.0)
    else:
        raise ValueError(f"unknown IS mode {mode!r}; one of {IS_MODES}")
    return w, raw


def mismatch_stats(logp_trainer: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor) -> dict:
    """Train-inference mismatch over active tokens: mean/max |delta logp|, NeMo-RL's token_mult_prob_error
    (mean exp|delta|), and the k3 estimate of KL(sampler || trainer) (samples come from the sampler)."""
    m = mask.bool() & ~torch.isnan(logp_sampler)
    d = (logp_trainer - logp_sampler)[m]
    if d.numel() == 0:
        return {"mean_abs": 0.0, "max_abs": 0.0, "token_mult_prob_error": 1.0, "k3_kl": 0.0}
    return {
        "mean_abs": d.abs().mean().item(),
        "max_abs": d.abs().max().item(),
        "token_mult_prob_error": d.abs().exp().mean().item(),
        "k3_kl": (torch.exp(d) - d - 1).mean().item(),
    }


def mismatch_spread(logp_trainer: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor,
                    clip_min: float | None, clip_max: float | None) -> dict:
    """How far a sampler's log-probs sit from the trainer's on the same tokens, as a distribution (the figures verl
    and NeMo-RL report for train-inference mismatch): per token, delta = logp_trainer - logp_sampler over active
    tokens (NaN left out): its mean, |delta| at the 50th/90th/99th percentile and max, mean exp|delta|, and the share
    of token ratios exp(delta) outside [clip_min, clip_max] (what token_mask drops); per sequence (rows with an
    active token), the summed delta: its standard deviation (population), |sum| at the 50th/90th percentile and
    max, the ratio's min and max, and the share outside the bounds (what sequence_mask drops). A bound of None is
    no bound."""
    m = mask.bool() & ~torch.isnan(logp_sampler)
    d = (logp_trainer - logp_sampler).double()
    lo = -math.inf if clip_min is None else math.log(clip_min) if clip_min > 0 else -math.inf
    hi = math.inf if clip_max is None else math.log(clip_max)
    tok = d[m]
    rows = m.any(-1)
    seq = torch.where(m, d, torch.zeros_like(d)).sum(-1)[rows]
    if tok.numel() == 0:
        return {"tokens": 0, "sequences": 0}
    q = torch.quantile(tok.abs(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64, device=tok.device))
    sq = torch.quantile(seq.abs(), torch.tensor([0.5, 0.9], dtype=torch.float64, device=seq.device))
    return {
        "tokens": tok.numel(), "mean": tok.mean().item(),
        "abs_p50": q[0].item(), "abs_p90": q[1].item(), "abs_p99": q[2].item(), "abs_max": tok.abs().max().item(),
        "token_mult_prob_error": tok.abs().exp().mean().item(),
        "token_out": ((tok < lo) | (tok > hi)).double().mean().item(),
        "sequences": seq.numel(), "seq_std": seq.std(unbiased=False).item(),
        "seq_abs_p50": sq[0].item(), "seq_abs_p90": sq[1].item(), "seq_abs_max": seq.abs().max().item(),
        "seq_ratio_min": seq.min().exp().item(), "seq_ratio_max": seq.max().exp().item(),
        "seq_out": ((seq < lo) | (seq > hi)).double().mean().item(),
    }


# ---------------------------------------------------------------------------------------------
# learning-rate schedule (the multiplier for optimizer step `step`, 0-based, as HF's LambdaLR): every
# `lr_scheduler_type` of transformers 5.25 that needs no metric, with its `lr_scheduler_kwargs`, as
# transformers.optimization writes them (its first optimizer step uses the multiplier of step 0)
# ---------------------------------------------------------------------------------------------
LR_SCHEDULES = ("constant", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup",
                "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
LR_SCHEDULES_WITH_METRIC = ("reduce_lr_on_plateau", "greedy")  # they step on an eval or training metric: not replayed


def _warmup(step: int, warmup_steps: int) -> float:
    """transformers' linear warmup from 0: step / warmup (step 0 trains at rate 0)."""
    return step / max(1, warmup_steps)


def _cosine(progress: float, cycles: float) -> float:
    """Half a cosine wave per 0.5 cycle: 1 at progress 0, 0 at progress 1 with cycles 0.5."""
    return 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress))


def lr_multiplier(step: int, schedule: str, total_steps: int, warmup_steps: int = 0, kwargs: dict | None = None,
                  lr: float | None = None) -> float:
    """The rate of optimizer step `step` (0-based) as a fraction of the peak `lr`. `kwargs`: transformers'
    `lr_scheduler_kwargs` (num_cycles, min_lr_rate or min_lr, lr_end and power, timescale, warmup_lr_rate,
    num_decay_steps, ...); `lr`: the peak rate, for the kwargs given as rates (min_lr, lr_end). The spec's `constant`
    with a warmup is transformers' `constant_with_warmup` (TRL's `constant` has none)."""
    kw = dict(kwargs or {})
    n, w, s = total_steps, warmup_steps, step
    if schedule == "warmup_stable_decay":
        return _wsd(s, n, w, kw)
    if schedule == "cosine_warmup_with_min_lr":  # a warmup of its own: the step's end, or from warmup_lr_rate
        r = kw.get("warmup_lr_rate")
        if s < w:
            return (s + 1.0) / max(1.0, w) if r is None else r + (1.0 - r) * s / max(1, w - 1)
        return max(0.0, _with_floor(_cosine((s - w + 1.0) / max(1.0, n - w), kw.get("num_cycles", 0.5)), kw, lr))
    if s < w:
        return _warmup(s, w)
    progress = (s - w) / max(1, n - w)
    if schedule in ("constant", "constant_with_warmup"):
        return 1.0
    if schedule == "linear":
        return max(0.0, (n - s) / max(1, n - w))
    if schedule == "cosine":
        return max(0.0, _cosine(progress, kw.get("num_cycles", 0.5)))
    if schedule == "cosine_with_min_lr":
        return max(0.0, _with_floor(_cosine(progress, kw.get("num_cycles", 0.5)), kw, lr))
    if schedule == "cosine_with_restarts":  # num_cycles hard restarts, 0 from the end of the run on
        return 0.0 if progress >= 1.0 else max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((kw.get("num_cycles", 1)
                                                                                        * progress) % 1.0))))
    if schedule == "polynomial":  # (lr - lr_end) x remaining^power + lr_end, lr_end after the run's end
        lr_end, power = kw.get("lr_end", 1e-7), kw.get("power", 1.0)
        peak = _peak(lr, "polynomial's lr_end")
        if s > n:
            return lr_end / peak
        remaining = 1.0 - (s - w) / (n - w) if n > w else 0.0
        return ((peak - lr_end) * remaining ** power + lr_end) / peak
    if schedule == "inverse_sqrt":  # 1 / sqrt((step + timescale - warmup) / timescale), timescale = warmup or 10000
        timescale = kw.get("timescale") or w or 10_000
        return 1.0 / math.sqrt((s + timescale - w) / timescale)
    if schedule in LR_SCHEDULES_WITH_METRIC:
        raise ValueError(f"lr schedule {schedule!r} steps on a metric (an eval loss, a training loss), not on the "
                         "step count: the built-in loop cannot replay it; name the schedule your loop follows")
    raise ValueError(f"unknown lr schedule {schedule!r}; one of {', '.join(LR_SCHEDULES)}")


def _peak(lr: float | None, what: str) -> float:
    if not lr:
        raise ValueError(f"{what} is a rate: the peak learning rate is needed to make it a multiplier")
    return lr


def _with_floor(factor: float, kw: dict, lr: float | None) -> float:
    """A cosine factor lifted to a floor: min_lr_rate (a fraction of the peak) or min_lr (a rate)."""
    if kw.get("min_lr") is not None and kw.get("min_lr_rate") is not None:
        raise ValueError("lr_scheduler_kwargs: only one of min_lr or min_lr_rate")
    floor = kw["min_lr"] / _peak(lr, "min_lr") if kw.get("min_lr") is not None else kw.get("min_lr_rate")
    if floor is None:
        raise ValueError("lr_scheduler_kwargs: cosine_with_min_lr needs min_lr_rate or min_lr (e.g. min_lr_rate = 0.1)")
    return factor * (1.0 - floor) + floor


def _wsd(s: int, n: int, w: int, kw: dict) -> float:
    """transformers' warmup-stable-decay: a warmup from min_lr_ratio (linear, cosine or 1-sqrt), the peak for
    num_stable_steps (by default the run's steps left after warmup and decay), a decay of num_decay_steps to
    min_lr_ratio, then min_lr_ratio."""
    if "num_decay_steps" not in kw:
        raise ValueError("lr_scheduler_kwargs: warmup_stable_decay needs num_decay_steps (e.g. num_decay_steps = 4)")
    floor, d = kw.get("min_lr_ratio", 0.0), kw["num_decay_steps"]
    stable = kw.get("num_stable_steps")
    stable = n - w - d if stable is None else stable
    shapes = {"linear": lambda x: x, "cosine": lambda x: 0.5 * (1.0 - math.cos(math.pi * x)),
              "1-sqrt": lambda x: 1.0 - math.sqrt(1.0 - x)}
    if s < w:
        return max(0.0, shapes[kw.get("warmup_type", "linear")](s / max(1, w)) * (1.0 - floor) + floor)
    if s < w + stable:
        return 1.0
    if s < w + stable + d:
        x = (s - w - stable) / max(1, d)
        shape = kw.get("decay_type", "cosine")
        f = 1.0 - x if shape == "linear" else _cosine(x, kw.get("num_cycles", 0.5)) if shape == "cosine" else \
            1.0 - math.sqrt(x)
        return max(0.0, f * (1.0 - floor) + floor)
    return floor


# ---------------------------------------------------------------------------------------------
# per-micro-batch statistics, with TRL's definitions
# ---------------------------------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()


def clip_stats(rho: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float) -> dict:
    """TRL's clip_ratio/* for one micro-batch: token means of low/high/region clipping where it binds, and the
    min (low) / max (high) over sequences of each sequence's clipped fraction."""
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    low = ((rho < 1 - clip_low) & (adv < 0)).float()
    high = ((rho > 1 + clip_high) & (adv > 0)).float()
    region = torch.maximum(low, high)
    per_seq = lambda x: (x * mask).sum(-1) / mask.sum(-1)  # noqa: E731  (NaN for empty sequences, as TRL)
    return {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/high_mean": masked_mean(high, mask),
        "clip_ratio/region_mean": masked_mean(region, mask),
        "clip_ratio/low_min": torch.nan_to_num(per_seq(low), nan=math.inf).min().item(),
        "clip_ratio/high_max": torch.nan_to_num(per_seq(high), nan=-math.inf).max().item(),
    }


# ---------------------------------------------------------------------------------------------
# the noise twin: a change to the weights that only rounding could have made
# ---------------------------------------------------------------------------------------------
def ulp_step(x: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` moved by one unit in the last place of `dtype` (up where `up`, down elsewhere), kept in x's dtype.

    The step is taken from x's value rounded to `dtype`, so an fp32 weight moves by one bf16 step when `dtype`
    is bfloat16 (the precision the forward pass sees under autocast) and by one fp32 step when it is float32."""
    low = x.to(dtype)
    target = torch.nextafter(low, torch.where(up, torch.full_like(low, math.inf), torch.full_like(low, -math.inf)))
    return x + (target.to(x.dtype) - low.to(x.dtype))


@torch.no_grad()
def nudge_ulp(model: torch.nn.Module, weights_dtype: str, seed: int) -> None:
    """Move every parameter by one ulp of the dtype the weights are held in, up or down at random (seeded per
    tensor)."""
    dtype = torch.bfloat16 if weights_dtype == "bfloat16" else torch.float32
    for i, (_, p) in enumerate(sorted(model.named_parameters())):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        if p.device.type == "cpu":  # one draw per weight: unpacking words costs as much here (measured)
            up = torch.rand(p.shape, generator=g) < 0.5
        else:  # on a GPU the per-weight CPU draw took ~2 s for a 0.6B model; words are drawn 31x fewer
            up = coin_flips(p.numel(), g, p.device).view(p.shape)
        p.copy_(ulp_step(p, up, dtype))


WORD_BITS = 31  # fair bits per draw of torch.randint(0, 2**31)


def coin_flips(n: int, generator: torch.Generator, device) -> torch.Tensor:
    """`n` fair coin flips (bool) on `device`, drawn on the CPU from `generator` (the same flips on any device),
    31 to a random word: bit b of word w is flip w * 31 + b. One CPU draw per flip (torch.rand) took ~2 s for a
    0.6B-parameter model's noise twin on the GPU machine; this draws 31x fewer numbers and unpacks them where the
    weights are. The noise twin uses it for weights on a GPU; on the CPU unpacking costs as much as drawing
    (155M flips: 1.86 s against 1.87 s), so CPU weights keep one draw each, the flips earlier runs used."""
    words = torch.randint(0, 2**WORD_BITS, (-(-n // WORD_BITS),), generator=generator, dtype=torch.int32)
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=device)
    return ((words.to(device)[:, None] >> shifts) & 1).flatten()[:n].bool()
