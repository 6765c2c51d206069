"""A drawn loop's source: one plain file, each stage written as the chosen loop writes it (no flags: only the code
of the choices drawn), following docs/your-loop.md's contract in lockstep."""

from __future__ import annotations

from tests.random_loops.vocab import PAD_ID, SCHEDULES

HEAD = '''"""A random GRPO loop (tests/random_loops, seed {seed}); drawn: {drawn}.

Plain PyTorch + transformers; the lines marked `# parity:` are the harness's contract (docs/your-loop.md). Outside
the harness it samples its own completions from the model given as its first argument.
"""

import math
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import loop as parity  # parity

cfg = parity.spec()  # parity
STEPS = cfg.get("STEPS", 12)
PROMPTS, G, ACCUM = cfg.get("PROMPTS_PER_STEP", 4), cfg.get("GROUP_SIZE", 4), cfg.get("GRAD_ACCUM", 2)
MAX_TOKENS, TEMPERATURE = cfg.get("MAX_TOKENS", 8), cfg.get("TEMPERATURE", 1.0)
{constants}
torch.manual_seed(parity.seed(0))  # parity
path = parity.init_dir(sys.argv[1] if len(sys.argv) > 1 else None)  # parity
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(path)
EOS = model.generation_config.eos_token_id
EOS = EOS[0] if isinstance(EOS, list) else EOS
PAD = tok.pad_token_id
{ref}
{optimizer}
sched = transformers.get_scheduler({sched_args})
probe = parity.Probe(model)  # parity


def pad(seqs, value, left):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s, dtype=torch.long), 1
    return ids, mask


def sample_round(r):
    """Outside the harness: our own prompts and samples, rewarded for writing the sum."""
    pairs = [((r * 3 + k) % 9 + 1, (r * 5 + 2 * k) % 9 + 1) for k in range(PROMPTS)]
    prompt_ids = [tok.apply_chat_template([{{"role": "user", "content": f"What is {{a}} + {{b}} ?"}}],
                                          add_generation_prompt=True, tokenize=True)
                  for a, b in pairs for _ in range(G)]
    prompt_ids = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompt_ids]
    ids, mask = pad(prompt_ids, PAD, left=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE,
                             top_k=0, max_new_tokens=MAX_TOKENS, pad_token_id=PAD)
    completion_ids = []
    for row in out[:, ids.size(1):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t == EOS), len(row))
        completion_ids.append(row[:end])
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    right = [float(str(sum(pairs[i // G])) in t) for i, t in enumerate(texts)]
    return {{"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "rewards": {{"correct": right, "format": [float("####" in t) for t in texts]}}, "reward_weights": [1.0, 0.5]}}


def token_logp(net, ids, attention, targets, P):
{forward}


def advantages(rewards):
{advantages}


step_losses = []
for step in range(STEPS):
{round_of_step}
    if it == 0:  # a new round: its completions, rewards and advantages
        model.eval()
        batch = parity.rollout(r) or sample_round(r)  # parity
        model.train()
        per_func = torch.tensor([[math.nan if v is None else v for v in vals] for vals in batch["rewards"].values()])
        rewards = (per_func.T * torch.tensor({reward_weights})).nansum(dim=1)
        adv = advantages(rewards)
        rows = list(range(len(rewards)))
{selection}
        prompt_ids, prompt_mask = pad([batch["prompt_ids"][i] for i in rows], PAD, left=True)
        completion_ids, completion_mask = pad([batch["completion_ids"][i] for i in rows], PAD, left=False)
        adv_rows, n, P = adv[rows], len(rows), prompt_ids.size(1)
        ids_all = torch.cat([prompt_ids, completion_ids], 1)
        attention_all = torch.cat([prompt_mask, completion_mask], 1)
{loss_mask}
        bounds = [0, *(int(c[-1]) + 1 for c in torch.arange(n).tensor_split(min(ACCUM, n)))]
        micro = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
{old_logps}
    lr = sched.get_last_lr()[0]
    step_loss, saved = 0.0, {{"logps": [], "per_token_loss": [], "old_logps": [], "ref_logps": []}}
    all_tokens = loss_mask.sum().clamp(min=1)
    for j, mb in enumerate(micro):
        logp = token_logp(model, ids_all[mb], attention_all[mb], completion_ids[mb], P)
{old_of_mb}
        ratio = torch.exp(logp - old)
        a = adv_rows[mb].unsqueeze(1)
        per_token = -torch.min(ratio * a, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
{kl}
        mask = loss_mask[mb].float()
{aggregate}
        loss.backward()
{loss_logged}
        saved["logps"].append(logp.detach())
        saved["old_logps"].append(old.detach())
        saved["per_token_loss"].append(per_token.detach())
    probe.before(step + 1)  # parity
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), {clip_norm})
    parity.tensors(step + 1, rewards=rewards[rows], advantages=adv_rows, mask=loss_mask, logps=saved["logps"],  # parity
                   old_logps=saved["old_logps"], ref_logps=saved["ref_logps"] or None,
                   per_token_loss=saved["per_token_loss"], loss=step_loss, grad_norm=grad_norm)
    opt.step()
    probe.after(step + 1)  # parity
    sched.step()
    opt.zero_grad(set_to_none=True)
{lr_logged}
    print(f"step {{step + 1}}: loss {{step_loss:.5f}} grad_norm {{float(grad_norm):.5f}} lr {{lr:.3e}}")
    parity.log_step(step + 1, loss=step_loss, grad_norm=grad_norm, learning_rate=lr,  # parity
                    reward=rewards.nanmean(), reward_std=rewards.std())

parity.save_weights(model)  # parity
'''


