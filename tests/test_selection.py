"""A loop that does not train each step on one whole round: part of a round per step, several rounds per step, groups
skipped. It says which completions each step trained on (harness.loop.trained), runs to its end (the harness records
as many rounds as it reads: [loop] rounds), and the built-in loop replays the same selection (SELECTION): each case
explained, the rule read from the selection, and confirmed over 12 steps."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DEFAULT_SPEC
from harness.diagnose import identify
from harness.diagnose.matrix import run_matrix
from harness.experiment.spec import load_spec
from harness.rollouts.lockstep import RecordingSource, ReplaySource
from harness.runlog.log import read_metrics
from harness.runlog.tensors import write_trained
from scratch_grpo.train import train
from test_explain import EXAMPLE, QUIET


def test_the_selection_rule_is_read_from_which_groups_are_skipped():
    g, sizes = 4, [16, 16]
    rewards = [[1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1], [0.5] * 4 + [1, 0, 0, 0] + [1, 1, 1, 0] + [0] * 4]
    flat = {(0, 0), (0, 2), (1, 0), (1, 3)}
    chosen = {1: [(0, i) for i in range(16) if (0, i // 4) not in flat], 2: [(1, i) for i in range(16)
                                                                              if (1, i // 4) not in flat]}
    f = identify.selection(chosen, sizes, g, 1, rewards, path="t.jsonl")
    assert "every group whose rewards are all equal" in f.rule and f.settings == {"SELECTION": "t.jsonl"}, f
    # the same skipped groups and one more that is not flat: no rule fits
    chosen[2] = [(1, i) for i in range(4, 8)]
    assert "no rule" in identify.selection(chosen, sizes, g, 1, rewards).rule
    # whole rounds in their order: TRL's
    same = identify.selection({1: [(0, i) for i in range(16)], 2: [(1, i) for i in range(16)]}, sizes, g, 1, rewards)
    assert same.same_as_spec and not same.settings
    parts = identify.selection({1: [(0, i) for i in range(8)], 2: [(0, i) for i in range(8, 16)]}, sizes, g, 1)
    assert "each round over 2 steps" in parts.rule, parts


def test_a_selection_of_whole_rounds_in_order_trains_as_the_rounds_do(tmp_path):
    """The selection path against the round path: whole rounds, micro-batches cut in the rollout's order on both
    (MICRO_BATCH_ORDER = rollout), the same numbers at every step, exactly (fp32, one process)."""
    from harness.experiment.models import checkpoint_dir, eos_token_ids, generation_config, load_tokenizer

    spec = load_spec(DEFAULT_SPEC, ["STEPS=4", 'MICRO_BATCH_ORDER="rollout"'])
    tok = load_tokenizer(checkpoint_dir(spec))
    source = RecordingSource(spec, eos_token_ids(generation_config(checkpoint_dir(spec)), tok), tok.pad_token_id, "cpu")
    train(spec, tmp_path / "recording", rollout_source=source, progress=False)
    records = source.records
    sel = tmp_path / "trained.jsonl"
    for s in range(1, 5):
        write_trained(sel, s, [(s - 1, i) for i in range(len(records[s - 1]["completion_ids"]))])
    rounds = train(spec, tmp_path / "rounds", rollout_source=ReplaySource(records), progress=False)
    picked = train(load_spec(DEFAULT_SPEC, ["STEPS=4", 'MICRO_BATCH_ORDER="rollout"', f"SELECTION={json.dumps(str(sel))}"]),
                   tmp_path / "picked", rollout_source=ReplaySource(records), progress=False)
    a, b = read_metrics(rounds / "metrics.jsonl")[0], read_metrics(picked / "metrics.jsonl")[0]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "reward", "entropy", "prompt_ids_hash", "sequences_in_step"):
            assert x[key] == y[key], (key, x[key], y[key])


@pytest.mark.parametrize("flags, sets, rule", [
    ("--skip-flat-groups --std-eps 0.01", [], "every group whose rewards are all equal"),
    ("--round-parts 2", [], "each round over 2 steps"),
    ("--rounds-per-step 2 --adam-beta2 0.999", ["loop.rounds=24"], "from 2 rounds at once"),
])
def test_a_loop_that_picks_its_completions_runs_to_its_end_and_is_explained(tmp_path, flags, sets, rule):
    cmd = f"{EXAMPLE} {flags}"
    spec = load_spec(DEFAULT_SPEC, [f"loop.command={json.dumps(cmd)}", "STEPS=12", *sets])
    doc = run_matrix(spec, tmp_path, "none", **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "diverged", cell.get("error")
    found = cell["attribution_detail"][0]
    sel = next(f for f in found["identified"] if f["stage"] == "selection")
    assert rule in sel["rule"], sel
    assert found["status"] == "confirmed", found["evidence"]
    assert "SELECTION" in found["fix"]["scratch"], found["fix"]
    if "--std-eps" in flags:
        assert found["fix"]["scratch"]["STD_EPS"] == 0.01
    if "--adam-beta2" in flags:
        assert found["fix"]["trl"] == {"adam_beta2": 0.999}, found["fix"]


def test_a_schedule_of_the_loops_own_is_replayed_step_by_step(tmp_path):
    """LR_STEPS: the built-in loop trains each step at the rate the list gives (a warmup from 0, then its own decay),
    and past the list at its last rate; a bad entry is refused before any model loads, naming the field."""
    from harness.experiment.spec import SpecError

    rates = [0.0, 2e-3, 1.5e-3]
    spec = load_spec(DEFAULT_SPEC, ["STEPS=4", f"LR_STEPS={rates}"])
    run = train(spec, tmp_path / "run", progress=False)
    logged = [row["learning_rate"] for row in read_metrics(run / "metrics.jsonl")[0]]
    assert logged == pytest.approx([*rates, rates[-1]], rel=1e-12, abs=0.0), logged
    with pytest.raises(SpecError, match=r"LR_STEPS\[1\]"):
        load_spec(DEFAULT_SPEC, ['LR_STEPS=[1e-3, "fast"]'])


def _recorded(tmp_path, steps: int) -> list[dict]:
    """`steps` rounds of the embedded default's completions, recorded by a built-in run."""
    from harness.experiment.models import checkpoint_dir, eos_token_ids, generation_config, load_tokenizer

    spec = load_spec(DEFAULT_SPEC, [f"STEPS={steps}"])
    tok = load_tokenizer(checkpoint_dir(spec))
    source = RecordingSource(spec, eos_token_ids(generation_config(checkpoint_dir(spec)), tok), tok.pad_token_id, "cpu")
    train(spec, tmp_path / "recording", rollout_source=source, progress=False)
    return source.records


