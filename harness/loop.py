"""Your own GRPO loop as a side of a parity run: the contract's helpers, in the standard library only.

The harness runs your loop's command with these environment variables (docs/your-loop.md):

    PARITY_INIT         folder with the starting weights and tokenizer (`from_pretrained(PARITY_INIT)`)
    PARITY_SPEC         the resolved experiment spec, as JSON (batch sizes, learning rate, loss settings, ...)
    PARITY_ROLLOUTS     lockstep only: rollouts.jsonl, one line per generation round, to train on instead of sampling
    PARITY_SEED         the seed of this run (free runs: one run per seed)
    PARITY_METRICS      where to append one JSON line per optimizer step: at least `step` and `loss`
    PARITY_WEIGHTS_OUT  optional: `save_pretrained` your final weights here, and the report shows the distance
    PARITY_TENSORS      optional: `tensors(step, advantages=..., logps=..., ...)` appends the first steps' tensors
                        here, and the harness names the first one that differs from the built-in loop's (as TRL)
    PARITY_TRAINED      optional: `trained(step, rows)` appends which completions each optimizer step trained on, for a
                        loop that does not train each step on one whole round

A typical loop changes in about ten lines:

    from harness import loop as parity

    spec = parity.spec()                     # {} when run outside the harness
    for step, batch in enumerate(...):
        rollout = parity.rollout(round_idx)  # lockstep: this round's prompts, completions, rewards (else None)
        ...
        parity.log_step(step + 1, loss=loss.item(), grad_norm=gn, reward=mean_reward)
    parity.save_weights(model)

Importing this module pulls in no torch, numpy or transformers: a loop in another framework can use it, and a
loop in another language can meet the same contract by reading and writing the files directly.
"""

from __future__ import annotations

import json
import math
import os
from functools import lru_cache

from harness.runlog.tensors import probe_indices

ENV = ("PARITY_INIT", "PARITY_SPEC", "PARITY_ROLLOUTS", "PARITY_SEED", "PARITY_METRICS", "PARITY_WEIGHTS_OUT",
       "PARITY_TENSORS", "PARITY_TRAINED")


def active() -> bool:
    """True when the harness started this process (PARITY_METRICS is set)."""
    return bool(os.environ.get("PARITY_METRICS"))


def init_dir(default: str | None = None) -> str | None:
    """The checkpoint folder every side starts from (config, weights, tokenizer)."""
    return os.environ.get("PARITY_INIT") or default


def seed(default: int = 0) -> int:
    value = os.environ.get("PARITY_SEED")
    return int(value) if value else default


@lru_cache(maxsize=1)
def spec() -> dict:
    """The resolved spec: the TOML fields (STEPS, PROMPTS_PER_STEP, GROUP_SIZE, GRAD_ACCUM, LR, ...) plus
    `derived` (sequences_per_step, micro_batch_size, rounds); {} outside the harness."""
    path = os.environ.get("PARITY_SPEC")
    if not path:
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


@lru_cache(maxsize=1)
def rollouts() -> list[dict] | None:
    """Every round of the lockstep rollouts (None in free mode: sample yourself). Each round holds `round`,
    `prompts` (chat messages), `prompt_ids`, `rows` (the data set rows: `answer`, ...), `completions` (texts),
    `completion_ids`, `logprobs` (the sampler's per-token log-probs, or null) and `rewards`
    ({function name: [score per completion]}), completions grouped by prompt (GROUP_SIZE in a row)."""
    path = os.environ.get("PARITY_ROLLOUTS")
    if not path:
        return None
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def rollout(round_idx: int) -> dict | None:
    """Round `round_idx` (0-based) of the lockstep rollouts, or None when there are none (free mode)."""
    rounds = rollouts()
    if rounds is None:
        return None
    if not 0 <= round_idx < len(rounds):
        raise IndexError(f"lockstep rollouts hold rounds 0..{len(rounds) - 1}; round {round_idx} was asked for: a loop "
                         "that reads more rounds than the spec's steps take sets [loop] rounds = N in the spec (or "
                         f"--set loop.rounds=N), N at least {round_idx + 1}")
    return rounds[round_idx]


def log_step(step: int, **metrics) -> None:
    """Append one optimizer step's metrics to PARITY_METRICS (a no-op outside the harness). Values must be
    numbers (or None); use the harness's names (`loss`, `grad_norm`, `reward`, `reward_std`, `kl`, `entropy`,
    `learning_rate`, `completions/mean_length`, ...) or map yours in the spec's [loop.metrics]."""
    path = os.environ.get("PARITY_METRICS")
    if not path:
        return
    row = {"step": int(step)}
    for key, value in metrics.items():
        if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)  # JSON has no nan/inf: read back, a non-finite loss is an error, any other value a
            # divergence at that step
        row[key] = value
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def tensors(step: int, **named) -> None:
    """Save this optimizer step's tensors along GRPO's dataflow for the harness's tensor diff (a no-op outside
    the harness and past `[loop] tensor_steps`): any of `rewards` (N,), `advantages` (N,), `mask` (N, T: the
    tokens your loss counts), `logps`, `old_logps`, `ref_logps` (N, T: per-token log-probs of the completion
    tokens), `per_token_loss` (N, T, before aggregation, a KL term included), `loss` and `grad_norm` (numbers). N is
    every completion of the round in the rollout's order, or, for a step you named with `trained(step, rows)`, those
    rows in that order; a list of your micro-batches' tensors is stacked back into rows; T any width (each row is
    read up to its completion's length). Tensors, numpy arrays, lists or numbers; standard library only here
    (`.tolist()` is called on what has it)."""
    from harness.runlog.tensors import write_row

    if int(step) < 1:
        raise ValueError(f"harness.loop.tensors: step {step}: steps count optimizer steps from 1, as log_step's do")
    path = os.environ.get("PARITY_TENSORS")
    if not path or int(step) > int(spec().get("loop", {}).get("tensor_steps", 2)):
        return
    write_row(path, step, named)


