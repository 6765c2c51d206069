"""Rewards, shared unchanged by the scratch loop and by TRL.

Two layers, as in the lesson:
- per-completion scorers: `correctness_reward(completion, answer)` and `format_reward(completion)`;
- batch functions in TRL's reward contract: a list of completions in, a list of the same length out,
  other data set columns by name through `**kwargs` (`reward_correct(completions, answer, **kwargs)`).

A scorer that raises, or returns None or NaN, scores 0.0 for that completion and is counted: the
batch function reports the count as `reward_errors/<name>` through the `log_metric` callback that TRL
(and the scratch loop) pass in kwargs. The metric log sums them into `reward_errors`.

To add a reward: write a batch function below and add it to `REWARDS`; specs name it there. Or bring your own:
`[rewards] functions` also takes `"path/to/file.py:name"` (relative to the spec file) and
`"package.module:name"`; `resolve_reward` imports them once per process, so both sides call the same function
objects, and `check_reward_functions` calls each once on two data rows before any model loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import signal
import sys
import threading
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path
from types import SimpleNamespace
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


# ---------------------------------------------------------------------------------------------
# your own reward functions: "path/to/file.py:name" or "package.module:name"
# ---------------------------------------------------------------------------------------------
_FILE_ENTRY = re.compile(r"^(?P<target>.+\.py):(?P<attr>[A-Za-z_]\w*)$")
_MODULE_ENTRY = re.compile(r"^(?P<target>[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*)$")
ENTRY_FORMS = ("a built-in name (" + ", ".join(sorted(REWARDS)) + "), \"path/to/file.py:function\" (relative to the "
               "spec file) or \"package.module:function\"")
_RESOLVED: dict[str, Callable] = {}


class RewardError(ValueError):
    """A reward function that cannot be used; the message names it and the fix."""


def parse_entry(entry: Any) -> tuple[str, str, str | None]:
    """("builtin", name, None), ("file", path, function) or ("module", module, function); ValueError otherwise."""
    if isinstance(entry, str) and entry in REWARDS:
        return "builtin", entry, None
    m = _FILE_ENTRY.match(entry) if isinstance(entry, str) else None
    if m:
        return "file", m["target"], m["attr"]
    m = _MODULE_ENTRY.match(entry) if isinstance(entry, str) else None
    if m:
        return "module", m["target"], m["attr"]
    raise ValueError(f"unknown reward {entry!r}: use {ENTRY_FORMS}")


def resolve_reward(entry: str) -> Callable[..., list[float]]:
    """The batch function an entry names, imported once per process (so both sides share the object)."""
    if entry in _RESOLVED:
        return _RESOLVED[entry]
    kind, target, attr = parse_entry(entry)
    if kind == "builtin":
        return REWARDS[target]
    if kind == "file":
        path = Path(target)
        if not path.is_file():
            raise RewardError(f"reward {entry!r}: no file {path}; give the path relative to the spec file")
        name = "grpo_parity_reward_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        try:
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # the user's file (SystemExit included): say which and why, never a traceback
            sys.modules.pop(name, None)
            raise RewardError(f"reward {entry!r}: importing {path} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise RewardError(f"reward {entry!r}: cannot import module {target!r} ({type(e).__name__}: {e}); "
                              "install it or run from the folder that holds it") from None
    fn = getattr(module, attr, None)
    if fn is None:
        known = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise RewardError(f"reward {entry!r}: {target} has no {attr!r}; callables there: {', '.join(known) or 'none'}")
    if not callable(fn):
        raise RewardError(f"reward {entry!r}: {attr!r} is a {type(fn).__name__}, not a function")
    _RESOLVED[entry] = fn
    return fn


def reward_functions(spec) -> list[Callable[..., list[float]]]:
    return [resolve_reward(e) for e in spec.rewards.functions]


def reward_provenance(spec) -> list[dict]:
    """Per function: the spec entry, its name as TRL logs it, its file and a SHA-256 of its source (manifests)."""
    out = []
    for entry in spec.rewards.functions:
        fn = resolve_reward(entry)
        try:
            source = inspect.getsource(fn)
            path = inspect.getsourcefile(fn)
        except (OSError, TypeError):
            source, path = None, None
        out.append({"entry": entry, "name": getattr(fn, "__name__", entry), "file": path,
                    "source_sha256": hashlib.sha256(source.encode()).hexdigest() if source else None})
    return out


CHECK_SECONDS = 120.0  # the check calls each of your functions on two rows; longer is an error (0: no limit)


class _TooSlow(BaseException):  # (not an Exception: a reward function's own `except Exception` lets it through)
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise _TooSlow in the main thread after `seconds` (SIGALRM; elsewhere, or with 0, no limit)."""
    if seconds <= 0 or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(signum, frame):
        raise _TooSlow()

    old = signal.signal(signal.SIGALRM, alarm)
    t0 = time.monotonic()
    outer, _interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer:  # someone else's alarm (a test timeout, say) was pending: set it again, less the time spent
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 1e-3))


