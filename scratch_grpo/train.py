"""A hand-written GRPO loop: plain PyTorch + transformers, top to bottom, no TRL.

    python -m harness run scratch --spec harness/specs/default.toml --out runs/scratch

Per optimizer step: take PROMPTS_PER_STEP prompts from the shared schedule, sample GROUP_SIZE
completions each, score them, turn rewards into group-normalised advantages, then minimise the
clipped surrogate over GRAD_ACCUM micro-batches and take one AdamW step. Every choice TRL makes
differently is a spec field (LOSS_NORM, ADV_SCALE, STD, LOGP_OLD, IS_*, LR_SCHEDULE, ...), so this loop
can reproduce any TRL setting; the math lives in `scratch_grpo/core.py`.

Metrics use TRL's names and meanings (see harness/runlog/log.py for the harness fields). Where TRL
averages a statistic over micro-batches (entropy, kl, clip_ratio/*), so does this loop.
"""

from __future__ import annotations

import copy
import math
import random
import time
import types

import numpy as np
import torch
from torch.optim.lr_scheduler import LambdaLR

from harness.experiment.data import encode_prompts
from harness.experiment.models import autocast_for
from harness.experiment.rewards import call_reward, check_rewards, reward_functions
from harness.rollouts.fastgen import sample_policy, static_decoder_for
from harness.rollouts.generate import pad_left, pad_right
from harness.rollouts.lockstep import shuffle_seed
from scratch_grpo import core


