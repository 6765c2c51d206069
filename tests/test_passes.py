"""Passes, row order, queued groups and the logged loss (issue 47, item 5 and the first half of 6): a loop that trains
each round in two passes is read as TRL's num_iterations, its old log-probs taken again before each pass as
LOGP_OLD = "current"; a loop that sorts a round before cutting micro-batches names that order with
harness.loop.trained and the built-in loop replays it; groups still queued when the run ends count for no skip rule;
the tensor diff reads your rows in the order trained() gives; a loss logged for the last micro-batch only is said.
Each on examples/my_grpo.py's flags, run as a user would (12 steps, --matrix none), and on the pure functions with
answers worked by hand."""

from __future__ import annotations

import json

import pytest

from conftest import DEFAULT_SPEC
from harness.diagnose import identify
from harness.diagnose.identify.weighting import last_micro_batch
from harness.diagnose.matrix import run_matrix
from harness.diagnose.tensordiff import in_rollout_order
from harness.experiment.spec import load_spec
from test_explain import EXAMPLE, QUIET


def test_whole_rounds_trained_twice_are_num_iterations():
    whole = lambda r: [(r, i) for i in range(8)]  # noqa: E731
    f = identify.selection({1: whole(0), 2: whole(0), 3: whole(1), 4: whole(1)}, [8, 8, 8], 4, 1, path="t.jsonl")
    assert f.settings == {"NUM_ITERATIONS": 2, "MICRO_BATCH_ORDER": "rollout"}, f
    assert f.settles == ("NUM_ITERATIONS",) and "num_iterations = 2" in f.rule and "a part at a time" not in f.rule
    assert "more than once" not in f.rule
    # the spec's own NUM_ITERATIONS: nothing to name
    same = identify.selection({1: whole(0), 2: whole(0), 3: whole(1)}, [8, 8], 4, 2, path="t.jsonl")
    assert same.same_as_spec and not same.settings, same
    # halves of a round are not passes
    parts = identify.selection({1: whole(0)[:4], 2: whole(0)[4:]}, [8], 4, 1)
    assert "NUM_ITERATIONS" not in parts.settings and "each round over 2 steps" in parts.rule


def test_whole_rounds_in_an_order_of_their_own_are_replayed_as_a_guess():
    longest_first = [5, 1, 7, 0, 2, 3, 4, 6]
    f = identify.selection({1: [(0, i) for i in longest_first], 2: [(1, i) for i in range(8)]}, [8, 8], 4, 1,
                           path="t.jsonl")
    assert f.settings == {"SELECTION": "t.jsonl"} and not f.settles and not f.same_as_spec, f
    assert "order of its own" in f.rule


def test_groups_still_queued_at_the_end_are_no_evidence_against_a_skip_rule():
    g = 4
    # round 0: groups 0, 2 flat; round 1: group 1 flat; round 1's groups 2 and 3 (not flat) still queued at the end
    rewards = [[1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1], [1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 0, 1, 0, 0, 0]]
    trained = [(0, 1), (0, 3), (1, 0)]  # (round, group) in queue order
    rows = [(r, gr * g + j) for r, gr in trained for j in range(g)]
    f = identify.selection({1: rows[:8], 2: rows[8:]}, [16, 16], g, 1, rewards, path="t.jsonl")
    assert "every group whose rewards are all equal" in f.rule, f.rule
    # after (1, 0), the last group trained: (1, 1) (flat: the rule skips it too) and (1, 2), (1, 3) (queued: no
    # evidence against the rule)
    assert f.evidence["pending_groups"] == 2 and f.evidence["skipped_groups"] == 3, f.evidence
    assert "still queued" in f.rule


def test_the_tensor_diff_reads_rows_in_the_order_trained_gives():
    picks = [(0, 2), (0, 0), (0, 3), (0, 1)]  # the order the loop's micro-batches took them
    mine = {1: {"rewards": [2.0, 0.0, 3.0, 1.0], "mask": [[1, 1], [1], [1, 1, 1], [1, 0]], "loss": 0.5}}
    back, problem = in_rollout_order(mine, {1: picks}, [4], 1)
    assert problem is None
    assert back[1]["rewards"] == [0.0, 1.0, 2.0, 3.0] and back[1]["mask"] == [[1], [1, 0], [1, 1], [1, 1, 1]]
    assert back[1]["loss"] == 0.5
    _, problem = in_rollout_order(mine, {1: picks[:3]}, [4], 1)  # part of a round: not the diff's unit
    assert problem and "its own choosing" in problem


