"""Prompts: loading (synthetic, GSM8K, a local file), validation, and the shared prompt schedule.

Both loops see the same rows in the same order: `prompt_schedule` fixes, for every generation
round, which row indices are used. The scratch loop reads it directly; the TRL runner hands TRL
a data set already in that order (with `shuffle_dataset=False`) and checks per step, from what
TRL actually consumed, that the order held.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from harness.experiment.rewards import gsm8k_answer


class DataError(ValueError):
    """Rows that cannot be used; the message names the row and the fix."""


def load_rows(data_spec) -> list[dict]:
    """Raw rows with `question` and `answer` (GSM8K's shape), from the source the spec names."""
    if data_spec.source == "synthetic":
        from harness.experiment.embedded import synthetic_rows

        rows = synthetic_rows(data_spec.size, data_spec.seed, data_spec.max_operand, list(data_spec.operations))
    elif data_spec.source == "gsm8k":
        from datasets import load_dataset  # the real loader; it needs the hub or a populated HF cache

        try:
            rows = load_dataset("openai/gsm8k", "main", split=data_spec.split).to_list()
        except (OSError, ValueError) as e:  # offline without a cache (ConnectionError), an unknown split
            raise DataError(f"data.source = \"gsm8k\": cannot load openai/gsm8k split {data_spec.split!r} here "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); fill the HF cache on a "
                            "machine with a network, or use source = \"file\" with a .jsonl copy") from None
    else:
        rows = read_file_rows(Path(data_spec.path))
    if data_spec.source != "synthetic" and data_spec.size:
        rows = rows[: data_spec.size]
    return rows


def read_file_rows(path: Path) -> list[dict]:
    if not path.exists():
        raise DataError(f"data.path: {path} does not exist")
    if path.suffix == ".jsonl":
        rows = []
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"data.path: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                            f"{e.start}); JSONL is UTF-8: save it as UTF-8") from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not a JSON object ({e.msg})") from None
        return rows
    if path.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    raise DataError(f"data.path: {path} must end in .jsonl or .parquet")


def to_prompt_rows(rows: list[dict], system_prompt: str = "") -> list[dict]:
    """Validate raw rows and turn them into conversational prompts with the gold answer.

    A row without `question` or `answer`, or whose answer has no `#### N`, is an error naming the row:
    silently skipping rows would change which prompts each step sees, on one side or both.
    """
    if not rows:
        raise DataError("the data set is empty: no rows to train on")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"row {i}: expected an object with `question` and `answer`, got {type(row).__name__}")
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise DataError(f"row {i}: missing or empty `{key}` (every row needs `question` and `answer`)")
        if "####" not in row["answer"]:
            raise DataError(f"row {i}: `answer` has no `#### N` final answer (GSM8K's format): {row['answer'][-60:]!r}")
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": row["question"]})
        out.append({"prompt": messages, "answer": gsm8k_answer(row["answer"]), "prompt_idx": i})
    return out


def prompt_schedule(n_rows: int, rounds: int, prompts_per_round: int, seed: int) -> list[list[int]]:
    """Row indices for each generation round: epochs of seeded permutations, laid end to end and cut."""
    import torch

    need = rounds * prompts_per_round
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    for _ in range(math.ceil(need / n_rows)):
        order.extend(torch.randperm(n_rows, generator=g).tolist())
    return [order[r * prompts_per_round:(r + 1) * prompts_per_round] for r in range(rounds)]


def hash_prompt_ids(indices: list[int]) -> str:
    """`prompt_ids_hash`: of the prompt indices a step used, in order."""
    return hashlib.sha256(",".join(str(int(i)) for i in indices).encode()).hexdigest()[:16]


def encode_prompts(tokenizer, prompts: list[list[dict]], max_prompt_tokens: int = 0) -> list[list[int]]:
    """Render conversational prompts with the chat template (generation prompt on), as TRL does; keep the last
    `max_prompt_tokens` tokens when it is set (TRL 1.16 has no max_prompt_length, so the harness truncates)."""
    out = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = list(ids["input_ids"])
        out.append(ids[-max_prompt_tokens:] if max_prompt_tokens else ids)
    return out
