"""Size limits, checked before anything is allocated: the longest prompt plus MAX_TOKENS against the model's
positions, and a floor of one side's peak memory against the machine.

A 250k-token prompt or a micro-batch whose logits cannot fit is refused by `validate` (and by every command
before its first model loads) with a SpecError naming the figure and the setting to change (exit 2), instead of
an allocation that fails minutes later, or a machine that swaps. The estimate is a floor: only what must be
allocated is counted, so a spec it refuses could not have run, and one it passes may still run out (activations
beyond one hidden state per layer, the KV cache and allocator slack come on top).
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.experiment.spec import SpecError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def peak_memory_floor(n_params: int, dtype_bytes: int, micro_batch: int, prompt_tokens: int, completion_tokens: int,
                      vocab: int, hidden: int, layers: int, frozen_copies: int = 0) -> dict[str, int]:
    """Bytes one side holds at its peak, at least, by part.

    The policy's weights, gradients and AdamW's two moments (4 x parameters x dtype bytes); frozen copies of the
    weights (the reference model when BETA > 0, the emulated sampler's copy); one micro-batch's logits, kept for
    the completion tokens and read in fp32 (batch x (completion + 1) x vocab x 4 bytes, as both loops ask for
    logits_to_keep = T + 1); and one hidden state per layer over the whole sequence, which the backward pass needs
    even with gradient checkpointing (batch x (prompt + completion) x hidden x layers x dtype bytes)."""
    weights = n_params * dtype_bytes
    return {
        "weights, gradients and AdamW states": 4 * weights,
        "frozen model copies": frozen_copies * weights,
        "logits": micro_batch * (completion_tokens + 1) * vocab * 4,
        "activations": micro_batch * (prompt_tokens + completion_tokens) * hidden * layers * dtype_bytes,
    }


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def machine_memory(device: str, vllm_share: float = 0.0, gpu_gib: float = 0.0) -> tuple[int, str] | None:
    """(bytes, what they are) of the memory a run on `device` can use: the GPU's total on CUDA (less vLLM's
    colocated share), physical memory on CPU; None when it cannot be known here (a CUDA spec on a machine without
    a GPU is not judged by this machine's RAM)."""
    if device in ("cuda", "auto"):
        import torch

        if torch.cuda.is_available():
            _free, total = torch.cuda.mem_get_info()
            card = f"GPU memory on {torch.cuda.get_device_name()}"
            if gpu_gib:  # GPU_MEMORY_GB: as on a card that size
                total, card = int(gpu_gib * 2**30), f"GPU memory GPU_MEMORY_GB allows on {torch.cuda.get_device_name()}"
            usable = int(total * (1 - vllm_share))
            share = f", less vLLM's {vllm_share:.0%}" if vllm_share else ""
            return usable, f"the {format_bytes(total)} of {card}{share}"
        if device == "cuda":
            return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return total, f"the {format_bytes(total)} of physical memory here"


def parameter_count(config) -> int:
    """Parameters of the model `config` describes, counted on the meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def tokenizer_and_config(spec):
    """The tokenizer and model config both loops will use, without weights; None when they are not on disk yet
    (SmolLM2 before its one-time conversion)."""
    if spec.model.source == "embedded":
        from harness.experiment.embedded import build_tokenizer, model_config

        tok = build_tokenizer(spec.data.max_operand, list(spec.data.operations), spec.model.vocab_size)
        return tok, model_config(spec.model, tok)
    from transformers import AutoConfig

    from harness.experiment.models import existing_checkpoint_dir, load_tokenizer

    path = existing_checkpoint_dir(spec)
    if path is None:
        return None
    return load_tokenizer(Path(path)), AutoConfig.from_pretrained(path)


def longest_prompt(tokenizer, prompt_rows: list[dict], max_prompt_tokens: int = 0) -> tuple[int, int]:
    """(tokens, row) of the longest prompt as the loops encode it (chat template, MAX_PROMPT_TOKENS applied)."""
    from harness.experiment.data import encode_prompts

    best = (0, 0)
    for i, row in enumerate(prompt_rows):
        n = len(encode_prompts(tokenizer, [row["prompt"]], max_prompt_tokens)[0])
        best = max(best, (n, -i))
    return best[0], -best[1]


def check_positions(prompt_tokens: int, row: int, max_tokens: int, max_prompt_tokens: int,
                    max_positions: int | None) -> None:
    """Prompt plus completion must fit the model's positions; the fix names the setting that makes it fit."""
    if not max_positions or prompt_tokens + max_tokens <= max_positions:
        return
    if max_tokens >= max_positions:
        raise SpecError("MAX_TOKENS", f"{max_tokens} completion tokens do not fit the model's {max_positions} "
                        f"positions (max_position_embeddings), prompt aside; set MAX_TOKENS below {max_positions}")
    cut = " (after MAX_PROMPT_TOKENS)" if max_prompt_tokens else ""
    raise SpecError("MAX_PROMPT_TOKENS", f"the longest prompt (data row {row}) has {prompt_tokens} tokens{cut}; with "
                    f"MAX_TOKENS = {max_tokens} that is {prompt_tokens + max_tokens} positions, and the model has "
                    f"{max_positions} (max_position_embeddings); set MAX_PROMPT_TOKENS = "
                    f"{max_positions - max_tokens} (keeps each prompt's last tokens), or shorten that row")


def micro_batch(spec) -> int:
    """The most sequences either side puts through one forward and backward pass."""
    trl_batch = spec.trl.get("per_device_train_batch_size")
    return max(spec.micro_batch_size, spec.PROMPTS_PER_STEP if spec.BATCH_MAPPING == "naive" else 0,
               trl_batch if isinstance(trl_batch, int) and not isinstance(trl_batch, bool) else 0)


def check_memory(parts: dict[str, int], machine: tuple[int, str] | None, batch: int, device: str) -> None:
    total = sum(parts.values())
    if machine is None or total <= machine[0]:
        return
    shown = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)
    per_batch = parts["logits"] + parts["activations"]
    if per_batch >= total / 2 and batch > 1:
        key, fix = "GRAD_ACCUM", (f"raise GRAD_ACCUM (a micro-batch holds {batch} sequences now), or lower MAX_TOKENS "
                                  "or MAX_PROMPT_TOKENS")
    elif per_batch >= total / 2:
        key, fix = "MAX_TOKENS", "lower MAX_TOKENS or MAX_PROMPT_TOKENS (a micro-batch is one sequence already)"
    else:
        key, fix = "model", ("a smaller model, DTYPE = \"bfloat16\" on a GPU, BETA = 0 (no reference copy), or a "
                             "machine with more memory")
    raise SpecError(key, f"one side needs at least {format_bytes(total)} on {device} ({shown}), more than "
                    f"{machine[1]}; {fix}")


