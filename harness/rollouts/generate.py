"""Drawing completions with Hugging Face `generate`, padding them, and scoring them as a sampler does.

Owns: left/right padding, cutting at eos, `generate_completions` (transformers' `generate` under the
spec's dtype) and `score_completions` (the sampled tokens' log-probs, as an inference engine reports
them). Used by the scratch loop when it samples for itself, by the lockstep recorder and by the
emulated sampler. Part of the rollouts stage: it imports no side. The trainers' own log-probs (with
gradients) are each side's business (`scratch_grpo/core.py`, TRL).
"""

from __future__ import annotations

import torch

from harness.experiment.models import autocast_for


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


LEAN_ROWS = 1024  # positions scored at once: a sampler never needs the whole fp32 (B, T, V) tensor


def sampled_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                     completion_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token log-probs (B, T) of the completion tokens on logits / temperature, in fp32, without gradients.

    Only input_ids and attention_mask go in (positions are the model's default), as TRL scores them. The
    same expression as the scratch loop's `token_logprobs`, taken chunk by chunk (no autograd here)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    T = completion_ids.size(1)
    logits = model(input_ids=input_ids, attention_mask=attention, logits_to_keep=T + 1).logits[:, :-1]
    out = torch.empty(completion_ids.shape, dtype=torch.float32, device=logits.device)
    for b in range(logits.size(0)):
        for s in range(0, T, LEAN_ROWS):
            x = torch.log_softmax(logits[b, s:s + LEAN_ROWS].float() / temperature, dim=-1)
            out[b, s:s + LEAN_ROWS] = x.gather(-1, completion_ids[b, s:s + LEAN_ROWS, None]).squeeze(-1)
    return out


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
            logp = sampled_logprobs(model, p.to(device), pm.to(device), c.to(device), cm.to(device), temperature)
        for row, n in zip(logp.float().cpu(), cm.sum(-1).tolist()):
            out.append(row[:n].tolist())
    return out

