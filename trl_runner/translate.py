"""Spec -> GRPOConfig for the installed TRL, and the mapping table that explains it.

The translation sets what the scratch loop means (`matched` batch semantics by default), names every
TRL default that changes the math, and applies the spec's `[trl]` table last. Every field is checked
against the installed TRL's `GRPOConfig` (`dataclasses.fields`) before any model loads; a field TRL
lacks is refused with TRL's version and, where one exists, what replaces it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from harness.experiment.models import precision_words
from harness.experiment.spec import SpecError

LOSS_TYPES = {"sequence": "grpo", "token_local": "bnpo", "token_global": "dapo", "constant": "dr_grpo"}
NORM_OF_LOSS_TYPE = {v: k for k, v in LOSS_TYPES.items()}

# fields earlier TRL releases had, and what to do instead on this one
REPLACED = {
    "max_prompt_length": "TRL 1.16 removed it; set MAX_PROMPT_TOKENS in the spec instead: the harness truncates "
                         "prompts itself (keeping the last tokens), for both loops",
}
# which of the lesson's three checks a TRL field belongs to; the rest are `other:<field>`
CHECK_OF_FIELD = {
    "per_device_train_batch_size": "batch", "gradient_accumulation_steps": "batch", "num_generations": "batch",
    "steps_per_generation": "batch", "generation_batch_size": "batch",
    "loss_type": "loss_type",
    "use_vllm": "importance_sampling", "vllm_importance_sampling_correction": "importance_sampling",
    "vllm_importance_sampling_mode": "importance_sampling", "vllm_importance_sampling_clip_min": "importance_sampling",
    "vllm_importance_sampling_clip_max": "importance_sampling",
}


def trl_version() -> str:
    import trl

    return trl.__version__


def grpo_config_fields() -> set[str]:
    from trl import GRPOConfig

    return {f.name for f in dataclasses.fields(GRPOConfig)}


# Values TRL documents only in a field's help (GRPOConfig gives no `choices`) and refuses late, at the trainer's
# start or first loss; a value a newer TRL quotes in that help passes too.
TRL_CHOICES = {
    "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
    "scale_rewards": ("group", "batch", "none", True, False),
    "importance_sampling_level": ("token", "sequence"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "vllm_mode": ("server", "colocate"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
}
# Ranges GRPOConfig does not check itself (its __post_init__ catches batch divisibility and num_generations < 2,
# not these); a value outside dies at the first step or trains on nonsense. "[a, b)": interval notation.
TRL_RANGES = {
    "learning_rate": "(0, inf)", "num_generations": "[2, inf)", "per_device_train_batch_size": "[1, inf)",
    "gradient_accumulation_steps": "[1, inf)", "steps_per_generation": "[1, inf)", "generation_batch_size": "[1, inf)",
    "max_completion_length": "[1, inf)", "num_iterations": "[1, inf)", "temperature": "(0, inf)", "top_p": "(0, 1]",
    "top_k": "[0, inf)", "min_p": "[0, 1]", "repetition_penalty": "(0, inf)", "beta": "[0, inf)", "epsilon": "[0, inf)",
    "epsilon_high": "[0, inf)", "delta": "(0, inf)", "max_grad_norm": "[0, inf]", "weight_decay": "[0, inf)",
    "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "adam_epsilon": "[0, inf)", "warmup_steps": "[0, inf)",
    "max_steps": "[1, inf)", "logging_steps": "(0, inf)", "seed": "[0, inf)", "vllm_gpu_memory_utilization": "(0, 1]",
    "vllm_importance_sampling_clip_min": "[0, inf)", "vllm_importance_sampling_clip_max": "(0, inf)",
}


def in_interval(value, interval: str) -> bool:
    """`value` in an interval written "[a, b)" ("inf" allowed); NaN is in none."""
    lo_text, hi_text = interval[1:-1].split(",")
    lo, hi = float(lo_text), float(hi_text)
    above = value > lo if interval[0] == "(" else value >= lo
    below = value < hi if interval[-1] == ")" else value <= hi
    return above and below


def accepts(tp, value) -> bool:
    """Whether a TOML value fits a GRPOConfig field's annotation (unions, Optional, Literal, str enums, lists of a
    type); an annotation TOML cannot write (a config object) is left to GRPOConfig."""
    import enum
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        enums = _enums(tp)
        if enums and isinstance(value, str):  # `SchedulerType | str`: a string that names a member
            return any(accepts(a, value) for a in enums)
        return any(accepts(a, value) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if tp is type(None):
        return value is None
    if tp is typing.Any:
        return True
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return value in {m.value for m in tp}
    if tp is str:
        return isinstance(value, str)
    if (origin or tp) is list:
        return isinstance(value, list) and (not args or all(accepts(args[0], v) for v in value))
    if (origin or tp) is dict:
        return isinstance(value, dict)
    return True


def _enums(tp) -> list:
    import enum
    import typing

    return [a for a in typing.get_args(tp) if isinstance(a, type) and issubclass(a, enum.Enum)]


def _annotation_text(tp) -> str:
    import typing

    if _enums(tp):
        return "one of " + ", ".join(repr(m.value) for e in _enums(tp) for m in e)
    text = getattr(tp, "__name__", None) if typing.get_origin(tp) is None else None
    return text or str(tp).replace("typing.", "")


def check_trl_value(key: str, value, tp, help_text: str = "") -> None:
    """One `[trl]` value against its GRPOConfig field: type, the documented choices, the range; SpecError naming
    `trl.<key>`, the value and what is allowed."""
    import math

    choices = TRL_CHOICES.get(key)
    if choices is not None:
        documented = isinstance(value, str) and any(f"{q}{value}{q}" in help_text for q in "'`\"")
        if not documented and not any(value == c and type(value) is type(c) for c in choices):
            raise SpecError(f"trl.{key}", f"must be one of {', '.join(map(repr, choices))}; got {value!r}")
        return
    if not accepts(tp, value):
        raise SpecError(f"trl.{key}", f"GRPOConfig.{key} is {_annotation_text(tp)}; got {type(value).__name__} "
                        f"{value!r}")
    numbers = [v for v in (value if isinstance(value, list) else [value])
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if any(isinstance(v, float) and math.isnan(v) for v in numbers):
        raise SpecError(f"trl.{key}", f"must be a number, got {value!r}")
    interval = TRL_RANGES.get(key)
    if interval and numbers and not in_interval(numbers[0], interval):
        raise SpecError(f"trl.{key}", f"must be in {interval}; got {value!r}")


def check_trl_overrides(overrides: dict) -> None:
    """Every `[trl]` value against the installed TRL's GRPOConfig field types, choices and ranges, before any
    model loads (GRPOConfig itself checks few of them; the rest fail mid-run)."""
    import typing

    from trl import GRPOConfig

    hints = typing.get_type_hints(GRPOConfig)
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for key, value in overrides.items():
        if key in fields:
            check_trl_value(key, value, hints.get(key, typing.Any), fields[key].metadata.get("help", ""))
            meta_choices = fields[key].metadata.get("choices")
            if meta_choices and value not in meta_choices:
                raise SpecError(f"trl.{key}", f"must be one of {', '.join(map(repr, meta_choices))}; got {value!r}")


@dataclasses.dataclass
class Translation:
    kwargs: dict  # GRPOConfig keyword arguments (without output_dir)
    table: list[dict]  # the mapping table rows
    overrides: dict  # the [trl] table as applied
    prompts_per_step: int  # what TRL will really take per optimizer step
    sequences_per_step: int
    validated_with: dict = dataclasses.field(default_factory=dict)  # device fields swapped to check it here

    def config(self, output_dir: str | Path, **extra):
        from trl import GRPOConfig

        return GRPOConfig(output_dir=str(output_dir), **{**self.kwargs, **extra})


def _row(check, scratch_name, scratch_value, trl_field, trl_value, note=""):
    return {"check": check, "scratch": scratch_name, "scratch_value": scratch_value, "trl": trl_field,
            "trl_value": trl_value, "note": note}


def translate(spec) -> Translation:
    """Translate `spec` into GRPOConfig kwargs; raises SpecError for fields the installed TRL lacks.

    With PROCESSES = N the TRL side accumulates GRAD_ACCUM / N micro-batches per process, so N processes x
    GRAD_ACCUM / N micro-batches hold the scratch loop's GRAD_ACCUM micro-batches of the same size."""
    known = grpo_config_fields()
    version = trl_version()
    G, P, GA, processes = spec.GROUP_SIZE, spec.PROMPTS_PER_STEP, spec.GRAD_ACCUM, spec.PROCESSES
    ga = GA // processes
    if spec.BATCH_MAPPING == "matched":
        per_device = P * G // GA
    else:  # the lesson's mistake, kept as a named variant for the matrix
        per_device = P
    kw = {
        "num_generations": G,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": ga,
        "max_completion_length": spec.MAX_TOKENS,
        "temperature": spec.TEMPERATURE, "top_p": spec.TOP_P, "top_k": spec.TOP_K,
        "loss_type": LOSS_TYPES[spec.LOSS_NORM],
        "scale_rewards": spec.ADV_SCALE,
        "epsilon": spec.CLIP_LOW, "epsilon_high": spec.CLIP_HIGH, "delta": spec.DELTA or None,
        "beta": spec.BETA, "use_bias_correction_kl": spec.KL_IS_CORRECTION,
        "num_iterations": spec.NUM_ITERATIONS,
        "mask_truncated_completions": spec.MASK_TRUNCATED,
        "learning_rate": spec.LR,
        "lr_scheduler_type": ("constant_with_warmup" if spec.WARMUP_STEPS else "constant")
        if spec.LR_SCHEDULE == "constant" else spec.LR_SCHEDULE,
        "warmup_steps": spec.WARMUP_STEPS,
        "adam_beta1": spec.ADAM_BETA1, "adam_beta2": spec.ADAM_BETA2, "adam_epsilon": spec.ADAM_EPS,
        "weight_decay": spec.WEIGHT_DECAY, "max_grad_norm": spec.MAX_GRAD_NORM, "optim": spec.OPTIM,
        "max_steps": spec.STEPS, "seed": spec.SEED,
        "reward_weights": [float(w) for w in spec.rewards.weights],
        "use_vllm": spec.sampler.kind == "vllm",
        "vllm_importance_sampling_correction": spec.IS_CORRECTION,
        "vllm_importance_sampling_mode": spec.IS_MODE,
        "vllm_importance_sampling_clip_min": spec.IS_CLIP_MIN or None,
        "vllm_importance_sampling_clip_max": spec.IS_CLIP_MAX,
        # harness plumbing: data comes pre-ordered, every step is logged, nothing is saved or reported
        "shuffle_dataset": False, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
        "dataloader_num_workers": 0, "use_cpu": spec.DEVICE == "cpu", "bf16": spec.DTYPE == "bfloat16",
        "full_determinism": spec.DETERMINISTIC,
    }
    if spec.LR_SCHEDULER_KWARGS:  # the schedule's parameters (min_lr_rate, num_cycles, power, lr_end, ...)
        kw["lr_scheduler_kwargs"] = dict(spec.LR_SCHEDULER_KWARGS)
    if spec.STEPS_PER_GENERATION > 1:  # several optimizer steps per generation (defaults to one per generation)
        kw["steps_per_generation"] = ga * spec.STEPS_PER_GENERATION
    gc_field = "activation_checkpointing" if "activation_checkpointing" in known else "gradient_checkpointing"
    kw[gc_field] = spec.GRADIENT_CHECKPOINTING
    if spec.sampler.kind == "vllm":
        kw.update(vllm_mode="colocate", vllm_gpu_memory_utilization=spec.sampler.vllm_gpu_memory_utilization,
                  vllm_enable_sleep_mode=spec.sampler.vllm_sleep)

    overrides = dict(spec.trl)
    for key in list(kw) + list(overrides):
        if key not in known:
            where = "[trl] override" if key in overrides else "translation"
            fix = REPLACED.get(key, "remove it from [trl], or install the TRL release that has it")
            raise SpecError(f"trl.{key}" if key in overrides else key,
                            f"GRPOConfig of the installed TRL {version} has no field {key!r} ({where}); {fix}")
    check_trl_overrides(overrides)
    final = {**kw, **overrides}

    spg = final.get("steps_per_generation") or final["gradient_accumulation_steps"]
    gen_batch = final.get("generation_batch_size") or final["per_device_train_batch_size"] * processes * spg
    seqs = final["per_device_train_batch_size"] * final["gradient_accumulation_steps"] * processes
    if gen_batch % final["num_generations"]:
        raise SpecError("BATCH_MAPPING", f"TRL's generation batch ({gen_batch} sequences) is not a multiple of "
                        f"num_generations ({final['num_generations']}); TRL would refuse to start")
    table = mapping_table(spec, final, overrides)
    translation = Translation(kwargs=final, table=table, overrides=overrides,
                              prompts_per_step=seqs // final["num_generations"], sequences_per_step=seqs)
    # GRPOConfig's own checks (value types, batch divisibility), still before any model. A GPU spec checked on a
    # machine without one (the preflight runs anywhere) is built with use_cpu/bf16 swapped: the rest is checked.
    import torch

    stand_in = {} if spec.DEVICE == "cpu" or torch.cuda.is_available() else {"use_cpu": True, "bf16": False}
    translation.validated_with = stand_in
    try:
        translation.config("/tmp/grpo-parity-validate", **stand_in)
    except (ValueError, TypeError) as e:
        bad = [k for k in overrides if k in str(e)]
        raise SpecError(f"trl.{bad[0]}" if bad else "trl", f"TRL {version} refuses the translated GRPOConfig: "
                        f"{str(e).splitlines()[0]}") from None
    return translation


def mapping_table(spec, kw: dict, overrides: dict) -> list[dict]:
    """The lesson's parameter table, made real: scratch name, TRL field, both values, and a note."""
    G, processes = kw["num_generations"], spec.PROCESSES
    seqs = kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] * processes
    T = []
    T.append(_row("batch", "PROMPTS_PER_STEP x GROUP_SIZE", f"{spec.PROMPTS_PER_STEP} x {spec.GROUP_SIZE} = "
                  f"{spec.sequences_per_step} sequences",
                  "per_device_train_batch_size x gradient_accumulation_steps x processes",
                  f"{kw['per_device_train_batch_size']} x {kw['gradient_accumulation_steps']} x {processes} = {seqs} "
                  f"sequences = {seqs // G} prompts",
                  "per_device_train_batch_size counts completions, not prompts (TRL #2776)"
                  + ("; the naive mapping halves or worse the prompts per step" if spec.BATCH_MAPPING == "naive" else "")))
    T.append(_row("batch", "GROUP_SIZE", spec.GROUP_SIZE, "num_generations", G))
    T.append(_row("batch", "GRAD_ACCUM / PROCESSES", f"{spec.GRAD_ACCUM} / {processes}", "gradient_accumulation_steps",
                  kw["gradient_accumulation_steps"], "steps_per_generation defaults to it: one generation per "
                  "optimizer step, shuffled with torch.randperm and cut into micro-batches (per process)"))
    spg = kw.get("steps_per_generation") or kw["gradient_accumulation_steps"]
    T.append(_row("batch", "STEPS_PER_GENERATION x GRAD_ACCUM / PROCESSES", f"{spec.STEPS_PER_GENERATION} x "
                  f"{spec.GRAD_ACCUM} / {processes}", "steps_per_generation", spg,
                  "micro-batches per generation: a generation feeds steps_per_generation / gradient_accumulation_steps "
                  "optimizer steps"))
    T.append(_row("loss_type", "LOSS_NORM", spec.LOSS_NORM, "loss_type", kw["loss_type"],
                  "TRL's default is dapo (token_global); a hand-written loop usually averages per sequence"))
    T.append(_row("importance_sampling", "IS_CORRECTION / sampler.kind",
                  f"{spec.IS_CORRECTION} / {spec.sampler.kind}", "vllm_importance_sampling_correction / use_vllm",
                  f"{kw['vllm_importance_sampling_correction']} / {kw['use_vllm']}",
                  "TRL defaults the correction on, but it only acts with vLLM (or the harness's emulated sampler)"))
    T.append(_row("importance_sampling", "IS_MODE, IS_CLIP_MIN, IS_CLIP_MAX",
                  f"{spec.IS_MODE}, {spec.IS_CLIP_MIN or None}, {spec.IS_CLIP_MAX}",
                  "vllm_importance_sampling_mode, _clip_min, _clip_max",
                  f"{kw['vllm_importance_sampling_mode']}, {kw['vllm_importance_sampling_clip_min']}, "
                  f"{kw['vllm_importance_sampling_clip_max']}",
                  "sequence modes multiply per-token ratios: small per-token gaps compound over long completions"))
    T.append(_row("other", "ADV_SCALE", spec.ADV_SCALE, "scale_rewards", kw["scale_rewards"]))
    T.append(_row("other", "STD", spec.STD, "(fixed)", "bessel",
                  "TRL divides by the Bessel-corrected group std (nanstd, n-1); many scratch loops use n"))
    T.append(_row("other", "STD_EPS", spec.STD_EPS, "(fixed)", 1e-4, "TRL adds 1e-4 to the std"))
    T.append(_row("other", "ADV_STATS_DTYPE / DROP_ZERO_ADV / ADV_RENORM / ADV_CLAMP",
                  f"{spec.ADV_STATS_DTYPE} / {spec.DROP_ZERO_ADV} / {spec.ADV_RENORM} / {spec.ADV_CLAMP}", "(fixed)",
                  "float32 / False / none / 0.0", "TRL computes the group statistics in float32, trains on every "
                  "completion, normalises once and never clamps; no setting changes any of these"))
    T.append(_row("other", "ADV_MICRO_BATCH_MEAN / ACCUM_DIVISOR", f"{spec.ADV_MICRO_BATCH_MEAN} / "
                  f"{spec.ACCUM_DIVISOR}", "(fixed)", "False / 0.0", "TRL weights each completion by its own "
                  "advantage and divides each micro-batch's loss by gradient_accumulation_steps; no setting changes "
                  "either"))
    T.append(_row("other", "ATTENTION_HIDE_ID / POSITIONS", f"{spec.ATTENTION_HIDE_ID} / {spec.POSITIONS}", "(fixed)",
                  "-1 / auto", "TRL's attention mask is the padding mask and it passes no position ids (the model's "
                  "own); no setting hides a token id or counts positions over the mask"))
    T.append(_row("other", "LOGP_ZERO_ID / END_AT_ID", f"{spec.LOGP_ZERO_ID} / {spec.END_AT_ID}", "(fixed)", "-1 / -1",
                  "TRL scores every completion token and ends completions at the eos only; no setting zeroes a "
                  "token's log-prob (ignore_index) or stops at another id"))
    T.append(_row("other", "TRUNCATED_IF", spec.TRUNCATED_IF, "(fixed)", "no_eos_or_pad",
                  "TRL's mask_truncated_completions takes a completion ending in the eos or the pad id as ended; no "
                  "setting counts one ending in a sampled pad id as truncated"))
    T.append(_row("other", "LOGITS_DTYPE", spec.LOGITS_DTYPE, "(fixed)", "float32",
                  "TRL takes its log_softmax on float32 logits; no setting casts them to a lower precision first"))
    T.append(_row("other", "CLIP_LOW / CLIP_HIGH", f"{spec.CLIP_LOW} / {spec.CLIP_HIGH}", "epsilon / epsilon_high",
                  f"{kw['epsilon']} / {kw['epsilon_high']}", "epsilon_high=None means epsilon"))
    T.append(_row("other", "DELTA", spec.DELTA or None, "delta", kw["delta"]))
    T.append(_row("other", "BETA, KL_IS_CORRECTION", f"{spec.BETA}, {spec.KL_IS_CORRECTION}",
                  "beta, use_bias_correction_kl", f"{kw['beta']}, {kw['use_bias_correction_kl']}",
                  "TRL multiplies the KL term by the policy ratio by default"))
    T.append(_row("other", "NUM_ITERATIONS", spec.NUM_ITERATIONS, "num_iterations", kw["num_iterations"]))
    T.append(_row("other", "LOGP_OLD", spec.LOGP_OLD, "(implicit)", "auto",
                  "TRL runs the extra forward pass only when num_iterations > 1, steps are misaligned or vLLM IS is "
                  "on; otherwise the ratio is exactly 1"))
    T.append(_row("other", "MAX_TOKENS", spec.MAX_TOKENS, "max_completion_length", kw["max_completion_length"]))
    T.append(_row("other", "MAX_PROMPT_TOKENS", spec.MAX_PROMPT_TOKENS or None, "(removed in TRL 1.16)", None,
                  "the harness truncates prompts for both loops"))
    T.append(_row("other", "TEMPERATURE / TOP_P / TOP_K", f"{spec.TEMPERATURE} / {spec.TOP_P} / {spec.TOP_K}",
                  "temperature / top_p / top_k", f"{kw['temperature']} / {kw['top_p']} / {kw['top_k']}",
                  "both compute log-probs on logits / temperature"))
    T.append(_row("other", "LR, LR_SCHEDULE, WARMUP_STEPS", f"{spec.LR}, {spec.LR_SCHEDULE}, {spec.WARMUP_STEPS}"
                  + (f", {spec.LR_SCHEDULER_KWARGS}" if spec.LR_SCHEDULER_KWARGS else ""),
                  "learning_rate, lr_scheduler_type, warmup_steps",
                  f"{kw['learning_rate']}, {kw['lr_scheduler_type']}, {kw['warmup_steps']}"
                  + (f", {kw['lr_scheduler_kwargs']}" if kw.get("lr_scheduler_kwargs") else ""),
                  "TRL's default schedule is linear decay to 0 at max_steps"))
    T.append(_row("other", "ADAM_BETA1 / ADAM_BETA2 / ADAM_EPS / WEIGHT_DECAY",
                  f"{spec.ADAM_BETA1} / {spec.ADAM_BETA2} / {spec.ADAM_EPS} / {spec.WEIGHT_DECAY}",
                  "adam_beta1 / adam_beta2 / adam_epsilon / weight_decay",
                  f"{kw['adam_beta1']} / {kw['adam_beta2']} / {kw['adam_epsilon']} / {kw['weight_decay']}",
                  "TRL's defaults: 0.9 / 0.999 / 1e-8 / 0.0"))
    T.append(_row("other", "OPTIM", spec.OPTIM, "optim", kw["optim"],
                  "adamw_torch_fused: torch.optim.AdamW(fused=True) on both sides (TRL's default); adamw_torch: "
                  "torch's own kernel choice on both sides"))
    T.append(_row("other", "MAX_GRAD_NORM", spec.MAX_GRAD_NORM, "max_grad_norm", kw["max_grad_norm"],
                  "grad_norm is logged before clipping on both sides"))
    T.append(_row("other", "MASK_TRUNCATED", spec.MASK_TRUNCATED, "mask_truncated_completions",
                  kw["mask_truncated_completions"]))
    T.append(_row("other", "SEED", spec.SEED, "seed / shuffle_dataset", f"{kw['seed']} / {kw['shuffle_dataset']}",
                  "the harness orders the data set by the shared prompt schedule; TRL's own shuffle is off"))
    T.append(_row("other", "DETERMINISTIC", spec.DETERMINISTIC, "full_determinism", kw["full_determinism"],
                  "both call transformers' enable_full_determinism"))
    T.append(_row("other", "DTYPE / DEVICE", f"{spec.DTYPE} / {spec.DEVICE}", "bf16 / use_cpu",
                  f"{kw['bf16']} / {kw['use_cpu']}",
                  precision_words(spec.DTYPE, getattr(spec, "MASTER_WEIGHTS", "float32")) + ", on both sides"))
    for key, value in overrides.items():
        T.append(_row(CHECK_OF_FIELD.get(key, "other"), "[trl] override", "", key, value,
                      "set by the spec's [trl] table, after the translation"))
    return T


def write_mapping(translation: Translation, path: str | Path) -> None:
    from harness.runlog.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(translation.table, indent=2, default=str) + "\n")


def format_mapping(table: list[dict]) -> str:
    """The mapping table as aligned text, for the terminal."""
    cols = ("check", "scratch", "scratch_value", "trl", "trl_value")
    rows = [[str(r[c]) for c in cols] for r in table]
    widths = [min(44, max(len(c), *(len(r[i]) for r in rows))) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v[:w].ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, rows)])
