"""The example GRPO trainer of Nous Research's Atropos (NousResearch/atropos @ c3fc68879ce695be8a1a9e58960ebcf015bbc069,
example_trainer/grpo.py, MIT License, Copyright (c) 2025 Nous Research), run on the harness's rollouts.
https://github.com/NousResearch/atropos/blob/c3fc68879ce695be8a1a9e58960ebcf015bbc069/example_trainer/grpo.py

Adapted as a user would, with the fewest changes: its batch preparation (`pad_data_to_good_offset`, the advantages
in it) and its training step are kept as written; what cannot run here is replaced, each line marked `# parity`:
the Atropos API server and the vLLM process it restarts (the harness's recorded rollouts stand for the API's batch:
one batch per step, one item per prompt group, `tokens` = prompt + completion, `masks` = -100 on the prompt and the
completion's ids after it, `scores` = the rollout's weighted reward), wandb (parity.log_step) and the checkpoint
saves (parity.save_weights). The model is PARITY_INIT, loaded in bf16 as the trainer loads its own.

Written down from the source before any run (what the explanation should find; the test asserts it):
- rewards: the rollout's weighted sum, as TRL's (no difference);
- advantages: per group, (score - mean) / max(population std, 1e-8), numpy float64. TRL: Bessel's std + 1e-4.
  TRL has no setting; built-in loop: STD = "population", STD_EPS = 0 (a group of equal scores gets 0 either way);
- the advantage's broadcast: the loss is ((-ratio * mask).sum(-1) / mask.sum(-1) * advantages).mean() with the
  advantages shaped (B, 1) and the per-sequence term (B,): a (B, B) product, so each completion is weighted by the
  MEAN advantage of its micro-batch of 2 (cut in the rollout's order), not by its own. TRL has no setting; the
  built-in loop had no switch for it when this was written (since then: ADV_MICRO_BATCH_MEAN);
- mask and forward pass: the prompt out of the loss, every completion token through the eos in it (as TRL); no
  attention mask, the padding (id 0) only after the sequence, so causal log-probs as TRL's; logits / the item's
  temperature, 1.0 where the batch names none (TRL divides by TEMPERATURE: alike at TEMPERATURE = 1, so 12 steps
  at the default spec cannot show it; built-in LOGP_ON_RAW_LOGITS);
- objective: exp(logp - logp.detach()) * A: TRL's ratio form at ratio 1, no clipping, no KL (one pass per round;
  TRL's clip bounds cannot act in 12 steps: the ratio is 1);
- weighting: the sequence mean (TRL's loss_type = "grpo", the spec's already) over micro-batches of 2 sequences,
  each micro-batch's loss divided by gradient_accumulation_steps = 32, not by the 8 micro-batches a round of 16
  holds: the gradient is 8/32 of the mean's. TRL has no setting (its divisor is its own micro-batch count); none
  existed in the built-in loop for a per-sequence mean over a constant count (LOSS_DIVISOR divides a token sum;
  since then: ACCUM_DIVISOR);
- optimizer: torch's AdamW with its defaults, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on every parameter,
  lr 1e-5 constant (the config's default; the spec's LR is not read), clip_grad_norm_ at 1.0: TRL learning_rate =
  1e-5, adam_beta2 = 0.999, weight_decay = 0.01 and the built-in WEIGHT_DECAY_ALL = true (TRL has none);
- numerics: the model loaded in bf16 and AdamW stepping bf16 weights: TRL bf16 = true with model_init_kwargs
  dtype = bfloat16 (spec DTYPE = MASTER_WEIGHTS = "bfloat16"). At lr 1e-5 most bf16 updates round to nothing
  (a weight of 0.02 moves in steps of 1.2e-4), and 0.01's decay (1e-7 a step) never shows: 12 steps cannot show it;
- logged: `loss` = the sum of the micro-batches' losses (the step's), `grad_norm` before clipping, `learning_rate`,
  and its own `pos_logp`, `neg_logp` (its `logp` is a tensor of one row per micro-batch slot, not a number: left
  out of the log).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim import AdamW
from transformers import AutoModelForCausalLM

from harness import loop as parity  # parity: the contract's helpers


@dataclass
class TrainingConfig:
    """The trainer's pydantic config, its defaults as written (model_name, seq_len and the vLLM/wandb fields dropped:
    nothing here reads them)."""

    lr: float = 1e-5
    training_steps: int = 10
    batch_size: int = 2
    gradient_accumulation_steps: int = 32
    device: str = "cuda" if torch.cuda.is_available() else "cpu"


def get_batch(step: int) -> dict:  # parity: the API's /batch is the harness's round `step`
    ro = parity.rollout(step)  # parity
    size, weights = parity.spec()["GROUP_SIZE"], ro["reward_weights"]  # parity
    scores = [sum(w * ro["rewards"][k][i] for k, w in zip(ro["rewards"], weights))  # parity: the env's score
              for i in range(len(ro["completion_ids"]))]  # parity
    batch = []  # parity
    for start in range(0, len(scores), size):  # parity: one item per prompt group, as an env sends it
        rows = range(start, start + size)  # parity
        batch.append({"tokens": [ro["prompt_ids"][i] + ro["completion_ids"][i] for i in rows],  # parity
                      "masks": [[-100] * len(ro["prompt_ids"][i]) + ro["completion_ids"][i] for i in rows],  # parity
                      "scores": [scores[i] for i in rows], "overrides": None})  # parity
    return {"batch": batch}  # parity


def pad_data_to_good_offset(data, batch_size: int):
    max_token_len = max([max([len(x) for x in item["tokens"]]) for item in data["batch"]])
    good_multiple = 64
    if (max_token_len - 1) % (good_multiple) != 0:
        max_token_len = math.ceil((max_token_len - 1) / (good_multiple)) * good_multiple
        token_setup_len = max_token_len + 1
    else:
        token_setup_len = max_token_len
        max_token_len = max_token_len - 1
    input_ids, labels, advantages, temperatures = [], [], [], []
    for item in data["batch"]:
        scores = np.array(item["scores"])
        if len(scores) > 1:
            scores = scores - scores.mean()
            scores = scores / max(scores.std(), 1e-8)
        item["scores"] = scores
        if item["overrides"] is not None:
            for i in range(len(item["overrides"])):
                if item["overrides"][i].get("set_advantage_to_zero", False):
                    item["scores"][i] = 0
        for i in range(len(item["tokens"])):
            pad = max(0, token_setup_len - len(item["tokens"][i]))
            label_item = np.concatenate([np.array(item["masks"][i]), np.full(pad, -100, dtype=np.int32)])
            item["tokens"][i] = np.concatenate([np.array(item["tokens"][i]), np.zeros(pad, dtype=np.int32)])
            input_ids.append(item["tokens"][i][:-1])
            labels.append(label_item[1:])
            advantages.append(item["scores"][i])
            temperatures.append(1.0)  # no overrides or generation_params in the batch: the trainer's 1.0
    stack = lambda xs, i: np.stack(xs[i * batch_size:(i + 1) * batch_size], axis=0)  # noqa: E731
    n = len(input_ids) // batch_size
    return ([torch.tensor(stack(input_ids, i)) for i in range(n)], [torch.tensor(stack(labels, i)) for i in range(n)],
            [torch.tensor(stack(advantages, i)).view(-1, 1) for i in range(n)],
            [torch.tensor(np.array(temperatures[i * batch_size:(i + 1) * batch_size], dtype=np.float32)).view(-1, 1, 1)
             for i in range(n)])


def completion_rows(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # parity: the tensors' rows
    """Each row's values at its loss tokens (labels != -100), from its first completion token, zero-padded."""  # parity
    rows = [values[r][labels[r] != -100].float() for r in range(labels.shape[0])]  # parity
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # parity