def _indent(text: str, n: int) -> str:
    return "\n".join((" " * n + line) if line.strip() else "" for line in text.strip("\n").splitlines())


def _constants(p: dict) -> str:
    lr = {"spec": 'cfg.get("LR", 3e-3)', "1e-3": "1e-3", "5e-3": "5e-3"}[p["lr"]]
    beta2 = {"spec": 'cfg.get("ADAM_BETA2", 0.99)', "0.999": "0.999", "0.95": "0.95"}[p["betas"]]
    decay = {"none": "0.0", "0.1_trainer": "0.1", "0.1_all": "0.1", "torch_default_0.01_all": "0.01"}[p["decay"]]
    clip_low, clip_high = p["clip"].split("_")
    lines = [f"LR = {lr}", f"BETAS = (0.9, {beta2})", f"WEIGHT_DECAY = {decay}",
             f"CLIP_LOW, CLIP_HIGH = {clip_low}, {clip_high}",
             f"PASSES = {2 if p['passes'].startswith('2') else 1}  # optimizer passes over each round"]
    if p["kl"] != "none":
        lines.append(f"BETA = {p['kl_beta']}  # KL weight")
    if p["agg"] == "grpo_over_constant_8":
        lines.append("ACCUM_STEPS = 8  # its config's gradient_accumulation_steps (it cuts ACCUM micro-batches)")
    if p["adv_scale"] != "none":
        eps = {"1e-4": "1e-4", "1e-8": "1e-8", "1e-6": "1e-6", "1e-2": "1e-2", "inside_1e-8": "1e-8"}[p["std_eps"]]
        lines.append(f"STD_EPS = {eps}")
    return "\n".join(lines)


def _optimizer(p: dict) -> str:
    if p["decay"] in ("0.1_all", "torch_default_0.01_all"):
        return "opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=WEIGHT_DECAY)"
    return ('decay = [q for n, q in model.named_parameters() if not ("bias" in n or "norm" in n.lower())]\n'
            'no_decay = [q for n, q in model.named_parameters() if "bias" in n or "norm" in n.lower()]\n'
            'opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, '
            '{"params": no_decay, "weight_decay": 0.0}],\n'
            '                        lr=LR, betas=BETAS, eps=1e-8)')


def _sched_args(p: dict) -> str:
    name, warmup, horizon, kwargs = SCHEDULES[p["schedule"]]
    extra = f", scheduler_specific_kwargs={kwargs!r}" if kwargs else ""
    return f'"{name}", opt, num_warmup_steps={warmup}, num_training_steps={horizon}{extra}'


