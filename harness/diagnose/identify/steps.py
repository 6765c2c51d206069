"""The steps of your loop a stage can read: each step's saved tensors and the completions they are rows of (the
round's, or the ones your loop's selection names), shared by the stages that read step by step."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's saved tensors and the completions they are rows of."""
    step: int
    tensors: dict  # {name: value} as saved; per-token advantages (verl's (B, T)) taken one per completion
    rows: list  # (round, index) of each row, in your loop's order
    completions: list  # each row's completion ids
    sampled: list | None  # a separate sampler's log-probs of each row's tokens (vLLM's), or None
    whole: bool  # the rows are whole groups, each in the rollout's order

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completions]


def steps(cell) -> list[Step]:
    """Every step with saved tensors whose rows the recording holds, in order (`cell`: a CellData). Without a
    selection (cell.trained) step s reads round (s - 1) // NUM_ITERATIONS; with one, the rows it names, in its
    order."""
    spec, records, chosen = cell.spec, cell.records, cell.trained
    per_round, group = spec.NUM_ITERATIONS, spec.GROUP_SIZE
    out = []
    for step in sorted(cell.tensors):
        t = dict(cell.tensors[step])
        adv_rows = t.get("advantages")
        if isinstance(adv_rows, list) and adv_rows and isinstance(adv_rows[0], list):  # per token (verl's (B, T))
            t["advantages"] = [row[0] if row else 0.0 for row in adv_rows]  # (constant along a completion's tokens)
        if chosen and step in chosen:  # the rows your loop named, in its order
            picks = chosen[step]
            if any(r >= len(records) for r, _ in picks):
                continue
            comps = [records[r]["completion_ids"][i] for r, i in picks]
            sampled = [records[r]["logprobs"][i] for r, i in picks] if all(
                records[r].get("logprobs") for r, _ in picks) else None
            whole = len(picks) % group == 0 and all(picks[k][1] % group == 0 and all(
                picks[k + j] == (picks[k][0], picks[k][1] + j) for j in range(group)) for k in range(0, len(picks), group))
            rows = picks
        else:
            r = (step - 1) // per_round
            if r >= len(records):
                continue
            comps, whole = records[r]["completion_ids"], True
            sampled = records[r].get("logprobs")  # a separate sampler's log-probs of its tokens (vLLM's), or None
            rows = [(r, i) for i in range(len(comps))]
        out.append(Step(step, t, rows, comps, sampled, whole))
    return out


def tolerance(spec) -> dict:
    """The losses' tolerances (rtol, atol) where they are computed under autocast (a dtype other than float32):
    looser; {} (each stage's own) in float32."""
    bf16 = getattr(spec, "DTYPE", "float32") != "float32"
    return {"rtol": 1e-2, "atol": 1e-4} if bf16 else {}


def _rows_of(value, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(isinstance(r, list) for r in value)


def _number(value) -> float:
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    return float(value) if isinstance(value, (int, float)) else float("nan")
