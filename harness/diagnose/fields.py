"""The vocabulary of the explanation: what each spec field it can name means, said of a loop (`words`), and the
look-alike values a confirmed explanation is checked against (`LOOK_ALIKE`).
"""

from __future__ import annotations

import json
from pathlib import Path


_WORDS = {
    "LOSS_NORM": lambda v: {"sequence": "averages the loss per sequence, then over sequences",
                            "token_local": "averages the loss over each micro-batch's tokens",
                            "token_global": "averages the loss over every token of the step",
                            "constant": "divides the summed loss by batch x max_completion_length"}[v],
    "ADV_SCALE": lambda v: {"group": "divides advantages by the group's std", "batch": "divides advantages by the "
                            "batch's std", "none": "does not divide advantages by a std"}[v],
    "MASK_TRUNCATED": lambda v: ("leaves truncated completions out of the loss" if v else
                                 "keeps truncated completions in the loss"),
    "BETA": lambda v: f"has a KL penalty to the initial model of weight {v:g}",
    "KL_IS_CORRECTION": lambda v: ("multiplies the KL term by the policy ratio" if v else
                                   "does not multiply the KL term by the policy ratio (TRL does by default)"),
    "KL_ESTIMATOR": lambda v: f"estimates the KL with {v} instead of k3",
    "KL_IN_REWARD": lambda v: "subtracts the KL penalty from the reward instead of adding it to the loss",
    "LR": lambda v: f"trains at a learning rate of {v:g}",
    "LR_SCHEDULE": lambda v: f"uses a {v} learning-rate schedule",
    "WARMUP_STEPS": lambda v: f"warms the learning rate up over {v} steps",
    "WEIGHT_DECAY": lambda v: f"decays weights by {v:g}",
    "MAX_GRAD_NORM": lambda v: f"clips the gradient norm at {v:g}" if v else "does not clip the gradient",
    "ADAM_EPS": lambda v: f"uses Adam epsilon {v:g}",
    "ADAM_BETA1": lambda v: f"uses Adam beta1 {v:g}",
    "ADAM_BETA2": lambda v: f"uses Adam beta2 {v:g}",
    "CLIP_HIGH": lambda v: f"clips the ratio above at 1 + {v:g}",
    "CLIP_LOW": lambda v: f"clips the ratio below at 1 - {v:g}",
    "STD_EPS": lambda v: f"adds {v:g} to the std before dividing (TRL: 1e-4, fixed)",
    "STD": lambda v: ("divides by the population std (n; TRL: Bessel's n-1, fixed)" if v == "population"
                      else "divides by Bessel's std (n-1)"),
    "STD_EPS_INSIDE": lambda v: "scales advantages by sqrt(var + eps) (TRL: std + eps)",
    "MASK_TOKEN_ID": lambda v: f"leaves every completion token with id {v} out of the loss, wherever it stands",
    "MASK_TOKEN_DROP": lambda v: ("takes that token out of the sequence the model sees, too (packing without it)" if v
                                  else "keeps that token in the sequence the model sees"),
    "IS_CORRECTION": lambda v: ("weights its loss by the sampler's importance-sampling ratio" if v else
                                "does not weight its loss by the sampler's importance-sampling ratio (TRL does, by "
                                "default, when it generates with vLLM)"),
    "IS_MODE": lambda v: "takes the importance-sampling ratio " + {
        "token_truncate": "per token, truncated to its bounds", "token_mask": "per token, 0 outside its bounds",
        "sequence_truncate": "per sequence, truncated to its bounds",
        "sequence_mask": "per sequence, 0 outside its bounds"}[v],
    "ADV_BASELINE": lambda v: ("centres each reward on the mean of its group's other completions (leave-one-out; "
                               "TRL: the group's own mean)" if v == "loo" else "centres each reward on its group's mean"),
    "COMPLETION_MASK": lambda v: {"no_eos": "leaves each completion's eos token out of the loss (TRL counts it)",
                                  "all": "counts the padding after short completions in the loss",
                                  "eos": "counts every completion token through the eos"}[v],
    "LOSS_SUM": lambda v: "sums the per-token losses without normalising",
    "WEIGHT_DECAY_ALL": lambda v: ("decays norms and biases too (TRL leaves them out)" if v
                                   else "leaves norms and biases out of the weight decay"),
    "SELECTION": lambda v: f"trains each step on the completions it chose ({Path(v).name}; TRL: its share of one round)",
    "MICRO_BATCH_ORDER": lambda v: ("cuts each round into micro-batches in the rollout's order (TRL shuffles it "
                                    "first)" if v == "rollout" else "shuffles each round before cutting it"),
    "LOSS_DIVISOR": lambda v: f"divides the step's masked per-token losses' sum by {v:g} (no TRL loss_type)",
    "LR_STEPS": lambda v: ("follows a learning-rate schedule of its own, per step " + ", ".join(f"{x:.4g}" for x in v[:6])
                           + (", ..." if len(v) > 6 else "") + " (TRL's are named schedules over the run's steps)"),
    "EMPTY_SKIP": lambda v: ("skips the backward of a micro-batch holding a completion with no loss token (an "
                             "unguarded 0/0 mean; TRL counts it as 0)" if v else "keeps such micro-batches"),
    "LOGP_OLD": lambda v: ("takes the old log-probs from an extra forward pass (TRL: the detached current ones)"
                           if v == "forward" else "takes the current log-probs, detached, as the old ones at every "
                           "step, a round trained over several steps too (TRL keeps those of generation)"
                           if v == "current" else "takes the old log-probs as TRL does"),
    "EOS_ATTENTION": lambda v: ("masks every eos token (the prompt's too) out of attention, positions counting only "
                                "attended tokens: its pad token is its eos" if v == "mask" else "attends to eos tokens"),
    "LOGP_ON_RAW_LOGITS": lambda v: "takes log-probs of the raw logits (TRL: logits / temperature)",
    "rewards.weights": lambda v: f"weighs the reward functions {toml_value(list(v))}",
}


def words(key: str, value) -> str:
    """What a spec change means, said of your loop."""
    fn = _WORDS.get(key)
    try:
        return "your loop " + fn(value) if fn else f"your loop has {key} = {toml_value(value)}"
    except (KeyError, TypeError, ValueError):
        return f"your loop has {key} = {toml_value(value)}"


# settings whose effect can stay under the tolerance over a run (a KL term near 0, Adam's beta2 and a weight decay
# at a small learning rate): each alternative is tried on the confirmed set, and one that reproduces your loop as well
# is said as what the run could not tell
LOOK_ALIKE = {"BETA": (0.0, 0.001, 0.01, 0.04), "KL_IS_CORRECTION": (True, False),
              "ADAM_BETA2": (0.999, 0.99, 0.98, 0.95), "WEIGHT_DECAY": (0.0, 0.01, 0.1),
              # (truncating and masking agree while no weight leaves the bounds; weights near 1 hide the correction)
              "IS_CORRECTION": (True, False),
              "IS_MODE": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")}


def toml_value(value) -> str:
    """A value as TOML writes it (true, "text", 0.01)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)
