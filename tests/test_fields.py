"""The vocabulary (harness/diagnose/fields.py): each field's TRL setting is the one the translation moves, and its
values are the ones the built-in loop has."""

from __future__ import annotations

from conftest import DEFAULT_SPEC
from harness.diagnose.as_trl import SCRATCH_OF_TRL
from harness.diagnose.fields import FIELDS, LOOK_ALIKE, QUIRKS, words
from harness.diagnose.preflight import apply_alignment
from harness.diagnose.search import trl_moves
from harness.experiment.spec import load_spec


def test_a_fields_trl_setting_is_what_the_translation_moves_and_a_quirk_moves_none():
    base = load_spec(DEFAULT_SPEC)
    sampled = apply_alignment(base, {"set": {"sampler.kind": "emulated", "IS_CORRECTION": True}})  # IS_* act here
    for key, field in FIELDS.items():
        spec = sampled if key.startswith("IS_") else base
        value = next((v for v in field.values if v != getattr(spec, key)), None)
        if value is None:
            continue
        moved = set(trl_moves(spec, {key: value}))
        assert moved == ({field.trl} if field.trl else set()), (key, value, moved)
    for trl, (key, _as_spec) in SCRATCH_OF_TRL.items():  # the built-in loop's fields for a [trl] override
        assert key not in FIELDS or FIELDS[key].trl == trl, (trl, key)


def test_the_values_are_the_built_in_loops_and_every_quirk_is_worded():
    from scratch_grpo.core import IS_MODES, LOSS_NORMS

    assert FIELDS["IS_MODE"].values == IS_MODES and FIELDS["LOSS_NORM"].values == LOSS_NORMS
    assert all(FIELDS[k].trl is None and f.preflight_words for k, f in QUIRKS.items())
    assert set(LOOK_ALIKE) <= set(FIELDS)
    assert words("COMPLETION_MASK", "no_eos") == "your loop leaves each completion's eos token out of the loss (TRL counts it)"
    assert words("REWARD_CLIP", 1.0) == "your loop has REWARD_CLIP = 1.0"  # no words: the field and its value


def test_bf16_weights_move_no_grpoconfig_field_beyond_the_bf16_compute_they_need():
    """MASTER_WEIGHTS = "bfloat16" cannot be set without DTYPE = "bfloat16" (the spec check): alone it is judged with
    DTYPE set on both sides, so it moves nothing (TRL loads the model as the harness says: the built-in loop's switch),
    while DTYPE moves TRL's bf16."""
    base = load_spec(DEFAULT_SPEC)
    assert trl_moves(base, {"MASTER_WEIGHTS": "bfloat16"}) == {}
    assert trl_moves(base, {"DTYPE": "bfloat16", "MASTER_WEIGHTS": "bfloat16"}) == {"bf16": True}
    assert words("MASTER_WEIGHTS", "bfloat16").startswith("your loop holds and steps its weights in bfloat16")