def test_a_loss_that_is_the_last_micro_batchs_is_recognised():
    """Four completions, two micro-batches of two. Per-token losses and masks by hand:
    row sums (masked) 1, 3 | 2, 6; counts 1, 3 | 2, 2. Last micro-batch: per-completion means 1 and 3, mean 2;
    over its tokens 8 / 4 = 2 (alike here, so the spec's type is preferred); over the step's 8 tokens 1; over
    4 completions x 8 max tokens 0.25; the step's (grpo, / 2 per micro-batch): (1 + 2) / 2 = 1.5."""
    ptl = [[1.0, 9.0], [1.0, 1.0, 1.0], [1.0, 1.0], [3.0, 3.0, 9.0]]
    mask = [[1, 0], [1, 1, 1], [1, 1], [1, 1, 0]]
    lengths = [2, 3, 2, 3]
    assert last_micro_batch(ptl, mask, lengths, 1.0, 2, 8, prefer="sequence") == ("sequence", 2)  # 2 / 2
    assert last_micro_batch(ptl, mask, lengths, 2.0, 2, 8, prefer="sequence") == ("sequence", 1)
    assert last_micro_batch(ptl, mask, lengths, 1.0, 2, 8, prefer="token_global") == ("token_global", 1)
    assert last_micro_batch(ptl, mask, lengths, 0.25, 2, 8) == ("constant", 1)
    assert last_micro_batch(ptl, mask, lengths, 1.5, 2, 8, prefer="sequence") is None  # the step's own loss
    assert last_micro_batch(ptl, mask, lengths, 1.0, 1, 8) is None  # one micro-batch: nothing to tell
    flat_last = [ptl[0], ptl[1], [0.0, 0.0], [0.0, 0.0, 0.0]]  # every advantage 0 there: a loss of 0 is its
    assert last_micro_batch(flat_last, mask, lengths, 0.0, 2, 8) == ("sequence", 1)
    assert last_micro_batch(flat_last, mask, lengths, 0.5, 2, 8) is None
    # a reading of what is logged needs a number that tells: not where the first micro-batch adds nothing
    assert last_micro_batch(ptl, mask, lengths, 1.0, 2, 8, prefer="sequence", telling=True) == ("sequence", 2)
    assert last_micro_batch(flat_last, mask, lengths, 0.0, 2, 8, telling=True) is None
    first_flat = [[0.0, 0.0], [0.0, 0.0, 0.0], ptl[2], ptl[3]]
    assert last_micro_batch(first_flat, mask, lengths, 1.0, 2, 8, prefer="sequence", telling=True) is None


def _explained(tmp_path, flags: str, *sets: str) -> dict:
    spec = load_spec(DEFAULT_SPEC, [f"loop.command={json.dumps(f'{EXAMPLE} {flags}')}", "STEPS=12", *sets])
    doc = run_matrix(spec, tmp_path, "none", **QUIET)
    cell = doc["cells"][0]
    assert cell["verdict"] == "diverged", (cell.get("error"), cell["first_divergence"])
    return cell["attribution_detail"][0]


def _stage(found: dict, stage: str) -> dict:
    return next(f for f in found["identified"] if f["stage"] == stage)


@pytest.mark.parametrize("old, fix", [("generation", {}), ("pass", {"LOGP_OLD": "current"})])
def test_two_passes_per_round_are_num_iterations_and_old_log_probs_of_each_pass_are_current(tmp_path, old, fix):
    found = _explained(tmp_path, f"--passes 2 --old-logps {old}")
    assert found["status"] == "confirmed", found["evidence"]
    assert found["fix"]["trl"] == {"num_iterations": 2}, found["fix"]
    assert "num_iterations = 2" in _stage(found, "selection")["rule"]
    assert "a part at a time" not in found["evidence"] and "SELECTION" not in found["fix"]["scratch"]
    scratch = found["fix"]["scratch"]
    assert {k: v for k, v in scratch.items() if k == "LOGP_OLD"} == fix, scratch
    if fix:
        assert "its old log-probs are its current ones" in _stage(found, "objective")["rule"]


