"""Preflight: what differs between the two sides, before any model loads or GPU time is spent.

`python -m harness preflight --spec FILE` prints the mapping table and a semantic diff: for each
quantity that shapes the numbers (prompts per step, micro-batches, loss normalizer, clip bounds,
lr at the first and last step, std estimator, IS on/off and mode, ...) what the scratch loop will do
and what TRL will do. Each difference is labelled with the lesson's check it belongs to (`batch`,
`loss_type`, `importance_sampling`) or `other:<field>`, and carries the spec change that aligns it
(used by attribution to confirm a cause). Exit status 0 aligned, 1 differences, 2 bad spec.

It also reads what the starting checkpoint's own files set (checkpoint.py, `checkpoint_facts`: config.json and
generation_config.json, when the checkpoint is already on disk; no weights are loaded): sampling defaults that
transformers' `generate` picks up on one side and not the other, dropout against TRL's `disable_dropout`, tied
embeddings, the stored dtype against how each side loads. Those that make the sides differ are differences
too; the rest are printed under "checkpoint defaults" as notes and warnings.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

from harness.diagnose.checkpoint import checkpoint_facts, format_checkpoint
from harness.diagnose.fields import FIELDS, QUIRKS
from harness.experiment.models import existing_checkpoint_dir
from trl_runner.translate import NORM_OF_LOSS_TYPE, Translation, translate

CHECK_ORDER = ("batch", "loss_type", "importance_sampling")


@dataclasses.dataclass
class Difference:
    quantity: str  # what differs, in words both sides share
    check: str  # batch | loss_type | importance_sampling | other:<field>
    scratch: object
    trl: object
    fields: tuple  # the spec / TRL fields behind it
    align: dict  # {"set": {spec key: value}, "drop_trl": [trl keys]}: the change that aligns this difference

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _lr_first_last(name, lr: float, steps: int, warmup: int, kwargs: dict | None = None) -> tuple[float, float]:
    """The learning rate used at the first and last optimizer step, from transformers' own scheduler."""
    import torch
    from transformers import get_scheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    name = getattr(name, "value", name)  # a SchedulerType enum, or its string
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=steps, scheduler_specific_kwargs=kwargs)
    first = opt.param_groups[0]["lr"]
    for _ in range(steps - 1):
        opt.step()
        sched.step()
    return first, opt.param_groups[0]["lr"]


def _scratch_lr_name(spec) -> str:
    if spec.LR_SCHEDULE != "constant":
        return spec.LR_SCHEDULE
    return "constant_with_warmup" if spec.WARMUP_STEPS else "constant"


