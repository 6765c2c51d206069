"""Preflight: what differs between the two sides, before any model loads or GPU time is spent.

`python -m harness preflight --spec FILE` prints the mapping table and a semantic diff: for each
quantity that shapes the numbers (prompts per step, micro-batches, loss normalizer, clip bounds,
lr at the first and last step, std estimator, IS on/off and mode, ...) what the scratch loop will do
and what TRL will do. Each difference is labelled with the lesson's check it belongs to (`batch`,
`loss_type`, `importance_sampling`) or `other:<field>`, and carries the spec change that aligns it
(used by attribution to confirm a cause). Exit status 0 aligned, 1 differences, 2 bad spec.

It also reads what the starting checkpoint's own files set (`checkpoint_facts`: config.json and
generation_config.json, when the checkpoint is already on disk; no weights are loaded): sampling defaults that
transformers' `generate` picks up on one side and not the other, dropout against TRL's `disable_dropout`, tied
embeddings, the stored dtype against how each side loads. Those that make the sides differ are differences
too; the rest are printed under "checkpoint defaults" as notes and warnings.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import re
import textwrap
from pathlib import Path

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
    if spec.LR_SCHEDULE == "linear":
        return "linear"
    return "constant_with_warmup" if spec.WARMUP_STEPS else "constant"


def side_facts(spec, tr: Translation, n_rows: int | None = None) -> tuple[dict, dict]:
    """Per quantity: (value on the scratch side, value on the TRL side, fields, check, alignment)."""
    kw = tr.kwargs
    G = kw["num_generations"]
    ga = kw["gradient_accumulation_steps"]
    n = spec.PROCESSES
    spg = kw.get("steps_per_generation") or ga
    trl_seqs = kw["per_device_train_batch_size"] * ga * n
    trl_gen = kw.get("generation_batch_size") or kw["per_device_train_batch_size"] * spg * n
    emulated_or_vllm = spec.sampler.kind in ("emulated", "vllm") or kw.get("use_vllm")
    trl_is = bool(emulated_or_vllm and kw["vllm_importance_sampling_correction"])
    scratch_is = bool(spec.sampler.kind != "policy" and spec.IS_CORRECTION)
    trl_cfg = tr.config("/tmp/grpo-parity-preflight", **tr.validated_with)
    trl_warmup = trl_cfg.get_warmup_steps(kw["max_steps"])
    s_lr = ((float(spec.LR_STEPS[0]), float(spec.LR_STEPS[min(spec.STEPS, len(spec.LR_STEPS)) - 1])) if spec.LR_STEPS
            else _lr_first_last(_scratch_lr_name(spec), spec.LR, spec.STEPS, spec.WARMUP_STEPS))
    t_lr = _lr_first_last(trl_cfg.lr_scheduler_type, kw["learning_rate"], kw["max_steps"], trl_warmup,
                          trl_cfg.lr_scheduler_kwargs or None)
    trl_override = lambda *keys: {"drop_trl": [k for k in keys if k in tr.overrides]}  # noqa: E731

    q = {}  # quantity -> (scratch, trl, fields, check, align)
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
    lr_fields = ("learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "lr_scheduler_kwargs")
    q["lr at first step"] = (s_lr[0], t_lr[0], ("LR", "WARMUP_STEPS", *lr_fields), "other:learning_rate",
                             trl_override(*lr_fields))
    # the last step's lr is the schedule's doing only where the schedules' shapes differ: the same shape at another
    # peak (TRL's learning_rate x1.02) is the learning rate at both ends, and named so (an H100 run named it
    # lr_scheduler_type, a field both sides had alike)
    same_shape = bool(s_lr[0] and t_lr[0]) and math.isclose(s_lr[1] / s_lr[0], t_lr[1] / t_lr[0], rel_tol=1e-9)
    last_check = "other:learning_rate" if s_lr[0] != t_lr[0] and same_shape else "other:lr_scheduler_type"
    q["lr at last step"] = (s_lr[1], t_lr[1], ("LR", "LR_SCHEDULE", *lr_fields), last_check, trl_override(*lr_fields))
    other("adam beta1", spec.ADAM_BETA1, kw["adam_beta1"], "adam_beta1", "ADAM_BETA1")
    other("adam beta2", spec.ADAM_BETA2, kw["adam_beta2"], "adam_beta2", "ADAM_BETA2")
    other("adam epsilon", spec.ADAM_EPS, kw["adam_epsilon"], "adam_epsilon", "ADAM_EPS")
    other("weight decay", spec.WEIGHT_DECAY, kw["weight_decay"], "weight_decay", "WEIGHT_DECAY")
    other("grad-norm clip", spec.MAX_GRAD_NORM, kw["max_grad_norm"], "max_grad_norm", "MAX_GRAD_NORM")
    other("optimizer steps", spec.STEPS, kw["max_steps"], "max_steps", "STEPS")
    other("seed", spec.SEED, kw["seed"], "seed", "SEED")
    other("deterministic kernels", spec.DETERMINISTIC, kw["full_determinism"], "full_determinism", "DETERMINISTIC")
    other("reward weights", [float(w) for w in spec.rewards.weights],
          [float(w) for w in kw["reward_weights"]] if kw.get("reward_weights") is not None else None,
          "reward_weights", "rewards.weights")
    # quirks of hand-written loops: scratch-loop fields TRL has no setting for (TRL always does the default)
    for key, f in QUIRKS.items():
        if key.startswith("KL_") and not spec.BETA or key == "LOGP_OLD" or key == "MASK_TOKEN_DROP" and \
                spec.MASK_TOKEN_ID < 0:
            continue  # no KL term (no token id), nothing for the estimator or its place (the drop) to change
        q[f.quantity] = (getattr(spec, key), f.trl_fixed, (key,), f"quirk:{key}", {"set": {key: f.trl_fixed}})
    if spec.LOGP_OLD == "current" and (spec.NUM_ITERATIONS > 1 or spec.STEPS_PER_GENERATION > 1 or spec.SELECTION):
        # (with one pass over each whole round the ratio is 1 either way: no difference to name)
        auto = QUIRKS["LOGP_OLD"].trl_fixed
        q[QUIRKS["LOGP_OLD"].quantity] = (spec.LOGP_OLD, auto, ("LOGP_OLD",), "quirk:LOGP_OLD", {"set": {"LOGP_OLD": auto}})
    # any other [trl] override is a difference of its own: the translation never sets it
    covered = {f for v in q.values() for f in v[2]}
    for key, value in tr.overrides.items():
        if key not in covered:
            q[f"[trl] {key}"] = ("(TRL default)", value, (key,), f"other:{key}", {"drop_trl": [key]})
    return q


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


# ---------------------------------------------------------------------------------------------
# checkpoint defaults: what the starting checkpoint's own files set, read without loading weights
# ---------------------------------------------------------------------------------------------
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
_NEUTRAL = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
_CKPT = "the checkpoint's"  # the source of a value transformers' generate fills from generation_config.json
_HEAD_ONLY_DROPOUT = ("classifier_dropout", "summary_first_dropout")  # heads a causal LM does not run
_LOCKSTEP_SAMPLING = ("in lockstep it has no effect on the loss: the shared sampler draws (through the scratch "
                      "side's path, harness/rollouts/lockstep.py) and both sides train on the same completions")


@dataclasses.dataclass
class CheckpointFact:
    """One thing the starting checkpoint's config.json or generation_config.json sets, and what each side does
    with it. `kind`: "difference" (the sides differ: one of preflight()'s differences), "warning" (no setting
    differs, but the numbers will, or a side you run yourself would), "note" (information)."""
    field: str  # the checkpoint's key (top_k, attention_dropout, tie_word_embeddings, dtype) or the TRL field
    quantity: str  # in words
    scratch: object  # what the scratch loop uses
    trl: object  # what TRL uses
    why: str  # which code path picks it up and which overrides it, in plain words, and the fix where one exists
    kind: str = "note"
    fields: tuple = ()
    align: dict = dataclasses.field(default_factory=dict)
    covers: tuple = ()  # [trl] overrides this fact says all there is about: their generic "[trl] key" entry goes
    who: str = "scratch"  # the side `scratch` describes ("your loop": a loop of yours set in [loop])

    @property
    def check(self) -> str:
        return f"other:{self.field}"


class PreflightFacts(dict):
    """preflight()'s quantities ({quantity: (scratch, trl, fields, check, align)}), plus `checkpoint` (the
    CheckpointFacts) and `checkpoint_dir` (None when the checkpoint is not on disk yet: nothing was read)."""
    checkpoint: list | tuple = ()
    checkpoint_dir: Path | None = None


def _read_json(path: Path) -> tuple[dict | None, str | None]:
    """A checkpoint JSON file: (its object, None), (None, None) when absent, (None, one line saying why) when bad."""
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{path}: cannot be read as JSON ({e}); both loops would fail to load it: fix or re-download it"
    if not isinstance(data, dict):
        return None, f"{path}: not a JSON object; both loops would fail to load it: fix or re-download it"
    return data, None


def _cuda(spec) -> bool:
    if spec.DEVICE == "auto":
        import torch

        return torch.cuda.is_available()
    return spec.DEVICE == "cuda"


def _emulated_sampling(spec) -> tuple[str, str]:
    """The emulated sampler's path (either side): the static-cache decoder where GENERATION resolves to it."""
    if spec.decoder(_cuda(spec)) != "hf":
        return "static", ("the emulated sampler, on the static-cache decoder (harness/rollouts/fastgen.py: "
                          "temperature, top_k and top_p only)")
    return "hf", "the emulated sampler (transformers' generate, harness/rollouts/generate.py's GenerationConfig)"


