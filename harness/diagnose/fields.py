"""The vocabulary of the diagnosis: every spec field the explanation can name, written once (`FIELDS`).

A `Field` holds the GRPOConfig field it sets (None: a quirk of hand-written loops TRL cannot set), its candidate
values, the first step a change of it can act from, and its words. Each place that names a field reads it here:
- the search (search.options): the values, in the order a round tries them, and `acts_from`;
- the explanation (`words`, the `[trl]` table's comments): `words`, said of your loop;
- the confirmed explanation's look-alikes (`LOOK_ALIKE`): `look_alike`;
- the tensor diff (tensordiff.py): `guesses`, the values it offers where a link of the chain differs (in its own
  order: they are tried in that order, the first at a tie), `diff_words` for what it recomputed exactly, and the
  values, `trl_fixed` included, it recomputes the advantages with;
- the preflight (preflight.py): a quirk's row (`quantity`, `trl_fixed`, and `preflight_words`, said of the scratch
  loop against TRL), `QUIRKS` in its table's order; and the loss normaliser's words.
Where these places said a field differently (the eos out of the loss, BETA's candidates), each keeps what it says
and tries: the differences are held side by side in the one Field, so that no output changes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from trl_runner.translate import LOSS_TYPES


@dataclasses.dataclass(frozen=True)
class Field:
    """One spec field the explanation can name."""
    trl: str | None  # the GRPOConfig field it sets; None: a quirk TRL has no setting for
    values: tuple = ()  # the search's candidate values, in the order a round tries them (none: not searched)
    acts_from: int | None = None  # the first step whose logged metrics a change of it can move (step 1 trains the
    # policy that generated; what acts through an update shows from step 2, through Adam's second moment from 3)
    words: Callable[[object], str] | None = None  # what a value means, said of a loop (after "your loop ")
    look_alike: tuple = ()  # values whose effect can stay under the tolerance: each tried on a confirmed explanation
    guesses: dict = dataclasses.field(default_factory=dict)  # the tensor diff's candidates: {differing tensor: values}
    diff_words: dict = dataclasses.field(default_factory=dict)  # the tensor diff's words for a value it recomputed
    trl_fixed: object = None  # a quirk: what TRL always does
    quantity: str = ""  # a quirk the preflight lists: the quantity's name in its table
    preflight_words: dict = dataclasses.field(default_factory=dict)  # the preflight's words per value ("*": any)


_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # scratch_grpo.core.IS_MODES

FIELDS = {
    # ---- TRL has a setting for these (GRPOConfig) ----
    "LOSS_NORM": Field(
        "loss_type", tuple(LOSS_TYPES), 1,
        lambda v: {"sequence": "averages the loss per sequence, then over sequences",
                   "token_local": "averages the loss over each micro-batch's tokens",
                   "token_global": "averages the loss over every token of the step",
                   "constant": "divides the summed loss by batch x max_completion_length"}[v],
        guesses={"loss": ("sequence", "token_global", "constant")},  # (token_local: a micro-batch's, not the step's)
        preflight_words={"sequence": "averages per sequence, each completion weighing the same",
                         "token_global": "averages over tokens, each token of the accumulated batch weighing the same",
                         "token_local": "averages over the tokens of each micro-batch",
                         "constant": "divides by batch x max completion length"}),
    "ADV_SCALE": Field(
        "scale_rewards", ("group", "batch", "none"), 1,
        lambda v: {"group": "divides advantages by the group's std", "batch": "divides advantages by the "
                   "batch's std", "none": "does not divide advantages by a std"}[v]),
    "MASK_TRUNCATED": Field(
        "mask_truncated_completions", (False, True), 1,
        lambda v: ("leaves truncated completions out of the loss" if v else "keeps truncated completions in the loss")),
    # the clip bounds bind only where the ratio can leave 1: from step 2 (step 1 trains the policy that generated)
    "CLIP_HIGH": Field("epsilon_high", (0.2, 0.28), 2, lambda v: f"clips the ratio above at 1 + {v:g}"),
    "CLIP_LOW": Field("epsilon", (0.1, 0.2), 2, lambda v: f"clips the ratio below at 1 - {v:g}"),
    "BETA": Field(
        "beta", (0.001, 0.005, 0.01, 0.02, 0.04, 0.05, 0.1), 2,
        lambda v: f"has a KL penalty to the initial model of weight {v:g}",
        look_alike=(0.0, 0.001, 0.01, 0.04),  # a KL term near 0
        guesses={"ref_logps": (0.01, 0.001, 0.04, 0.1), "per_token_loss": (0.001, 0.01, 0.04, 0.1)}),
    "KL_IS_CORRECTION": Field(
        "use_bias_correction_kl", (False, True), 2,
        lambda v: ("multiplies the KL term by the policy ratio" if v else
                   "does not multiply the KL term by the policy ratio (TRL does by default)"),
        look_alike=(True, False)),
    "LR": Field("learning_rate", (1e-6, 2e-6, 3e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2), 2,
                lambda v: f"trains at a learning rate of {v:g}"),
    "LR_SCHEDULE": Field("lr_scheduler_type", ("constant", "linear"), 3, lambda v: f"uses a {v} learning-rate schedule"),
    "WARMUP_STEPS": Field("warmup_steps", words=lambda v: f"warms the learning rate up over {v} steps"),
    "LR_SCHEDULER_KWARGS": Field("lr_scheduler_kwargs", words=lambda v: f"sets its schedule's parameters "
                                 f"{toml_value(v)}" if v else "sets no parameters of its schedule"),
    "ADAM_BETA1": Field("adam_beta1", (0.9, 0.0), 3, lambda v: f"uses Adam beta1 {v:g}"),
    "ADAM_BETA2": Field("adam_beta2", (0.999, 0.99, 0.98, 0.95, 0.9), 3, lambda v: f"uses Adam beta2 {v:g}",
                        look_alike=(0.999, 0.99, 0.98, 0.95)),  # (at a small learning rate)
    "ADAM_EPS": Field("adam_epsilon", (1e-6, 1e-5), 2, lambda v: f"uses Adam epsilon {v:g}"),
    "OPTIM": Field("optim", ("adamw_torch_fused", "adamw_torch"), 2, lambda v: (  # (searched on bf16 weights only)
        "steps AdamW with torch's fused kernel (each weight update in float32, rounded once)" if v == "adamw_torch_fused"
        else "steps AdamW with torch's for-each or for-loop kernel (each moment and weight update rounded to the "
             "weights' dtype op by op: `AdamW(model.parameters())` as torch builds it; TRL's default is the fused "
             "kernel)"), look_alike=("adamw_torch_fused", "adamw_torch")),  # (tried on bf16 weights only)
    "WEIGHT_DECAY": Field("weight_decay", (0.0, 0.01, 0.1), 2, lambda v: f"decays weights by {v:g}",
                          look_alike=(0.0, 0.01, 0.1)),  # (at a small learning rate)
    # gradient-norm clipping thresholds (0: none; hand-written loops often clip at 0.1 or 0.2, TRL at 1.0). Under Adam
    # a threshold below every step's norm only rescales the whole gradient, which Adam all but cancels: such
    # thresholds cannot be told apart, and the verdict says the loop clips, not at which of them
    "MAX_GRAD_NORM": Field("max_grad_norm", (0.0, 0.1, 0.2, 0.5, 1.0), 2,
                           lambda v: f"clips the gradient norm at {v:g}" if v else "does not clip the gradient"),
    # (truncating and masking agree while no weight leaves the bounds; weights near 1 hide the correction)
    "IS_CORRECTION": Field(
        "vllm_importance_sampling_correction", (False, True), 1,
        lambda v: ("weights its loss by the sampler's importance-sampling ratio" if v else
                   "does not weight its loss by the sampler's importance-sampling ratio (TRL does, by "
                   "default, when it generates with vLLM)"),
        look_alike=(True, False)),
    "IS_MODE": Field(
        "vllm_importance_sampling_mode", _IS_MODES, 1,
        lambda v: "takes the importance-sampling ratio " + {
            "token_truncate": "per token, truncated to its bounds", "token_mask": "per token, 0 outside its bounds",
            "sequence_truncate": "per sequence, truncated to its bounds",
            "sequence_mask": "per sequence, 0 outside its bounds"}[v],
        look_alike=_IS_MODES),
    "rewards.weights": Field("reward_weights", words=lambda v: f"weighs the reward functions {toml_value(list(v))}"),
    "NUM_ITERATIONS": Field("num_iterations", words=lambda v: f"trains each round in {v} optimizer passes, a whole "
                                                             "round per step (read from harness.loop.trained, or from "
                                                             "the rounds your saved tensors are rows of)"),
    # ---- quirks of hand-written loops: TRL has no setting (the built-in loop has a spec field for each) ----
    "STD_EPS": Field(None, (1e-8, 1e-6, 1e-5, 1e-3, 0.0), 1,
                     lambda v: f"adds {v:g} to the std before dividing (TRL: 1e-4, fixed)", trl_fixed=1e-4),
    "STD": Field(None, ("bessel", "population"), 1,
                 lambda v: ("divides by the population std (n; TRL: Bessel's n-1, fixed)" if v == "population"
                            else "divides by Bessel's std (n-1)"), trl_fixed="bessel"),
    # the preflight's quirk rows, in its table's order
    "COMPLETION_MASK": Field(
        None, ("no_eos", "all"), 1,
        lambda v: {"no_eos": "leaves each completion's eos token out of the loss (TRL counts it)",
                   "all": "counts the padding after short completions in the loss",
                   "eos": "counts every completion token through the eos"}[v],
        diff_words={"no_eos": "your loop leaves the eos out of the loss (TRL counts it; no TRL setting)"},
        trl_fixed="eos", quantity="completion tokens the loss counts", preflight_words={
            "no_eos": "leaves the eos token out of the loss; TRL counts it and has no option to drop it",
            "all": "counts the padding after short completions in the loss; TRL masks it and has no option to count "
                   "it"}),
    "EOS_ATTENTION": Field(
        None, ("attend", "mask"), 1,
        lambda v: ("masks every eos token (the prompt's too) out of attention, positions counting only attended "
                   "tokens: its pad token is its eos" if v == "mask" else "attends to eos tokens"),
        trl_fixed="attend", quantity="eos tokens in attention", preflight_words={
            "mask": "masks every eos (the prompt's too) out of attention, positions counting only attended tokens (pad "
                    "= eos); TRL attends to them and has no option not to"}),
    "EMPTY_SKIP": Field(
        None, (False, True), 1,
        lambda v: ("skips the backward of a micro-batch holding a completion with no loss token (an unguarded 0/0 "
                   "mean; TRL counts it as 0)" if v else "keeps such micro-batches"),
        trl_fixed=False, quantity="micro-batch skipped for an empty completion", preflight_words={
            True: "skips a micro-batch holding a completion with no loss token (NaN mean); TRL counts that completion "
                  "as 0 and has no option to skip"}),
    "LOGP_ON_RAW_LOGITS": Field(
        None, (False, True), 1, lambda v: "takes log-probs of the raw logits (TRL: logits / temperature)",
        trl_fixed=False, quantity="log-probs on raw logits", preflight_words={
            True: "takes log-probs on the raw logits; TRL divides them by the temperature first and has no option "
                  "not to"}),
    "TRUNCATED_IF": Field(
        None, ("no_eos_or_pad", "no_eos"), 1, words=lambda v: (
            "counts a completion as truncated wherever it does not end in an eos (one ending in a sampled pad id too; "
            "TRL counts that one as ended)" if v == "no_eos" else "counts a completion as truncated where it ends in "
            "neither an eos nor the pad id, as TRL does"),
        trl_fixed="no_eos_or_pad", quantity="truncated completions", preflight_words={
            "no_eos": "counts a completion ending in a sampled pad id as truncated; TRL counts it as ended (its last "
                      "token the eos or the pad id) and has no option not to"}),
    # the precision: the compute dtype (TRL's bf16) and the dtype the weights are held and stepped in (TRL: the
    # model loaded in it, model_init_kwargs dtype; the trl table cannot write it: the built-in loop's switch)
    "DTYPE": Field("bf16", words=lambda v: ("computes its forward and backward passes in bfloat16 (TRL: bf16 = true)"
                                            if v == "bfloat16" else "computes in float32 (TRL: bf16 = false)")),
    "MASTER_WEIGHTS": Field(None, words=lambda v: (
        "holds and steps its weights in bfloat16, the model loaded in bfloat16 (TRL: bf16 = true with the model "
        "loaded in bfloat16, model_init_kwargs dtype = \"bfloat16\"; the harness's TRL side loads it as "
        "MASTER_WEIGHTS says)" if v == "bfloat16" else "holds float32 master weights"), trl_fixed="float32"),
    "LOGITS_DTYPE": Field(
        # TRL's selective_log_softmax takes it in the logits' own dtype: float32 with float32 weights, or under
        # autocast (log_softmax is one of autocast's float32 ops); it never casts the logits down
        None, words=lambda v: f"takes its log_softmax on {v} logits (cast before the temperature; TRL: the "
                              "logits' own dtype, never cast down)",
        trl_fixed="float32", quantity="log_softmax dtype", preflight_words={
            "*": "takes its log_softmax on logits cast down (`logits.to(bfloat16)`); TRL takes it in the logits' own "
                 "dtype (float32 with float32 weights or under autocast) and has no option to cast them"}),
    "KL_ESTIMATOR": Field(
        None, ("k1", "k2"), 1, lambda v: f"estimates the KL with {v} instead of k3",  # (k3's gradient is 0 at 1)
        trl_fixed="k3", quantity="KL estimator", preflight_words={
            "k1": "estimates the KL with k1 (logp - ref); TRL uses k3 and has no option for another",
            "k2": "estimates the KL with k2 ((logp - ref)^2 / 2); TRL uses k3 and has no option for another"}),
    "KL_IN_REWARD": Field(
        None, (True,), 2, lambda v: "subtracts the KL penalty from the reward instead of adding it to the loss",
        trl_fixed=False, quantity="KL penalty in the reward", preflight_words={
            True: "puts the KL penalty in the reward; TRL adds it to the loss and has no option to move it"}),
    "ADV_BASELINE": Field(
        None, words=lambda v: ("centres each reward on the mean of its group's other completions (leave-one-out; "
                               "TRL: the group's own mean)" if v == "loo" else "centres each reward on its group's mean"),
        trl_fixed="group", quantity="advantage baseline", preflight_words={
            "loo": "centres each reward on the mean of its group's other completions (leave-one-out); TRL centres on "
                   "the group's own mean and has no option for another"}),
    "ADV_STATS_DTYPE": Field(
        None, words=lambda v: f"computes the group statistics on {v} rewards (TRL: float32)",
        trl_fixed="float32", quantity="group statistics' dtype", preflight_words={
            "float16": "computes the group statistics on float16 rewards; TRL computes them in float32 and has no "
                       "option for another dtype"}),
    "DROP_ZERO_ADV": Field(
        None, words=lambda v: ("leaves every completion whose advantage is exactly 0 out of the loss (TRL trains on "
                               "them)" if v else "trains on completions whose advantage is 0"),
        trl_fixed=False, quantity="completions with advantage 0 out of the loss", preflight_words={
            True: "leaves the completions whose advantage is exactly 0 out of the loss; TRL trains on them (their "
                  "tokens count in a token-mean and a KL) and has no option not to"}),
    "ADV_RENORM": Field(
        None, words=lambda v: ("normalises the advantages a second time over the loss's tokens, each completion "
                               "counted once per token (TRL: once, per group)" if v == "tokens"
                               else "normalises the advantages once, per group"),
        trl_fixed="none", quantity="advantages normalised again", preflight_words={
            "tokens": "normalises the advantages a second time over the loss's tokens; TRL normalises them once, per "
                      "group, and has no option for another"}),
    "ADV_CLAMP": Field(
        None, words=lambda v: f"clamps the advantages to [-{v:g}, {v:g}] (TRL: unclamped)",
        trl_fixed=0.0, quantity="advantages clamped to +-", preflight_words={
            "*": "clamps the advantages; TRL uses them unclamped and has no option to clamp"}),
    "STD_EPS_INSIDE": Field(
        None, (False, True), 1, lambda v: "scales advantages by sqrt(var + eps) (TRL: std + eps)",
        trl_fixed=False, quantity="std epsilon inside the square root", preflight_words={
            True: "divides by sqrt(var + eps); TRL divides by std + eps and has no option for the other"}),
    "SELECTION": Field(
        None, words=lambda v: f"trains each step on the completions it chose ({Path(v).name}; TRL: its share of one "
                              "round)",
        trl_fixed="", quantity="completions each step trains on", preflight_words={
            "*": "trains each step on the completions a file names (a loop's own selection); TRL trains each step on "
                 "its share of one round and has no option to choose"}),
    "MICRO_BATCH_ORDER": Field(
        None, ("rollout",), 1,
        lambda v: ("cuts each round into micro-batches in the rollout's order (TRL shuffles it first)" if v == "rollout"
                   else "shuffles each round before cutting it"),
        trl_fixed="shuffled", quantity="micro-batches cut from", preflight_words={
            "rollout": "cuts each round into micro-batches in the rollout's order; TRL shuffles the round first and "
                       "has no option not to"}),
    "WEIGHT_DECAY_ALL": Field(  # (searched with WEIGHT_DECAY: a decay that reaches norms and biases too)
        None, words=lambda v: ("decays norms and biases too (TRL leaves them out)" if v
                               else "leaves norms and biases out of the weight decay"),
        trl_fixed=False, quantity="weight decay on norms and biases", preflight_words={
            True: "decays norms and biases too; TRL (transformers' Trainer) leaves them out and has no option not to"}),
    "LOSS_DIVISOR": Field(
        None, words=lambda v: f"divides the step's masked per-token losses' sum by {v:g} (no TRL loss_type)",
        trl_fixed=0.0, quantity="loss's constant divisor", preflight_words={
            "*": "divides the step's masked per-token losses' sum by a constant; no TRL loss_type does that"}),
    "ADV_MICRO_BATCH_MEAN": Field(  # (set where the gradient stage reads it: never searched)
        None, words=lambda v: ("weights each completion's per-token mean by the mean advantage of its micro-batch, not "
                               "by its own (advantages (B, 1) against a per-completion term (B,): a (B, B) broadcast; "
                               "TRL: each completion's own)" if v else "weights each completion by its own advantage"),
        trl_fixed=False, quantity="micro-batch's mean advantage in the loss", preflight_words={
            True: "weights each completion by the mean advantage of its micro-batch, not by its own; TRL weights "
                  "each completion by its own advantage and has no option for another"}),
    "ACCUM_DIVISOR": Field(  # (set where the gradient stage reads it: never searched)
        None, words=lambda v: (f"divides each micro-batch's loss by {v:g}, a constant of its own, not by the number "
                               "of micro-batches (TRL: gradient_accumulation_steps, their number)"),
        trl_fixed=0.0, quantity="micro-batch loss's constant divisor", preflight_words={
            "*": "divides each micro-batch's loss by a constant of its own; TRL divides it by "
                 "gradient_accumulation_steps, the number of micro-batches, and has no option for another"}),
    "LOSS_SUM": Field(
        None, (True,), 1, lambda v: "sums the per-token losses without normalising",
        trl_fixed=False, quantity="loss summed, not averaged", preflight_words={
            True: "sums the per-token losses without normalising; no TRL loss_type does that"}),
    "MASK_TOKEN_ID": Field(
        None, words=lambda v: f"leaves every completion token with id {v} out of the loss, wherever it stands",
        trl_fixed=-1, quantity="token id left out of the loss", preflight_words={
            "*": "leaves every completion token with one id out of the loss, wherever it stands (a mask built from "
                 "`ids != pad_id`); TRL masks only after the eos and has no option for it"}),
    "MASK_TOKEN_DROP": Field(
        None, (False, True), 1,
        lambda v: ("takes that token out of the sequence the model sees, too (packing without it)" if v
                   else "keeps that token in the sequence the model sees"),
        trl_fixed=False, quantity="masked token dropped from the sequence", preflight_words={
            True: "takes that token out of the sequence the model sees (packing without pad tokens); TRL feeds every "
                  "generated token and has no option not to"}),
    # the forward pass: what it sees, at which positions, and which log-probs it zeroes (identify/forward.py reads them)
    "ATTENTION_HIDE_ID": Field(
        None, words=lambda v: f"hides every token with id {v} from attention, wherever it stands (an attention mask "
                              "built as `ids != pad_id`), the token kept in the sequence",
        trl_fixed=-1, quantity="token id hidden from attention", preflight_words={
            "*": "hides every token with one id from attention (an attention mask built as `ids != pad_id`); TRL's "
                 "attention mask is the padding mask and it has no option for it"}),
    "POSITIONS": Field(
        None, words=lambda v: {"mask": "counts position ids over the attention mask (TRL passes none: the model's "
                                       "own, 0, 1, 2, ... over every column)",
                               "plain": "passes no position ids (the model's own, over every column)"}.get(
                                   v, "counts positions as the built-in loop does"),
        trl_fixed="auto", quantity="position ids", preflight_words={
            "mask": "counts position ids over the attention mask; TRL passes none (the model's own) and has no option "
                    "to", "plain": "passes the model's own position ids where tokens are masked out of attention"}),
    "LOGP_ZERO_ID": Field(
        None, words=lambda v: f"scores every token with id {v} with a log-prob of 0 (cross_entropy(ignore_index="
                              f"{v})): no gradient there, the loss still counting it where its mask does",
        trl_fixed=-1, quantity="token id scored with log-prob 0", preflight_words={
            "*": "scores one token id with a log-prob of 0 (cross_entropy's ignore_index); TRL scores every token and "
                 "has no option for it"}),
    "END_AT_ID": Field(
        None, words=lambda v: f"ends each completion at its first token with id {v}, that token included (its sampler "
                              "stops there): the tokens after it are not in its sequences",
        trl_fixed=-1, quantity="completions end at a token id", preflight_words={
            "*": "ends each completion at its first token of one id (a sampler that stops there); TRL ends them at "
                 "the eos only and has no option for another"}),
    "LR_STEPS": Field(
        None, words=lambda v: (f"follows a learning-rate schedule of its own, {len(v)} rates from {v[0]:.4g} to "
                               f"{v[-1]:.4g} (TRL's are named schedules over the run's steps)"),
        trl_fixed=[], quantity="learning rate per optimizer step", preflight_words={
            "*": "follows a learning-rate schedule of its own, one rate per step; TRL's are named schedules over the "
                 "run's steps (lr_scheduler_type, warmup_steps) and it has no option for another"}),
    "LOGP_OLD": Field(
        None, ("forward",), 1,
        lambda v: ("takes the old log-probs from an extra forward pass (TRL: the detached current ones)"
                   if v == "forward" else "takes the current log-probs, detached, as the old ones at every "
                   "step, a round trained over several steps too (TRL keeps those of generation)"
                   if v == "current" else "takes the old log-probs as TRL does"),
        trl_fixed="auto", quantity="old log-probs of a round trained over several steps", preflight_words={
            "current": "takes the current log-probs, detached, as the old ones at every step (the ratio always 1); "
                       "TRL keeps a round's generation-time log-probs over its steps and has no option not to"}),
    "REWARD_CLIP": Field(
        None, trl_fixed=0.0, quantity="reward clipped to +-", preflight_words={
            "*": "clips the summed reward; TRL uses the reward functions' sum as it is (clip inside your reward "
                 "function to match)"}),
}

# the quirks the preflight lists, each a row of its table (in this order)
QUIRKS = {key: f for key, f in FIELDS.items() if f.quantity}
# settings whose effect can stay under the tolerance over a run (a KL term near 0, Adam's beta2 and a weight decay
# at a small learning rate): each alternative is tried on the confirmed set, and one that reproduces your loop as well
# is said as what the run could not tell (in this order)
LOOK_ALIKE = {key: f.look_alike for key, f in FIELDS.items() if f.look_alike}
CLIP_NORMS = FIELDS["MAX_GRAD_NORM"].values


def words(key: str, value) -> str:
    """What a spec change means, said of your loop."""
    field = FIELDS.get(key)
    fn = field.words if field else None
    try:
        return "your loop " + fn(value) if fn else f"your loop has {key} = {toml_value(value)}"
    except (KeyError, TypeError, ValueError):
        return f"your loop has {key} = {toml_value(value)}"


def toml_value(value) -> str:
    """A value as TOML writes it (true, "text", 0.01)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):  # an inline table: {min_lr_rate = 0.1}
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value) if isinstance(value, str) else repr(value)
