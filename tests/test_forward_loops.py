"""Loops that treat the pad token specially in the forward pass (issue 47): the example loop with an attention mask
built as `ids != pad_id`, a pad token scored with cross_entropy(ignore_index=pad_id), and each completion ended at its
first pad token. On the embedded default the pad id (0, `<|endoftext|>`) is not the eos (2, `<|im_end|>`), and the
tiny model generates it inside completions (4 of step 1's 16 here). Each explanation names the forward rule, confirms
it, and invents no divisor (12 steps, `--matrix none`, as a user runs it)."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import DEFAULT_SPEC, ROOT
from harness.diagnose.matrix import run_matrix
from harness.experiment.spec import load_spec

EXAMPLE = f"{sys.executable} {ROOT / 'examples' / 'my_grpo.py'}"
QUIET = {"log": lambda *_: None}


@pytest.mark.parametrize("flags, rule, words", [
    ("--attention-hide-id 0", {"ATTENTION_HIDE_ID": 0}, "hides every token with id 0 from attention"),
    ("--ignore-id 0", {"LOGP_ZERO_ID": 0}, "with a log-prob of 0"),
    ("--end-at-id 0", {"END_AT_ID": 0}, "ends each completion at its first token with id 0"),
])
def test_a_pad_token_forward_rule_is_named_and_confirmed(tmp_path, flags, rule, words):
    spec = load_spec(DEFAULT_SPEC, [f"loop.command={json.dumps(f'{EXAMPLE} {flags}')}", "STEPS=12"])
    doc = run_matrix(spec, tmp_path, "none", **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "diverged", cell.get("error")
    found = cell["attribution_detail"][0]
    assert found["status"] == "confirmed", found.get("evidence")
    assert found["quirks"] == rule and found["fix"]["trl"] == {}, (found["quirks"], found["fix"])
    assert words in found["fix"]["sentence"], found["fix"]["sentence"]
    forward = next(f for f in found["identified"] if f["stage"] == "forward")
    assert forward["exact"] and forward["settings"] == rule and "pad token's id" in forward["rule"], forward
    said = json.dumps(found)
    assert "LOSS_DIVISOR" not in said and "divides the step's masked" not in said  # no divisor invented
    assert "around the prompt's eos" not in said  # nor the old guess at the forward pass