def test_a_round_sorted_by_length_is_replayed_in_its_order_and_the_diff_reads_it_so(tmp_path):
    """A loop that sorts each round, longest first, before cutting micro-batches, with a loss over each micro-batch's
    own tokens (TRL's bnpo: the order moves the loss) and its own reward weights: the order is named (trained()) and
    replayed (SELECTION), the loss type read as bnpo, and the tensor diff, reading the rows in that order, finds the
    weights the rewards stage reads (not "its own reward code")."""
    found = _explained(tmp_path, "--sort-by-length --loss-agg micro-token --reward-weights 1,1")
    assert found["status"] == "confirmed", found["evidence"]
    assert "SELECTION" in found["fix"]["scratch"], found["fix"]
    assert "MICRO_BATCH_ORDER" not in found["fix"]["scratch"], found["fix"]  # its order is not the rollout's
    assert found["fix"]["trl"].get("loss_type") == "bnpo" and found["fix"]["trl"].get("reward_weights") == [1.0, 1.0]
    assert "order of its own" in _stage(found, "selection")["rule"]
    diff = found.get("tensor_diff") or {}
    assert not diff.get("skipped"), diff.get("skipped")
    said = json.dumps(diff)
    assert "own reward code" not in said and "own reward code" not in found["evidence"]


def test_groups_left_in_a_queue_when_the_run_ends_do_not_hide_the_skip_rule(tmp_path):
    found = _explained(tmp_path, "--queue", "loop.rounds=30")
    sel = _stage(found, "selection")
    assert "every group whose rewards are all equal" in sel["rule"], sel["rule"]
    assert sel["evidence"]["pending_groups"] > 0, sel["evidence"]
    assert found["status"] == "confirmed", found["evidence"]


def test_a_loss_logged_for_the_last_micro_batch_is_said(tmp_path):
    """A loss over the step's tokens (TRL's dapo), each micro-batch's share logged as it goes, the last one's kept: the
    loss type is read from that micro-batch, and what it logs is said (no divisor of its own). On the embedded
    default's rounds the first steps cannot tell (a micro-batch of flat groups, two alike): the first that tells is
    step 8, so every step's tensors are saved."""
    found = _explained(tmp_path, "--loss-agg token --log-loss last", "loop.tensor_steps=12")
    weighting = _stage(found, "weighting")
    assert "last micro-batch's loss alone" in weighting["rule"], weighting
    assert "LOSS_DIVISOR" not in found["fix"]["scratch"] and found["fix"]["trl"] == {"loss_type": "dapo"}, found["fix"]
    assert "last micro-batch's loss alone" in found["evidence"], found["evidence"]
    assert found["status"] == "confirmed", found["evidence"]


def test_the_advantages_of_a_round_in_an_order_of_its_own_are_read_in_its_groups():
    """Two groups of four, rewards by hand, advantages (r - mean) / (Bessel's std + 0.01), the rows saved longest
    first (the loop's order, trained()): the advantages stage reads them back in their groups and finds the epsilon."""
    import types

    import torch

    rewards = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.25]
    r = torch.tensor(rewards).view(2, 4)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 0.01)).reshape(-1).tolist()
    order = [5, 1, 7, 0, 2, 3, 6, 4]
    spec = load_spec(DEFAULT_SPEC)
    cell = types.SimpleNamespace(spec=spec, records=[{"completion_ids": [[1, 2]] * 8, "logprobs": None}],
                                 trained={1: [(0, i) for i in order]},
                                 tensors={1: {"rewards": [rewards[i] for i in order], "advantages": [adv[i] for i in order]}})
    read = next(f for f in identify.STAGES if f.__module__.endswith(".advantages"))  # (the forward stage came second)
    found = read(cell, {})
    assert len(found) == 1 and found[0].exact and found[0].settings.get("STD_EPS") == 0.01, found


