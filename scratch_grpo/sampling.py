"""Drawing completions with Hugging Face `generate`, batching them, and scoring them with a model.

Used by the scratch loop when it samples for itself, and by the harness's samplers (the emulated
vLLM stand-in, the lockstep sampler). Plain transformers + torch.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from scratch_grpo.core import token_logprobs


def autocast_for(device: str, dtype: str):
    """bf16 runs keep fp32 master weights and compute under autocast, as TRL's bf16=True does."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    return nullcontext()


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
    return ids, mask


def pad_right(seqs: list[list], pad_value, dtype=torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(s) for s in seqs))
    out = torch.full((len(seqs), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, : len(s)] = torch.tensor(s, dtype=dtype)
            mask[i, : len(s)] = 1
    return out, mask


def cut_at_eos(rows: torch.Tensor, eos_ids: list[int]) -> list[list[int]]:
    """Each generated row up to and including its first eos (all of it when there is none)."""
    out = []
    eos = torch.tensor(eos_ids)
    for row in rows.cpu():
        hits = torch.isin(row, eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else len(row)
        out.append(row[:end].tolist())
    return out


@torch.no_grad()
def generate_completions(model, prompt_ids: list[list[int]], *, eos_ids: list[int], pad_id: int, max_tokens: int,
                         temperature: float, top_p: float, top_k: int, device: str, dtype: str = "float32",
                         batch_size: int | None = None) -> list[list[int]]:
    """Sample one completion per entry of `prompt_ids` (prompts already repeated per group)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=True, temperature=temperature, top_p=top_p,
                              top_k=top_k, pad_token_id=pad_id, eos_token_id=eos_ids, bos_token_id=None,
                              disable_compile=True)
    out: list[list[int]] = []
    step = batch_size or len(prompt_ids)
    for start in range(0, len(prompt_ids), step):
        ids, mask = pad_left(prompt_ids[start:start + step], pad_id)
        with autocast_for(device, dtype):
            gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        out.extend(cut_at_eos(gen[:, ids.size(1):], eos_ids))
    return out


def completion_forward(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                       completion_mask: torch.Tensor, temperature: float, with_entropy: bool = False):
    """Per-token log-probs (B, T) of the completion tokens, and optionally the logits for entropy.

    Only input_ids and attention_mask go in (positions are the model's default), as TRL scores them.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    T = completion_ids.size(1)
    logits = model(input_ids=input_ids, attention_mask=attention, logits_to_keep=T + 1).logits[:, :-1]
    logp = token_logprobs(logits, completion_ids, temperature)
    return (logp, logits) if with_entropy else (logp, None)


@torch.no_grad()
def score_completions(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], *, pad_id: int,
                      temperature: float, device: str, dtype: str = "float32",
                      batch_size: int | None = None) -> list[list[float]]:
    """Per-token log-probs of given completions under `model` (what a sampler reports as its log-probs)."""
    out: list[list[float]] = []
    step = batch_size or len(prompt_ids)
    for start in range(0, len(prompt_ids), step):
        p, pm = pad_left(prompt_ids[start:start + step], pad_id)
        c, cm = pad_right(completion_ids[start:start + step], pad_id)
        with autocast_for(device, dtype):
            logp, _ = completion_forward(model, p.to(device), pm.to(device), c.to(device), cm.to(device), temperature)
        for row, n in zip(logp.float().cpu(), cm.sum(-1).tolist()):
            out.append(row[:n].tolist())
    return out


def encode_prompts(tokenizer, prompts: list[list[dict]], max_prompt_tokens: int = 0) -> list[list[int]]:
    """Render conversational prompts with the chat template (generation prompt on), as TRL does; keep the last
    `max_prompt_tokens` tokens when it is set (TRL 1.16 has no max_prompt_length, so the harness truncates)."""
    out = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = list(ids["input_ids"])
        out.append(ids[-max_prompt_tokens:] if max_prompt_tokens else ids)
    return out
