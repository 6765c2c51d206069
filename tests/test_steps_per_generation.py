"""Several optimizer steps per generation (TRL's steps_per_generation > gradient_accumulation_steps): each side
logs what each optimizer step consumed, and the scratch loop can do the same thing (STEPS_PER_GENERATION)."""

from __future__ import annotations

import json

import pytest

from conftest import small_spec
from harness.diagnose.matrix import run_matrix
from harness.diagnose.preflight import preflight

QUIET = {"log": lambda *_: None}


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trl_logs_each_steps_slice_not_the_whole_generation(tmp_path):
    """GRAD_ACCUM = 1 and [trl] steps_per_generation = 2: a 32-sequence generation feeds two optimizer steps of 16."""
    from trl_runner.runner import train

    train(small_spec("GRAD_ACCUM=1", "trl.steps_per_generation=2"), tmp_path, progress=False)
    log = rows(tmp_path / "metrics.jsonl")
    assert [r["sequences_in_step"] for r in log] == [16, 16, 16, 16]
    assert len({r["prompt_ids_hash"] for r in log}) == 4  # every step consumed its own slice
    assert all(1 <= r["prompts_in_step"] <= 8 for r in log)
    assert [("reward" in r) for r in log] == [True, False, True, False]  # generation figures on generating steps


def test_the_preflight_names_the_difference_and_the_scratch_field_that_matches():
    _tr, diffs, _facts = preflight(small_spec("GRAD_ACCUM=1", "trl.steps_per_generation=2"))
    steps = next(d for d in diffs if d.quantity == "optimizer steps per generation")
    assert (steps.scratch, steps.trl, steps.check) == (1, 2, "batch")
    assert preflight(small_spec("GRAD_ACCUM=1", "STEPS_PER_GENERATION=2"))[1] == []  # translated: aligned


@pytest.mark.parametrize("extra", [
    ("GRAD_ACCUM=1", 'LOSS_NORM="sequence"'),
    ("GRAD_ACCUM=1", 'LOSS_NORM="token_global"'),  # dapo's normaliser: the generation's tokens x GA / spg
    ("GRAD_ACCUM=2", 'LOSS_NORM="token_local"'),  # bnpo: per micro-batch, so the shuffle must match too
    ("GRAD_ACCUM=1", "NUM_ITERATIONS=2"),  # two passes over a generation of two steps: the ratio leaves 1
])
def test_scratch_loop_with_several_steps_per_generation_reaches_parity(tmp_path, extra):
    doc = run_matrix(small_spec("STEPS=6", "STEPS_PER_GENERATION=2", *extra), tmp_path, "none", **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "parity", cell.get("first_divergence") or cell.get("error")
    scratch = rows(tmp_path / "as-given" / "scratch" / "metrics.jsonl")
    trl = rows(tmp_path / "as-given" / "trl" / "metrics.jsonl")
    assert [r["prompt_ids_hash"] for r in scratch] == [r["prompt_ids_hash"] for r in trl]
    hashes = [r["prompt_ids_hash"] for r in scratch]
    if "NUM_ITERATIONS=2" in extra:  # slices a, b of a round, then a second pass over a, b
        assert hashes[:2] == hashes[2:4] and hashes[0] != hashes[1]
        assert max(r["clip_ratio/region_mean"] for r in scratch) > 0  # later steps train on an older policy
    else:
        assert len(set(hashes)) == len(hashes)


def test_steps_not_a_multiple_of_the_steps_per_generation(tmp_path):
    """STEPS = 5 with two steps per generation: the last round feeds one step; TRL's data set must hold it."""
    doc = run_matrix(small_spec("STEPS=5", "GRAD_ACCUM=1", "STEPS_PER_GENERATION=2"), tmp_path, "none", **QUIET)
    assert doc["cells"][0]["verdict"] == "parity", doc["cells"][0].get("first_divergence")


def test_several_processes_with_several_steps_per_generation_are_refused():
    from harness.experiment.spec import SpecError

    with pytest.raises(SpecError, match="STEPS_PER_GENERATION: with PROCESSES > 1"):
        small_spec("STEPS_PER_GENERATION=2", "PROCESSES=2")
