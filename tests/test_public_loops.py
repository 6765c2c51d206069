"""Public GRPO loops nobody here wrote, adapted to the --loop contract as a new user would (examples/public/,
docs/your-loop.md), each explained in full over 12 steps on CPU: every difference on the list written by hand before
any run is named, in TRL's terms where TRL has a setting and as the built-in loop's switch where it has none, and the
whole is confirmed (the built-in loop with all of it reproduces the loop at every step)."""

from __future__ import annotations

import json
import sys

from conftest import DEFAULT_SPEC, ROOT
from harness.diagnose.matrix import run_matrix
from harness.experiment.spec import load_spec

QUIET = {"log": lambda *_: None}


def test_verls_grpo_math_as_a_one_process_loop(tmp_path):
    """verl's core_algos (GRPO advantages with eps 1e-6, token-mean per micro-batch with micro-batches sliced in
    order, a k3 KL of weight 0.001 without TRL's ratio factor) and its actor's AdamW (beta2 0.999, decay 0.01 on every
    parameter). Its logged loss is verl's pg_loss, the KL term apart: said as logged otherwise, never a cause."""
    cmd = f"{sys.executable} {ROOT / 'examples' / 'public' / 'verl_grpo.py'}"
    doc = run_matrix(load_spec(DEFAULT_SPEC, [f"loop.command={json.dumps(cmd)}", "STEPS=12"]), tmp_path, "none",
                     **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "diverged", cell.get("error")
    found = cell["attribution_detail"][0]
    assert found["status"] == "confirmed", found["evidence"]
    assert found["fix"]["trl"] == {"loss_type": "bnpo", "beta": 0.001, "use_bias_correction_kl": False,
                                   "adam_beta2": 0.999, "weight_decay": 0.01}, found["fix"]
    assert found["fix"]["scratch"] == {"STD_EPS": 1e-06, "MICRO_BATCH_ORDER": "rollout", "WEIGHT_DECAY_ALL": True}
    weighting = next(f for f in found["identified"] if f["stage"] == "weighting")
    assert "leaves the KL term out" in weighting["rule"], weighting
