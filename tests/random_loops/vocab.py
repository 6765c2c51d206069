"""The vocabulary of the random loops: for each stage of a GRPO step, the choices public loops make, and what each one
means for the answer (the TRL fields, the built-in loop's switches, or nothing that can express it).

Surveyed from the loops' own code and TRL's options, not from the harness's explanation:
- TRL GRPOTrainer / GRPOConfig (the default of each stage here is the embedded spec's TRL set-up: loss_type "grpo",
  scale_rewards "group", std + 1e-4, epsilon 0.2 / epsilon_high 0.28, beta 0, one pass, AdamW betas (0.9, 0.99), lr
  3e-3 constant, max_grad_norm 1, no decay; reward_weights [1.0, 0.5]); its loss types grpo / bnpo / dapo / dr_grpo,
  scale_rewards group / batch / none, mask_truncated_completions, num_iterations, use_bias_correction_kl, and
  transformers' lr_scheduler_type (linear, cosine, cosine_with_min_lr + min_lr_rate, polynomial + power,
  constant_with_warmup, warmup_steps, a horizon: num_cycles).
- verl core_algos: agg_loss's token-mean / seq-mean-token-mean / seq-mean-token-sum, kl_penalty's kl (k1) / mse (k2)
  / low_var_kl (k3), GRPO epsilon 1e-6, AdamW(model.parameters()) with decay 0.01 on every parameter, symmetric clip.
- OpenRLHF: group_norm advantages, token mean over the step, cosine schedule with a floor (min_lr 0.1x), lr logged after
  the scheduler stepped.
- NeMo-RL / RLOO: a leave-one-out baseline. open-instruct: a mask built from `ids != pad_id`, flat groups filtered.
- align-anything: one prompt group per optimizer step, an attention mask `ids != pad_id` (a sampled pad id hidden
  from the tokens after it, kept in the loss).
- tiny-grpo: pad = eos, attention mask `ids != pad`, positions over the mask, eos out of the loss, std + 1e-8.
- nano-aha-moment / nanochat: torch AdamW defaults, no gradient clipping, a linear decay over a horizon.
- Loops seen by issue 47: a second normalisation of the advantages over loss tokens, advantages clamped, group
  statistics in float16, cross_entropy(ignore_index=pad_id) as the log-prob, a loss logged for one micro-batch,
  two passes with old log-probs recomputed before each; Atropos' advantages (B, 1) broadcast against a per-completion
  term (B,) (each completion weighted by its micro-batch's mean advantage) and its loss over a constant
  gradient_accumulation_steps that is not its micro-batches' number.

Each choice: (name, weight, answer part). The first of each stage is the default, drawn most often, so that a loop
differs from TRL in a few places. An answer part holds `trl` (fields, values as the loop writes them), `quirks` (the
spec fields of the built-in loop that reproduce what TRL cannot set), `inexpressible` (what no switch reproduces:
drawn on purpose, scored as a failure), `cannot_show` (what the 12 steps cannot show, with words the verdict should
use), `unsure` (fields whose effect may stay under the run's tolerance: said as "could not tell" is right too).
"""

from __future__ import annotations

SPEC_TRL = {  # what the embedded default spec sets TRL to (trl_runner/translate.py on harness/specs/default.toml)
    "loss_type": "grpo", "scale_rewards": "group", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.0,
    "use_bias_correction_kl": True, "num_iterations": 1, "mask_truncated_completions": False, "learning_rate": 3e-3,
    "lr_scheduler_type": "constant", "warmup_steps": 0, "adam_beta1": 0.9, "adam_beta2": 0.99, "adam_epsilon": 1e-8,
    "weight_decay": 0.0, "max_grad_norm": 1.0, "reward_weights": [1.0, 0.5],
}
STEPS = 12
PAD_ID = 0  # the embedded tokenizer's pad id (its eos is 2)


def _c(name, weight, **answer):
    return (name, weight, answer)


