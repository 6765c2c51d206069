"""The tensors of a GRPO step along its dataflow, as every side saves them for the tensor diff (`tensors.jsonl`).

One JSON line per optimizer step: `{"step": s, "rewards": [...], "advantages": [...], "mask": [[...]], ...}`, rows
in the order of the round's rollout (GROUP_SIZE completions of a prompt in a row), per-token tensors as rows of
any width (read up to each completion's length). `CHAIN` is the dataflow in order; a side saves any subset.
Standard library only: your loop's helper (`harness.loop.tensors`) writes through it without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

TENSORS_FILE = "tensors.jsonl"
TRAINED_FILE = "trained.jsonl"  # which completions each optimizer step of your loop trained on (harness.loop.trained)
# rewards -> advantages -> the loss's mask -> log-probs (policy, old, reference) -> per-token loss -> loss -> gradient
CHAIN = ("rewards", "advantages", "mask", "logps", "old_logps", "ref_logps", "per_token_loss", "loss", "grad_norm")
PER_TOKEN = ("mask", "logps", "old_logps", "ref_logps", "per_token_loss")
PER_ROW = ("rewards", "advantages")
# beside the chain: a slice of the parameters around the optimizer step (harness.loop.Probe), for the optimizer stage
EXTRA = ("probe",)


def _plain(value, name: str | None = None):
    """A tensor, array, number or nested list as JSON-ready lists of floats (NaN and inf kept). A list of tensors is
    your micro-batches in order: per-token ones (B, T) are stacked row by row (a 1-D item is one completion's row),
    per-completion ones (B,) joined."""
    if isinstance(value, (list, tuple)) and any(hasattr(v, "tolist") for v in value):
        parts = [_plain(v) for v in value]
        if name in PER_TOKEN:  # (an empty micro-batch, (0, T), adds no row)
            return [row for p in parts if p != [] for row in (p if isinstance(p[0], list) else [p])]
        if name in PER_ROW:
            return [x for p in parts for x in (p if isinstance(p, list) else [p])]
        raise ValueError(f"{name}: one number for the step (the loss or gradient norm as you log it), got a list of "
                         f"{len(parts)}: add your micro-batches' values up first")
    if hasattr(value, "detach"):
        value = value.detach()
    if hasattr(value, "float") and hasattr(value, "cpu"):
        value = value.float().cpu()
    if hasattr(value, "tolist"):
        value = value.tolist()
    return value


def _parts(value, name: str) -> list[int] | None:
    """The rows of each micro-batch in a list of tensors (per-token (B, T) or 1-D items, per-completion (B,)), or
    None for anything else."""
    if name not in PER_TOKEN and name not in PER_ROW or not isinstance(value, (list, tuple)) or len(value) < 2 \
            or not all(hasattr(v, "shape") for v in value):
        return None
    dims = 2 if name in PER_TOKEN else 1  # micro-batches: (B, T) per token, (B,) per completion; else rows or numbers
    if any(len(v.shape) != dims for v in value):
        return None
    return [int(v.shape[0]) for v in value]


def write_row(path: str | Path, step: int, named: dict) -> None:
    """Append one step's tensors (names from CHAIN) to `path`."""
    row = {"step": int(step)}
    for name, value in named.items():
        if name not in CHAIN and name not in EXTRA:
            raise ValueError(f"unknown tensor {name!r}; one of {', '.join(CHAIN)}")
        if value is not None:
            row[name] = value if name in EXTRA else _plain(value, name)
            parts = _parts(value, name)
            if parts:  # your micro-batches as you cut them: how many rows each held (the weighting stage reads it)
                row.setdefault("micro_batches", parts)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, allow_nan=True) + "\n")


def read_tensors(path: str | Path) -> dict[int, dict]:
    """{step: {name: value}} from a tensors.jsonl (an unreadable line is skipped: a run cut mid-write)."""
    out: dict[int, dict] = {}
    path = Path(path)
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step"})
    return out


def write_trained(path: str | Path, step: int, rows) -> None:
    """Append step `step`'s completions, as (round, index within the round) pairs, to `path`."""
    pairs = []
    for item in rows:
        if not hasattr(item, "__len__") or len(item) != 2:
            raise ValueError(f"trained: step {step}: rows are (round, index) pairs, [(0, 3), (0, 4), ...]; got "
                             f"{item!r} among them")
        r, i = (int(x) for x in item)
        if r < 0 or i < 0:
            raise ValueError(f"trained: step {step}: ({r}, {i}) is not a (round, index) pair of non-negative integers")
        pairs.append([r, i])
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": int(step), "rows": pairs}) + "\n")


def read_trained(path: str | Path) -> dict[int, list[tuple[int, int]]]:
    """{step: [(round, index), ...]} from a trained.jsonl ({} when there is none; several lines for one step add up, in
    order: a loop may call trained() once per micro-batch). A line that is not {"step": int, "rows": [[int, int], ...]}
    is a ValueError naming it."""
    out: dict[int, list[tuple[int, int]]] = {}
    path = Path(path)
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pairs = [(int(r), int(i)) for r, i in row["rows"]]
            step = row["step"]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path.name}:{n}: not {{\"step\": 1, \"rows\": [[round, index], ...]}}: {line[:120]!r}")
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"{path.name}:{n}: step must be an integer from 1, got {step!r}")
        out.setdefault(step, []).extend(pairs)
    return out


def probe_indices(numel: int, per_param: int = 32) -> list[int]:
    """The flat indices Probe reads of a parameter of `numel` elements: `per_param` evenly spaced (all of a smaller
    one). The harness finds them again from a probed parameter's size and how many values it saved."""
    k = min(per_param, numel)
    return sorted({i * numel // k for i in range(k)})