def call_reward(fn, prompts: list, texts: list[str], completion_ids: list, columns: dict, step: int, max_steps: int,
                log_metric=None):
    """One reward function called as TRL 1.16's GRPOTrainer calls it: keyword arguments only, completions in the
    conversational form, the data set's other columns, `trainer_state`, and the metric hooks (no-ops by default).
    The scratch loop, the lockstep recording and the reward check all call rewards through here."""
    return fn(prompts=prompts, completions=[[{"role": "assistant", "content": t}] for t in texts],
              completion_ids=completion_ids, log_metric=log_metric or (lambda *a, **k: None),
              log_extra=lambda *a, **k: None, trainer_state=SimpleNamespace(global_step=step, max_steps=max_steps),
              **columns)


def check_reward_functions(spec, rows: list[dict]) -> None:
    """Import every reward function and call it once, as TRL does, on two data rows (their reference answers
    as completions), within CHECK_SECONDS; raises RewardError naming the function and the fix. Built-in names are
    trusted."""
    sample = rows[:2]
    if not sample:
        return
    completions = [str(r.get("answer", "")) for r in sample]
    columns = {k: [r.get(k) for r in sample] for k in sample[0] if k != "prompt"}
    for entry in spec.rewards.functions:
        fn = resolve_reward(entry)
        if entry in REWARDS:
            continue
        try:
            with _time_limit(CHECK_SECONDS):
                out = call_reward(fn, [r["prompt"] for r in sample], completions,
                                  [list(c.encode("utf-8")) for c in completions], columns, 0, spec.STEPS)
                values = list(out) if hasattr(out, "__iter__") and not isinstance(out, (str, bytes, dict)) else out
        except _TooSlow:
            raise RewardError(f"reward {entry!r} took more than {CHECK_SECONDS:g} s to score two completions: a "
                              "training run calls it on every generation batch; make it faster") from None
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # the user's code (SystemExit included): say which and why, never a traceback
            raise RewardError(f"reward {entry!r} raised {type(e).__name__}: {e} when called as TRL calls it "
                              "(prompts=, completions=, completion_ids=, the data set's columns and trainer_state, "
                              "log_metric, log_extra as keyword arguments): accept **kwargs and return one float "
                              "(or None) per completion") from None
        if not isinstance(values, list):
            raise RewardError(f"reward {entry!r} returned {type(out).__name__}, not a list: return one float (or None) "
                              f"per completion") from None
        if len(values) != len(sample):
            raise RewardError(f"reward {entry!r} returned {len(values)} values for {len(sample)} completions: return "
                              "exactly one float (or None) per completion")
        bad = [v for v in values if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real))]
        if bad:
            raise RewardError(f"reward {entry!r} returned {type(bad[0]).__name__} {repr(bad[0])[:80]}: each value must "
                              "be a float or None (None counts as TRL counts it: NaN, then 0 in the weighted sum)")
        try:
            [float(v) for v in values if v is not None]
        except OverflowError:
            raise RewardError(f"reward {entry!r} returned an integer too large for a float: return one float (or None) "
                              "per completion") from None
