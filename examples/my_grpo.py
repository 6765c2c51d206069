"""A hand-written GRPO loop of the kind people write before they move to TRL: plain transformers, its own
generate call, its own advantages and loss. The lines marked `# parity:` are the change that lets the harness
run it as a side of a parity run (docs/your-loop.md walks through them):

    python -m harness parity --spec harness/specs/default.toml --loop "python examples/my_grpo.py" --matrix none

Its choices are flags, so you can see what the harness says when they differ from TRL's:
    --loss-agg seq|token|micro-token   mean per completion, then over completions (the GRPO paper), over all
                             tokens, or over each micro-batch's own tokens, then over micro-batches (TRL's bnpo)
    --adv-scale std|none     divide the group-centred rewards by the group's std, or not (Dr. GRPO)
    --std bessel|population  the std estimator (TRL: Bessel's n-1)
    --std-eps E              added to the std before dividing (TRL: 1e-4)
    --no-eos-in-loss         leave each completion's eos token out of the loss (as loops that pad with eos do)
    --beta B                 k3 KL to the initial model, weight B (TRL: beta); --kl-ratio no leaves out TRL's
                             factor of the policy ratio (use_bias_correction_kl); --kl-log round averages the
                             logged kl over the round's tokens (TRL: per micro-batch, then over them)
    --lr, --adam-beta2, --weight-decay, --lr-schedule constant|linear   the optimizer's own values
    --clip-high C            the ratio's upper clip bound 1 + C (TRL: epsilon_high; it binds once the ratio leaves 1,
                             as with the spec's NUM_ITERATIONS > 1)
    --reward-weights 1,1     its own weights for the reward functions' scores (TRL: reward_weights)
    --pg-loss ratio|logp     the policy term -ratio * A (TRL), or -logp * A (REINFORCE: the same gradient with one
                             pass per round, another value)
    --mask-token-id ID       build the loss mask from token ids (`ids != ID`, as loops do with their pad id): a
                             generated token ID drops out of the loss
    --loss-divisor D         the loss is the masked per-token losses' sum divided by D (a fixed constant)
    --max-grad-norm M        its own gradient clipping threshold (0: none)
    --is-correction MODE|off TRL's importance-sampling weight on the per-token loss, from the sampler's log-probs that
                             the rollouts carry (vLLM's, or the emulated sampler's): token_truncate, token_mask,
                             sequence_truncate or sequence_mask, bounded by the spec's IS_CLIP_MIN / IS_CLIP_MAX; off:
                             none (a loop that trains on a separate sampler's completions as if they were its own)
  What its forward pass sees (loops that treat their pad token id specially; TRL does none of these):
    --attention-hide-id ID   build the attention mask as `ids != ID` (with the pad id: a generated pad token is
                             hidden from the tokens after it), the token kept in the loss
    --positions plain|mask   pass no position ids (the model's own, TRL) or count them over the attention mask
    --ignore-id ID           score tokens with cross_entropy(ignore_index=ID): that id's log-prob is 0, and it still
                             counts in the loss's divisor
    --end-at-id ID           end each completion at its first token ID, that token included (a sampler that stops
                             at the pad id): the tokens after it are not trained on
  Which completions a step trains on (the loop then says so with parity.trained, and reads lockstep rounds at its own
  pace; TRL trains each step on one whole round):
    --skip-flat-groups       leave out the groups whose rewards are all equal (DAPO's dynamic sampling)
    --round-parts K          train on each round over K steps, its groups a part at a time, in order
    --rounds-per-step R      train each step on R rounds at once (set [loop] rounds = R x STEPS in the spec)
    --queue                  each round's groups go through a queue, those whose rewards are all equal left out, and
                             each step takes PROMPTS_PER_STEP groups from it (reading rounds as it runs short; set
                             [loop] rounds): groups are still queued when the run ends
    --passes K               K optimizer steps (passes) over each whole round, old log-probs from a no-grad pass at
                             its first (TRL's num_iterations); --old-logps pass takes them again before each pass
    --sort-by-length         sort each round by completion length, longest first, before cutting micro-batches
  What it logs:
    --log-loss last          log (and save) the last micro-batch's loss as the step's, not their sum
The spec's NUM_ITERATIONS > 1 takes that many optimizer steps over each round, logp_old from a no-grad pass.
Left unset, each follows the harness's spec, which is TRL's setting: the example then matches TRL.
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import loop as parity  # parity: the contract's helpers (standard library only)

p = argparse.ArgumentParser()
p.add_argument("--loss-agg", choices=("seq", "token", "micro-token"), default="seq")
p.add_argument("--adv-scale", choices=("std", "none"), default="std")
p.add_argument("--std", choices=("bessel", "population"), default="bessel")
p.add_argument("--std-eps", type=float, default=1e-4)
p.add_argument("--no-eos-in-loss", action="store_true")
p.add_argument("--beta", type=float)
p.add_argument("--kl-ratio", choices=("yes", "no"))
p.add_argument("--kl-log", choices=("micro", "round"), default="micro")
p.add_argument("--lr", type=float)
p.add_argument("--adam-beta2", type=float)
p.add_argument("--weight-decay", type=float)
p.add_argument("--lr-schedule", choices=("constant", "linear"))
p.add_argument("--clip-high", type=float)
p.add_argument("--reward-weights", type=lambda t: [float(w) for w in t.split(",")])
p.add_argument("--pg-loss", choices=("ratio", "logp"), default="ratio")
p.add_argument("--mask-token-id", type=int)
p.add_argument("--loss-divisor", type=float)
p.add_argument("--max-grad-norm", type=float)
p.add_argument("--is-correction", choices=("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"))
p.add_argument("--attention-hide-id", type=int)
p.add_argument("--positions", choices=("plain", "mask"), default="plain")
p.add_argument("--ignore-id", type=int)
p.add_argument("--end-at-id", type=int)
p.add_argument("--skip-flat-groups", action="store_true")
p.add_argument("--round-parts", type=int, default=1)
p.add_argument("--rounds-per-step", type=int, default=1)
p.add_argument("--queue", action="store_true")
p.add_argument("--passes", type=int)
p.add_argument("--old-logps", choices=("generation", "pass"), default="generation")
p.add_argument("--sort-by-length", action="store_true")
p.add_argument("--log-loss", choices=("step", "last"), default="step")
p.add_argument("--no-tensors", action="store_true", help="do not save the first steps' tensors for the tensor diff")
p.add_argument("--no-probe", action="store_true", help="save the tensors, but no slice of the weights (the optimizer)")
p.add_argument("--model", default="./models/Qwen3-0.6B", help="used when the harness does not give PARITY_INIT")
args = p.parse_args()

# ---- hyperparameters: the harness's spec when it runs us, our own defaults otherwise -------------------------
cfg = parity.spec()  # parity
STEPS = cfg.get("STEPS", 100)
PROMPTS, G, ACCUM = cfg.get("PROMPTS_PER_STEP", 8), cfg.get("GROUP_SIZE", 8), cfg.get("GRAD_ACCUM", 4)
LR = args.lr if args.lr is not None else cfg.get("LR", 1e-6)
BETAS = (cfg.get("ADAM_BETA1", 0.9), args.adam_beta2 if args.adam_beta2 is not None else cfg.get("ADAM_BETA2", 0.99))
EPS = cfg.get("ADAM_EPS", 1e-8)
WEIGHT_DECAY = args.weight_decay if args.weight_decay is not None else cfg.get("WEIGHT_DECAY", 0.0)
CLIP_LOW = cfg.get("CLIP_LOW", 0.2)
CLIP_HIGH = args.clip_high if args.clip_high is not None else cfg.get("CLIP_HIGH", 0.28)
TEMPERATURE, MAX_TOKENS = cfg.get("TEMPERATURE", 1.0), cfg.get("MAX_TOKENS", 512)
MAX_GRAD_NORM = args.max_grad_norm if args.max_grad_norm is not None else cfg.get("MAX_GRAD_NORM", 1.0)
LINEAR_LR = (args.lr_schedule or cfg.get("LR_SCHEDULE", "constant")) == "linear"
BETA = args.beta if args.beta is not None else cfg.get("BETA", 0.0)
KL_RATIO = (args.kl_ratio or ("yes" if cfg.get("KL_IS_CORRECTION", True) else "no")) == "yes"
MU = args.passes or cfg.get("NUM_ITERATIONS", 1)  # optimizer steps (passes) over each generation round: GRPO's mu
IS_MODE = args.is_correction or (cfg.get("IS_MODE", "sequence_mask") if cfg.get("IS_CORRECTION") else "off")
IS_MODE = None if IS_MODE == "off" else IS_MODE
IS_LO, IS_HI = cfg.get("IS_CLIP_MIN", 0.0) or None, cfg.get("IS_CLIP_MAX", 3.0)
if cfg.get("STEPS_PER_GENERATION", 1) != 1:
    raise SystemExit("this example trains every optimizer step on a whole generation round: STEPS_PER_GENERATION "
                     "must be 1")
SELECT = args.skip_flat_groups or args.round_parts > 1 or args.rounds_per_step > 1 or args.queue
NAMED = bool(args.passes or args.sort_by_length)  # whole rounds, but not one per step in the rollout's order
if SELECT and MU > 1:
    raise SystemExit("--skip-flat-groups, --round-parts, --rounds-per-step and --queue train one pass: NUM_ITERATIONS "
                     "must be 1")
if SELECT and args.sort_by_length:
    raise SystemExit("--sort-by-length sorts whole rounds: not with a selection flag")
IS_FROM = "--is-correction" if args.is_correction else "the spec's IS_CORRECTION"
if IS_MODE and SELECT:
    raise SystemExit(f"an importance-sampling correction ({IS_FROM}) with a selection of completions: this example "
                     "weights whole rounds only; pass --is-correction off")
if args.end_at_id is not None and (SELECT or IS_MODE):
    raise SystemExit("--end-at-id cuts whole rounds' completions, without a selection or an importance-sampling "
                     "correction")
if args.pg_loss == "logp" and MU > 1:
    raise SystemExit("--pg-loss logp is the policy gradient with one pass per round: NUM_ITERATIONS must be 1")

DEVICE = cfg.get("DEVICE", "cpu")
DEVICE = ("cuda" if torch.cuda.is_available() else "cpu") if DEVICE == "auto" else DEVICE
BF16 = cfg.get("DTYPE", "float32") == "bfloat16"  # bf16 autocast over fp32 weights, as TRL's bf16=True

torch.manual_seed(parity.seed(42))  # parity: the run's seed
path = parity.init_dir(args.model)  # parity: the weights every side starts from
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
if cfg.get("GRADIENT_CHECKPOINTING", False):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
tok = AutoTokenizer.from_pretrained(path)
eos = model.generation_config.eos_token_id
eos = set(eos if isinstance(eos, list) else [eos])
ref = None
if BETA > 0:  # the frozen initial policy for the KL term
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval().requires_grad_(False)
# no decay on biases and norms, as transformers' Trainer (TRL) groups them
decay = [p for n, p in model.named_parameters() if not ("bias" in n or "norm" in n.lower())]
no_decay = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n.lower()]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=LR, betas=BETAS, eps=EPS, fused=True)
probe = parity.Probe(model)  # parity: a slice of the weights around each optimizer step (the optimizer, identified)


def pad(seqs, value, left):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s, dtype=torch.long), 1
    return ids, mask


def pad_values(rows):
    """Per-token floats of different lengths, right-padded with 0 into one tensor."""
    out = torch.zeros(len(rows), max(map(len, rows)))
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def is_weight(trainer_logp, sampler_logp, mask):
    """TRL's importance-sampling weight: pi_trainer / pi_sampler of the sampled tokens, per token or per sequence
    (the product), truncated to [IS_LO, IS_HI] or zero outside it (mask)."""
    d = (trainer_logp - sampler_logp) * mask
    if IS_MODE.startswith("sequence"):
        d = d.sum(1, keepdim=True)
    w = torch.exp(d)
    if IS_MODE.endswith("truncate"):
        return w.clamp(min=IS_LO, max=IS_HI)
    lo = IS_LO if IS_LO is not None else -math.inf
    return w.masked_fill((w < lo) | (w > IS_HI), 0.0)


def sample_round(r):
    """Free runs: our own prompts, sampling and rewards (here the harness's data and reward functions stand in
    for a user's own)."""
    from harness.experiment.data import encode_prompts, load_rows, prompt_schedule, to_prompt_rows
    from harness.experiment.rewards import reward_functions
    from harness.experiment.spec import parse_spec

    spec = parse_spec({k: v for k, v in cfg.items() if k != "derived"})
    rows = to_prompt_rows(load_rows(spec.data), spec.data.system_prompt)
    group = [rows[i] for i in prompt_schedule(len(rows), r + 1, PROMPTS, spec.SEED)[r] for _ in range(G)]
    prompt_ids = encode_prompts(tok, [row["prompt"] for row in group], spec.MAX_PROMPT_TOKENS)
    ids, mask = pad(prompt_ids, tok.pad_token_id, left=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), do_sample=True,
                             temperature=TEMPERATURE, top_p=1.0, top_k=0, max_new_tokens=MAX_TOKENS,
                             pad_token_id=tok.pad_token_id)
    completion_ids = []
    for row in out[:, ids.size(1):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        completion_ids.append(row[:end])
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    columns = {k: [row[k] for row in group] for k in group[0] if k != "prompt"}
    scores = {fn.__name__: fn(prompts=[row["prompt"] for row in group], completions=[[{"role": "assistant",
              "content": t}] for t in texts], completion_ids=completion_ids, **columns) for fn in reward_functions(spec)}
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "rewards": scores,
            "reward_weights": list(spec.rewards.weights)}