def completion_forward(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                       completion_mask: torch.Tensor, temperature: float, entropy_temperature: float | None = None,
                       masked_eos: tuple[int, ...] = (), dropped: int | None = None, hidden: tuple[int, ...] = (),
                       positions: str = "auto", zero_id: int = -1, logits_dtype: str = "float32"):
    """Per-token log-probs (B, T) of the completion tokens, and with `entropy_temperature` the entropy (B, T) of
    softmax(logits / entropy_temperature) (no gradient); else None.

    Only input_ids and attention_mask go in (positions are the model's default), as TRL scores them. `masked_eos`
    (a quirk, EOS_ATTENTION = "mask"): these tokens are masked out of attention, and positions count only the
    attended tokens (`cumsum(mask) - 1`, 1 where masked), as a loop whose pad token is its eos does. `dropped` (a
    quirk, MASK_TOKEN_DROP): every completion token with this id is taken out of the sequence, as a loop that packs
    its sequences without pad tokens does: out of attention, positions counting only the tokens kept, and each kept
    token scored from the last kept position before it (the dropped token's own log-prob is left, for the loss mask
    to leave out). `hidden` (a quirk, ATTENTION_HIDE_ID): tokens of these ids hidden from attention wherever they
    stand (a mask built as `ids != pad_id`), kept in the sequence. `positions` (POSITIONS): `plain` (the model's own,
    TRL), `mask` (counted over the attention mask), `auto` (counted where eos tokens are masked or a token dropped).
    `zero_id` (LOGP_ZERO_ID): that id's log-probs are 0 (cross_entropy's ignore_index). `logits_dtype`
    (LOGITS_DTYPE): the dtype the log_softmax is taken in (core.low_precision_logprobs; TRL: float32).
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    T = completion_ids.size(1)
    extra = {}
    kept = None
    if dropped is not None:
        kept = ~((completion_ids == dropped) & (completion_mask > 0))
        attention = attention * torch.cat([torch.ones_like(prompt_mask, dtype=torch.bool), kept], dim=1)
    attention = core.hide_ids(attention, input_ids, tuple(masked_eos) + tuple(hidden))
    if positions == "mask" or positions == "auto" and (masked_eos or kept is not None):
        extra["position_ids"] = core.position_ids(attention)
    logits = model(input_ids=input_ids, attention_mask=attention, logits_to_keep=T + 1, **extra).logits[:, :-1]
    if kept is not None:  # token j from the last kept position before it (0: the prompt's last token)
        at = torch.arange(1, T + 1, device=kept.device).expand_as(kept) * kept  # 1 + index where kept, else 0
        source = torch.cat([torch.zeros_like(at[:, :1]), at[:, :-1]], dim=1).cummax(dim=1).values
        logits = logits.gather(1, source.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
    if entropy_temperature is None:
        logp = core.token_logprobs(logits, completion_ids, temperature, logits_dtype)
        return core.zero_logps_at(logp, completion_ids, zero_id), None
    logp, entropy = core.token_logprobs_and_entropy(logits, completion_ids, temperature, entropy_temperature,
                                                    logits_dtype)
    return core.zero_logps_at(logp, completion_ids, zero_id), entropy


def train(spec, out_dir, rollout_source=None, progress: bool = True, noise_twin: bool = False, stop_when=None,
          tensor_steps: int = 0, warm=None, record_rounds: int = 0, selection: dict | None = None):
    """Train per `spec`, writing the metric log and manifest to `out_dir`. Returns the run folder.

    `rollout_source`, when given, supplies completions instead of the loop's own sampling (lockstep
    parity): `rollout_source(round_idx, prompt_ids, policy) -> (completion_ids, sampler_logps or None)`.
    `noise_twin`: the same run changed only in its rounding (`core.nudge_ulp` on the initial weights,
    micro-batches summed in reverse order): its distance to the plain run is the floating-point noise the
    calibrated tolerance measures (harness/diagnose/noise.py).
    `stop_when(row) -> bool`, called with each logged step's row: True ends the run there, that step logged (the
    explanation search runs a candidate only as far as its question needs; the schedule still spans STEPS).
    `tensor_steps`: save the first that many steps' tensors along the dataflow (rewards, advantages, the loss's
    mask, log-probs, per-token loss; rows in the rollout's order) to `tensors.jsonl` (harness/runlog/tensors.py),
    for the tensor diff against a loop of yours.
    `warm`: a `harness.experiment.models.Warm` that keeps the loaded model across runs of one process (each run
    starts from the checkpoint's weights, restored in place): the explanation search's candidates.
    `record_rounds`: rounds the `rollout_source` is asked for in all: those past the run's own are sampled after the
    last step from the final weights (a loop of yours that reads more rounds than the spec's steps take).
    `selection`: {step: [(round, index), ...]}, the completions each optimizer step trains on (a loop of yours that
    trains on part of a round, several rounds or a subset of groups per step: harness.loop.trained): each round is
    prepared (scored, its old and reference log-probs taken) when a step first needs it, and each step trains on its
    rows as one batch cut into GRAD_ACCUM micro-batches in the order given. Default: whole rounds, as TRL.
    """
    from harness.runlog.tensors import TENSORS_FILE, write_row
    from harness.experiment.data import hash_prompt_ids, load_rows, prompt_schedule, to_prompt_rows
    from harness.runlog.params import ParamSketch
    from harness.experiment.models import checkpoint_dir, eos_token_ids, load_model, load_tokenizer, resolve_device
    from harness.runlog.log import COMPLETIONS_PER_STEP, Progress, RunWriter, peak_memory_bytes
    from harness.rollouts.samplers import describe_sampler, make_sampler
    from harness.runlog.stops import check_stop

    # ---- seeding and determinism: everything random below draws from these -----------------------
    random.seed(spec.SEED)
    np.random.seed(spec.SEED % 2**32)
    torch.manual_seed(spec.SEED)
    if spec.DETERMINISTIC:  # deterministic GPU kernels, as TRL's full_determinism (it also seeds, as above)
        from transformers import enable_full_determinism

        enable_full_determinism(spec.SEED)
    device = resolve_device(spec)

    # ---- model, tokenizer, data -------------------------------------------------------------------
    ckpt = checkpoint_dir(spec)
    if warm is not None:  # the same model as the last run's, its weights restored to the checkpoint's
        tokenizer, model = warm.get(ckpt, spec.MASTER_WEIGHTS, device, spec.GRADIENT_CHECKPOINTING)
    else:
        tokenizer = load_tokenizer(ckpt)
        model = load_model(ckpt, spec.MASTER_WEIGHTS, device)  # fp32 masters (bf16 DTYPE: autocast), or bf16 weights
        if spec.GRADIENT_CHECKPOINTING:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if noise_twin:
        core.nudge_ulp(model, spec.MASTER_WEIGHTS, spec.SEED)
    model.train()
    ref_model = None
    if spec.BETA > 0:  # the frozen initial policy for the KL term
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    eos_ids, pad_id = eos_token_ids(model.generation_config, tokenizer), tokenizer.pad_token_id

    rows = to_prompt_rows(load_rows(spec.data), spec.data.system_prompt)
    prompt_tokens = encode_prompts(tokenizer, [r["prompt"] for r in rows], spec.MAX_PROMPT_TOKENS)
    G, P, GA, mu = spec.GROUP_SIZE, spec.PROMPTS_PER_STEP, spec.GRAD_ACCUM, spec.NUM_ITERATIONS
    S = spec.STEPS_PER_GENERATION  # optimizer steps per generation round (each on its own slice of the round)
    rounds = spec.rounds  # one generation round feeds S x mu optimizer steps
    # (a longer schedule begins with the same rounds: laid end to end from the same seeded permutations)
    if selection is None and spec.SELECTION:  # a loop's own choice of completions per step, replayed
        from harness.runlog.tensors import read_trained

        selection = read_trained(spec.SELECTION)
        if not selection:
            raise ValueError(f"SELECTION: {spec.SELECTION} holds no steps (harness.loop.trained writes them)")
    needed = 1 + max((r for picks in (selection or {}).values() for r, _ in picks), default=-1)  # rounds it picks from
    schedule = prompt_schedule(len(rows), max(rounds, record_rounds, needed), P * S, spec.SEED)
    reward_names = list(spec.rewards.functions)
    reward_fns = reward_functions(spec)  # built-in, or the user's own: the objects TRL's side calls too
    # the rewards, their group statistics and the advantages live on the training device, as TRL's do: a group whose
    # rewards are all equal has its mean rounded by the device's own reduction, and 1e-4 in the denominator turns a
    # one-ulp residual into advantages of ~1e-3 on one side and 0 on the other (an H100 run, issue 28)
    reward_w = torch.tensor(spec.rewards.weights, dtype=torch.float32, device=device)

    # emulated: a stated stand-in for vLLM; vllm: colocated, as TRL's colocate mode (lockstep: the source samples)
    sampler = make_sampler(spec, model, eos_ids, pad_id, device) if rollout_source is None else None
    # the policy's own sampling: transformers' generate, or a static-cache decoder (GENERATION; auto on a GPU)
    decoder = None
    if sampler is None and rollout_source is None:
        decoder = static_decoder_for(spec, model, eos_ids, pad_id, device)

    # ---- optimizer: AdamW, no decay on biases and norms (as transformers' Trainer), LR schedule ----------
    # OPTIM: the fused kernel (TRL's default), or torch's own choice of kernel (for-each on a GPU, for-loop on a CPU)
    skip = (lambda n: False) if spec.WEIGHT_DECAY_ALL else (lambda n: "bias" in n or "norm" in n.lower())  # a quirk
    decay = [p for n, p in model.named_parameters() if not skip(n)]
    no_decay = [p for n, p in model.named_parameters() if skip(n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.LR, betas=(spec.ADAM_BETA1, spec.ADAM_BETA2), eps=spec.ADAM_EPS,
        fused=True if spec.OPTIM == "adamw_torch_fused" else None)
    if spec.LR_STEPS:  # a schedule of your loop's own, one rate per step (a quirk: TRL's are named schedules)
        rates = [float(r) for r in spec.LR_STEPS]
        scheduler = LambdaLR(optimizer, lambda s: rates[min(s, len(rates) - 1)] / spec.LR)
    else:
        scheduler = LambdaLR(optimizer, lambda s: core.lr_multiplier(s, spec.LR_SCHEDULE, spec.STEPS, spec.WARMUP_STEPS,
                                                                     spec.LR_SCHEDULER_KWARGS, spec.LR))

    extra = {"checkpoint": str(ckpt), "sampler": describe_sampler(spec),
             "generation": (decoder.describe() if decoder else sampler.describe() if sampler
                            else "given (lockstep rollouts)" if rollout_source else "transformers generate"),
             "rollouts": "external (lockstep)" if rollout_source else "own",
             "noise_twin": noise_twin}
    writer = RunWriter(out_dir, "scratch", spec, device, extra)
    sketch = ParamSketch(model, writer.dir, seed=spec.SEED)  # the weights after each step, for lockstep parity
    (writer.dir / TENSORS_FILE).unlink(missing_ok=True)  # an earlier run's tensors must not pass for this run's
    bar = Progress(spec.STEPS, "scratch", progress)
    at = types.SimpleNamespace(step=0, tokens_seen=0, prompts_seen=0, stopped=False, t0=time.perf_counter())
    logp_temperature = 1.0 if spec.LOGP_ON_RAW_LOGITS else spec.TEMPERATURE  # raw logits: a quirk
    masked_eos = tuple(eos_ids) if spec.EOS_ATTENTION == "mask" else ()  # pad = eos: a quirk
    dropped = spec.MASK_TOKEN_ID if spec.MASK_TOKEN_ID >= 0 and spec.MASK_TOKEN_DROP else None  # a quirk
    # the forward pass's quirks: what it sees, where, and which log-probs it zeroes (TRL: none of them)
    forward_rules = {"masked_eos": masked_eos, "dropped": dropped, "positions": spec.POSITIONS,
                     "zero_id": spec.LOGP_ZERO_ID, "hidden": (spec.ATTENTION_HIDE_ID,) if spec.ATTENTION_HIDE_ID >= 0 else (),
                     "logits_dtype": spec.LOGITS_DTYPE}

    def prepare(r: int) -> types.SimpleNamespace:
        """Round r as it stands when it is generated: its prompts (each repeated G times: a group), completions,
        rewards and advantages, the padded tensors, and what is computed at generation time (logp_old, the reference
        log-probs, the IS weights and the train-inference mismatch), with the policy of that moment."""
        at.t0 = time.perf_counter()
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        # ---- 1. prompts of this round, each repeated G times (a group) --------------------------------
        idx = schedule[r]
        seq_rows = [rows[i] for i in idx for _ in range(G)]
        prompt_ids = [prompt_tokens[i] for i in idx for _ in range(G)]
        N = len(prompt_ids)

        # ---- 2. rollouts: our own sampling, a separate sampler, or given from outside ------------------
        sampler_logps = None
        t_gen = time.perf_counter()
        model.eval()
        if rollout_source is not None:
            completion_ids, sampler_logps = rollout_source(r, prompt_ids, model)
        elif sampler is not None:
            sampler.sync_weights(model)
            completion_ids, sampler_logps = sampler.generate(prompt_ids)
        else:
            completion_ids = sample_policy(decoder, spec, model, prompt_ids, eos_ids=eos_ids, pad_id=pad_id,
                                           device=device)
        model.train()
        gen_s = time.perf_counter() - t_gen  # completions are host lists here: the GPU work is done
        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

        # ---- 3. rewards r_i (weighted sum of functions) and advantages A_i ------------------------------
        metric_sink: dict[str, list[float]] = {}
        log_metric = lambda name, value: metric_sink.setdefault(name, []).append(value)  # noqa: E731
        columns = {k: [row[k] for row in seq_rows] for k in seq_rows[0] if k != "prompt"}
        rewards_per_func = torch.zeros(N, len(reward_fns), device=device)
        for j, (name, fn) in enumerate(zip(reward_names, reward_fns)):
            out = call_reward(fn, [row["prompt"] for row in seq_rows], completions, completion_ids, columns, at.step,
                              spec.STEPS, log_metric)
            rewards_per_func[:, j] = torch.tensor(check_rewards(fn.__name__, out, N), device=device)
        rewards = (rewards_per_func * reward_w).nansum(dim=1)
        rewards = core.shape_rewards(rewards, spec.REWARD_CLIP)  # a quirk when > 0: TRL takes the sum as it is
        advantages, std_used = core.group_advantages(rewards, G, spec.ADV_SCALE, spec.STD, spec.STD_EPS,
                                                     spec.STD_EPS_INSIDE, spec.ADV_BASELINE,
                                                     spec.ADV_STATS_DTYPE)

        # ---- 4. pad the round; logp_old, reference and IS weights (no grad) --------------------------
        if spec.END_AT_ID >= 0:  # a quirk: each completion ends at its first token of this id (the pad id, say)
            completion_ids = core.end_at_id(completion_ids, spec.END_AT_ID)
            if sampler_logps is not None:
                sampler_logps = [lp[:len(c)] for lp, c in zip(sampler_logps, completion_ids)]
        p_ids, p_mask = pad_left(prompt_ids, pad_id)
        c_ids, c_mask = pad_right(completion_ids, pad_id)
        # TRL counts a completion as truncated when its last token is neither an eos nor the pad token
        truncated = torch.tensor(core.truncated_rows(completion_ids, eos_ids, pad_id))
        if spec.MASK_TRUNCATED:  # (TRUNCATED_IF: what counts as truncated for the mask, a quirk; TRL's for metrics)
            cut = torch.tensor(core.truncated_rows(completion_ids, eos_ids, pad_id, spec.TRUNCATED_IF))
            c_mask = c_mask * (~cut).unsqueeze(1).long()
        p_ids, p_mask, c_ids, c_mask = (t.to(device) for t in (p_ids, p_mask, c_ids, c_mask))
        # the tokens the loss counts: the completion mask (TRL), or a quirk's (no eos, or the padding too)
        ends_with_eos = torch.tensor([bool(ids) and ids[-1] in eos_ids for ids in completion_ids], device=device)
        l_mask = core.loss_mask(c_mask, ends_with_eos, spec.COMPLETION_MASK)
        if spec.MASK_TOKEN_ID >= 0:  # a quirk: a mask built from `ids != token` (the pad id, say) wherever it stands
            l_mask = l_mask * (c_ids != spec.MASK_TOKEN_ID)
        generated_tokens = sum(map(len, prompt_ids)) + sum(map(len, completion_ids))
        mb_size = N // (GA * S)

        def no_grad_logps(net):
            with torch.no_grad(), autocast_for(device, spec.DTYPE):
                return torch.cat([completion_forward(net, p_ids[s:s + mb_size], p_mask[s:s + mb_size],
                                                     c_ids[s:s + mb_size], c_mask[s:s + mb_size],
                                                     logp_temperature, **forward_rules)[0]
                                  for s in range(0, N, mb_size)])

        # (a selection of rows may train on this round after an update: its old log-probs are taken now; with
        # LOGP_OLD = "current" every step takes the current ones instead, so this pass would go unused)
        need_old = spec.LOGP_OLD == "forward" or spec.LOGP_OLD != "current" and (
            mu > 1 or S > 1 or spec.IS_CORRECTION or selection is not None)
        logp_old = no_grad_logps(model) if need_old else None
        ref_logps = no_grad_logps(ref_model) if ref_model is not None else None
        if ref_logps is not None and spec.KL_IN_REWARD:  # a quirk: the KL penalty in the reward, not the loss
            now = logp_old if logp_old is not None else no_grad_logps(model)
            seq_kl = (core.kl_estimate(now, ref_logps, spec.KL_ESTIMATOR) * l_mask).sum(-1)
            rewards = core.shape_rewards(rewards, seq_kl=seq_kl, beta=spec.BETA)
            advantages, std_used = core.group_advantages(rewards, G, spec.ADV_SCALE, spec.STD, spec.STD_EPS,
                                                         spec.STD_EPS_INSIDE, spec.ADV_BASELINE,
                                                         spec.ADV_STATS_DTYPE)
        # quirks after the group's advantages (TRL: none): A = 0 out of the loss, a second normalisation, a clamp
        advantages, l_mask = core.shape_advantages(advantages, l_mask, spec.DROP_ZERO_ADV, spec.ADV_RENORM,
                                                   spec.ADV_CLAMP)
        is_w, mismatch = None, {}
        if sampler_logps is not None:
            s_lp = pad_right(sampler_logps, 0.0, dtype=torch.float32)[0].to(device)
            trainer_lp = logp_old if logp_old is not None else no_grad_logps(model)
            mismatch = core.mismatch_stats(trainer_lp, s_lp, c_mask)
            if spec.IS_CORRECTION:
                is_w, is_raw = core.is_weights(trainer_lp, s_lp, c_mask, spec.IS_MODE, spec.IS_CLIP_MIN or None,
                                               spec.IS_CLIP_MAX)
                flat = is_w.flatten() if spec.IS_MODE.startswith("sequence") else is_w[c_mask.bool()]
                flat_raw = is_raw.flatten() if spec.IS_MODE.startswith("sequence") else is_raw[c_mask.bool()]
                mismatch.update({"is_min": flat.min().item(), "is_mean": flat.mean().item(),
                                 "is_max": flat.max().item(), "is_raw_min": flat_raw.min().item(),
                                 "is_raw_mean": flat_raw.mean().item(), "is_raw_max": flat_raw.max().item()})
        return types.SimpleNamespace(
            r=r, idx=idx, seq_rows=seq_rows, prompt_ids=prompt_ids, completion_ids=completion_ids,
            completions=completions, N=N, rewards_per_func=rewards_per_func, rewards=rewards, advantages=advantages,
            std_used=std_used, p_ids=p_ids, p_mask=p_mask, c_ids=c_ids, c_mask=c_mask, l_mask=l_mask,
            truncated=truncated, logp_old=logp_old, ref_logps=ref_logps, is_w=is_w, mismatch=mismatch,
            metric_sink=metric_sink, generated_tokens=generated_tokens, gen_s=gen_s, mb_size=mb_size,
            version=at.step, fresh=None,
            # token_global's denominator: the active tokens of one step's share of the round (TRL:
            # num_items_in_batch of the generation batch x gradient_accumulation_steps / steps_per_generation)
            step_tokens=float(l_mask.sum()) / S)

    def optimizer_step(b, micro_batches: list, step_tokens: float, generated: list, used: list[int],
                       used_tokens: int, n_seqs: int) -> None:
        """One optimizer step over `micro_batches` (index tensors into `b`'s rows), logged. `generated`: the rounds
        first trained on at this step (the first one's generation statistics go in its log line, as TRL logs them);
        `used`: the prompts it trains on (once per prompt of a whole round, else once per completion), `used_tokens`
        their tokens, `n_seqs` its completions."""
        ga = len(micro_batches)
        if noise_twin:  # the same sum, added up in another order
            micro_batches = micro_batches[::-1]
        adv = b.advantages.to(device)
        lr_now = optimizer.param_groups[0]["lr"]
        step_loss, mb_stats = 0.0, []
        capture = at.step < tensor_steps  # this step's tensors, in the rollout's order, for the tensor diff
        if capture:
            seen_logps = torch.full(b.c_ids.shape, float("nan"))
            seen_loss = torch.full(b.c_ids.shape, float("nan"))
        for mb in micro_batches:
            with autocast_for(device, spec.DTYPE):
                logp, entropy = completion_forward(model, b.p_ids[mb], b.p_mask[mb], b.c_ids[mb], b.c_mask[mb],
                                                   logp_temperature, entropy_temperature=spec.TEMPERATURE,
                                                   **forward_rules)
            mask = b.c_mask[mb].float()
            old = b.logp_old[mb] if b.logp_old is not None else logp.detach()
            if b.fresh is not None:  # rows of a round generated at this very policy: the current ones, detached (TRL)
                old = torch.where(b.fresh[mb].unsqueeze(1), logp.detach(), old)
            if spec.LOGP_OLD == "current":  # a quirk: the ratio is 1 at every step (REINFORCE-style loops)
                old = logp.detach()
            a_mb = adv[mb]
            if spec.ADV_MICRO_BATCH_MEAN:  # a quirk: the micro-batch's mean advantage for each of its completions
                a_mb = core.micro_batch_mean_advantage(a_mb)
            per_token, rho = core.clipped_surrogate(logp, old, a_mb, spec.CLIP_LOW, spec.CLIP_HIGH,
                                                    spec.DELTA or None)
            if b.is_w is not None:
                per_token = per_token * b.is_w[mb]
            stats = {"entropy": core.masked_mean(entropy, mask)}
            if b.ref_logps is not None:
                kl = core.kl_estimate(logp, b.ref_logps[mb], spec.KL_ESTIMATOR)
                if spec.KL_IS_CORRECTION:
                    kl = kl * rho
                if not spec.KL_IN_REWARD:
                    per_token = per_token + spec.BETA * kl
                stats["kl"] = core.masked_mean(kl.detach(), mask)
            loss = core.aggregate_loss(per_token, b.l_mask[mb].float(),
                                       "sum" if spec.LOSS_SUM or spec.LOSS_DIVISOR else spec.LOSS_NORM,
                                       core.accumulation_divisor(ga, spec.ACCUM_DIVISOR), spec.MAX_TOKENS,
                                       step_tokens)
            if spec.LOSS_DIVISOR:  # a quirk: the step's sum over a constant of the loop's own
                loss = loss / spec.LOSS_DIVISOR
            if capture:
                seen_logps[mb.cpu()] = logp.detach().float().cpu()
                seen_loss[mb.cpu()] = per_token.detach().float().cpu()
            # a quirk: a completion with no loss token makes an unguarded mean NaN, and the loop skips it all
            skip = spec.EMPTY_SKIP and bool((b.l_mask[mb].sum(-1) == 0).any())
            if not skip:
                loss.backward()
                step_loss += loss.item()
            stats.update(core.clip_stats(rho.detach(), a_mb, mask, spec.CLIP_LOW, spec.CLIP_HIGH))
            mb_stats.append(stats)
        clip_to = spec.MAX_GRAD_NORM if spec.MAX_GRAD_NORM > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_to).item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        at.step += 1
        step = at.step
        t_harness = time.perf_counter()  # bookkeeping from here to the log line counts as harness time
        sketch.record(model)
        if capture:
            write_row(writer.dir / TENSORS_FILE, step, {
                "rewards": b.rewards, "advantages": b.advantages, "mask": b.l_mask, "logps": seen_logps,
                "old_logps": seen_logps if spec.LOGP_OLD == "current" else b.logp_old,  # (the ones the loss used)
                "ref_logps": b.ref_logps, "per_token_loss": seen_loss,
                "loss": step_loss, "grad_norm": grad_norm})

        # ---- 6. log this optimizer step ------------------------------------------------------------
        row = {"step": step, "loss": step_loss, "grad_norm": grad_norm, "learning_rate": lr_now}
        row.update({k: float(np.mean([s[k] for s in mb_stats])) for k in mb_stats[0]})
        for g in generated:  # generation statistics belong to the step that generated (as TRL logs them)
            at.prompts_seen += len(g.idx)
            at.tokens_seen += g.generated_tokens
        if generated:
            g = generated[0]
            row.update(_generation_metrics(g.completion_ids, g.truncated, g.rewards_per_func, g.rewards, reward_w,
                                           reward_names, reward_fns, g.std_used, G, g.metric_sink))
            row.update(_mismatch_metrics(g.mismatch))
            row["num_tokens"] = at.tokens_seen
            adv_list, per_func = g.advantages.tolist(), g.rewards_per_func.tolist()
            writer.log_completions(step, [
                {"prompt": g.seq_rows[i]["prompt"], "completion": g.completions[i], "advantage": adv_list[i],
                 "rewards": {fn.__name__: per_func[i][j] for j, fn in enumerate(reward_fns)}}
                for i in range(min(g.N, COMPLETIONS_PER_STEP))])
        row.update({
            "prompts_in_step": len(set(used)), "sequences_in_step": n_seqs,
            "prompt_ids_hash": hash_prompt_ids(used),
            "tokens_in_step": used_tokens, "epoch": at.prompts_seen / len(rows),
            "gen_s": sum(g.gen_s for g in generated), "harness_s": time.perf_counter() - t_harness,
            "wall_s": time.perf_counter() - at.t0, "peak_mem_bytes": peak_memory_bytes(device),
        })
        if not math.isfinite(step_loss) or not math.isfinite(grad_norm):
            writer.log_step(row)
            raise FloatingPointError(f"non-finite loss at step {step}")
        writer.log_step(row)
        bar.update(row)
        check_stop(step)  # SIGINT/SIGTERM: stop here, with this step logged
        if stop_when is not None and stop_when(row):
            at.stopped = True
            writer.update(stopped_at=step)
        at.t0 = time.perf_counter()

    with writer:
        if selection is None:  # whole rounds, in order, through the one step function
            for r in range(rounds):
                if at.stopped:
                    break
                b = prepare(r)
                # ---- 5. mu passes over the round, each S optimizer steps over GA shuffled micro-batches --------
                g = torch.Generator().manual_seed(shuffle_seed(spec.SEED, r))
                order = torch.randperm(b.N, generator=g) if spec.MICRO_BATCH_ORDER == "shuffled" else torch.arange(b.N)
                shuffled = order.view(S * GA, b.mb_size).to(device)  # (a quirk: `rollout` cuts it in order)
                for it, k in ((it, k) for it in range(mu) for k in range(S)):
                    if at.step >= spec.STEPS or at.stopped:
                        break
                    micro_batches = list(shuffled[k * GA:(k + 1) * GA])
                    used, used_tokens = b.idx, b.generated_tokens
                    if S > 1:  # what this step consumed: its slice of the round (a prompt once per completion)
                        seqs = shuffled[k * GA:(k + 1) * GA].flatten().tolist()
                        used = [i for i in b.idx for _ in range(sum(b.idx[j // G] == i for j in seqs))]
                        used_tokens = sum(len(b.prompt_ids[j]) + len(b.completion_ids[j]) for j in seqs)
                    optimizer_step(b, micro_batches, b.step_tokens, [b] if it == 0 and k == 0 else [], used,
                                   used_tokens, b.N // S)
        else:  # your loop's selection: each step trains on the completions it names, from any rounds
            prepared: dict[int, types.SimpleNamespace] = {}
            for s in range(1, spec.STEPS + 1):
                if at.stopped:
                    break
                picks = selection.get(s)
                if not picks:
                    raise ValueError(f"selection: no completions for step {s} (each step {s} of STEPS names the "
                                     "completions it trains on)")
                new = [r for r in dict.fromkeys(r for r, _ in picks) if r not in prepared]
                for r in new:
                    prepared[r] = prepare(r)
                vb = _gather(prepared, picks, pad_id, device, at.step)
                chunks = list(torch.arange(len(picks), device=device).tensor_split(min(GA, len(picks))))
                groups = dict.fromkeys((r, i // G) for r, i in picks)  # its prompts, once each (as a round's are)
                used = [prepared[r].idx[g] for r, g in groups]
                used_tokens = sum(len(vb.prompt_ids[j]) + len(vb.completion_ids[j]) for j in range(len(picks)))
                optimizer_step(vb, chunks, float(vb.l_mask.sum()), [prepared[r] for r in new], used, used_tokens,
                               len(picks))
        if rollout_source is not None and record_rounds > rounds and not at.stopped:  # rounds only your loop reads
            model.eval()
            for r in range(rounds, record_rounds):
                rollout_source(r, [prompt_tokens[i] for i in schedule[r] for _ in range(G)], model)
    bar.close()
    return writer.dir


def _gather(prepared: dict, picks: list, pad_id: int, device: str, version: int):
    """The rows `picks` ((round, index) pairs) of prepared rounds as one batch of their own: prompts re-padded on the
    left, per-token tensors cut or padded on the right to the widest pick, and which rows come from a round generated
    at the current policy (`fresh`: their old log-probs are the current ones, as TRL's are on a round's first step)."""
    def rows(name, fill=0.0):
        got = [getattr(prepared[r], name) for r, _ in picks]
        if got[0] is None:
            return None
        if got[0].dim() == 1 or got[0].size(1) == 1 and name == "is_w":  # per completion ((B, 1): sequence IS weights)
            return torch.stack([t[i] for t, (_, i) in zip(got, picks)])
        width = max(len(prepared[r].completion_ids[i]) for r, i in picks)
        out = []
        for t, (_, i) in zip(got, picks):
            row = t[i]
            if row.size(0) >= width:
                out.append(row[:width])
            else:
                out.append(torch.cat([row, torch.full((width - row.size(0),), fill, dtype=row.dtype,
                                                      device=row.device)]))
        return torch.stack(out)

    prompt_ids = [prepared[r].prompt_ids[i] for r, i in picks]
    completion_ids = [prepared[r].completion_ids[i] for r, i in picks]
    p_ids, p_mask = pad_left(prompt_ids, pad_id)
    return types.SimpleNamespace(
        prompt_ids=prompt_ids, completion_ids=completion_ids, p_ids=p_ids.to(device), p_mask=p_mask.to(device),
        c_ids=rows("c_ids", pad_id), c_mask=rows("c_mask"), l_mask=rows("l_mask"), advantages=rows("advantages"),
        rewards=rows("rewards"), logp_old=rows("logp_old"), ref_logps=rows("ref_logps"), is_w=rows("is_w"),
        fresh=torch.tensor([prepared[r].version == version for r, _ in picks], device=device))


def _generation_metrics(completion_ids, truncated, rewards_per_func, rewards, reward_w, names, fns, std_used, G,
                        metric_sink) -> dict:
    lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float32)
    term = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
    out = {
        "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": term.mean().item(),
        "completions/min_terminated_length": term.min().item(),
        "completions/max_terminated_length": term.max().item(),
    }
    for j, fn in enumerate(fns):  # TRL names reward metrics after the function's __name__
        col = rewards_per_func[:, j]
        out[f"rewards/{fn.__name__}/mean"] = torch.nanmean(col).item()
        out[f"rewards/{fn.__name__}/std"] = core.nanstd(col).item()
    out["reward"] = torch.nanmean(rewards).item()
    out["reward_std"] = core.nanstd(rewards).item()
    out["frac_reward_zero_std"] = torch.isclose(std_used, torch.zeros_like(std_used)).float().mean().item()
    errors = {k: float(np.mean(v)) for k, v in metric_sink.items()}
    out.update(errors)
    out["reward_errors"] = sum(v for k, v in errors.items() if k.startswith("reward_errors/"))
    return out


def _mismatch_metrics(m: dict) -> dict:
    """Train-inference mismatch. TRL's `sampling/*` names only where TRL logs them (IS correction on)."""
    if not m:
        return {}
    out = {"mismatch/logp_diff/mean": m["mean_abs"], "mismatch/logp_diff/max": m["max_abs"],
           "mismatch/token_mult_prob_error": m["token_mult_prob_error"], "mismatch/k3_kl": m["k3_kl"]}
    if "is_min" in m:
        out.update({"sampling/sampling_logp_difference/mean": m["mean_abs"],
                    "sampling/sampling_logp_difference/max": m["max_abs"],
                    "sampling/importance_sampling_ratio/min": m["is_min"],
                    "sampling/importance_sampling_ratio/mean": m["is_mean"],
                    "sampling/importance_sampling_ratio/max": m["is_max"],
                    "mismatch/is_ratio_raw/min": m["is_raw_min"], "mismatch/is_ratio_raw/mean": m["is_raw_mean"],
                    "mismatch/is_ratio_raw/max": m["is_raw_max"]})
    return out
