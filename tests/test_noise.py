"""The calibrated tolerance: the ulp nudge, the envelope, the bound, the noise twin on a real pair, and the
reasons a toggle cannot show. Known answers are computed by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from harness.diagnose import noise
from harness.diagnose.compare import compare_frames, load_tolerances
from harness.diagnose.showable import equal_lengths, is_ratio_exactly_one, why_no_effect
from scratch_grpo.core import coin_flips, nudge_ulp, ulp_step


def test_ulp_step_known_answers():
    x = torch.tensor([1.0, 1.0, -2.0, 0.5, 0.0])
    up = torch.tensor([True, False, True, False, True])
    # fp32: 1 + 2^-23, 1 - 2^-24, -2 + 2^-23 (towards 0: the finer binade below), 0.5 - 2^-25, the smallest subnormal
    assert ulp_step(x, up, torch.float32).tolist() == [1 + 2**-23, 1 - 2**-24, -2 + 2**-23, 0.5 - 2**-25, 2**-149]
    # bf16 (7 stored mantissa bits): 1 + 2^-7, 1 - 2^-8, -2 + 2^-7, 0.5 - 2^-9; kept in fp32
    got = ulp_step(x, up, torch.bfloat16)
    assert got.dtype == torch.float32
    assert got[:4].tolist() == [1 + 2**-7, 1 - 2**-8, -2 + 2**-7, 0.5 - 2**-9]


def test_coin_flips_are_the_bits_of_the_drawn_words_in_order():
    g = torch.Generator().manual_seed(5)
    words = torch.randint(0, 2**31, (3,), generator=g, dtype=torch.int32).tolist()
    want = [bool((w >> b) & 1) for w in words for b in range(31)][:70]  # by hand: word by word, low bit first
    flips = coin_flips(70, torch.Generator().manual_seed(5), "cpu")
    assert flips.dtype == torch.bool and flips.tolist() == want
    many = coin_flips(100_003, torch.Generator().manual_seed(1), "cpu")
    assert many.numel() == 100_003 and 0.49 < many.float().mean().item() < 0.51


def test_nudge_ulp_moves_every_weight_by_one_step_both_ways_seeded():
    lin = torch.nn.Linear(64, 64)
    before = {n: p.detach().clone() for n, p in lin.named_parameters()}
    nudge_ulp(lin, "float32", seed=3)
    for n, p in lin.named_parameters():
        step = (p.detach() - before[n]).abs()
        spacing = torch.from_numpy(np.spacing(np.abs(before[n].numpy())))
        # one fp32 step (the step below a power of two is half the spacing above it)
        assert bool(((step == spacing) | (step == spacing / 2)).all())
        moved_up = (p.detach() > before[n]).float().mean().item()
        assert 0.3 < moved_up < 0.7
    again = torch.nn.Linear(64, 64)
    again.load_state_dict({n: t for n, t in before.items()})
    nudge_ulp(again, "float32", seed=3)
    assert torch.equal(again.weight, lin.weight)


def test_envelope_is_the_running_max_absolute_and_relative():
    plain = pd.DataFrame({"m": [1.0, 2.0, 4.0, 4.0], "z": [0.0, 0.0, 0.0, 0.0]}, index=[1, 2, 3, 4])
    twin = pd.DataFrame({"m": [1.0, 2.5, 4.1, 4.0], "z": [0.0, 1e-3, 0.0, 0.0]}, index=[1, 2, 3, 4])
    env = noise.envelope(plain, twin, [1e-6, 3e-6, 2e-6, 5e-6])
    assert env.absolute["m"].tolist() == pytest.approx([0.0, 0.5, 0.5, 0.5])
    assert env.relative["m"].tolist() == pytest.approx([0.0, 0.25, 0.25, 0.25])
    assert env.absolute["param_rel_l2"].tolist() == pytest.approx([1e-6, 3e-6, 3e-6, 5e-6])
    # at a value of 10 (a spike) the relative part rules: 0.25 x 10; at 1 the absolute part: 0.5
    assert env.at("m", [4], [10.0]).tolist() == pytest.approx([2.5])
    assert env.at("m", [4], [1.0]).tolist() == pytest.approx([0.5])
    assert env.at("z", [1, 2, 3], [0.0, 0.0, 0.0]).tolist() == pytest.approx([0.0, 1e-3, 1e-3])
    assert env.at("nope", [1]) is None


def test_save_and_load_round_trip(tmp_path):
    plain = pd.DataFrame({"m": [1.0, 2.0]}, index=[1, 2])
    env = noise.envelope(plain, plain + 0.5, None)
    noise.save(env, tmp_path, 10.0, "twin")
    back = noise.load(tmp_path)
    assert back.absolute["m"].tolist() == [0.5, 0.5]
    assert back.relative["m"].tolist() == pytest.approx([0.5, 0.5])  # 0.5/1, then 0.5/2 under the running max
    assert noise.load(tmp_path / "nowhere") is None


def _frames(diff: float):
    idx = pd.Index([1, 2, 3], name="step")
    a = pd.DataFrame({"grad_norm": [1.0, 1.0, 1.0]}, index=idx)
    b = pd.DataFrame({"grad_norm": [1.0, 1.0, 1.0 + diff]}, index=idx)
    return a, b


def test_calibrated_bound_is_k_times_the_envelope_above_the_static_floor():
    tol = load_tolerances()
    k = tol["calibrated"]["k"]
    plain = pd.DataFrame({"grad_norm": [1.0, 1.0, 1.0]}, index=[1, 2, 3])
    env = noise.envelope(plain, plain + 1e-4, None)  # the twin moved grad_norm by 1e-4
    # static fp32: rtol 1.3e-6 -> a 5e-4 difference diverges; calibrated: within k x 1e-4 (plus the floor)
    a, b = _frames(5e-4)
    assert compare_frames(a, b, tolerances=tol)["first_divergence"] == {"step": 3, "metric": "grad_norm"}
    calibrated = compare_frames(a, b, tolerances=tol, envelope=env)
    assert calibrated["first_divergence"] is None
    assert calibrated["metrics"]["grad_norm"]["ratio_to_noise"] == pytest.approx(5.0, rel=1e-3)
    # beyond k x the envelope: diverged
    a, b = _frames(1e-4 * k * 1.5)
    assert compare_frames(a, b, tolerances=tol, envelope=env)["first_divergence"] == {"step": 3, "metric": "grad_norm"}
    # an envelope of 0 leaves the static floor
    zero = noise.envelope(plain, plain, None)
    a, b = _frames(5e-5)  # beyond fp32's atol 1e-5 + rtol 1.3e-6
    assert compare_frames(a, b, tolerances=tol, envelope=zero)["first_divergence"] is not None


def test_calibrated_weights_bound_uses_the_floor_and_the_twin():
    tol = load_tolerances()
    floor, k = tol["calibrated"]["param_rel_l2_floor"], tol["calibrated"]["k"]
    a, b = _frames(0.0)
    env = noise.envelope(a, a, [floor / 10, floor / 10, floor])  # k x floor at step 3: above the floor
    ok = compare_frames(a, b, tolerances=tol, envelope=env, param_rel_l2=[floor / 2, floor / 2, 0.9 * k * floor])
    assert ok["first_divergence"] is None
    assert compare_frames(a, b, tolerances=tol, envelope=env, param_rel_l2=[1.1 * floor, 0, 0])["first_divergence"] \
        == {"step": 1, "metric": "param_rel_l2"}  # k x floor / 10 = floor at step 1: the floor rules
    bad = compare_frames(a, b, tolerances=tol, envelope=env, param_rel_l2=[floor / 2, floor / 2, 1.1 * k * floor])
    assert bad["first_divergence"] == {"step": 3, "metric": "param_rel_l2"}


def test_equal_lengths_and_is_ratio_one():
    assert equal_lengths([[8, 8], [8, 8, 8]]) == 8
    assert equal_lengths([[8, 7]]) is None
    assert equal_lengths([]) is None
    ones = pd.DataFrame({"sampling/importance_sampling_ratio/min": [1.0, 1.0],
                         "sampling/importance_sampling_ratio/max": [1.0, 1.0]})
    assert is_ratio_exactly_one(ones)
    ones.iloc[1, 1] = 1.0000001
    assert not is_ratio_exactly_one(ones)
    assert not is_ratio_exactly_one(pd.DataFrame({"loss": [0.0]}))


def test_why_no_effect_reasons():
    from harness.diagnose.cell import CellData

    record = {"round": 0, "prompt_ids": [[5, 6], [5, 6]], "completion_ids": [[1] * 16, [2] * 16], "logprobs": None}
    cell = CellData(spec=None, records=(record,) * 3)
    assert "every completion is 16 tokens long" in why_no_effect("loss_type", {"metrics": {}}, cell)
    cell = CellData(spec=None, records=({**record, "completion_ids": [[1] * 16, [2] * 9]},))
    assert why_no_effect("loss_type", {"metrics": {}}, cell) is None  # static, lengths vary: cannot tell
    calibrated = {"tolerance_mode": "calibrated", "k_noise": 10.0, "metrics": {"param_rel_l2": {"noise_last": 2e-6}}}
    why = why_no_effect("loss_type", calibrated, cell)
    assert "2e-05" in why and "noise" in why


@pytest.mark.slow
def test_noise_twin_on_a_real_pair_and_a_difference_it_still_flags(tmp_path):
    """The embedded default, lockstep: the matched pair stays within k x the twin's noise, and TRL with Adam's
    beta2 0.991 against the scratch loop's 0.99 (invisible at step 1, where Adam's update is sign-like) is flagged."""
    from harness.diagnose.pairs import run_pair
    from harness.diagnose.preflight import apply_alignment
    from harness.experiment.spec import load_spec

    spec = load_spec("harness/specs/default.toml", ["STEPS=6"])
    matched = run_pair(spec, tmp_path / "matched")
    assert matched["tolerance_mode"] == "calibrated" and matched["first_divergence"] is None
    assert (tmp_path / "matched" / "twin" / "metrics.jsonl").exists()
    assert json.loads((tmp_path / "matched" / "twin" / "manifest.json").read_text())["noise_twin"] is True
    ratios = [m["ratio_to_noise"] for m in matched["metrics"].values() if m.get("ratio_to_noise") is not None]
    assert ratios and max(ratios) < matched["k_noise"]
    beta2 = apply_alignment(spec, {"set": {"ADAM_BETA2": 0.99}, "set_trl": {"adam_beta2": 0.991}})
    parted = run_pair(beta2, tmp_path / "beta2")
    assert parted["first_divergence"] is not None and parted["first_divergence"]["step"] >= 2
    assert not math.isnan(parted["metrics"]["param_rel_l2"]["max_abs"])


def test_update_stats_count_updates_that_rounded_to_nothing():
    from harness.runlog.params import step_update_stats

    before = np.array([1.0, 2.0, 4.0, 0.0], dtype=np.float32)
    after = np.array([1.0, 2.5, 4.0, 1e-3], dtype=np.float32)
    s = step_update_stats(before, after)
    assert s["unchanged"] == pytest.approx(0.5)  # 1.0 and 4.0 did not move
    assert s["median_rel"] == pytest.approx(0.0)  # |d|/|w| over the non-zero weights: 0, 0.25, 0 -> median 0
    # a bf16 weight of 1.0 under an update of 1e-3 (below half its bf16 step, 2^-8): unchanged
    w = torch.ones(4, dtype=torch.bfloat16)
    w2 = w + torch.full((4,), 1e-3, dtype=torch.bfloat16)
    assert step_update_stats(w.float().numpy(), w2.float().numpy())["unchanged"] == 1.0


def test_lost_updates_warning_only_for_bf16_weights():
    from types import SimpleNamespace

    from harness.diagnose.showable import lost_updates_warning

    summary = {"scratch": {"unchanged": 0.8, "median_rel": 1e-4}, "trl": {"unchanged": 0.7, "median_rel": 1e-4}}
    assert "80%" in lost_updates_warning(SimpleNamespace(MASTER_WEIGHTS="bfloat16"), summary)
    assert lost_updates_warning(SimpleNamespace(MASTER_WEIGHTS="float32"), summary) is None
    low = {"scratch": {"unchanged": 0.2, "median_rel": 1e-2}}
    assert lost_updates_warning(SimpleNamespace(MASTER_WEIGHTS="bfloat16"), low) is None