def token_logp(net, ids, attention, targets, P):
    if args.attention_hide_id is not None:  # the attention mask from token ids: that id hidden wherever it stands
        attention = attention * (ids != args.attention_hide_id).long()
    extra = {}
    if args.positions == "mask":  # positions counted over the attention mask (1 where masked)
        extra["position_ids"] = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
    with torch.autocast(DEVICE.split(":")[0], dtype=torch.bfloat16, enabled=BF16):
        logits = net(input_ids=ids, attention_mask=attention, **extra).logits[:, P - 1:-1]
    if args.ignore_id is not None:  # cross_entropy's ignore_index: that id's log-prob is 0
        return -torch.nn.functional.cross_entropy(logits.float().transpose(1, 2) / TEMPERATURE, targets,
                                                  ignore_index=args.ignore_id, reduction="none")
    return torch.log_softmax(logits.float() / TEMPERATURE, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def scored(batch):
    """A round's rewards (the reward functions' scores, weighted) and advantages: centred per group of G
    completions, scaled by the group's std."""
    per_func = torch.tensor([[math.nan if v is None else v for v in vals] for vals in batch["rewards"].values()])
    weights = args.reward_weights or batch["reward_weights"]
    rewards = (per_func.T * torch.tensor(weights)).nansum(dim=1)  # a failed score counts 0
    grouped = rewards.view(-1, G)
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if args.adv_scale == "std":
        adv = adv / (grouped.std(dim=1, keepdim=True, unbiased=args.std == "bessel") + args.std_eps)
    return rewards, adv.reshape(-1)


taken = {}  # round -> (its batch, rewards, advantages, old log-probs per completion, the step it came in)


def take(r, step):
    """Round r when the loop first reads it: scored, and its log-probs under the policy of that moment (the old
    policy of any later step that trains on it)."""
    if r not in taken:
        model.eval()
        batch = parity.rollout(r) or sample_round(r)  # parity: lockstep rollouts when the harness gives them
        rewards, adv = scored(batch)
        ids, mask = pad(batch["prompt_ids"], tok.pad_token_id, left=True)
        c_ids, c_mask = pad(batch["completion_ids"], tok.pad_token_id, left=False)
        with torch.no_grad():
            old = token_logp(model, torch.cat([ids, c_ids], 1).to(DEVICE), torch.cat([mask, c_mask], 1).to(DEVICE),
                             c_ids.to(DEVICE), ids.size(1))
        model.train()
        taken[r] = (batch, rewards, adv, [row[:len(c)] for row, c in zip(old, batch["completion_ids"])], step)
    return taken[r]


def picks_of(step):
    """The (round, index) pairs this step trains on, by the selection flags."""
    if args.rounds_per_step > 1:
        k = args.rounds_per_step
        return [(step * k + j, i) for j in range(k) for i in range(PROMPTS * G)]
    if args.round_parts > 1:
        r, part = divmod(step, args.round_parts)
        width = PROMPTS * G // args.round_parts
        return [(r, i) for i in range(part * width, (part + 1) * width)]
    if args.queue:  # the queue's first PROMPTS groups, a round read (its flat groups left out) whenever it runs short
        while len(queue) < PROMPTS:
            q = len(taken)  # (the rounds are read in order)
            queue.extend((q, g) for g in range(PROMPTS) if take(q, step)[1].view(-1, G)[g].std() > 0)
        out = [(q, g * G + j) for q, g in queue[:PROMPTS] for j in range(G)]
        del queue[:PROMPTS]
        return out
    return [(step, i) for i in range(PROMPTS * G)]


queue = []  # --queue: (round, group) pairs waiting for a step


sampler_logp = None  # a separate sampler's log-probs of the round's tokens (lockstep rollouts carry them)
for step in range(STEPS):
    r, it = divmod(step, MU)  # round r, pass `it` over it (NUM_ITERATIONS passes)
    # ---- 1-2. completions, rewards and advantages: a round (the harness's in lockstep, or our own) ------------
    if not SELECT and it == 0:  # later passes train on the same round
        model.eval()
        given = parity.rollout(r)  # parity: lockstep rollouts when the harness gives them
        batch = given or sample_round(r)
        model.train()
        if args.end_at_id is not None:  # each completion through its first token of that id (its sampler stops there)
            batch = {**batch, "completion_ids": [c[:c.index(args.end_at_id) + 1] if args.end_at_id in c else c
                                                 for c in batch["completion_ids"]]}
        rewards, adv = scored(batch)
        order = list(range(len(adv)))  # the order its micro-batches take the round's rows
        if args.sort_by_length:  # longest first (fewer pad tokens per micro-batch)
            order = sorted(order, key=lambda i: -len(batch["completion_ids"][i]))
            batch = {**batch, **{k: [batch[k][i] for i in order] for k in ("prompt_ids", "completion_ids", "logprobs")
                                 if batch.get(k)}}
            rewards, adv = rewards[order], adv[order]
        # our own samples come from the policy itself: no weight
        sampler_logp = None
        if IS_MODE and given:
            if not batch.get("logprobs"):
                raise SystemExit(f"an importance-sampling correction ({IS_FROM}), but the rollouts carry no sampler "
                                 "log-probs (the spec's sampler.kind is \"policy\"): set sampler.kind = \"vllm\" or "
                                 "\"emulated\", or pass --is-correction off")
            sampler_logp = pad_values(batch["logprobs"])
    elif SELECT:  # the rows the flags choose, from the rounds they come from
        picks = picks_of(step)
        if args.skip_flat_groups:  # (where every group is flat it trains on them all: a step needs completions)
            picks = [(q, i) for q, i in picks if take(q, step)[1].view(-1, G)[i // G].std() > 0] or picks
        parity.trained(step + 1, picks)  # parity: the completions this step trains on
        rows = [(take(q, step), i) for q, i in picks]
        batch = {"prompt_ids": [t[0]["prompt_ids"][i] for t, i in rows],
                 "completion_ids": [t[0]["completion_ids"][i] for t, i in rows]}
        rewards, adv = torch.stack([t[1][i] for t, i in rows]), torch.stack([t[2][i] for t, i in rows])
        fresh = torch.tensor([t[4] == step for t, _ in rows])  # read this step: its old policy is the current one
        width = max(map(len, batch["completion_ids"]))
        kept_old = torch.stack([torch.nn.functional.pad(t[3][i], (0, width - len(t[3][i]))) for t, i in rows])
    if NAMED and not SELECT:
        parity.trained(step + 1, [(r, i) for i in order])  # parity: its rows, in the order its micro-batches take them
    adv = adv.to(DEVICE)

    # ---- 3. the clipped surrogate over ACCUM micro-batches, one optimizer step -------------------------------
    prompt_ids, prompt_mask = (t.to(DEVICE) for t in pad(batch["prompt_ids"], tok.pad_token_id, left=True))
    completion_ids, completion_mask = (t.to(DEVICE) for t in pad(batch["completion_ids"], tok.pad_token_id, left=False))
    loss_mask = completion_mask.clone()
    if args.mask_token_id is not None:  # the mask from token ids: a generated token with that id drops out too
        loss_mask = loss_mask * (completion_ids != args.mask_token_id).long()
    if args.no_eos_in_loss:  # a completion's last token, when it is an eos, does not count
        for i, ids in enumerate(batch["completion_ids"]):
            if ids and ids[-1] in eos:
                loss_mask[i, len(ids) - 1] = 0
    n, P = len(adv), prompt_ids.size(1)
    all_tokens = loss_mask.sum().clamp(min=1)
    lr = LR * (1 - step / STEPS) if LINEAR_LR else LR
    for group in opt.param_groups:
        group["lr"] = lr
    step_loss, kls, kl_sum = 0.0, [], 0.0
    seen_logp, seen_loss, seen_ref = [], [], []  # per micro-batch, in order: the round's rows for the tensor diff
    micro = [slice(s, s + n // ACCUM) for s in range(0, n, n // ACCUM)]
    if SELECT:  # a selection's size may not divide: ACCUM parts, the first ones one larger
        bounds = [0, *(int(c[-1]) + 1 for c in torch.arange(n).tensor_split(min(ACCUM, n)))]
        micro = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    inputs = [(torch.cat([prompt_ids[mb], completion_ids[mb]], dim=1),
               torch.cat([prompt_mask[mb], completion_mask[mb]], dim=1)) for mb in micro]
    if MU > 1 and (it == 0 or args.old_logps == "pass"):  # several passes: the old policy is the one that generated,
        # from a no-grad pass (--old-logps pass: the current policy, before each pass: the ratio always 1)
        with torch.no_grad():
            old_logps = [token_logp(model, ids, attention, completion_ids[mb], P)
                         for mb, (ids, attention) in zip(micro, inputs)]

    for j, (mb, (ids, attention)) in enumerate(zip(micro, inputs)):
        logp = token_logp(model, ids, attention, completion_ids[mb], P)
        old = old_logps[j] if MU > 1 else logp.detach()  # one pass per round: the old policy is the current one
        if SELECT:  # rows of a round read at an earlier step: the policy that read it
            old = torch.where(fresh[mb].unsqueeze(1).to(DEVICE), logp.detach(), kept_old[mb].to(DEVICE))
        ratio = torch.exp(logp - old)
        a = adv[mb].unsqueeze(1)
        if args.pg_loss == "logp":  # REINFORCE's form (nano-aha-moment's): TRL's gradient at ratio 1, not its value
            per_token = -logp * a
        else:
            per_token = -torch.min(ratio * a, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
        mask = loss_mask[mb].float()
        if sampler_logp is not None:  # TRL: the policy term times the weight, the KL term after it
            per_token = per_token * is_weight(old, sampler_logp[mb].to(DEVICE), completion_mask[mb].float())
        seen_logp.append(logp.detach())
        if ref is not None:
            with torch.no_grad():
                ref_logp = token_logp(ref, ids, attention, completion_ids[mb], P)
            seen_ref.append(ref_logp)
            kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3
            if KL_RATIO:
                kl = kl * ratio
            per_token = per_token + BETA * kl
            kls.append(((kl.detach() * mask).sum() / mask.sum().clamp(min=1)).item())
            kl_sum += (kl.detach() * mask).sum().item()
        seen_loss.append(per_token.detach())
        if args.loss_divisor:
            loss = (per_token * mask).sum() / args.loss_divisor
        elif args.loss_agg == "seq":
            loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean() / ACCUM
        elif args.loss_agg == "micro-token":
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1) / ACCUM
        else:
            loss = (per_token * mask).sum() / all_tokens
        loss.backward()
        step_loss += loss.item()
    if args.log_loss == "last":  # what it logs is its last micro-batch's loss alone
        step_loss = loss.item()
    if not (args.no_tensors or args.no_probe):
        probe.before(step + 1)  # parity: the gradient before clipping, and the weights
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM if MAX_GRAD_NORM > 0 else math.inf)
    if not args.no_tensors:  # parity: the first steps' tensors, for the harness's tensor diff (optional)
        parity.tensors(step + 1, rewards=rewards, advantages=adv, mask=loss_mask, logps=seen_logp,
                       old_logps=old_logps if MU > 1 else kept_old if SELECT else None,
                       ref_logps=seen_ref or None, per_token_loss=seen_loss, loss=step_loss, grad_norm=grad_norm)
    opt.step()
    if not (args.no_tensors or args.no_probe):
        probe.after(step + 1)  # parity: the weights after the step
    opt.zero_grad(set_to_none=True)

    lengths = completion_mask.sum(1).float()
    print(f"step {step + 1}: loss {step_loss:.4f} reward {rewards.nanmean():.3f} length {lengths.mean():.1f}")
    extra = {}
    if kls:  # TRL's kl: per micro-batch, then averaged; "round": over every token of the round
        extra["kl"] = kl_sum / float(all_tokens) if args.kl_log == "round" else sum(kls) / len(kls)
    parity.log_step(step + 1, loss=step_loss, grad_norm=grad_norm, learning_rate=lr,  # parity: one line per step
                    reward=rewards.nanmean(), reward_std=rewards.std(), **{"completions/mean_length": lengths.mean()},
                    **extra)

parity.save_weights(model)  # parity: the final weights, for the distance to the other side
