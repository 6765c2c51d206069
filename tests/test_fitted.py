"""No fit may crash the explanation (issue 47, item 3): random fitted values (hypothesis) pass the one gate
(diagnose.fitted.admissible) and what it keeps builds a spec, translates for TRL and names its TRL fields; what it
refuses is said as what this run could not tell. Random rates through the schedule fit (diagnose.schedules) never
raise, and a fit it returns is one the gate keeps."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEFAULT_SPEC

settings.register_profile("fitted", max_examples=40, derandomize=True, database=None, deadline=None,
                          suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def base():
    from harness.diagnose.as_trl import scratch_as_trl
    from harness.experiment.spec import load_spec

    return scratch_as_trl(load_spec(DEFAULT_SPEC))


_NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64), st.integers(-10**6, 10**6),
                     st.sampled_from([0, 0.0, -0.349, 1e-300, 1e300, 12, 50, -1]))
_VALUES = st.one_of(_NUMBERS, st.booleans(), st.none(), st.text(max_size=8),
                    st.sampled_from(["constant", "linear", "cosine", "polynomial", "sequence", "group", "bessel"]),
                    st.lists(_NUMBERS, max_size=4),
                    st.dictionaries(st.sampled_from(["min_lr_rate", "lr_end", "power", "num_cycles", "timescale",
                                                     "num_decay_steps", "x"]), _NUMBERS, max_size=3))
_KEYS = st.sampled_from(["LR", "LR_SCHEDULE", "WARMUP_STEPS", "LR_SCHEDULER_KWARGS", "LR_STEPS", "STD_EPS", "BETA",
                         "CLIP_LOW", "CLIP_HIGH", "IS_CLIP_MIN", "IS_CLIP_MAX", "LOSS_NORM", "ADV_SCALE", "STD",
                         "WEIGHT_DECAY", "ADAM_BETA1", "ADAM_BETA2", "ADAM_EPS", "MAX_GRAD_NORM", "NUM_ITERATIONS",
                         "rewards.weights", "TEMPERATURE", "DELTA", "NO_SUCH_FIELD", "model.hidden"])


@settings(settings.get_profile("fitted"))
@given(changes=st.dictionaries(_KEYS, _VALUES, max_size=5))
def test_random_fits_never_crash_the_gate(base, changes):
    from harness.diagnose.as_trl import trl_fields
    from harness.diagnose.fitted import admissible, refused_words
    from harness.diagnose.preflight import apply_alignment
    from trl_runner.translate import translate

    kept, refused = admissible(base, changes)
    assert set(kept) | set(refused) == set(changes) and not set(kept) & set(refused)
    translate(apply_alignment(base, {"set": kept}))  # what is kept runs, on both sides
    trl_fields(base, kept)
    said = refused_words(refused)
    assert all(s.startswith(f"this run could not tell {k}:") for s, k in zip(said, refused))


def test_a_warmup_past_the_run_is_kept_and_a_refused_fit_is_said(base):
    """The fits that crashed the harness (exit 3: WARMUP_STEPS >= STEPS) now run; a value the spec check still
    refuses (a negative std epsilon, the -0.349 an explanation once read) is said with the check's reason."""
    from harness.diagnose.fitted import admissible, refused_words

    kept, refused = admissible(base, {"WARMUP_STEPS": 50, "STD_EPS": -0.349, "LR": 1e-6})
    assert kept == {"WARMUP_STEPS": 50, "LR": 1e-6} and list(refused) == ["STD_EPS"]
    assert "must be >= 0" in refused_words(refused)[0]
    kept, refused = admissible(base, {"IS_CLIP_MIN": 5.0})  # a cross-check of two fields names the fitted one
    assert kept == {} and "IS_CLIP_MAX" in refused["IS_CLIP_MIN"]


@settings(settings.get_profile("fitted"))
@given(rates=st.lists(st.one_of(st.none(), st.floats(min_value=-1e-3, max_value=1e-2), st.just(math.nan),
                                st.sampled_from([0.0, 1e-6, 2e-8, math.inf])), min_size=1, max_size=12),
       steps=st.integers(1, 14), tol=st.sampled_from([1e-5, 1e-3, 0.05]))
def test_random_rates_through_the_schedule_fit_never_raise(base, rates, steps, tol):
    from harness.diagnose.fitted import admissible
    from harness.diagnose.schedules import fit_schedule

    fit = fit_schedule(dict(enumerate(rates)), steps, tol, {"LR": 1e-6, "LR_SCHEDULE": "constant"})
    if fit is not None:
        kept, refused = admissible(base, fit.settings())
        assert not refused or set(refused) <= {"LR", "LR_SCHEDULER_KWARGS"}, refused  # (a peak above 10, say)