def _scratch_sampling(spec) -> tuple[str, str]:
    """How the scratch loop (and the lockstep recorder) draws completions: (path, words)."""
    if spec.sampler.kind == "vllm":
        return "vllm", "the harness's vLLM sampler (SamplingParams with the spec's temperature, top_p, top_k only)"
    if spec.sampler.kind == "emulated":
        return _emulated_sampling(spec)
    if spec.decoder(_cuda(spec)) != "hf":
        return "static", "its static-cache decoder (harness/rollouts/fastgen.py: temperature, top_k and top_p only)"
    return "hf", "transformers' generate (harness/rollouts/generate.py's GenerationConfig)"


def _trl_sampling(spec, cfg) -> tuple[str, str]:
    """How the TRL side draws completions when it samples itself: (path, words)."""
    if spec.sampler.kind == "emulated":
        path, words = _emulated_sampling(spec)
        return path, words.replace("the emulated sampler", "the harness's emulated sampler in TRL's vLLM slot", 1)
    if cfg.use_vllm:
        return "trl-vllm", "vLLM with TRL's SamplingParams (trl/generation/vllm_generation.py)"
    return "trl-hf", "transformers' generate (TRL's GenerationConfig, trl/trainer/grpo_trainer.py)"


def _sampling_value(path: str, key: str, ckpt, spec, cfg, overrides: dict) -> tuple[object, str]:
    """The value of sampling parameter `key` on one sampling path, and where it comes from.

    The harness's GenerationConfig (harness/rollouts/generate.py) sets do_sample, temperature, top_p and top_k;
    TRL's (trl/trainer/grpo_trainer.py, `generation_kwargs = {...}`) also min_p (None unless set) and
    repetition_penalty, then its generation_kwargs. transformers' generate fills every field a passed
    GenerationConfig leaves None from the model's generation_config (generation/utils.py,
    _prepare_generation_config), so the checkpoint's value reaches exactly the fields a side leaves unset. The
    static decoder and vLLM's SamplingParams apply only what they are given."""
    own = {"do_sample": (True, "always samples"), "temperature": (spec.TEMPERATURE, "the spec's TEMPERATURE"),
           "top_p": (spec.TOP_P, "the spec's TOP_P"), "top_k": (spec.TOP_K, "the spec's TOP_K")}
    if path in ("hf", "static", "vllm"):
        if key in own:
            return own[key]
        if path == "hf":
            return (ckpt, _CKPT) if ckpt is not None else (None, "unset: transformers' default")
        return _NEUTRAL[key], "not applied"
    extra = cfg.generation_kwargs if isinstance(cfg.generation_kwargs, dict) else {}
    if key in extra:
        return extra[key], "[trl] generation_kwargs"
    if key == "do_sample":
        return True, "always samples"
    if key == "min_p" and cfg.min_p is None:
        if path == "trl-hf":
            return (ckpt, _CKPT) if ckpt is not None else (None, "unset: transformers' default")
        return 0.0, "not applied (TRL passes 0.0 for None)"
    where = f"[trl] {key}" if key in overrides else f"GRPOConfig.{key}" + (
        ", from the spec" if key in ("temperature", "top_p", "top_k") else ", TRL's default")
    return getattr(cfg, key), where


