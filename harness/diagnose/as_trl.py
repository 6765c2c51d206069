"""The built-in loop set up as TRL is, and TRL's fields for a change of it: where the explanation's search starts
(`scratch_as_trl`) and how a change it keeps is said as GRPOConfig fields (`trl_fields`)."""

from __future__ import annotations

from harness.diagnose.preflight import apply_alignment
from harness.diagnose.search import _same, trl_moves
from trl_runner.translate import NORM_OF_LOSS_TYPE


def trl_fields(base, changes: dict) -> dict:
    """The GRPOConfig fields (and values) that `changes` of the spec become, relative to TRL as the spec configures
    it (its `[trl]` table included): what to add to that table or change in it. A field the change moves is TRL's
    whether or not `[trl]` sets it (the new value then overrides the table's); one it moves to the value TRL is
    configured with already is left out. A change that moves no GRPOConfig field is a quirk (`trl_moves`)."""
    from trl_runner.translate import translate

    configured = translate(base).kwargs
    return {k: v for k, v in trl_moves(base, changes).items() if k not in configured or not _same(configured[k], v)}


# the `[trl]` overrides the built-in loop can take on: GRPOConfig field -> (the spec field it translates from, that
# field's value for a TRL value). scratch_as_trl keeps a move only where TRL's configuration comes out the same
SCRATCH_OF_TRL = {
    "learning_rate": ("LR", float), "beta": ("BETA", float), "use_bias_correction_kl": ("KL_IS_CORRECTION", bool),
    "epsilon": ("CLIP_LOW", float), "epsilon_high": ("CLIP_HIGH", float), "delta": ("DELTA", lambda v: v or 0.0),
    "loss_type": ("LOSS_NORM", NORM_OF_LOSS_TYPE.__getitem__),
    "scale_rewards": ("ADV_SCALE", str), "num_iterations": ("NUM_ITERATIONS", int),
    "mask_truncated_completions": ("MASK_TRUNCATED", bool), "max_completion_length": ("MAX_TOKENS", int),
    "temperature": ("TEMPERATURE", float), "top_p": ("TOP_P", float), "top_k": ("TOP_K", int),
    "lr_scheduler_type": ("LR_SCHEDULE", lambda v: {"constant_with_warmup": "constant"}.get(getattr(v, "value", v),
                                                                                         getattr(v, "value", v))),
    "lr_scheduler_kwargs": ("LR_SCHEDULER_KWARGS", dict),
    "warmup_steps": ("WARMUP_STEPS", int), "adam_beta1": ("ADAM_BETA1", float), "adam_beta2": ("ADAM_BETA2", float),
    "adam_epsilon": ("ADAM_EPS", float), "weight_decay": ("WEIGHT_DECAY", float),
    "optim": ("OPTIM", lambda v: str(getattr(v, "value", v))),
    "max_grad_norm": ("MAX_GRAD_NORM", float), "reward_weights": ("rewards.weights", lambda v: [float(w) for w in v]),
}


def scratch_as_trl(spec):
    """The spec with the built-in loop set up as TRL is, as the spec configures it: every difference the preflight
    lists aligned on the scratch side (its alignment of a `[trl]` override drops the override, TRL's side: no use
    here), and every `[trl]` override the built-in loop has a field for moved into that field (SCRATCH_OF_TRL: `[trl]
    beta = 0.01` becomes BETA = 0.01 and leaves the table), kept only where TRL's translated configuration comes out
    the same. The search's starting point, so that what it finds is a difference from TRL as configured (a loop with
    the table's KL weight has no KL to find), and a change of a moved field is the GRPOConfig field it sets."""
    from harness.diagnose.preflight import preflight
    from trl_runner.translate import translate

    _tr, diffs, _facts = preflight(spec)
    sets = {}
    for d in diffs:
        sets.update(d.align.get("set", {}))
    aligned = apply_alignment(spec, {"set": sets}) if sets else spec
    target = translate(aligned).kwargs
    moved: dict = {}  # [trl] key -> (spec field, value)
    for _ in range(2):  # a move may need another first (warmup_steps before lr_scheduler_type "constant_with_warmup")
        for key, value in aligned.trl.items():
            if key in moved or key not in SCRATCH_OF_TRL:
                continue
            field, as_spec = SCRATCH_OF_TRL[key]
            try:
                trial = {**moved, key: (field, as_spec(value))}
                kw = translate(apply_alignment(aligned, {"set": dict(trial.values()), "drop_trl": list(trial)})).kwargs
            except Exception:  # noqa: BLE001 - a value the spec field refuses (None, a loss_type it lacks) stays in [trl]
                continue
            if kw.keys() == target.keys() and all(_same(kw[k], target[k]) for k in kw):
                moved = trial
    if not moved:
        return aligned
    return apply_alignment(aligned, {"set": dict(moved.values()), "drop_trl": list(moved)})