def test_old_log_probs_taken_at_every_step_keep_the_ratio_at_one(tmp_path):
    """LOGP_OLD = "current": a round trained over two steps keeps the ratio at 1 on its second step too (a
    REINFORCE-style loop: -logp A on the current policy); TRL's way ("auto") keeps the round's log-probs from before
    the first step's update, so the second step's ratio leaves 1."""
    from harness.runlog.tensors import read_tensors

    records = _recorded(tmp_path, 2)
    sel = tmp_path / "trained.jsonl"
    for s, part in ((1, range(0, 8)), (2, range(8, 16))):  # round 0 over two steps
        write_trained(sel, s, [(0, i) for i in part])
    ratios = {}
    for how in ("auto", "current"):
        spec = load_spec(DEFAULT_SPEC, ["STEPS=2", "GRAD_ACCUM=1", 'MICRO_BATCH_ORDER="rollout"',
                                        f"SELECTION={json.dumps(str(sel))}", f'LOGP_OLD="{how}"'])
        run = train(spec, tmp_path / how, rollout_source=ReplaySource(records), progress=False, tensor_steps=2)
        t = read_tensors(run / "tensors.jsonl")[2]
        adv = torch.tensor(t["advantages"])
        ptl, mask = torch.tensor(t["per_token_loss"]), torch.tensor(t["mask"])
        live = (mask > 0) & (adv.abs() > 1e-6).unsqueeze(1)
        ratios[how] = (-ptl / adv.unsqueeze(1))[live]  # the ratio each counted token used (unclipped here)
        if how == "current":  # the old log-probs saved are the ones the loss used
            assert t["old_logps"] == t["logps"]
    assert torch.allclose(ratios["current"], torch.ones_like(ratios["current"]), atol=1e-6), ratios["current"]
    assert (ratios["auto"] - 1).abs().max() > 1e-5, ratios["auto"]


def test_a_token_dropped_from_the_sequence_scores_as_if_it_was_never_there():
    """MASK_TOKEN_DROP: the built-in loop's forward with a completion token taken out of the sequence (out of
    attention, positions counting only the tokens kept, each kept token scored from the last kept position before
    it) gives the kept tokens the log-probs of the sequence without that token; without the switch they differ."""
    from harness.experiment.models import checkpoint_dir
    from scratch_grpo.train import completion_forward
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(load_spec(DEFAULT_SPEC)), dtype=torch.float32).eval()
    prompt = torch.tensor([[5, 9, 11, 4]])
    full = torch.tensor([[7, 3, 12, 3, 8, 6]])  # token 3 is dropped wherever it stands
    kept = torch.tensor([[7, 12, 8, 6]])
    ones = lambda t: torch.ones_like(t)  # noqa: E731
    with torch.no_grad():
        dropped = completion_forward(model, prompt, ones(prompt), full, ones(full), 1.0, dropped=3)[0]
        plain = completion_forward(model, prompt, ones(prompt), kept, ones(kept), 1.0)[0]
        kept_in = completion_forward(model, prompt, ones(prompt), full, ones(full), 1.0)[0]
    at = [0, 2, 4, 5]  # the kept tokens' places in the full completion
    torch.testing.assert_close(dropped[0, at], plain[0], rtol=1e-5, atol=1e-5)
    assert (kept_in[0, at] - plain[0]).abs().max() > 1e-3  # kept in the sequence, the tokens after it score otherwise