def train(config: TrainingConfig) -> None:
    model = AutoModelForCausalLM.from_pretrained(parity.init_dir(), torch_dtype=torch.bfloat16)  # parity: PARITY_INIT
    model.to(config.device)
    model.gradient_checkpointing_enable()
    model.train()
    optimizer = AdamW(model.parameters(), lr=config.lr)
    probe = parity.Probe(model)  # parity: a slice of the weights around each optimizer step
    for step in range(config.training_steps):
        total_loss = 0
        total_pos_logp, total_neg_logp, total_logp, total_pos, total_neg = 0, 0, 0, 0, 0
        token_batches, label_batches, advantage_batches, temperature_batches = pad_data_to_good_offset(
            get_batch(step), config.batch_size)  # parity: one API batch per step, the harness's round
        saved = {"advantages": [], "mask": [], "logps": [], "per_token_loss": []}  # parity
        for tokens, labels, advantages, temperatures in zip(token_batches, label_batches, advantage_batches,
                                                            temperature_batches):
            tokens, labels, advantages = tokens.to(config.device), labels.to(config.device), advantages.to(config.device)
            outputs = model(tokens)
            logits = outputs.logits
            t = temperatures.to(logits.device, logits.dtype)
            t = torch.where(t <= 0, torch.ones_like(t), t)
            logits = logits / t
            logp_per_token = -F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1).long(),
                                              reduction="none", ignore_index=-100).view(labels.shape)
            mask = (labels != -100).float()
            with torch.no_grad():
                pos = (advantages > 0).float()
                neg = (advantages <= 0).float()
                mask = mask.to(logp_per_token.dtype)
                mask_sum = mask.sum(dim=-1).clamp_min(1e-8)
                avg_logp = (logp_per_token * mask).sum(dim=-1) / mask_sum
                pos_logp = (logp_per_token * pos).mean().item()
                neg_logp = (logp_per_token * neg).mean().item()
                total_pos_logp += pos_logp
                total_neg_logp += neg_logp
                total_logp += avg_logp
                total_pos += pos.sum().item()
                total_neg += neg.sum().item()
            grpo_loss_term = torch.exp(logp_per_token - logp_per_token.detach())
            grpo_loss = (((-grpo_loss_term * mask).sum(-1) / mask.sum(-1))
                         * advantages.to(logp_per_token.device)).mean() / config.gradient_accumulation_steps
            grpo_loss.backward()
            total_loss += grpo_loss.item()
            with torch.no_grad():  # parity: this micro-batch's rows, as the user reads them
                saved["advantages"].append(advantages.view(-1).float())  # parity
                saved["mask"].append(completion_rows(mask, labels))  # parity
                saved["logps"].append(completion_rows(logp_per_token, labels))  # parity
                saved["per_token_loss"].append(completion_rows(-grpo_loss_term * advantages, labels))  # parity
        probe.before(step + 1)  # parity: the gradient before clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        probe.after(step + 1)  # parity: the weights after the step
        if total_pos > 0:
            total_pos_logp /= total_pos
        if total_neg > 0:
            total_neg_logp /= total_neg
        save_tensors(step + 1, saved, total_loss, grad_norm.item())  # parity
        parity.log_step(step + 1, loss=total_loss, learning_rate=optimizer.param_groups[0]["lr"],  # parity: wandb's
                        grad_norm=grad_norm.item(), pos_logp=total_pos_logp, neg_logp=total_neg_logp)  # parity
    parity.save_weights(model)  # parity: the final model


def save_tensors(step: int, saved: dict, loss: float, grad_norm: float) -> None:  # parity
    """The micro-batches' tensors, in order (the harness stacks them back into rows and keeps their sizes)."""  # parity
    parity.tensors(step, **saved, loss=loss, grad_norm=grad_norm)  # parity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, default=TrainingConfig.lr, help="the config's lr (default 1e-5)")
    args = ap.parse_args()
    torch.manual_seed(parity.seed(0))  # parity: the run's seed (the trainer seeds nothing)
    spec = parity.spec()  # parity
    if not spec:
        raise SystemExit("atropos_grpo.py trains only on the harness's rollouts; sampling needs Atropos' API server")
    train(TrainingConfig(lr=args.lr, training_steps=spec["STEPS"]))  # parity: the harness's steps


if __name__ == "__main__":
    main()
