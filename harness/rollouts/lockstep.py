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

from harness.rollouts.fastgen import sample_policy, static_decoder_for

ROLLOUTS_FILE = "rollouts.jsonl"


def shuffle_seed(seed: int, round_idx: int) -> int:
    """Seed of the micro-batch shuffle of generation round `round_idx`: the scratch loop shuffles with it, and
    the TRL runner seeds TRL's own shuffle with it in lockstep, so both cut a round into the same micro-batches."""
    return (seed * 1_000_003 + 7919 * (round_idx + 1)) % (2**63)


class RecordingSource:
    """Samples each round from the policy it is handed (seeded per round), records it, returns it.

    With `sampler.kind = "emulated"` the draw comes from the emulated sampler synced to that policy,
    and the sampler's log-probs travel with the completions (what an IS correction needs)."""

    def __init__(self, spec, eos_ids: list[int], pad_id: int, device: str, path: str | Path | None = None):
        self.spec, self.eos_ids, self.pad_id, self.device = spec, eos_ids, pad_id, device
        self.records: list[dict] = []
        self.sampler = None
        self.decoder = None  # a static-cache decoder when spec.GENERATION asks for one (built on first use)
        self.path = Path(path) if path else None
        if self.path:
            self.path.write_text("")

    def sample(self, round_idx: int, prompt_ids: list[list[int]], policy):
        spec = self.spec
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.device.startswith("cuda") else []):
            torch.manual_seed(spec.SEED * 7_368_787 + round_idx)
            if spec.sampler.kind != "policy":  # vLLM or the emulated sampler: its log-probs travel with the rollout
                from harness.rollouts.samplers import make_sampler

                if self.sampler is None:
                    self.sampler = make_sampler(spec, policy, self.eos_ids, self.pad_id, self.device)
                self.sampler.sync_weights(policy)
                return self.sampler.generate(prompt_ids)
            if self.decoder is None:
                self.decoder = static_decoder_for(spec, policy, self.eos_ids, self.pad_id, self.device) or False
            completions = sample_policy(self.decoder or None, spec, policy, prompt_ids, eos_ids=self.eos_ids,
                                        pad_id=self.pad_id, device=self.device)
            return completions, None

    def release(self) -> None:
        """Drop the sampling models (the recording is kept): the other side needs the memory."""
        self.sampler = self.decoder = None

    def __call__(self, round_idx: int, prompt_ids: list[list[int]], policy, part=(0, 1)):
        completions, logps = self.sample(round_idx, prompt_ids, policy)
        record = {"round": round_idx, "prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logps}
        self.records.append(record)
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        return completions, logps


class ReplaySource:
    """Hands out recorded rollouts round by round.

    When the other side asks for prompts the recording does not have (its batch semantics differ),
    lockstep cannot hold: with a `fallback` (a RecordingSource) it samples those from the asking
    side's own policy and notes the round in `broken_rounds`; without one it refuses."""

    def __init__(self, records: list[dict], fallback: RecordingSource | None = None):
        self.records = records
        self.fallback = fallback
        self.broken_rounds: list[int] = []

    @classmethod
    def from_file(cls, path: str | Path) -> "ReplaySource":
        return cls([json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()])

    def __call__(self, round_idx: int, prompt_ids: list[list[int]], policy, part=(0, 1)):
        """`part` = (rank, processes): a process of a multi-process side asks for its slice of the round."""
        rec = self.records[round_idx] if round_idx < len(self.records) else None
        if rec is not None and part[1] > 1:
            n = len(prompt_ids)
            sl = slice(part[0] * n, (part[0] + 1) * n)
            rec = {"prompt_ids": rec["prompt_ids"][sl], "completion_ids": rec["completion_ids"][sl],
                   "logprobs": rec["logprobs"][sl] if rec.get("logprobs") else None}
        if rec is None or [list(p) for p in prompt_ids] != rec["prompt_ids"]:
            if self.fallback is None:
                raise RuntimeError(f"lockstep: round {round_idx} asks for prompts the recording does not have: the "
                                   "two sides' prompt schedules differ (batch semantics?)")
            self.broken_rounds.append(round_idx)
            return self.fallback.sample(round_idx, prompt_ids, policy)
        return rec["completion_ids"], rec.get("logprobs")