STAGES: dict[str, list] = {
    "reward_weights": [
        _c("spec", 85),
        _c("correct_only", 8, trl={"reward_weights": [1.0, 0.0]}),
        _c("equal", 7, trl={"reward_weights": [1.0, 1.0]}),
    ],
    "adv_center": [
        _c("group_mean", 90),
        _c("leave_one_out", 10, quirks={"ADV_BASELINE": "loo"}),  # scale forced to none (RLOO's form)
    ],
    "adv_scale": [
        _c("group_std", 75),
        _c("none", 15, trl={"scale_rewards": "none"}),
        _c("batch_std", 10, trl={"scale_rewards": "batch"}),
    ],
    "std_kind": [
        _c("bessel", 85),
        _c("population", 15, quirks={"STD": "population"}),
    ],
    "std_eps": [
        _c("1e-4", 75),
        _c("1e-8", 8, quirks={"STD_EPS": 1e-8}, unsure=["STD_EPS"]),
        _c("1e-6", 7, quirks={"STD_EPS": 1e-6}, unsure=["STD_EPS"]),
        _c("1e-2", 5, quirks={"STD_EPS": 1e-2}),
        _c("inside_1e-8", 5, quirks={"STD_EPS": 1e-8, "STD_EPS_INSIDE": True}, unsure=["STD_EPS", "STD_EPS_INSIDE"]),
    ],
    "adv_extra": [  # switches of the built-in loop since issue 47 (ADV_STATS_DTYPE, ADV_RENORM, ADV_CLAMP, DROP_ZERO_ADV)
        _c("none", 88 - 2 / 1.8),  # (range_scale's weight taken from here, the default's boost 1.8 undone: every
        # other seed draws as before)
        _c("range_scale", 2, inexpressible=["advantages divided by the group's reward range (max - min)"]),
        _c("float16_stats", 3, quirks={"ADV_STATS_DTYPE": "float16"}),
        # (a second normalisation divides out a factor common to every group: Bessel's std or the population's alike)
        _c("renorm_tokens", 3, quirks={"ADV_RENORM": "tokens"}, unsure=["STD"]),
        _c("clamp_1", 3, quirks={"ADV_CLAMP": 1.0}),
        _c("drop_zero_adv", 3, quirks={"DROP_ZERO_ADV": True}),
    ],
    "mask": [
        _c("through_eos", 80),
        _c("no_eos", 8, quirks={"COMPLETION_MASK": "no_eos"}),
        _c("ids_ne_pad", 6, quirks={"MASK_TOKEN_ID": PAD_ID}),
        _c("truncated_out", 6, trl={"mask_truncated_completions": True}, quirks={"TRUNCATED_IF": "no_eos"},
           unsure=["TRUNCATED_IF"]),  # `EOS in ids`: one ending in a sampled pad id is out too (TRL: ended)
    ],
    "forward": [
        _c("padding_mask", 85 - 5 / 1.8),  # (pad_id_attention's weight taken from here, the default's boost undone:
        # every other seed draws as before)
        # align-anything, open-instruct: `attention_mask = ids != pad_id`, a sampled pad id hidden from later tokens
        _c("pad_id_attention", 5, quirks={"ATTENTION_HIDE_ID": PAD_ID}),
        _c("eos_out_of_attention", 7, quirks={"EOS_ATTENTION": "mask"}),
        _c("ce_ignore_pad", 4, quirks={"LOGP_ZERO_ID": PAD_ID}),  # the built-in loop's switch since the forward stage
        _c("logits_bf16", 4, quirks={"LOGITS_DTYPE": "bfloat16"}),  # the built-in loop's switch since round 2
    ],
    "agg": [
        _c("grpo", 65 - 5 / 1.8),  # (the two below take their weight from here, the boost undone: others draw as before)
        # Atropos' trainer: `(term * advantages).mean()` with the advantages (B, 1) and the per-completion term (B,),
        # each completion weighted by its micro-batch's mean advantage (the built-in loop's ADV_MICRO_BATCH_MEAN;
        # its micro-batches cut in the rollout's order, MICRO_BATCH_ORDER, true of every drawn loop)
        _c("mean_advantage_broadcast", 2, quirks={"ADV_MICRO_BATCH_MEAN": True}),
        # a per-completion mean over each micro-batch divided by a gradient_accumulation_steps of its config (8), not
        # by its micro-batches' number: a mean over the round's completions times 2 / 8 (ACCUM_DIVISOR)
        _c("grpo_over_constant_8", 3, quirks={"ACCUM_DIVISOR": 8.0}),
        _c("dapo", 12, trl={"loss_type": "dapo"}),
        _c("bnpo_in_order", 7, trl={"loss_type": "bnpo"}, quirks={"MICRO_BATCH_ORDER": "rollout"}),
        _c("dr_grpo", 6, trl={"loss_type": "dr_grpo"}),
        _c("seq_sum_mean", 6, quirks={"LOSS_DIVISOR": 16.0}),  # verl's seq-mean-token-sum: sum / 16 completions
        _c("sum", 4, quirks={"LOSS_SUM": True}),
    ],
    "kl": [
        _c("none", 75),
        _c("k3", 13),
        _c("k1", 6, quirks={"KL_ESTIMATOR": "k1"}),
        _c("k2", 6, quirks={"KL_ESTIMATOR": "k2"}),
    ],
    "kl_beta": [  # drawn only with a KL
        _c("0.04", 40, trl={"beta": 0.04}),
        _c("0.01", 30, trl={"beta": 0.01}),
        _c("0.1", 20, trl={"beta": 0.1}),
        _c("0.001", 10, trl={"beta": 0.001}, unsure=["beta"]),
    ],
    "kl_ratio": [  # drawn only with a KL: TRL multiplies the KL by the policy ratio
        _c("ratio", 60),
        _c("no_ratio", 40, trl={"use_bias_correction_kl": False}, unsure=["use_bias_correction_kl"]),
    ],
    "passes": [
        _c("1", 85),
        _c("2", 10, trl={"num_iterations": 2}),
        _c("2_old_each_pass", 5, trl={"num_iterations": 2}, quirks={"LOGP_OLD": "current"}),
    ],
    "clip": [
        _c("0.2_0.28", 80),
        _c("0.2_0.2", 12, trl={"epsilon_high": 0.2}),
        _c("0.1_0.28", 8, trl={"epsilon": 0.1}),
    ],
    "lr": [
        _c("spec", 80),
        _c("1e-3", 10, trl={"learning_rate": 1e-3}),
        _c("5e-3", 10, trl={"learning_rate": 5e-3}),
    ],
    "betas": [
        _c("spec", 80),
        _c("0.999", 12, trl={"adam_beta2": 0.999}),
        _c("0.95", 8, trl={"adam_beta2": 0.95}),
    ],
    "decay": [
        _c("none", 80),
        _c("0.1_trainer", 8, trl={"weight_decay": 0.1}),
        _c("0.1_all", 6, trl={"weight_decay": 0.1}, quirks={"WEIGHT_DECAY_ALL": True}),
        _c("torch_default_0.01_all", 6, trl={"weight_decay": 0.01}, quirks={"WEIGHT_DECAY_ALL": True},
           unsure=["weight_decay", "WEIGHT_DECAY_ALL"]),
    ],
    "grad_clip": [
        _c("1.0", 80),
        _c("none", 12, trl={"max_grad_norm": 0.0}),
        _c("0.5", 8, trl={"max_grad_norm": 0.5}),
    ],
    "schedule": [  # transformers.get_scheduler(name, ...) as the loop calls it; checked by the rates it gives
        _c("constant", 70),
        _c("linear", 6, trl={"lr_scheduler_type": "linear"}),
        _c("cosine", 5, trl={"lr_scheduler_type": "cosine"}),
        _c("linear_warmup_3", 4, trl={"lr_scheduler_type": "linear", "warmup_steps": 3}),
        _c("constant_warmup_20", 4, trl={"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 20},
           cannot_show=[("the schedule after its warmup (20 steps, longer than the run)", "warmup")]),
        _c("cosine_min_lr_0.1", 4, trl={"lr_scheduler_type": "cosine_with_min_lr",
                                        "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}),
        _c("polynomial_power_2", 3, trl={"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"power": 2.0}}),
        _c("cosine_over_64", 4, trl={"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 12 / 128}}),
    ],
    "lr_logged": [
        _c("this_step", 85),
        _c("after_scheduler_step", 15),  # a step ahead (OpenRLHF); the table is the same
    ],
    "selection": [
        _c("whole_round", 88 - 6 / 1.8),  # (group_per_step's weight taken from here: every other seed draws as before)
        # align-anything: one prompt group per optimizer step (a round over PROMPTS steps), each step on the current
        # policy (the ratio 1 against its own log-probs: TRL keeps the round's, the built-in loop's LOGP_OLD)
        _c("group_per_step", 6, quirks={"SELECTION": "<trained.jsonl>", "LOGP_OLD": "current"}),
        _c("skip_flat_groups", 12, quirks={"SELECTION": "<trained.jsonl>"}),
    ],
    "loss_logged": [
        _c("sum_of_micro_batches", 90),
        _c("last_micro_batch", 10, logged=[("the loss logged for the last micro-batch only",
                                                  "last micro-batch|one micro-batch|single micro-batch")]),
    ],
}

# schedules as the loop builds them: transformers.get_scheduler's name, warmup and horizon, and extra kwargs
SCHEDULES = {
    "constant": ("constant", 0, STEPS, {}),
    "linear": ("linear", 0, STEPS, {}),
    "cosine": ("cosine", 0, STEPS, {}),
    "linear_warmup_3": ("linear", 3, STEPS, {}),
    "constant_warmup_20": ("constant_with_warmup", 20, STEPS, {}),
    "cosine_min_lr_0.1": ("cosine_with_min_lr", 0, STEPS, {"min_lr_rate": 0.1}),
    "polynomial_power_2": ("polynomial", 0, STEPS, {"power": 2.0}),
    "cosine_over_64": ("cosine", 0, 64, {}),
}

# what a choice's code needs the others to be: (stage, choice) -> {stage: forced choice}
REQUIRES = {
    ("adv_center", "leave_one_out"): {"adv_scale": "none", "adv_extra": "none"},
    ("adv_extra", "range_scale"): {"adv_scale": "none"},  # the range in place of a std
    ("adv_extra", "float16_stats"): {"std_eps": "1e-4"},  # a smaller epsilon is 0 in float16: 0 / 0 in a flat group
    ("selection", "skip_flat_groups"): {"passes": "1", "agg": "grpo", "adv_extra": "none"},
    # (advantages over the round, a second normalisation over the step's tokens: the built-in loop's is the round's)
    ("selection", "group_per_step"): {"passes": "1", "adv_extra": "none"},
    ("agg", "bnpo_in_order"): {"selection": "whole_round"},
    # the broadcast's loss is Atropos' own: -ratio per token (no clip, no KL), one pass (the ratio is 1)
    ("agg", "mean_advantage_broadcast"): {"kl": "none", "passes": "1"},
}
DEPENDS = {"kl_beta": ("kl", "none"), "kl_ratio": ("kl", "none"), "std_kind": ("adv_scale", "none"),
           "std_eps": ("adv_scale", "none")}  # drawn only where the stage named is not that choice