def test_what_a_loop_logs_as_its_loss_is_read_at_every_step_against_the_reproducing_runs_losses():
    """The hand example above (two micro-batches of two; the step's grpo loss 1.5, the last micro-batch's 2, or 1 as
    it goes into backward) as the run that reproduces a loop saved it, one step: a logged 1 is the last
    micro-batch's, 1.5 the step's, 0.7 neither, 0.75 one completion's (row 3: 6 over 8 max tokens). A step whose
    losses are all 0 tells nothing: alone it is untold, with a step that tells, that step decides. A KL term of
    0.1 x k3 (log-probs 0, reference -1: e^-1 per token) in the per-token losses: a logged 1 (the last
    micro-batch's policy loss, the KL left out, as oat logs pg_loss) is read only with the KL term named."""
    from harness.diagnose.logged import loss_logged_as

    spec = load_spec(DEFAULT_SPEC, ["LOSS_NORM=\"sequence\"", "DTYPE=\"float32\""])
    ptl = [[1.0, 9.0], [1.0, 1.0, 1.0], [1.0, 1.0], [3.0, 3.0, 9.0]]
    mask = [[1, 0], [1, 1, 1], [1, 1], [1, 1, 0]]
    lengths = [2, 3, 2, 3]
    ref = {1: {"per_token_loss": ptl, "mask": mask, "loss": 1.5}}
    assert loss_logged_as({1: 1.0}, ref, {1: lengths}, 2, spec) == "last"
    assert loss_logged_as({1: 1.5}, ref, {1: lengths}, 2, spec) == "step"
    assert loss_logged_as({1: 0.7}, ref, {1: lengths}, 2, spec) == "other"
    # one completion's alone (a micro-batch of one in a shuffled order, as oat's): row 3's sum 6 over 8 max tokens
    assert loss_logged_as({1: 0.75}, ref, {1: lengths}, 2, spec) == "last"
    assert loss_logged_as({1: 0.76}, ref, {1: lengths}, 2, spec) == "other"
    assert loss_logged_as({1: 1.5}, ref, {1: lengths}, 1, spec) == "step"  # one micro-batch: the step's own
    zeros = {2: {"per_token_loss": [[0.0] * k for k in lengths], "mask": mask, "loss": 0.0}}
    assert loss_logged_as({2: 0.0}, zeros, {2: lengths}, 2, spec) == "untold"
    assert loss_logged_as({1: 1.0, 2: 0.0}, {**ref, **zeros}, {1: lengths, 2: lengths}, 2, spec) == "last"
    assert loss_logged_as({1: 1.5, 2: 0.0}, {**ref, **zeros}, {1: lengths, 2: lengths}, 2, spec) == "step"
    e = 0.36787944117144233  # k3 at logp 0, ref -1: exp(-1) + 1 - 1
    with_kl = {1: {"per_token_loss": [[v + 0.1 * e for v in row] for row in ptl], "mask": mask, "loss": 1.5 + 0.1 * e,
                   "logps": [[0.0] * k for k in lengths], "ref_logps": [[-1.0] * k for k in lengths]}}
    assert loss_logged_as({1: 1.0}, with_kl, {1: lengths}, 2, spec) == "other"
    assert loss_logged_as({1: 1.0}, with_kl, {1: lengths}, 2, spec, kl=("k3", 0.1, False)) == "last"
    assert loss_logged_as({1: 1.5 + 0.1 * e}, with_kl, {1: lengths}, 2, spec, kl=("k3", 0.1, False)) == "step"


def test_passes_a_loop_does_not_name_are_read_from_the_rows_its_tensors_hold():
    """Two rounds of four completions, lengths by hand: round 0 (3, 1, 2, 3), round 1 (3, 3, 3, 1). A loop that names
    no selection saves at step 2 a mask counting (3, 1, 2, 3) tokens: round 1's last completion has 1 token, so the
    rows cannot be round 1's (TRL's step 2 with one pass); they fit round 0: two passes over each round. A step 2
    whose rows fit round 1 is left as TRL reads it; so is one that fits neither."""
    import types

    from harness.diagnose.identify.selection import implied

    records = [{"completion_ids": [[5] * k for k in (3, 1, 2, 3)]}, {"completion_ids": [[5] * k for k in (3, 3, 3, 1)]}]
    scores = ({"f": [1.0, 0.0, 0.0, 1.0]}, {"f": [0.0, 1.0, 1.0, 0.0]})
    ones = lambda *ks: [[1] * k for k in ks]  # noqa: E731

    def cell(mask2, rewards2=(1.0, 0.0, 0.0, 1.0), passes=1):
        tensors = {1: {"mask": ones(3, 1, 2, 3), "rewards": [1.0, 0, 0, 1.0]}, 2: {"mask": mask2, "rewards": list(rewards2)},
                   3: {"probe": 1}}  # (a step with the parameter slice alone: no rows to read)
        return types.SimpleNamespace(spec=types.SimpleNamespace(NUM_ITERATIONS=passes), trained=None, records=records,
                                     scores=scores, tensors=tensors)
    whole0 = [(0, i) for i in range(4)]
    assert implied(cell(ones(3, 1, 2, 3))) == {1: whole0, 2: whole0}
    assert implied(cell(ones(3, 1, 2, 2))) == {1: whole0, 2: whole0}  # (a mask that leaves a token out)
    assert implied(cell(ones(3, 3, 3, 1), (0.0, 1.0, 1.0, 0.0))) is None  # round 1's: TRL's own
    assert implied(cell(ones(3, 1, 2, 3), passes=2)) is None  # the spec's two passes already read it so
    # round 0's completions 1 and 2 score alike (0) with rewards 1 and 0: not round 0's rewards
    assert implied(cell(ones(3, 1, 2, 3), (1.0, 1.0, 0.0, 1.0))) is None
    assert implied(cell(ones(4, 4, 4, 4))) is None  # more tokens than either round's completions: no fit
