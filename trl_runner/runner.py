"""TRL's GRPOTrainer, run from the harness spec, writing the same metric log as the scratch loop.

What the harness adds to TRL, and nothing more:
- the data set arrives in the shared prompt schedule's order (`shuffle_dataset=False`), with a
  `prompt_idx` column; the trainer records which indices each generation really consumed, and how
  many sequences and tokens, so `prompts_in_step` and `prompt_ids_hash` come from what TRL used;
- a `TrainerCallback` writes one metric-log line per optimizer step (`logging_steps=1`), keeping
  TRL's metric names;
- optional: prompts truncated to MAX_PROMPT_TOKENS (TRL 1.16 has no max_prompt_length);
- optional: completions from outside through TRL's own `rollout_func` (lockstep parity);
- optional: the emulated sampler put where TRL calls vLLM (`trainer.vllm_generation`), so TRL's own
  importance-sampling code runs; such runs are labelled `emulated sampler`; in free runs on vLLM with
  `sampler.vllm_engine = "shared"`, this process's one vLLM engine (harness/rollouts/samplers.py) is put there the
  same way, instead of a second engine;
- optional (`tensor_steps`): the first steps' tensors along the dataflow, read from inside TRL, saved as the
  scratch loop saves its own (`tensors.jsonl`, rows in the rollout's order) for the tensor diff. See `TensorCapture`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from trl import GRPOTrainer


@contextlib.contextmanager
def locals_at_return(func, names: tuple[str, ...], into: dict):
    """While inside, every call of `func` (its code object) puts the named locals it holds when it returns into
    `into`: the very tensors TRL computed, not a recomputation (sys.settrace on that one frame; other frames are
    not traced line by line). The trace function in force before is restored on the way out."""
    code = inspect.unwrap(func).__code__

    def local(frame, event, arg):
        if event == "return":
            into.update({n: frame.f_locals.get(n) for n in names})
        return local

    def calls(frame, event, arg):
        return local if frame.f_code is code else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield into
    finally:
        sys.settrace(previous)


def _rows_of(t, n_procs: int) -> list:
    """A (local) tensor as host rows, every process's in rank order (the rollout's order: process k holds the k-th
    slice of the round)."""
    if t is None:
        return None
    rows = t.detach().float().cpu().tolist()
    if n_procs > 1:
        from accelerate.utils import gather_object

        rows = [r for part in gather_object([rows]) for r in part]
    return rows


class TensorCapture:
    """The first `steps` optimizer steps' tensors, read from inside GRPOTrainer (TRL 1.16), in the rollout's order.

    Where each comes from (all TRL's own values):
    - rewards: `_calculate_rewards`' return (every process's rewards per function), weighted and summed as
      `_generate_and_score_completions` does (`nansum`, NaN where every function returned None);
    - advantages, mask (`completion_mask`, times `tool_mask` if any), old_logps (`old_per_token_logps`, only where TRL
      computes them), ref_logps (`ref_per_token_logps`, beta > 0): the dict `_generate_and_score_completions` returns,
      before TRL shuffles it (rank order = the rollout's order);
    - logps (the policy call's `per_token_logps`) and per_token_loss: the locals of `_compute_loss` when it returns
      (`locals_at_return`), per micro-batch; a row index (`harness_row`) added to the generation batch rides TRL's
      shuffle (`shuffle_sequence_dict`) and split, is taken out in `_prepare_inputs` before TRL's loss sees the
      batch, and puts each micro-batch's rows back in the rollout's order (rows a step did not train on: NaN, as
      the scratch loop saves them);
    - loss, grad_norm: what TRL logs for the step (the sum of the micro-batches' losses; the norm before clipping).
    """

    def __init__(self, steps: int):
        self.steps = steps
        self.round: dict | None = None  # the generation round's tensors (rollout order)
        self.micro: list[tuple] = []  # this step's micro-batches: (rows, logps, per_token_loss)
        self.rows = None  # the row index of the micro-batch being trained (set in _prepare_inputs)

    def active(self, trainer) -> bool:
        return self.steps > 0 and trainer.model.training and trainer.state.global_step < self.steps

    def step_row(self, n_procs: int) -> dict | None:
        """This step's tensors (all processes'), in the rollout's order; None when none were taken."""
        micro = self.micro
        self.micro = []
        if n_procs > 1:
            from accelerate.utils import gather_object

            micro = [m for part in gather_object([micro]) for m in part]
        if self.round is None or not micro:
            return None
        n = len(self.round["rewards"])
        width = max((len(r) for r in self.round["mask"]), default=0)
        logps = [[math.nan] * width for _ in range(n)]
        per_token = [[math.nan] * width for _ in range(n)]
        for rows, lp, ptl in micro:
            for i, row in enumerate(rows):
                logps[row] = lp[i]
                if ptl is not None:
                    per_token[row] = ptl[i]
        out = {**self.round, "logps": logps}
        if any(ptl is not None for _r, _l, ptl in micro):
            out["per_token_loss"] = per_token
        return out


class HarnessGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that records what each generation consumed. Loss, advantages, IS: all TRL's own code."""

    def __init__(self, *args, max_prompt_tokens: int = 0, lockstep_seed: int | None = None, tensor_steps: int = 0,
                 **kwargs):
        self.harness_tensors = TensorCapture(tensor_steps)
        self.harness_max_prompt_tokens = max_prompt_tokens
        self.harness_lockstep_seed = lockstep_seed
        self.harness_generations: list[dict] = []  # one record per generation round
        self.harness_gen_s = 0.0  # seconds in the last generation (TRL's own, or the lockstep rollout_func)
        self.harness_s = 0.0  # seconds of harness bookkeeping since the last log line
        self.harness_consumed: list[dict] = []  # several steps per generation: what each micro-step trained on
        super().__init__(*args, **kwargs)
        # a generation feeds several optimizer steps: log what each step consumed, not the whole generation
        self.harness_per_step = self.args.steps_per_generation > self.args.gradient_accumulation_steps

    def _tokenize_prompts(self, prompts):
        prompt_ids, images, fields = super()._tokenize_prompts(prompts)
        if self.harness_max_prompt_tokens:
            prompt_ids = [list(ids)[-self.harness_max_prompt_tokens:] for ids in prompt_ids]
        return prompt_ids, images, fields

    def _generate(self, prompts):
        t0 = time.perf_counter()
        out = super()._generate(prompts)
        prompt_ids, completion_ids = out[0], out[1]  # host lists: the GPU work is done
        self.harness_gen_s = time.perf_counter() - t0
        self._harness_seq_tokens = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
        self._harness_tokens = sum(self._harness_seq_tokens)
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.harness_tensors.active(self):  # every process's, gathered by TRL; weighted as TRL weighs them
            w = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
            rewards = (rewards_per_func * w).nansum(dim=1)
            rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
            self._harness_rewards = rewards.detach().cpu().tolist()
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        out = super()._generate_and_score_completions(inputs)
        t0 = time.perf_counter()
        capture = self.harness_tensors
        if capture.active(self):  # before TRL shuffles the batch: rank order is the rollout's order
            n_procs, rank, n = self.accelerator.num_processes, self.accelerator.process_index, len(inputs)
            mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
            capture.round = {"rewards": self._harness_rewards, "advantages": _rows_of(out["advantages"], n_procs),
                             "mask": _rows_of(mask, n_procs),
                             "old_logps": _rows_of(out.get("old_per_token_logps"), n_procs),
                             "ref_logps": _rows_of(out.get("ref_per_token_logps"), n_procs)}
            capture.round = {k: v for k, v in capture.round.items() if v is not None}
            # a row index that rides TRL's shuffle and split (taken out in _prepare_inputs before TRL's loss)
            out["harness_row"] = torch.arange(rank * n, (rank + 1) * n, device=out["advantages"].device)
        if mode == "train":
            from accelerate.utils import gather_object

            # what every process consumed, in rank order (each holds whole groups: the spec checks it)
            local = {"prompt_idx": [int(x["prompt_idx"]) for x in inputs[:: self.num_generations]],
                     "sequences": len(inputs), "tokens": self._harness_tokens}
            parts = gather_object([local]) if self.accelerator.num_processes > 1 else [local]
            self.harness_generations.append({
                "prompt_idx": [i for part in parts for i in part["prompt_idx"]],
                "sequences": sum(part["sequences"] for part in parts),
                "tokens": sum(part["tokens"] for part in parts),  # prompt + completion tokens as generated
            })
            if self.harness_per_step:  # per sequence: its prompt and tokens, shuffled and sliced along with it
                out["harness_prompt_idx"] = torch.tensor([int(x["prompt_idx"]) for x in inputs])
                out["harness_tokens"] = torch.tensor(self._harness_seq_tokens)
            if self.harness_lockstep_seed is not None:
                # lockstep: pin the micro-batch shuffle TRL is about to draw (torch.randperm on the global RNG)
                # to the seed the scratch loop uses for this round
                from harness.rollouts.lockstep import shuffle_seed

                torch.manual_seed(shuffle_seed(self.harness_lockstep_seed, len(self.harness_generations) - 1))
        self.harness_s += time.perf_counter() - t0
        return out


    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training:
            return inputs
        self.harness_tensors.rows = inputs["harness_row"].tolist() if "harness_row" in inputs else None
        if self.harness_per_step:
            self.harness_consumed.append({"prompt_idx": inputs["harness_prompt_idx"].tolist(),
                                          "tokens": int(inputs["harness_tokens"].sum())})
        return {k: v for k, v in inputs.items() if not k.startswith("harness_")}  # TRL's loss never sees them

    def _compute_loss(self, model, inputs):
        capture = self.harness_tensors
        if capture.rows is None or not capture.active(self):
            return super()._compute_loss(model, inputs)
        with locals_at_return(GRPOTrainer._compute_loss, ("per_token_logps", "per_token_loss", "mask"), {}) as seen:
            loss = super()._compute_loss(model, inputs)
        logps, per_token = seen.get("per_token_logps"), seen.get("per_token_loss")
        if logps is None:
            warnings.warn("TRL's _compute_loss holds no per_token_logps: this TRL's tensors cannot be captured")
            return loss
        if per_token is not None:  # (B, 1) at sequence-level importance sampling: one value per token, as saved
            per_token = per_token.expand_as(seen["mask"]) if per_token.shape != seen["mask"].shape else per_token
            per_token = per_token.detach().float().cpu().tolist()
        capture.micro.append((capture.rows, logps.detach().float().cpu().tolist(), per_token))
        capture.rows = None
        return loss


class MetricLogCallback(TrainerCallback):
    """Writes the shared metric log from TRL's per-step logs and the trainer's consumption records."""

    def __init__(self, writer, n_rows: int, device: str, progress: bool = False):
        from harness.runlog.log import Progress

        self.writer, self.n_rows, self.device = writer, n_rows, device
        self.bar = Progress(writer.manifest["spec"]["STEPS"], "trl", progress)
        self.trainer = None
        self.sketch = None
        self.prompts_seen = 0
        self.seen_generations = 0
        self.t0 = time.perf_counter()

    def _log_completions(self, step: int) -> None:
        from harness.runlog.log import COMPLETIONS_PER_STEP

        logs = self.trainer._logs  # TRL keeps the latest generation batch here for its completion tables
        n = len(logs["completion"])
        first = list(range(max(0, n - self.trainer.harness_generations[-1]["sequences"]), n))[:COMPLETIONS_PER_STEP]
        prompts, completions = list(logs["prompt"]), list(logs["completion"])
        advantages = list(logs["advantages"])
        rewards = {name: list(vals) for name, vals in logs["rewards"].items()}
        self.writer.log_completions(step, [
            {"prompt": prompts[i], "completion": completions[i][0]["content"] if isinstance(completions[i], list)
             else completions[i], "advantage": advantages[i], "rewards": {k: v[i] for k, v in rewards.items()}}
            for i in first])

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.sketch is not None:
            t0 = time.perf_counter()
            self.sketch.record(model if model is not None else self.trainer.model)
            self.trainer.harness_s += time.perf_counter() - t0

    def on_step_begin(self, args, state, control, **kwargs):
        if self.device.startswith("cuda") and state.global_step == 0:
            torch.cuda.reset_peak_memory_stats()

    def on_log(self, args, state, control, logs=None, **kwargs):
        from harness.experiment.data import hash_prompt_ids
        from harness.runlog.log import peak_memory_bytes
        from harness.runlog.stops import check_stop

        if not logs or "loss" not in logs:  # the end-of-training summary carries no step metrics
            return
        t_harness = time.perf_counter()
        gens = self.trainer.harness_generations
        last = gens[-1]
        row = {"step": state.global_step}
        for key, value in logs.items():
            if key == "epoch":
                row["trl/epoch"] = value
            elif isinstance(value, (int, float)) or value is None:
                row[key] = value
        while self.seen_generations < len(gens):
            self.prompts_seen += len(gens[self.seen_generations]["prompt_idx"])
            self.seen_generations += 1
        errors = [v for k, v in row.items() if k.startswith("reward_errors/") and v is not None]
        if errors or "reward" in row:  # a generation step: 0 when no reward function failed, as the scratch loop logs
            row["reward_errors"] = float(sum(errors))
        used, sequences, tokens = last["prompt_idx"], last["sequences"], last["tokens"]
        if self.trainer.harness_per_step:  # this step's slice of the generation, from every process
            from accelerate.utils import gather_object

            local = self.trainer.harness_consumed
            parts = gather_object([local]) if self.trainer.accelerator.num_processes > 1 else [local]
            consumed = [micro for part in parts for micro in part]
            seen = [i for micro in consumed for i in micro["prompt_idx"]]
            used = [i for i in last["prompt_idx"] for _ in range(seen.count(i))]  # once per completion, in order
            sequences = sum(len(micro["prompt_idx"]) for micro in consumed)
            tokens = sum(micro["tokens"] for micro in consumed)
            self.trainer.harness_consumed = []
        row.update({
            "prompts_in_step": len(set(used)), "sequences_in_step": sequences,
            "prompt_ids_hash": hash_prompt_ids(used), "tokens_in_step": tokens,
            "epoch": self.prompts_seen / self.n_rows,
            "gen_s": self.trainer.harness_gen_s,
            "harness_s": self.trainer.harness_s + time.perf_counter() - t_harness,
            "wall_s": time.perf_counter() - self.t0, "peak_mem_bytes": peak_memory_bytes(self.device),
        })
        self.trainer.harness_gen_s = self.trainer.harness_s = 0.0
        self.writer.log_step(row)
        if state.global_step <= self.trainer.harness_tensors.steps:  # every process: the rows are gathered
            from harness.runlog.tensors import TENSORS_FILE, write_row

            named = self.trainer.harness_tensors.step_row(self.trainer.accelerator.num_processes)
            if named is not None and self.writer.dir is not None:
                write_row(self.writer.dir / TENSORS_FILE, state.global_step,
                          {**named, "loss": row.get("loss"), "grad_norm": row.get("grad_norm")})
        if self.seen_generations and "reward" in row:  # a generation step: keep a few of its completions
            self._log_completions(state.global_step)
        self.bar.update(row)
        self.t0 = time.perf_counter()
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        loss, gn = row.get("loss"), row.get("grad_norm")
        if loss is None or not math.isfinite(loss) or (gn is not None and not math.isfinite(gn)):
            raise FloatingPointError(f"non-finite loss at step {state.global_step}")
        check_stop(state.global_step)  # SIGINT/SIGTERM: stop here, with this step logged


class TRLSamplerAdapter:
    """A harness sampler (the emulated one, or this process's vLLM engine) behind the interface GRPOTrainer calls for
    vLLM generation."""

    def __init__(self, sampler, trainer):
        self.sampler, self.trainer = sampler, trainer

    def sync_weights(self):
        self.sampler.sync_weights(self.trainer.model)

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        # colocate semantics: one completion per entry; prompts arrive already repeated per group
        if getattr(self.sampler, "asleep", False):  # as TRL's generate: weights dropped by sleep are pushed again
            self.sync_weights()
        completions, logps = self.sampler.generate([list(p) for p in prompts])
        return prompts, completions, [[[lp] for lp in seq] for seq in logps], None


class _SilentWriter:
    """What processes other than the first write: nothing (the first one logs the gathered step)."""

    def __init__(self, spec):
        self.manifest = {"spec": spec.to_dict()}
        self.dir = None

    def log_step(self, row):
        pass

    def log_completions(self, step, samples):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NoSync:
    """Lockstep with a separate sampler (emulated or vLLM): the rollouts come from outside, no weights to push."""

    def sync_weights(self):
        pass


def make_rollout_func(rollout_source, tokenizer, max_prompt_tokens: int):
    """TRL's rollout_func from a harness rollout source (lockstep): one call per generation round."""
    from harness.experiment.data import encode_prompts

    state = {"round": 0}

    def rollout_func(prompts, trainer):
        # TRL 1.16 passes this process's prompts, already repeated num_generations times, and wants one
        # completion each; with several processes each asks for its slice of the round
        prompt_ids = encode_prompts(tokenizer, prompts, max_prompt_tokens)
        part = (trainer.accelerator.process_index, trainer.accelerator.num_processes)
        completion_ids, logps = rollout_source(state["round"], prompt_ids, trainer.model, part=part)
        state["round"] += 1
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logps}

    return rollout_func


def train(spec, out_dir, rollout_source=None, progress: bool = True, lockstep: bool = False, tensor_steps: int = 0):
    """Run TRL's GRPOTrainer per `spec`; write metrics.jsonl, manifest.json and mapping.json to `out_dir`.

    `tensor_steps`: save the first that many optimizer steps' tensors along the dataflow, read from inside TRL
    (`TensorCapture`), to `tensors.jsonl` in the scratch loop's format and row order (harness/runlog/tensors.py),
    for the tensor diff; as the scratch loop's `train(..., tensor_steps=)`. Capturing does not change TRL's numbers.
    """
    from datasets import Dataset

    from harness.experiment.data import load_rows, prompt_schedule, to_prompt_rows
    from harness.experiment.models import checkpoint_dir, eos_token_ids, load_model, load_tokenizer, resolve_device
    from harness.runlog.params import ParamSketch
    from harness.runlog.log import RunWriter
    from harness.experiment.rewards import reward_functions
    from trl_runner.translate import translate, write_mapping

    translation = translate(spec)  # refuses bad [trl] fields before any model loads
    out_dir = Path(out_dir)
    device = resolve_device(spec)
    from accelerate import PartialState

    main = PartialState(cpu=spec.DEVICE == "cpu").is_main_process  # several processes: the first one writes
    rows = to_prompt_rows(load_rows(spec.data), spec.data.system_prompt)
    # the shared schedule, long enough for whatever TRL takes per step (the naive mapping takes fewer)
    # (every optimizer step takes at most prompts_per_step prompts: enough rounds for STEPS of them)
    per_step = max(translation.prompts_per_step, spec.PROMPTS_PER_STEP)
    # (and at least the scratch loop's rounds: TRL drops an incomplete last generation batch of the data set)
    n_rounds = max(math.ceil(spec.STEPS * per_step / spec.PROMPTS_PER_STEP), spec.rounds * spec.STEPS_PER_GENERATION)
    schedule = prompt_schedule(len(rows), n_rounds, spec.PROMPTS_PER_STEP, spec.SEED)
    ordered = [rows[i] for block in schedule for i in block]
    dataset = Dataset.from_list(ordered)

    ckpt = checkpoint_dir(spec)
    tokenizer = load_tokenizer(ckpt)
    torch.manual_seed(spec.SEED)
    model = load_model(ckpt, spec.MASTER_WEIGHTS, device)  # as the scratch loop: fp32 masters, or bf16 weights
    # lockstep on vLLM: the rollouts (vLLM's completions and log-probs, recorded by the scratch side) come through
    # rollout_func, so TRL builds no engine of its own; use_vllm goes on after construction (below), which is what
    # its IS correction reads
    # free runs on vLLM with sampler.vllm_engine = "shared": TRL samples through this process's one engine
    # (harness/rollouts/samplers.py, built with the LLM arguments of TRL's colocate mode), put where TRL would build a
    # second engine of its own (two engines of a 0.3 share each do not fit a 32 GB card beside the trainer, and each
    # free seed's TRL run built another)
    replay_vllm = spec.sampler.kind == "vllm" and (rollout_source is not None or spec.sampler.vllm_engine == "shared")
    config = translation.config(out_dir / "trl_output", disable_tqdm=True, **({"use_vllm": False} if replay_vllm else {}))

    if spec.sampler.kind == "vllm" and not replay_vllm:  # TRL's own engine (vllm_engine = "per_side")
        from harness.rollouts.samplers import vllm_environment

        vllm_environment()

    sampler = None
    if (spec.sampler.kind == "emulated" or replay_vllm) and rollout_source is None:
        from harness.rollouts.samplers import EmulatedSampler, VLLMSampler

        eos = eos_token_ids(model.generation_config, tokenizer)
        sampler = (EmulatedSampler(spec, model, eos, tokenizer.pad_token_id, device) if spec.sampler.kind == "emulated"
                   else VLLMSampler(spec, ckpt))
    extra = {"checkpoint": str(ckpt), "trl_config": {k: v for k, v in translation.kwargs.items()},
             "sampler": sampler.describe() if sampler else spec.sampler.kind,
             "rollouts": "external (lockstep)" if rollout_source else "own"}
    if main:
        writer = RunWriter(out_dir, "trl", spec, device, {**extra, "processes": spec.PROCESSES})
        write_mapping(translation, out_dir / "mapping.json")
        from harness.runlog.tensors import TENSORS_FILE

        (writer.dir / TENSORS_FILE).unlink(missing_ok=True)  # an earlier run's tensors must not pass for this run's
    else:
        writer = _SilentWriter(spec)
    with writer:
        trainer = HarnessGRPOTrainer(
            model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
            reward_funcs=reward_functions(spec),
            rollout_func=make_rollout_func(rollout_source, tokenizer, spec.MAX_PROMPT_TOKENS) if rollout_source else None,
            max_prompt_tokens=spec.MAX_PROMPT_TOKENS, lockstep_seed=spec.SEED if lockstep else None,
            tensor_steps=tensor_steps,
        )
        if spec.sampler.kind == "emulated" or replay_vllm:
            # TRL's vLLM code paths (its IS correction included), with the emulated sampler or this process's vLLM
            # engine where TRL's own engine would be; in lockstep the shared rollouts arrive through rollout_func
            # with the sampler's log-probs
            trainer.use_vllm = True
            trainer.vllm_generation = TRLSamplerAdapter(sampler, trainer) if sampler else _NoSync()
            trainer._last_loaded_step = -1
        # TRL's printers would echo every log dict; the metric log and our own progress line replace them
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        callback = MetricLogCallback(writer, len(rows), device, progress and main)
        callback.trainer = trainer
        callback.sketch = ParamSketch(model, writer.dir, seed=spec.SEED) if main else None
        trainer.add_callback(callback)
        trainer.train()
    return writer.dir
