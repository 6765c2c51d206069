"""Lockstep rollouts: one seeded sampler draws every round's completions, and both loops get the same.

The scratch loop runs first with a `RecordingSource`: at each round it samples from the scratch
side's current weights (seeded per round, without touching the loop's own RNG) and records the
rollout. The TRL side then gets a `ReplaySource` over the same records, through TRL's own
`rollout_func`. Each side still computes its own rewards, advantages, logp_old, loss, gradient
and update, so any difference there is a difference between the two implementations.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scratch_grpo.sampling import generate_completions

ROLLOUTS_FILE = "rollouts.jsonl"


class RecordingSource:
    def __init__(self, spec, eos_ids: list[int], pad_id: int, device: str, path: str | Path | None = None):
        self.spec, self.eos_ids, self.pad_id, self.device = spec, eos_ids, pad_id, device
        self.records: list[dict] = []
        self.path = Path(path) if path else None
        if self.path:
            self.path.write_text("")

    def __call__(self, round_idx: int, prompt_ids: list[list[int]], policy):
        spec = self.spec
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.device.startswith("cuda") else []):
            torch.manual_seed(spec.SEED * 7_368_787 + round_idx)
            completions = generate_completions(
                policy, prompt_ids, eos_ids=self.eos_ids, pad_id=self.pad_id, max_tokens=spec.MAX_TOKENS,
                temperature=spec.TEMPERATURE, top_p=spec.TOP_P, top_k=spec.TOP_K, device=self.device,
                dtype=spec.DTYPE)
        record = {"round": round_idx, "prompt_ids": prompt_ids, "completion_ids": completions}
        self.records.append(record)
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        return completions, None


class ReplaySource:
    """Hands out recorded rollouts round by round; refuses prompts that differ from the recording."""

    def __init__(self, records: list[dict]):
        self.records = records

    @classmethod
    def from_file(cls, path: str | Path) -> "ReplaySource":
        return cls([json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()])

    def __call__(self, round_idx: int, prompt_ids: list[list[int]], policy):
        if round_idx >= len(self.records):
            raise RuntimeError(f"lockstep: round {round_idx} was not recorded ({len(self.records)} rounds exist)")
        rec = self.records[round_idx]
        if [list(p) for p in prompt_ids] != rec["prompt_ids"]:
            raise RuntimeError(f"lockstep: round {round_idx} asks for other prompts than the recording: the two "
                               "sides' prompt schedules differ (batch semantics?)")
        return rec["completion_ids"], None
