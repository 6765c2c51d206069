"""The offline embedded default: a tiny seeded Qwen3, a word-level tokenizer and GSM8K-shaped arithmetic.

Nothing here touches a network. The same spec fields give the same tokenizer, the same weights
(built once from `model.init_seed`, then cached as a safetensors checkpoint that both loops load)
and the same questions.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

PAD, EOS, IM_START, UNK = "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"
WORDS = ["system", "user", "assistant", "What", "is", "?", "+", "-", "*", "=", "####"]
MAX_VOCAB_NUMBERS = 4000

# Qwen-style chat template, reduced to what the synthetic data needs; TRL renders prompts through it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_PARITY_CACHE", Path.home() / ".cache" / "grpo_parity"))


def number_range(max_operand: int, operations: list[str]) -> tuple[int, int]:
    lo, hi = 0, 0
    for op in operations:
        if op == "+":
            hi = max(hi, 2 * max_operand)
        elif op == "-":
            lo, hi = min(lo, -max_operand), max(hi, max_operand)
        elif op == "*":
            hi = max(hi, max_operand * max_operand)
    return lo, hi


def vocabulary(max_operand: int, operations: list[str]) -> list[str]:
    lo, hi = number_range(max_operand, operations)
    if hi - lo + 1 > MAX_VOCAB_NUMBERS:
        raise ValueError(f"data.max_operand = {max_operand} with {operations} needs {hi - lo + 1} number tokens; the "
                         f"embedded tokenizer holds at most {MAX_VOCAB_NUMBERS}: lower data.max_operand")
    return [PAD, IM_START, EOS, UNK, *WORDS, *[str(n) for n in range(lo, hi + 1)]]


def padded_vocabulary(max_operand: int, operations: list[str], size: int = 0) -> list[str]:
    """The vocabulary, padded with unused `<|unused_i|>` tokens up to `size` (0: no padding)."""
    words = vocabulary(max_operand, operations)
    if size and size < len(words):
        raise ValueError(f"model.vocab_size = {size} is smaller than the embedded tokenizer's {len(words)} tokens: "
                         f"raise it or set it to 0")
    return words + [f"<|unused_{i}|>" for i in range(max(0, size - len(words)))]


def build_tokenizer(max_operand: int, operations: list[str], vocab_size: int = 0):
    """A word-level PreTrainedTokenizerFast with pad/eos tokens and a chat template (TRL's prompt path works)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(padded_vocabulary(max_operand, operations, vocab_size))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        additional_special_tokens=[IM_START], padding_side="left", truncation_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def synthetic_rows(size: int, seed: int, max_operand: int, operations: list[str]) -> list[dict]:
    """`size` arithmetic questions in GSM8K's shape: `question`, and `answer` ending in `#### N`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(operations)
        c = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"question": f"What is {a} {op} {b} ?", "answer": f"{a} {op} {b} = {c} #### {c}"})
    return rows


SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "init_seed", "init_std")
EXTRA_SHAPE_FIELDS = {"head_dim": 0, "vocab_size": 0, "max_positions": 512}  # in the key only when changed


def _model_key(model_spec, vocab: list[str]) -> str:
    fields = {k: getattr(model_spec, k) for k in SHAPE_FIELDS}
    fields.update({k: getattr(model_spec, k) for k, v in EXTRA_SHAPE_FIELDS.items() if getattr(model_spec, k) != v})
    blob = json.dumps({"model": fields, "vocab": vocab, "format": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_config(model_spec, tokenizer):
    """The embedded model's Qwen3Config (also what the size limits read, before any weights exist)."""
    from transformers import Qwen3Config

    m = model_spec
    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=m.hidden, intermediate_size=m.intermediate,
        num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim or m.hidden // m.heads, max_position_embeddings=m.max_positions, tie_word_embeddings=True,
        initializer_range=m.init_std, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def build_model(model_spec, tokenizer):
    """A Qwen3ForCausalLM with seeded random weights (float32, CPU): same spec, same weights."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    m = model_spec
    config = model_config(m, tokenizer)
    cpu_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(m.init_seed)
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(cpu_state)  # building the model must not move anyone's RNG
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return model


def ensure_embedded_checkpoint(model_spec, data_spec) -> Path:
    """Build (once) and return the checkpoint directory of the embedded model with its tokenizer."""
    vocab = padded_vocabulary(data_spec.max_operand, list(data_spec.operations), model_spec.vocab_size)
    path = cache_root() / f"embedded-{_model_key(model_spec, vocab)}"
    if (path / "model.safetensors").exists():
        return path
    tokenizer = build_tokenizer(data_spec.max_operand, list(data_spec.operations), model_spec.vocab_size)
    model = build_model(model_spec, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not path.exists():  # another process may have won the race: then keep its copy
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
