"""The diagnosis says today what it said when the golden verdicts were recorded (issue 46: a change to its shape
must not change its answers). Each case runs again and its verdict.json, summary and your_loop_in_trl.toml, less
timings, folders and versions, must be identical to tests/golden/verdicts/<case>.json. To record them again after a
change that is meant to change an answer: `python tests/golden_verdicts.py record CASE` (and say why in the commit).
"""

from __future__ import annotations

import json

import pytest

from cpu_arithmetic import fingerprint
from golden_verdicts import CASES, differences, golden, recorded_on, run_case


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_verdict_is_the_golden_one(name):
    """Where this machine computes the arithmetic the golden was recorded on (tests/cpu_arithmetic.py: the tests pin
    AVX2 kernels, so any x86-64 machine with AVX2 should); elsewhere its floats cannot hold to the last bit, and the
    case is skipped, saying both arithmetics. A golden with no arithmetic recorded fails: record it again."""
    here, at = fingerprint(), recorded_on(name)
    assert at, f"{name}: the golden says no arithmetic; python tests/golden_verdicts.py record {name}"
    if at != here:
        pytest.skip(f"recorded on the arithmetic {at}, this machine computes {here}")
    want = golden(name)
    got = run_case(name)
    diff = differences(want, got)
    assert not diff, f"{name}: the verdict changed:\n  " + "\n  ".join(diff)


def test_a_changed_verdict_is_caught():
    """The comparison itself: a changed number, a missing key, a changed line of the summary each count."""
    want = {"verdict": {"cells": [{"share": 0.5, "notes": ["a"]}]}, "summary": "one\ntwo", "your_loop_in_trl": None}
    assert differences(want, json.loads(json.dumps(want))) == []
    assert differences(want, {**want, "verdict": {"cells": [{"share": 0.5000001, "notes": ["a"]}]}})
    assert differences(want, {**want, "verdict": {"cells": [{"share": 0.5}]}})
    assert differences(want, {**want, "summary": "one\nthree"}) == [
        "/summary line 2: golden 'two', now 'three'"]
    assert differences({"s": "a long line"}, {"s": "a lung line"}) == [
        "/s at character 3: golden ...'a long line', now ...'a lung line'"]
    assert differences(want, {**want, "your_loop_in_trl": "[trl]\n"})