class Probe:
    """A small fixed slice of your model's parameters, read around each optimizer step, from which the harness
    identifies your optimizer (learning rate per step, Adam's betas and epsilon, weight decay, gradient clipping) in
    closed form. Three marked lines:

        probe = parity.Probe(model)            # once, after building the model
        ...
        loss.backward()                        # (every micro-batch)
        probe.before(step)                     # the gradient BEFORE clip_grad_norm_, and the weights
        torch.nn.utils.clip_grad_norm_(...)
        optimizer.step()
        probe.after(step)                      # the weights after the step

    and log the pre-clip `grad_norm` each step (log_step). With fp16 loss scaling call `before` after
    `scaler.unscale_(optimizer)`, so that the gradient read is the one the logged norm measures. It reads `per_param`
    evenly spaced elements of up to `max_params` parameters spread over `model.named_parameters()` (a few thousand
    numbers a step), for the first
    `steps` optimizer steps (default: 4, or the spec's `[loop] tensor_steps` where that is more), into PARITY_TENSORS;
    outside the harness it does nothing. Duck-typed: any framework whose parameters index like torch tensors
    (`p.detach().reshape(-1)[idx]`, `.tolist()`)."""

    def __init__(self, model, per_param: int = 32, max_params: int = 16, steps: int | None = None):
        named = [(n, p) for n, p in model.named_parameters() if getattr(p, "requires_grad", True)]
        if len(named) > max(max_params, 1):
            named = [named[round(i * (len(named) - 1) / max(max_params - 1, 1))] for i in range(max(max_params, 1))]
        self.picks = [(name, p, probe_indices(int(p.numel()), per_param)) for name, p in named]
        if steps is None:
            steps = max(4, int(spec().get("loop", {}).get("tensor_steps", 2)))
        self.steps, self._pending = steps, None

    def read(self, grads: bool = False) -> dict:
        """{"names", "before": the picked weights, "grad": their gradients (with grads=True; None where a parameter
        has none: a skipped backward, or one outside the loss)}."""
        out = {"names": [n for n, _, _ in self.picks], "before": [_values(p, idx) for _, p, idx in self.picks]}
        if grads:
            out["grad"] = [_values(p.grad, idx) if getattr(p, "grad", None) is not None else None
                           for _, p, idx in self.picks]  # None: no gradient (a skipped backward: Adam does not step)
        return out

    def _on(self, step: int) -> bool:
        return bool(os.environ.get("PARITY_TENSORS")) and 1 <= int(step) <= self.steps

    def before(self, step: int) -> None:
        """After the backward passes, before clipping and optimizer.step()."""
        self._pending = self.read(grads=True) if self._on(step) else None

    def after(self, step: int) -> None:
        """After optimizer.step(): writes the step's slice."""
        if self._pending is None or not self._on(step):
            return
        from harness.runlog.tensors import write_row

        write_row(os.environ["PARITY_TENSORS"], step, {"probe": {**self._pending, "after": self.read()["before"]}})
        self._pending = None


def _values(p, idx: list[int]) -> list[float]:
    flat = p.detach().reshape(-1)[idx]
    if hasattr(flat, "float"):
        flat = flat.float()
    if hasattr(flat, "cpu"):
        flat = flat.cpu()
    return [float(x) for x in flat.tolist()]


def trained(step: int, rows) -> None:
    """The completions optimizer step `step` trained on, as (round, index) pairs: `round` as in rollout(round), `index`
    the completion's place in that round (prompts repeated GROUP_SIZE times in a row), in the order your micro-batches
    took them. Needed only where a step does not train on exactly one whole round in the rollout's order (part of a
    round, several rounds, groups skipped or queued, a replay buffer, several passes over each round, or a whole round
    in an order of your own, sorted by length, say): the harness's built-in loop then replays the same selection in
    the same order, and the tensors you save for that step (`tensors`) are read in this order, one row per pair.
    A no-op outside the harness."""
    path = os.environ.get("PARITY_TRAINED")
    if not path:
        return
    from harness.runlog.tensors import write_trained

    if int(step) < 1:
        raise ValueError(f"harness.loop.trained: step {step}: steps count optimizer steps from 1, as log_step's do")
    write_trained(path, step, rows)


def weights_out() -> str | None:
    return os.environ.get("PARITY_WEIGHTS_OUT") or None


def save_weights(model) -> None:
    """`model.save_pretrained(PARITY_WEIGHTS_OUT)` when the harness asked for the final weights."""
    path = weights_out()
    if path:
        model.save_pretrained(path)