def _forward(p: dict) -> str:
    f = p["forward"]
    if f == "eos_out_of_attention":  # pad = eos (tiny-grpo): every eos out of attention, positions over the mask
        body = """
attention = attention * (ids != EOS).long()
positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
logits = net(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, P - 1:-1]
return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)"""
    elif f == "ce_ignore_pad":
        body = """
logits = net(input_ids=ids, attention_mask=attention).logits[:, P - 1:-1] / TEMPERATURE
ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=PAD, reduction="none")
return -ce  # a pad id in a completion scores 0 (and still counts in the loss below)"""
    elif f == "pad_id_attention":  # the mask from the ids: a pad id sampled inside a completion is hidden too
        body = """
attention = (ids != PAD).long()
logits = net(input_ids=ids, attention_mask=attention).logits[:, P - 1:-1]
return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)"""
    elif f == "logits_bf16":
        body = """
logits = net(input_ids=ids, attention_mask=attention).logits[:, P - 1:-1]
logp = torch.log_softmax(logits.to(torch.bfloat16) / TEMPERATURE, dim=-1).float()
return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)"""
    else:
        body = """
logits = net(input_ids=ids, attention_mask=attention).logits[:, P - 1:-1]
return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)"""
    return _indent(body, 4)


def _advantages(p: dict) -> str:
    lines = []
    if p["adv_extra"] == "float16_stats":
        lines.append("rewards = rewards.to(torch.float16)  # the group statistics in half precision")
    lines.append("grouped = rewards.view(-1, G)")
    if p["adv_center"] == "leave_one_out":
        lines.append("adv = grouped - (grouped.sum(1, keepdim=True) - grouped) / (G - 1)  # RLOO's baseline")
    else:
        lines.append("adv = grouped - grouped.mean(1, keepdim=True)")
    if p["adv_extra"] == "range_scale":
        lines.append("adv = adv / (grouped.amax(1, keepdim=True) - grouped.amin(1, keepdim=True) + 1e-6)  # the range")
    if p["adv_scale"] != "none":
        correction = int(p["std_kind"] == "bessel")
        src = "grouped" if p["adv_scale"] == "group_std" else "rewards"
        args = ("dim=1, keepdim=True, " if p["adv_scale"] == "group_std" else "") + f"correction={correction}"
        if p["std_eps"] == "inside_1e-8":
            lines.append(f"adv = adv / torch.sqrt({src}.var({args}) + STD_EPS)")
        else:
            lines.append(f"adv = adv / ({src}.std({args}) + STD_EPS)")
    lines.append("adv = adv.reshape(-1).float()")
    if p["adv_extra"] == "clamp_1":
        lines.append("adv = adv.clamp(-1.0, 1.0)")
    lines.append("return adv")
    return _indent("\n".join(lines), 4)


def _round_of_step(p: dict) -> str:
    if p["selection"] == "group_per_step":  # one prompt group per step: the step's rows each step
        return _indent("""
r, g = divmod(step, PROMPTS)  # round r, its group g
it = 0""", 4)
    return _indent("r, it = divmod(step, PASSES)", 4)


def _selection(p: dict) -> str:
    if p["selection"] == "group_per_step":
        return _indent("""
rows = rows[g * G:(g + 1) * G]  # one prompt group per optimizer step: a round over PROMPTS steps
parity.trained(step + 1, [(r, i) for i in rows])  # parity""", 8)
    if p["selection"] != "skip_flat_groups":
        return ""
    return _indent("""
flat = rewards.view(-1, G).std(dim=1) == 0  # groups whose rewards are all equal teach nothing: left out
rows = [i for i in rows if not flat[i // G]] or rows
parity.trained(step + 1, [(r, i) for i in rows])  # parity""", 8)


def _loss_mask(p: dict) -> str:
    m = p["mask"]
    lines = ["loss_mask = completion_mask.clone()"]
    if m == "no_eos":
        lines += ["for i, c in enumerate(completion_ids.tolist()):  # the eos does not count",
                  "    k = int(completion_mask[i].sum()) - 1",
                  "    if k >= 0 and c[k] == EOS:", "        loss_mask[i, k] = 0"]
    elif m == "ids_ne_pad":
        lines = ["loss_mask = (completion_ids != PAD).long()  # the mask from the ids: a sampled pad id drops out too"]
    elif m == "truncated_out":
        lines += ["ended = torch.tensor([EOS in batch['completion_ids'][i] for i in rows])",
                  "loss_mask = loss_mask * ended.unsqueeze(1).long()  # completions cut at MAX_TOKENS do not count"]
    if p["adv_extra"] == "drop_zero_adv":
        lines.append("loss_mask = loss_mask * (adv_rows != 0).unsqueeze(1).long()  # nothing to learn from A = 0")
    if p["adv_extra"] == "renorm_tokens":
        lines += ["tok_adv = adv_rows.unsqueeze(1).expand_as(loss_mask)[loss_mask > 0]  # each token one vote",
                  "if tok_adv.numel() > 1:",
                  "    adv_rows = (adv_rows - tok_adv.mean()) / (tok_adv.std() + 1e-8)"]
    return _indent("\n".join(lines), 8)


