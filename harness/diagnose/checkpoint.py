"""What the starting checkpoint's own files set, read without loading weights, against what each side does with it.

`checkpoint_facts` reads config.json and generation_config.json (when the checkpoint is already on disk; no weights
are loaded): sampling defaults that transformers' `generate` picks up on one side and not the other, dropout
against TRL's `disable_dropout`, tied embeddings, the stored dtype against how each side loads. Those that make
the sides differ are differences of the preflight (preflight.py); the rest it prints under "checkpoint defaults"
(`format_checkpoint`) as notes and warnings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import textwrap
from pathlib import Path

from harness.experiment.models import existing_checkpoint_dir
from trl_runner.translate import Translation, translate

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


def format_checkpoint(checkpoint: list[CheckpointFact], path: Path | None = None) -> list[str]:
    """The "checkpoint defaults" block: one line per fact (its kind, label, what each side uses), then why."""
    lines = [f"checkpoint defaults ({path or 'the starting checkpoint'}: config.json and generation_config.json, "
             "read without loading weights):"]
    for f in checkpoint:
        lines.append(f"  {f.kind}: [{f.check}] {f.quantity}: {f.who} {f.scratch!r}, TRL {f.trl!r}")
        lines += textwrap.wrap(f.why, width=120, initial_indent="      ", subsequent_indent="      ")
    return lines
