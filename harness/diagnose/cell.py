"""One cell of a parity run, read once: what the pair left in its folder, as one frozen object.

A cell's folder holds each side's run, the lockstep rollouts, the noise twin's envelope and, for your loop, its
saved tensors, selection and rewards. `run_pair` has most of it in hand when it returns; `CellData` keeps it, so that
every later step (the attribution, your loop's stages read by `identify`, the explanation, the float32 re-check, the
verdict, the report) takes this object and no module reads a file of the cell folder back. The folder itself is
still where later steps write (a search's runs, the written TRL table).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class CellData:
    """A pair's cell, loaded once. Sequences are tuples and nothing is changed after loading; make a changed copy
    with `dataclasses.replace` (the cell as TRL configures it: `replace(cell, spec=base)`)."""
    spec: object  # the spec the pair ran (harness.experiment.spec.Spec)
    folder: Path = Path(".")  # the cell folder: written to by later steps, never read back
    sides: tuple = ("scratch", "trl")  # the pair compared: ("yours", "trl") for your loop against TRL
    mode: str = "lockstep"  # lockstep | free
    comparison: dict = dataclasses.field(default_factory=dict)  # compare's result: the `compare` command's JSON
    runs: dict = dataclasses.field(default_factory=dict)  # side -> its metric log (a pandas DataFrame, step index)
    records: tuple = ()  # the lockstep rounds both sides trained on: {"round", "prompt_ids", "completion_ids",
    #                      "logprobs"} each (rollouts.jsonl)
    envelope: object = None  # the noise twin's envelope (noise.Envelope) for the calibrated tolerance, or None
    eos_ids: tuple = ()  # the checkpoint's eos token ids
    pad_id: int | None = None  # the tokenizer's pad token id
    scores: tuple = ()  # your loop's rounds: each {reward function: [score per completion]} (loop_rollouts.jsonl)
    tensors: dict = dataclasses.field(default_factory=dict)  # your loop's saved tensors {step: {name: value}}
    trained: dict | None = None  # your loop's selection {step: [(round, index), ...]} (harness.loop.trained)
    trained_path: str = ""  # where that selection is (the built-in loop's SELECTION replays it)

    @property
    def yours(self):
        """Your loop's metric log (None for a pair of the built-in sides)."""
        return self.runs.get("yours")

    def grad_norms(self) -> dict[int, float]:
        """Your loop's logged pre-clip gradient norm per step ({} when it logs none)."""
        yours = self.yours
        if yours is None or "grad_norm" not in yours.columns:
            return {}
        return {int(s): float(v) for s, v in yours["grad_norm"].dropna().items()}