def _effective(key: str, value):
    return _NEUTRAL[key] if value is None else value


def _equal(key: str, a, b) -> bool:
    a, b = _effective(key, a), _effective(key, b)
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _sampling_facts(spec, cfg, overrides: dict, gen: dict, gen_file: str) -> list[CheckpointFact]:
    s_path, s_words = _scratch_sampling(spec)
    t_path, t_words = _trl_sampling(spec, cfg)
    out = []
    for key in SAMPLING_KEYS:
        c = gen.get(key)
        s_val, s_src = _sampling_value(s_path, key, c, spec, cfg, overrides)
        t_val, t_src = _sampling_value(t_path, key, c, spec, cfg, overrides)
        covers = (key,) if key in ("min_p", "repetition_penalty") and key in overrides else ()
        same = _equal(key, s_val, t_val)
        leaks = [side for side, src in (("the scratch loop", s_src), ("TRL", t_src)) if src == _CKPT]
        sets = f"{gen_file} sets {key} = {c!r}" if c is not None else f"{gen_file} does not set {key}"
        sides = (f"The scratch loop samples through {s_words}: {key} {_effective(key, s_val)!r} ({s_src}); TRL "
                 f"through {t_words}: {key} {_effective(key, t_val)!r} ({t_src}).")
        if not same:
            if key in ("temperature", "top_p", "top_k") and not leaks:
                continue  # a difference of the spec and [trl]: listed with the other quantities
            if s_src == _CKPT:
                align, how = {"set_trl": {key: c}}, f"set {key} = {c!r} in [trl]"
            elif t_src == _CKPT:
                align, how = {"set_trl": {key: _NEUTRAL[key]}}, f"set {key} = {_NEUTRAL[key]!r} in [trl]"
            else:
                align = {"drop_trl": [key]} if key in overrides else {}
                how = f"remove {key} from [trl]" if key in overrides else ""
            leak = (f" transformers' generate fills every field a GenerationConfig leaves unset from the model's "
                    f"generation_config, so {' and '.join(leaks)} picks up the checkpoint's {key}." if leaks else "")
            out.append(CheckpointFact(
                key, f"{key} while sampling", _effective(key, s_val), _effective(key, t_val),
                f"{sets}. {sides}{leak} Free runs sample differently; {_LOCKSTEP_SAMPLING}."
                + (f" To match: {how}." if how else ""), "difference", (key,), align, covers))
        elif leaks:
            who = "both sides sample" if len(leaks) == 2 else f"{leaks[0]} samples"
            out.append(CheckpointFact(
                key, f"{key} while sampling", _effective(key, s_val), _effective(key, t_val),
                f"{sets}, and {who} with it although the spec does not show it: a GenerationConfig that leaves {key} "
                f"unset gets it from the checkpoint in transformers' generate. {sides}", "note", (key,), {}, covers))
        elif c is not None:
            out.append(CheckpointFact(
                key, f"{key} = {c!r} in {gen_file}", _effective(key, s_val), _effective(key, t_val),
                f"{sets}; shadowed on both sides: neither picks it up. {sides} A loop of your own whose "
                f"model.generate call (or GenerationConfig) leaves {key} unset would sample with {c!r}.",
                "note", (key,), {}, covers))
        elif covers:  # a [trl] override that changes nothing: the sides agree
            out.append(CheckpointFact(key, f"{key} while sampling", _effective(key, s_val), _effective(key, t_val),
                                      f"{sets}. {sides}", "note", (key,), {}, covers))
        if c is not None and spec.loop.command and not _equal(key, c, t_val):
            out.append(CheckpointFact(
                key, f"{key} in your loop's model.generate", c, _effective(key, t_val),
                f"{sets}. Your loop ([loop] command) samples with it wherever its model.generate call (or its "
                f"GenerationConfig) leaves {key} unset, while TRL samples with {key} {_effective(key, t_val)!r} "
                f"({t_src}): free runs then sample differently (in lockstep your loop is handed the shared "
                f"completions and samples nothing). Pass {key} explicitly in your loop (examples/my_grpo.py passes "
                "temperature, top_p and top_k).", "warning",
                (key,), who="your loop"))
    return out