def side_facts(spec, tr: Translation, n_rows: int | None = None) -> tuple[dict, dict]:
    """Per quantity: (value on the scratch side, value on the TRL side, fields, check, alignment)."""
    kw = tr.kwargs
    n = spec.PROCESSES
    emulated_or_vllm = spec.sampler.kind in ("emulated", "vllm") or kw.get("use_vllm")
    trl_is = bool(emulated_or_vllm and kw["vllm_importance_sampling_correction"])
    scratch_is = bool(spec.sampler.kind != "policy" and spec.IS_CORRECTION)
    trl_override = lambda *keys: _trl_override(tr, *keys)  # noqa: E731

    q = _batch_facts(spec, tr, n_rows)  # quantity -> (scratch, trl, fields, check, align)
    trl_norm = NORM_OF_LOSS_TYPE.get(kw["loss_type"], kw["loss_type"])
    if trl_norm == "token_local" and n > 1:  # bnpo divides by each process's own micro-batch: not the scratch split
        trl_norm = f"token_local per process ({n} processes)"
    q["loss normalizer"] = (spec.LOSS_NORM, trl_norm, ("LOSS_NORM", "loss_type"), "loss_type", trl_override("loss_type"))
    q["IS correction"] = ("on" if scratch_is else "off", "on" if trl_is else "off",
                          ("IS_CORRECTION", "vllm_importance_sampling_correction"), "importance_sampling",
                          trl_override("vllm_importance_sampling_correction", "use_vllm"))
    if scratch_is or trl_is:
        q["IS mode and bounds"] = (
            (spec.IS_MODE, spec.IS_CLIP_MIN or None, spec.IS_CLIP_MAX) if scratch_is else None,
            (kw["vllm_importance_sampling_mode"], kw["vllm_importance_sampling_clip_min"],
             kw["vllm_importance_sampling_clip_max"]) if trl_is else None,
            ("IS_MODE", "vllm_importance_sampling_mode"), "importance_sampling",
            trl_override("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                         "vllm_importance_sampling_clip_max"))

    def other(name, s_val, t_val, trl_field, spec_key):
        q[name] = (s_val, t_val, (spec_key, trl_field), f"other:{trl_field}", trl_override(trl_field))

    other("advantage scaling", spec.ADV_SCALE, kw["scale_rewards"], "scale_rewards", "ADV_SCALE")
    for key, name in (("STD", "std estimator"), ("STD_EPS", "std epsilon")):  # quirks TRL fixes, listed with these
        trl = FIELDS[key].trl_fixed
        q[name] = (getattr(spec, key), trl, (key,), f"other:{key}", {"set": {key: trl}})
    other("clip low (epsilon)", spec.CLIP_LOW, kw["epsilon"], "epsilon", "CLIP_LOW")
    other("clip high (epsilon_high)", spec.CLIP_HIGH, kw["epsilon_high"] if kw["epsilon_high"] is not None
          else kw["epsilon"], "epsilon_high", "CLIP_HIGH")
    other("two-sided clip (delta)", spec.DELTA or None, kw["delta"], "delta", "DELTA")
    other("KL coefficient (beta)", spec.BETA, kw["beta"], "beta", "BETA")
    if spec.BETA or kw["beta"]:
        other("KL times policy ratio", spec.KL_IS_CORRECTION, kw["use_bias_correction_kl"], "use_bias_correction_kl",
              "KL_IS_CORRECTION")
    other("optimizer passes per generation", spec.NUM_ITERATIONS, kw["num_iterations"], "num_iterations",
          "NUM_ITERATIONS")
    other("mask truncated completions", spec.MASK_TRUNCATED, kw["mask_truncated_completions"],
          "mask_truncated_completions", "MASK_TRUNCATED")
    other("max completion tokens", spec.MAX_TOKENS, kw["max_completion_length"], "max_completion_length", "MAX_TOKENS")
    other("temperature (sampling and log-probs)", spec.TEMPERATURE, kw["temperature"], "temperature", "TEMPERATURE")
    other("top_p", spec.TOP_P, kw["top_p"], "top_p", "TOP_P")
    other("top_k", spec.TOP_K, kw["top_k"], "top_k", "TOP_K")
    q.update(_lr_facts(spec, tr))
    other("adam beta1", spec.ADAM_BETA1, kw["adam_beta1"], "adam_beta1", "ADAM_BETA1")
    other("adam beta2", spec.ADAM_BETA2, kw["adam_beta2"], "adam_beta2", "ADAM_BETA2")
    other("adam epsilon", spec.ADAM_EPS, kw["adam_epsilon"], "adam_epsilon", "ADAM_EPS")
    other("weight decay", spec.WEIGHT_DECAY, kw["weight_decay"], "weight_decay", "WEIGHT_DECAY")
    other("AdamW kernel (optim)", spec.OPTIM, kw["optim"], "optim", "OPTIM")
    other("grad-norm clip", spec.MAX_GRAD_NORM, kw["max_grad_norm"], "max_grad_norm", "MAX_GRAD_NORM")
    other("optimizer steps", spec.STEPS, kw["max_steps"], "max_steps", "STEPS")
    other("seed", spec.SEED, kw["seed"], "seed", "SEED")
    other("deterministic kernels", spec.DETERMINISTIC, kw["full_determinism"], "full_determinism", "DETERMINISTIC")
    other("reward weights", [float(w) for w in spec.rewards.weights],
          [float(w) for w in kw["reward_weights"]] if kw.get("reward_weights") is not None else None,
          "reward_weights", "rewards.weights")
    q.update(_quirk_facts(spec))
    # any other [trl] override is a difference of its own: the translation never sets it
    covered = {f for v in q.values() for f in v[2]}
    for key, value in tr.overrides.items():
        if key not in covered:
            q[f"[trl] {key}"] = ("(TRL default)", value, (key,), f"other:{key}", {"drop_trl": [key]})
    return q


def _trl_override(tr: Translation, *keys) -> dict:
    """The alignment that drops those of `keys` the spec's [trl] table overrides."""
    return {"drop_trl": [k for k in keys if k in tr.overrides]}


def _batch_facts(spec, tr: Translation, n_rows: int | None) -> dict:
    """The batch quantities (the lesson's first check): prompts, sequences and micro-batches per step, steps per
    generation, the generation batch, steps per epoch (given the data set's `n_rows`), the prompt order."""
    kw = tr.kwargs
    G = kw["num_generations"]
    ga = kw["gradient_accumulation_steps"]
    n = spec.PROCESSES
    spg = kw.get("steps_per_generation") or ga
    trl_seqs = kw["per_device_train_batch_size"] * ga * n
    trl_gen = kw.get("generation_batch_size") or kw["per_device_train_batch_size"] * spg * n
    trl_override = lambda *keys: _trl_override(tr, *keys)  # noqa: E731

    q = {}
    q["prompts per optimizer step"] = (spec.PROMPTS_PER_STEP, trl_seqs // G,
                                       ("BATCH_MAPPING", "per_device_train_batch_size", "gradient_accumulation_steps"),
                                       "batch", {"set": {"BATCH_MAPPING": "matched"},
                                                 **trl_override("per_device_train_batch_size",
                                                                "gradient_accumulation_steps", "num_generations")})
    q["sequences per optimizer step"] = (spec.sequences_per_step, trl_seqs, q["prompts per optimizer step"][2], "batch",
                                         q["prompts per optimizer step"][4])
    q["completions per prompt"] = (spec.GROUP_SIZE, G, ("GROUP_SIZE", "num_generations"), "batch",
                                   trl_override("num_generations"))
    q["micro-batches per step (all processes)"] = (spec.GRAD_ACCUM, ga * n, ("GRAD_ACCUM", "gradient_accumulation_steps"),
                                                   "batch", trl_override("gradient_accumulation_steps"))
    q["sequences per micro-batch"] = (spec.micro_batch_size, kw["per_device_train_batch_size"],
                                      q["prompts per optimizer step"][2], "batch", q["prompts per optimizer step"][4])
    q["optimizer steps per generation"] = (spec.STEPS_PER_GENERATION, spg // ga if spg % ga == 0 else spg / ga,
                                           ("STEPS_PER_GENERATION", "steps_per_generation"), "batch",
                                           trl_override("steps_per_generation", "generation_batch_size"))
    q["generation batch (sequences)"] = (spec.sequences_per_step * spec.STEPS_PER_GENERATION, trl_gen,
                                         ("steps_per_generation", "generation_batch_size"), "batch",
                                         {"set": {"BATCH_MAPPING": "matched"},
                                          **trl_override("steps_per_generation", "generation_batch_size",
                                                         "per_device_train_batch_size")})
    if n_rows:
        q["optimizer steps per epoch"] = (round(n_rows / spec.PROMPTS_PER_STEP, 2), round(n_rows / (trl_seqs // G), 2),
                                          q["prompts per optimizer step"][2], "batch", q["prompts per optimizer step"][4])
    q["prompt order"] = ("shared schedule", "TRL's own shuffle" if kw["shuffle_dataset"] else "shared schedule",
                         ("shuffle_dataset",), "batch", trl_override("shuffle_dataset"))
    return q


def _lr_facts(spec, tr: Translation) -> dict:
    """The learning rate at the first and the last optimizer step on each side (each side's own schedule)."""
    kw = tr.kwargs
    trl_cfg = tr.config("/tmp/grpo-parity-preflight", **tr.validated_with)
    trl_warmup = trl_cfg.get_warmup_steps(kw["max_steps"])
    s_lr = ((float(spec.LR_STEPS[0]), float(spec.LR_STEPS[min(spec.STEPS, len(spec.LR_STEPS)) - 1])) if spec.LR_STEPS
            else _lr_first_last(_scratch_lr_name(spec), spec.LR, spec.STEPS, spec.WARMUP_STEPS,
                                spec.LR_SCHEDULER_KWARGS or None))
    t_lr = _lr_first_last(trl_cfg.lr_scheduler_type, kw["learning_rate"], kw["max_steps"], trl_warmup,
                          trl_cfg.lr_scheduler_kwargs or None)
    lr_fields = ("learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "lr_scheduler_kwargs")
    q = {"lr at first step": (s_lr[0], t_lr[0], ("LR", "WARMUP_STEPS", *lr_fields), "other:learning_rate",
                              _trl_override(tr, *lr_fields))}
    # the last step's lr is the schedule's doing only where the schedules' shapes differ: the same shape at another
    # peak (TRL's learning_rate x1.02) is the learning rate at both ends, and named so (an H100 run named it
    # lr_scheduler_type, a field both sides had alike)
    same_shape = bool(s_lr[0] and t_lr[0]) and math.isclose(s_lr[1] / s_lr[0], t_lr[1] / t_lr[0], rel_tol=1e-9)
    last_check = "other:learning_rate" if s_lr[0] != t_lr[0] and same_shape else "other:lr_scheduler_type"
    q["lr at last step"] = (s_lr[1], t_lr[1], ("LR", "LR_SCHEDULE", *lr_fields), last_check,
                            _trl_override(tr, *lr_fields))
    return q


def _quirk_facts(spec) -> dict:
    """The quirks of hand-written loops (fields.QUIRKS): scratch-loop fields TRL has no setting for, TRL always
    doing what `trl_fixed` says."""
    q = {}
    for key, f in QUIRKS.items():
        if key.startswith("KL_") and not spec.BETA or key == "LOGP_OLD" or key == "MASK_TOKEN_DROP" and \
                spec.MASK_TOKEN_ID < 0 or key == "TRUNCATED_IF" and not spec.MASK_TRUNCATED:
            continue  # no KL term (no token id), nothing for the estimator or its place (the drop) to change
        q[f.quantity] = (getattr(spec, key), f.trl_fixed, (key,), f"quirk:{key}", {"set": {key: f.trl_fixed}})
    if spec.LOGP_OLD == "current" and (spec.NUM_ITERATIONS > 1 or spec.STEPS_PER_GENERATION > 1 or spec.SELECTION):
        # (with one pass over each whole round the ratio is 1 either way: no difference to name)
        auto = QUIRKS["LOGP_OLD"].trl_fixed
        q[QUIRKS["LOGP_OLD"].quantity] = (spec.LOGP_OLD, auto, ("LOGP_OLD",), "quirk:LOGP_OLD", {"set": {"LOGP_OLD": auto}})
    return q


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


class PreflightFacts(dict):
    """preflight()'s quantities ({quantity: (scratch, trl, fields, check, align)}), plus `checkpoint` (the
    CheckpointFacts) and `checkpoint_dir` (None when the checkpoint is not on disk yet: nothing was read)."""
    checkpoint: list | tuple = ()
    checkpoint_dir: Path | None = None


def preflight(spec, n_rows: int | None = None) -> tuple[Translation, list[Difference], dict]:
    """The translation, the differences (the lesson's checks first), and every quantity compared (a
    PreflightFacts: its `checkpoint` holds what the starting checkpoint sets, when it is on disk)."""
    tr = translate(spec)
    facts = PreflightFacts(side_facts(spec, tr, n_rows))
    facts.checkpoint_dir = existing_checkpoint_dir(spec)
    facts.checkpoint = checkpoint_facts(spec, tr, facts.checkpoint_dir) if facts.checkpoint_dir else []
    for fact in facts.checkpoint:
        for key in fact.covers:  # the checkpoint says exactly what this override does: no generic entry
            facts.pop(f"[trl] {key}", None)
    diffs = [Difference(name, check, s, t, fields, align) for name, (s, t, fields, check, align) in facts.items()
             if not _same(s, t)]
    diffs += [Difference(f.quantity, f.check, f.scratch, f.trl, f.fields, f.align) for f in facts.checkpoint
              if f.kind == "difference"]
    rank = {c: i for i, c in enumerate(CHECK_ORDER)}
    diffs.sort(key=lambda d: rank.get(d.check, len(rank)))
    return tr, diffs, facts


def alignment_for(diffs: list[Difference], check: str) -> dict:
    """The union of the alignments of every difference under one check label."""
    out = {"set": {}, "drop_trl": []}
    for d in diffs:
        if d.check == check:
            out["set"].update(d.align.get("set", {}))
            out["drop_trl"] += [k for k in d.align.get("drop_trl", []) if k not in out["drop_trl"]]
            if d.align.get("set_trl"):  # (the checkpoint's differences: a [trl] value that makes TRL do the same)
                out.setdefault("set_trl", {}).update(d.align["set_trl"])
    return out


def apply_alignment(spec, align: dict):
    """A copy of `spec` changed as `align` says: `set` spec keys (dotted for tables), `drop_trl` [trl] overrides,
    `set_trl` [trl] overrides."""
    from harness.experiment.spec import parse_spec

    raw = copy.deepcopy(spec.to_dict())
    for key, value in align.get("set", {}).items():
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    for key in align.get("drop_trl", []):
        raw["trl"].pop(key, None)
    raw["trl"].update(align.get("set_trl", {}))
    return parse_spec(raw)


def format_preflight(facts: dict, diffs: list[Difference]) -> str:
    lines = [f"{'quantity':38s} {'scratch':>24s} {'trl':>24s}  check"]
    differing = {d.quantity for d in diffs}
    for name, (s, t, _fields, check, _align) in facts.items():
        mark = check if name in differing else ""
        lines.append(f"{name:38s} {str(s):>24s} {str(t):>24s}  {mark}")
    lines.append("")
    checkpoint = list(getattr(facts, "checkpoint", ()))
    if checkpoint:  # before the summary: `parity` prints only the last block
        lines += format_checkpoint(checkpoint, getattr(facts, "checkpoint_dir", None))
        lines.append("")
    if diffs:
        lines.append(f"{len(diffs)} difference(s), the lesson's checks first:")
        for d in diffs:
            lines.append(f"  [{d.check}] {d.quantity}: scratch {d.scratch!r} vs TRL {d.trl!r}")
    else:
        warned = any(f.kind == "warning" for f in checkpoint)
        lines.append("aligned: the two sides will compute the same thing"
                     + (" (but see the checkpoint warnings above)" if warned else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# what to change, in words
# ---------------------------------------------------------------------------------------------
def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def fix_for(spec, diffs: list[Difference], check: str) -> dict:
    """What aligning `check` changes, and a sentence saying it: `trl` (GRPOConfig fields that change, to set in
    `[trl]` so TRL does what the scratch loop does), `scratch` (spec fields that change on the scratch side when TRL
    has no setting for it), `sentence`."""
    mine = [d for d in diffs if d.check == check]
    align = alignment_for(diffs, check)
    if check.startswith("quirk:") and mine:  # TRL has no setting: the only match is on the scratch side
        key = check.split(":", 1)[1]
        default, words = QUIRKS[key].trl_fixed, QUIRKS[key].preflight_words
        value = mine[0].scratch
        fallback = words.get("*", f"has {key} = {value!r}")
        said = fallback if isinstance(value, (list, dict)) else words.get(value, fallback)
        return {"trl": {}, "scratch": {key: default},
                "sentence": f"the scratch loop {said}: set {key} = {_toml(default)} in the spec to match"}
    try:
        before, after = translate(spec).kwargs, translate(apply_alignment(spec, align)).kwargs
    except Exception:  # an alignment the installed TRL refuses: say what differs, without a fix
        before = after = {}
    trl = {k: after.get(k) for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)}
    scratch = {k: v for k, v in align.get("set", {}).items() if k != "BATCH_MAPPING" and not trl}
    if check == "loss_type" and mine:
        d = mine[0]
        said = FIELDS["LOSS_NORM"].preflight_words
        what = (f"TRL {said.get(d.trl, d.trl)} (loss_type={before.get('loss_type')}); the scratch loop "
                f"{said.get(d.scratch, d.scratch)}")
    elif check == "batch" and mine:
        facts = {d.quantity: d for d in mine}
        p = facts.get("prompts per optimizer step")
        s = facts.get("sequences per optimizer step")
        what = "; ".join(f"{d.quantity}: TRL {d.trl}, the scratch loop {d.scratch}" for d in mine[:2])
        if p and s:
            what = (f"TRL takes {p.trl} prompts ({s.trl} sequences) per optimizer step, the scratch loop {p.scratch} "
                    f"({s.scratch}): per_device_train_batch_size counts completions, not prompts")
    elif check == "importance_sampling" and mine:
        d = mine[0]
        mode = before.get("vllm_importance_sampling_mode")
        what = (f"TRL multiplies the loss by an importance-sampling ratio ({mode}), the scratch loop does not"
                if d.trl == "on" else "; ".join(f"{x.quantity}: TRL {x.trl}, the scratch loop {x.scratch}" for x in mine))
    else:
        what = "; ".join(f"{d.quantity}: TRL {d.trl!s}, the scratch loop {d.scratch!s}" for d in mine) or check
    if trl:
        how = "set " + ", ".join(f"{k} = {_toml(v)}" for k, v in trl.items()) + " in [trl] to match"
    elif scratch:
        how = ("TRL has no setting for it; set " + ", ".join(f"{k} = {_toml(v)}" for k, v in scratch.items())
               + " in the spec (the scratch loop) to match")
    else:
        how = ""
    return {"trl": trl, "scratch": scratch, "sentence": what + (": " + how if how else "")}
