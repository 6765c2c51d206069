"""Rewards, shared unchanged by the scratch loop and by TRL.

Two layers, as in the lesson:
- per-completion scorers: `correctness_reward(completion, answer)` and `format_reward(completion)`;
- batch functions in TRL's reward contract: a list of completions in, a list of the same length out,
  other data set columns by name through `**kwargs` (`reward_correct(completions, answer, **kwargs)`).

A scorer that raises, or returns None or NaN, scores 0.0 for that completion and is counted: the
batch function reports the count as `reward_errors/<name>` through the `log_metric` callback that TRL
(and the scratch loop) pass in kwargs. The metric log sums them into `reward_errors`.

To add a reward: write a batch function below and add it to `REWARDS`; specs name it there.
"""

from __future__ import annotations

import hashlib
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

# a number as people write it: sign, thousands commas, decimals ("-1,234.50", "+3", ".5")
_NUMBER = r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(rf"(?<![\w.]){_NUMBER}")
_HASHES_RE = re.compile(rf"####\s*\$?\s*({_NUMBER})")
_BOXED_RE = re.compile(rf"\\boxed\{{\s*\$?\s*({_NUMBER})\s*\}}")
_MAX_DIGITS = 60  # anything longer is junk, not an answer


def _to_decimal(text: str | None) -> Decimal | None:
    if not text:
        return None
    text = text.replace(",", "").strip()
    if not text or text in "+-." or len(text) > _MAX_DIGITS:
        return None
    try:
        value = Decimal(text)
    except (InvalidOperation, ValueError):
        return None
    return value if value.is_finite() else None


def _numbers(pattern: re.Pattern, text: str) -> list[Decimal]:
    """Every match of `pattern` in `text` that reads as a finite number, in order."""
    return [v for v in map(_to_decimal, pattern.findall(text)) if v is not None]


def extract_answer(text: Any) -> Decimal | None:
    """The final numeric answer of a completion, or None.

    Order: the number after the last `####`, else the last `\\boxed{N}`, else the last number in the text.
    Commas, a leading `$`, signs and decimals are understood. Never raises: junk gives None.
    """
    if not isinstance(text, str) or not text:
        return None
    for pattern in (_HASHES_RE, _BOXED_RE, _NUMBER_RE):
        found = _numbers(pattern, text)
        if found:
            return found[-1]
    return None


def first_number(text: Any) -> Decimal | None:
    """The first number a completion states (after `####` or not), or None. Never raises."""
    found = _numbers(_NUMBER_RE, text) if isinstance(text, str) else []
    return found[0] if found else None


def gsm8k_answer(answer_field: str) -> str:
    """GSM8K's answer column ends with `#### N`; the gold answer is the text after it."""
    return answer_field.split("####")[-1].strip()


def correctness_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final number equals the gold answer, else 0.0."""
    got, gold = extract_answer(completion), extract_answer(str(answer))
    return 1.0 if got is not None and gold is not None and got == gold else 0.0


def first_answer_reward(completion: str, answer: str) -> float:
    """1.0 when the first number the completion states equals the gold answer: no second tries. A completion
    that stops before stating a number is wrong, so wrong completions are the shorter ones more often; how
    lengths then move depends on the loss normalisation (the length task, harness/specs/lengths.toml)."""
    got, gold = first_number(completion), extract_answer(str(answer))
    return 1.0 if got is not None and gold is not None and got == gold else 0.0


def format_reward(completion: str) -> float:
    """1.0 when the completion states its answer as `#### N`, else 0.0."""
    return 1.0 if isinstance(completion, str) and _HASHES_RE.search(completion) else 0.0


def completion_text(completion: Any) -> str:
    """TRL passes conversational completions as [{"role": "assistant", "content": ...}]; plain ones as str."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return completion if isinstance(completion, str) else str(completion)


def score_each(name: str, scorer: Callable[..., float], columns: list[list], log_metric=None) -> list[float]:
    """Apply `scorer` to each row of `columns`; failures score 0.0 and are counted in `reward_errors/<name>`."""
    scores, errors = [], 0
    for row in zip(*columns, strict=True):
        try:
            value = scorer(*row)
            value = float(value) if value is not None else math.nan
        except Exception:  # a reward must never stop training: score it 0 and count it
            value = math.nan
        if not math.isfinite(value):
            errors += 1
            value = 0.0
        scores.append(value)
    if log_metric is not None:
        log_metric(f"reward_errors/{name}", float(errors))
    return scores


def reward_correct(completions: list, answer: list, **kwargs) -> list[float]:
    texts = [completion_text(c) for c in completions]
    return score_each("correctness", correctness_reward, [texts, answer], kwargs.get("log_metric"))


def reward_first_answer(completions: list, answer: list, **kwargs) -> list[float]:
    texts = [completion_text(c) for c in completions]
    return score_each("first_answer", first_answer_reward, [texts, answer], kwargs.get("log_metric"))


def reward_format(completions: list, **kwargs) -> list[float]:
    texts = [completion_text(c) for c in completions]
    return score_each("format", format_reward, [texts], kwargs.get("log_metric"))


def noise_reward(completion: str) -> float:
    """A stable pseudo-random score in [0, 1) from the completion's text (SHA-256). No task signal: it exists
    so that a model with random weights (benchmarks, bf16 noise measurements) gets rewards that differ within
    a group, hence non-zero advantages and a real gradient, the same on both sides."""
    digest = hashlib.sha256(completion.encode("utf-8", "replace")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def reward_noise(completions: list, **kwargs) -> list[float]:
    texts = [completion_text(c) for c in completions]
    return score_each("noise", noise_reward, [texts], kwargs.get("log_metric"))


# registry name -> batch function. TRL logs a function under its __name__: rewards/<__name__>/mean.
REWARDS: dict[str, Callable[..., list[float]]] = {
    "correctness": reward_correct,
    "format": reward_format,
    "noise": reward_noise,
    "first_answer": reward_first_answer,
}


def check_rewards(name: str, values: Any, expected: int) -> list[float]:
    """The scratch loop's twin of TRL's length check, with the same wording."""
    values = list(values)
    if len(values) != expected:
        raise ValueError(
            f"The reward function '{name}' returned {len(values)} rewards, but {expected} were expected "
            f"(one per prompt-completion pair). Make sure the reward function returns exactly one reward per completion."
        )
    return [math.nan if v is None else float(v) for v in values]