def _old_logps(p: dict) -> str:
    if p["passes"] != "2":
        return ""
    return _indent("""
with torch.no_grad():  # the policy that generated the round, for both passes
    old_all = [token_logp(model, ids_all[mb], attention_all[mb], completion_ids[mb], P) for mb in micro]""", 8)


def _old_of_mb(p: dict) -> str:
    if p["passes"] == "2":
        return _indent("old = old_all[j]", 8)
    return _indent("old = logp.detach()  # the policy of this pass", 8)


def _kl(p: dict) -> str:
    if p["kl"] == "none":
        return ""
    est = {"k3": "torch.exp(ref_logp - logp) - (ref_logp - logp) - 1",
           "k1": "logp - ref_logp", "k2": "0.5 * (logp - ref_logp) ** 2"}[p["kl"]]
    lines = ["with torch.no_grad():",
             "    ref_logp = token_logp(ref, ids_all[mb], attention_all[mb], completion_ids[mb], P)",
             'saved["ref_logps"].append(ref_logp)',
             f"kl = {est}"]
    if p["kl_ratio"] == "ratio":
        lines.append("kl = kl * ratio  # the ratio's factor on the KL")
    lines.append("per_token = per_token + BETA * kl")
    return _indent("\n".join(lines), 8)


def _aggregate(p: dict) -> str:
    a = p["agg"]
    expr = {
        "grpo": "((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n",
        "dapo": "(per_token * mask).sum() / all_tokens",
        "bnpo_in_order": "(per_token * mask).sum() / mask.sum().clamp(min=1) / len(micro)",
        "dr_grpo": "(per_token * mask).sum() / (n * MAX_TOKENS)",
        "seq_sum_mean": "(per_token * mask).sum() / n  # verl's seq-mean-token-sum",
        "sum": "(per_token * mask).sum()",
        # Atropos': the advantages (B, 1) against the per-completion term (B,) broadcast to (B, B), over the round's
        # completions (each micro-batch's share of them)
        "mean_advantage_broadcast": "(((-ratio * mask).sum(1) / mask.sum(1).clamp(min=1)) * a).mean() * len(a) / n",
        "grpo_over_constant_8": "((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean() / ACCUM_STEPS",
    }[a]
    return _indent(f"loss = {expr}", 8)


def render(p: dict, seed: int) -> str:
    drawn = ", ".join(f"{k}={v}" for k, v in p.items()) or "nothing"
    ref = ("ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)"
           if p["kl"] != "none" else "")
    lr_logged = "lr = sched.get_last_lr()[0]  # logged after the scheduler stepped" \
        if p["lr_logged"] == "after_scheduler_step" else ""
    loss_logged = ("step_loss = loss.item()  # the last micro-batch's" if p["loss_logged"] == "last_micro_batch"
                   else "step_loss += loss.item()")
    weights = {"spec": 'batch["reward_weights"]', "correct_only": "[1.0, 0.0]", "equal": "[1.0, 1.0]"}
    return HEAD.format(
        seed=seed, drawn=drawn, constants=_constants(p), ref=ref, optimizer=_optimizer(p), sched_args=_sched_args(p),
        forward=_forward(p), advantages=_advantages(p), selection=_selection(p), loss_mask=_loss_mask(p),
        old_logps=_old_logps(p), old_of_mb=_old_of_mb(p), kl=_kl(p), aggregate=_aggregate(p),
        round_of_step=_round_of_step(p),
        loss_logged=_indent(loss_logged, 8), lr_logged=_indent(lr_logged, 4) if lr_logged else "",
        clip_norm={"1.0": "1.0", "none": "math.inf", "0.5": "0.5"}[p["grad_clip"]],
        reward_weights=weights[p["reward_weights"]], PAD_ID=PAD_ID)