def check_limits(spec, prompt_rows: list[dict]) -> None:
    """Every size limit of `spec` on its data, before any model loads; SpecError (exit 2) when one is over."""
    found = tokenizer_and_config(spec)
    if found is None:
        return
    tokenizer, config = found
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    prompt_tokens, row = longest_prompt(tokenizer, prompt_rows, spec.MAX_PROMPT_TOKENS)
    check_positions(prompt_tokens, row, spec.MAX_TOKENS, spec.MAX_PROMPT_TOKENS,
                    getattr(text, "max_position_embeddings", None))
    frozen = (spec.BETA > 0) + (spec.sampler.kind == "emulated")
    batch = micro_batch(spec)
    parts = peak_memory_floor(parameter_count(config), DTYPE_BYTES[spec.DTYPE], batch, prompt_tokens,
                              spec.MAX_TOKENS, getattr(text, "vocab_size", 0) or len(tokenizer),
                              getattr(text, "hidden_size", 0) or 0, getattr(text, "num_hidden_layers", 0) or 0, frozen)
    share = spec.sampler.vllm_gpu_memory_utilization if spec.sampler.kind == "vllm" else 0.0
    check_memory(parts, machine_memory(spec.DEVICE, share, spec.GPU_MEMORY_GB), batch, spec.DEVICE)
