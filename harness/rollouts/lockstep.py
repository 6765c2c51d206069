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
from harness.runlog.atomic import atomic_open

ROLLOUTS_FILE = "rollouts.jsonl"
LOOP_ROLLOUTS_FILE = "loop_rollouts.jsonl"  # the same rounds as your loop reads them (write_loop_rollouts)


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
        """Drop the sampling models (the recording is kept): the other side needs the memory. (A vLLM engine stays:
        the process's runs share one, harness/rollouts/samplers.py.)"""
        self.sampler = self.decoder = None

    def __call__(self, round_idx: int, prompt_ids: list[list[int]], policy, part=(0, 1)):
        completions, logps = self.sample(round_idx, prompt_ids, policy)
        record = {"round": round_idx, "prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logps}
        self.records.append(record)
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        return completions, logps


def _ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(row, list) and all(type(t) is int and t >= 0 for t in row)
                                           for row in value)


def _record_problem(rec) -> str | None:
    """What keeps `rec` from being one round's rollout record, or None."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object {{\"round\", \"prompt_ids\", \"completion_ids\", \"logprobs\"}}"
    for key in ("prompt_ids", "completion_ids"):
        if not _ids(rec.get(key)):
            return f"{key} is not a list of token-id lists (non-negative integers)"
    if len(rec["prompt_ids"]) != len(rec["completion_ids"]):
        return f"{len(rec['prompt_ids'])} prompts but {len(rec['completion_ids'])} completions"
    logps = rec.get("logprobs")
    if logps is not None:
        if not (isinstance(logps, list) and len(logps) == len(rec["completion_ids"]) and all(
                isinstance(row, list) and len(row) == len(ids) and
                all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)
                for row, ids in zip(logps, rec["completion_ids"]))):
            return "logprobs is neither null nor one list of numbers per completion token"
    return None


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
        """A recorded rollouts.jsonl. A truncated last line (a recorder killed mid-write) is dropped, as the metric
        log's reader does; any other line that is not one round's record is a ValueError naming the line."""
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        records = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if n == len(lines):
                    break
                raise ValueError(f"line {n} is not JSON ({e.msg})") from None
            problem = _record_problem(rec)
            if problem:
                raise ValueError(f"line {n}: {problem}")
            records.append(rec)
        return cls(records)

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


def write_loop_rollouts(spec, records: list[dict], path: str | Path) -> Path:
    """The rollouts as your own loop reads them (PARITY_ROLLOUTS): per round, beside the token ids and the sampler's
    log-probs, the prompts as chat messages, the data set rows, the completion texts and each reward function's
    score of each completion (scored by the same functions both built-in sides call)."""
    from harness.experiment.data import encode_prompts, load_rows, prompt_schedule, to_prompt_rows
    from harness.experiment.models import checkpoint_dir, load_tokenizer
    from harness.experiment.rewards import call_reward, check_rewards, reward_functions

    tokenizer = load_tokenizer(checkpoint_dir(spec))
    rows = to_prompt_rows(load_rows(spec.data), spec.data.system_prompt)
    schedule = prompt_schedule(len(rows), len(records), spec.PROMPTS_PER_STEP * spec.STEPS_PER_GENERATION, spec.SEED)
    fns = reward_functions(spec)
    path = Path(path)
    with atomic_open(path, "w") as fh:
        for rec in records:
            r = rec["round"]
            group = [rows[i] for i in schedule[r] for _ in range(spec.GROUP_SIZE)]
            expected = encode_prompts(tokenizer, [row["prompt"] for row in group], spec.MAX_PROMPT_TOKENS)
            if expected != [list(p) for p in rec["prompt_ids"]]:
                raise RuntimeError(f"lockstep round {r}: the recorded prompts are not the shared schedule's")
            texts = tokenizer.batch_decode(rec["completion_ids"], skip_special_tokens=True)
            columns = {k: [row[k] for row in group] for k in group[0] if k != "prompt"}
            rewards = {}
            for entry, fn in zip(spec.rewards.functions, fns):
                out = call_reward(fn, [row["prompt"] for row in group], texts, rec["completion_ids"], columns, r,
                                  spec.STEPS)
                name = fn.__name__ if fn.__name__ not in rewards else entry  # two files' `score`: keep both
                rewards[name] = [None if v != v else v for v in check_rewards(fn.__name__, out, len(texts))]
            fh.write(json.dumps({
                "round": r, "prompts": [row["prompt"] for row in group], "prompt_ids": rec["prompt_ids"],
                "rows": [{k: v for k, v in row.items() if k != "prompt"} for row in group],
                "completions": texts, "completion_ids": rec["completion_ids"], "logprobs": rec.get("logprobs"),
                "rewards": rewards, "reward_weights": list(spec.rewards.weights)}) + "\n")
    return path