def _dropout_kind(model_type: str, key: str) -> str:
    """"module" when the model's code builds a torch.nn.Dropout from config.<key> (TRL's disable_dropout reaches
    it), "functional" when it uses config.<key> otherwise (e.g. Qwen3 and Llama pass attention_dropout to the
    attention call), "unknown" when the modeling file cannot tell. Reads transformers' source text only."""
    found = importlib.util.find_spec("transformers")
    name = str(model_type or "").replace("-", "_")
    if not name or found is None or not found.submodule_search_locations:
        return "unknown"
    src = Path(list(found.submodule_search_locations)[0]) / "models" / name / f"modeling_{name}.py"
    try:
        text = src.read_text()
    except OSError:
        return "unknown"
    key = re.escape(key)
    if re.search(rf"nn\.Dropout\(\s*(?:p\s*=\s*)?config\.{key}\b", text):
        return "module"
    return "functional" if re.search(rf"\bconfig\.{key}\b", text) else "unknown"


def _dropout_facts(spec, cfg, overrides: dict, config: dict, model_type: str) -> list[CheckpointFact]:
    probs = {k: v for k, v in config.items() if ("dropout" in k or k.endswith("pdrop")) and k not in _HEAD_ONLY_DROPOUT
             and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
    disable = bool(cfg.disable_dropout)
    covers = ("disable_dropout",) if "disable_dropout" in overrides else ()
    if not probs:
        if disable:
            return [CheckpointFact("disable_dropout", "dropout", "none", "none", "disable_dropout = true, but config.json "
                                   "sets no dropout probability above 0: it changes nothing", "note",
                                   ("disable_dropout",), {}, covers)]
        return []
    kinds = {k: _dropout_kind(model_type, k) for k in probs}
    off = [k for k in probs if disable and kinds[k] != "functional"]  # what TRL's disable_dropout sets to 0
    on = [k for k in probs if k not in off]
    listed = lambda keys: ", ".join(f"{k}={probs[k]}" for k in keys)  # noqa: E731
    functional = [k for k in probs if kinds[k] == "functional"]
    unknown = [k for k in probs if kinds[k] == "unknown"]
    scratch_words = ("The scratch loop trains in model.train() mode with dropout on (scratch_grpo/train.py; the spec "
                     "has no switch for it) and samples in model.eval() mode, without dropout.")
    trl_words = (f"TRL's disable_dropout (default false; here {str(disable).lower()}) sets p = 0 on every "
                 "torch.nn.Dropout module (trl/trainer/utils.py: disable_dropout_in_model) and on nothing else"
                 + (f"; {model_type} applies {', '.join(functional)} as a function in its attention call (dropout=0.0 "
                    "if not self.training else ...), which it does not reach" if functional else "")
                 + (f"; whether {model_type} builds torch.nn.Dropout modules from {', '.join(unknown)} could not be "
                    "read from its modeling code (taken as yes)" if unknown else "") + ".")
    unreached = [k for k in probs if disable and kinds[k] == "functional"]
    out = []
    if off:
        out.append(CheckpointFact(
            "disable_dropout", "dropout in training forward passes", f"on ({listed(probs)})",
            f"off ({listed(off)})" + (f"; on ({listed(on)})" if on else ""),
            f"config.json sets {listed(probs)}. {scratch_words} {trl_words} With disable_dropout = true TRL trains "
            f"without {listed(off)}, the scratch loop with it: the losses and gradients differ from step 1. To "
            "match: remove disable_dropout from [trl] (both then train with dropout, each drawing its own masks), or "
            "set the probabilities to 0 in a copy of the checkpoint's config.json (both train without it)",
            "difference", ("disable_dropout", *probs), {"drop_trl": ["disable_dropout"]} if covers else {}, covers))
    else:
        out.append(CheckpointFact(
            next(iter(probs)), "dropout in training forward passes", f"on ({listed(probs)})", f"on ({listed(on)})",
            f"config.json sets {listed(probs)}. {scratch_words} {trl_words} Both sides train with dropout on, "
            "each drawing its own masks from its own random stream, so lockstep parity cannot hold to fp32 "
            "tolerance: expect a divergence from step 1 that no setting explains. "
            + (f"disable_dropout = true does not reach {listed(unreached)}. " if unreached else "")
            + "To compare the loops exactly, set the probabilities to 0 in a copy of the checkpoint's config.json.",
            "warning", tuple(probs), {}, covers))
    t_path, t_words = _trl_sampling(spec, cfg)
    if t_path == "trl-hf" and on:
        out.append(CheckpointFact(
            next(iter(on)), "dropout while sampling", "off (eval mode)", f"on ({listed(on)}; train mode)",
            f"When TRL samples itself it calls generate on the model in training mode (transformers' "
            f"Trainer.training_step calls model.train() before GRPOTrainer._prepare_inputs generates, and neither "
            f"grpo_trainer.py nor trl/models/utils.py calls eval()), so {listed(on)} acts while it "
            f"samples; the scratch loop samples in eval mode. Free runs sample from different distributions; "
            f"{_LOCKSTEP_SAMPLING}.", "difference", tuple(on), {}))
    return out


def _dtype_facts(spec, cfg, overrides: dict, stored) -> list[CheckpointFact]:
    out = []
    if stored and stored != "float32" and spec.model.source != "embedded":
        out.append(CheckpointFact(
            "dtype", f"stored dtype {stored}", spec.MASTER_WEIGHTS, spec.MASTER_WEIGHTS,
            f"config.json stores {stored} weights. Both sides load them as {spec.MASTER_WEIGHTS} master weights "
            "(MASTER_WEIGHTS; load_model in scratch_grpo/train.py and trl_runner/runner.py): the same cast on both, "
            f"exact; DTYPE = \"{spec.DTYPE}\"" + (" computes under bf16 autocast on both." if spec.DTYPE == "bfloat16"
                                                  else " computes in float32.")
            + " A TRL script of your own that passes the model by name loads float32 too (TRL's default dtype, "
            f"trl/trainer/utils.py: create_model_from_path) unless its model_init_kwargs say dtype=\"auto\" (then "
            f"{stored}).", "note", ("dtype",)))
    mik = cfg.model_init_kwargs if "model_init_kwargs" in overrides else None
    if not isinstance(mik, dict):
        return out
    asked = mik.get("dtype", mik.get("torch_dtype"))
    resolved = (stored or "float32") if asked == "auto" else str(asked).replace("torch.", "") if asked else "float32"
    only_dtype = set(mik) <= {"dtype", "torch_dtype"}
    said = f"[trl] model_init_kwargs = {mik}" + (f" (dtype=\"auto\" means config.json's {stored or 'float32'})"
                                                 if asked == "auto" else "")
    if not cfg.beta:
        out.append(CheckpointFact(
            "model_init_kwargs", "model_init_kwargs", "float32 policy", "float32 policy (model_init_kwargs ignored)",
            f"{said}: the harness hands GRPOTrainer a loaded float32 model, and TRL uses model_init_kwargs only to load "
            "a model given by name (trl/trainer/grpo_trainer.py warns that they are ignored otherwise) or, with beta "
            "> 0, its reference model: at BETA = 0 it changes nothing here."
            + (f" A TRL script of yours that passes the model by name would train {resolved} weights, against the "
               "scratch loop's float32 master weights." if resolved != "float32" else ""),
            "warning" if resolved != "float32" else "note", ("model_init_kwargs",), {},
            ("model_init_kwargs",)))
    elif resolved != "float32":
        out.append(CheckpointFact(
            "model_init_kwargs", "reference model dtype (KL term)", "float32 (a frozen copy of the policy)",
            f"{resolved} (model_init_kwargs)",
            f"{said}. With BETA > 0 TRL builds its reference model from the checkpoint with model_init_kwargs "
            "(trl/trainer/grpo_trainer.py: dtype defaults to the policy's float32 only when they do not set it), so "
            f"TRL's reference log-probs come from {resolved} weights and the scratch loop's from float32 ones: the "
            "KL term differs from step 1. To match: remove model_init_kwargs from [trl].", "difference",
            ("model_init_kwargs", "BETA"), {"drop_trl": ["model_init_kwargs"]},
            ("model_init_kwargs",) if only_dtype else ()))
    elif only_dtype:
        out.append(CheckpointFact(
            "model_init_kwargs", "reference model dtype (KL term)", "float32", "float32",
            f"{said}: TRL's reference model loads float32, as the scratch loop's frozen copy.", "note",
            ("model_init_kwargs",), {}, ("model_init_kwargs",)))
    return out


def checkpoint_facts(spec, tr: Translation | None = None, path: Path | None = None) -> list[CheckpointFact]:
    """What the starting checkpoint's config.json and generation_config.json set, against what each side does with
    it. Reads the two JSON files (and transformers' modeling source, for dropout) only when the checkpoint is
    already on disk (`existing_checkpoint_dir`); builds, converts and loads nothing. [] when it is not there yet."""
    path = path or existing_checkpoint_dir(spec)
    if path is None:
        return []
    tr = tr or translate(spec)
    cfg = tr.config("/tmp/grpo-parity-preflight", **tr.validated_with)
    overrides = tr.overrides
    config, bad = _read_json(path / "config.json")
    gen, bad_gen = _read_json(path / "generation_config.json")
    problems = [p for p in (bad, bad_gen) if p]
    out = [CheckpointFact("checkpoint", "checkpoint files", "-", "-", p, "warning") for p in problems]
    if config is None:
        return out
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    merged = {**config, **text}
    gen_file = "generation_config.json"
    if gen is None and not bad_gen:  # transformers derives the generation config from config.json then
        gen, gen_file = {k: merged[k] for k in SAMPLING_KEYS if merged.get(k) is not None}, "config.json"
    out += _sampling_facts(spec, cfg, overrides, gen or {}, gen_file)
    out += _dropout_facts(spec, cfg, overrides, merged, str(merged.get("model_type", "")))
    if merged.get("tie_word_embeddings") and spec.model.source != "embedded":
        out.append(CheckpointFact(
            "tie_word_embeddings", "tied input and output embeddings", "one tensor", "one tensor",
            "tie_word_embeddings = true: lm_head.weight is model.embed_tokens.weight. model.named_parameters() yields "
            "it once, so the parameter sketch and both AdamW optimizers hold one tensor, updated once per step by the "
            "sum of both uses' gradients. Both put it in the weight-decay group (the scratch loop exempts names with "
            "'bias' or 'norm', transformers' Trainer.get_decay_parameter_names bias and norm patterns), so "
            f"WEIGHT_DECAY = {spec.WEIGHT_DECAY} acts on it alike.", "note", ("tie_word_embeddings",)))
    stored = merged.get("dtype") or merged.get("torch_dtype")
    out += _dtype_facts(spec, cfg, overrides, str(stored).replace("torch.", "") if stored else None)
    rank = {"difference": 0, "warning": 1, "note": 2}
    return sorted(out, key=lambda f: rank.get(f.kind, 3))


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


def format_checkpoint(checkpoint: list[CheckpointFact], path: Path | None = None) -> list[str]:
    """The "checkpoint defaults" block: one line per fact (its kind, label, what each side uses), then why."""
    lines = [f"checkpoint defaults ({path or 'the starting checkpoint'}: config.json and generation_config.json, "
             "read without loading weights):"]
    for f in checkpoint:
        lines.append(f"  {f.kind}: [{f.check}] {f.quantity}: {f.who} {f.scratch!r}, TRL {f.trl!r}")
        lines += textwrap.wrap(f.why, width=120, initial_indent="      ", subsequent_indent="      ")
    return lines


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
