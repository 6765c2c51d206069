"""The AdamW kernel (TRL's `optim`, the built-in loop's OPTIM): torch's fused kernel computes each update in float32
and rounds once; its for-loop (and for-each) kernel rounds each moment update and the step op by op. On bf16 weights
the two part on a few elements a step, and over 12 steps that is enough to move a bf16 grad_norm by one spacing
(Atropos' trainer: torch's `AdamW(model.parameters())` at beta2 0.999, which the fused kernel matched only at 0.98)."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from conftest import DEFAULT_SPEC, small_spec
from harness.diagnose import matrix as M
from harness.experiment.spec import SpecError, load_spec

opt_stage = importlib.import_module("harness.diagnose.identify.optimizer")


def _probe_rows(kernel: dict, steps: int = 5, n: int = 4096, lr: float = 1e-3, b2: float = 0.999,
                wd: float = 0.0) -> tuple:
    """A bf16 'loop' stepped by torch's AdamW with `kernel`: the Probe's rows (before, gradient, after) of one
    4096-element slice and each step's gradient norm. The gradients are bf16 numbers, as a bf16 model's are."""
    gen = torch.Generator().manual_seed(0)
    x = torch.nn.Parameter((torch.randn(n, generator=gen) * 0.05).bfloat16())
    opt = torch.optim.AdamW([x], lr=lr, betas=(0.9, b2), eps=1e-8, weight_decay=wd, **kernel)
    rows, norms = [], []
    for _ in range(steps):
        g = (torch.randn(n, generator=gen) * 1e-3).bfloat16()
        before = x.detach().float().tolist()
        x.grad = g.clone()
        opt.step()
        rows.append({"names": ["model.layers.0.mlp.weight"], "before": [before], "grad": [g.float().tolist()],
                     "after": [x.detach().float().tolist()]})
        norms.append(float(g.float().norm()))
    return rows, norms


FUSED, FOR_LOOP = {"fused": True}, {"foreach": False}


def test_each_kernel_replays_its_own_updates_exactly_and_misses_the_others():
    """Known answer by construction: the slice stepped by one kernel is reproduced by the replay of that kernel at
    every probed step (0 misses), and the other kernel misses some of its roundings."""
    for made_by, same, other in ((FUSED, "adamw_torch_fused", "adamw_torch"),
                                 (FOR_LOOP, "adamw_torch", "adamw_torch_fused")):
        rows, norms = _probe_rows(made_by)
        p = opt_stage._probed(rows, norms)
        intervals = opt_stage._bf16_intervals(p, 0.9, 0.999, 1e-8, math.inf)
        misses = opt_stage.bf16_kernel_misses(p, intervals, 0.9, 0.999, 1e-8, math.inf, rate=1e-3)
        assert misses[same] == [0] * 5, (made_by, misses)
        assert sum(misses[other]) > 0, (made_by, misses)


def test_the_for_each_kernel_replays_as_the_for_loop_one_without_a_known_rate():
    """torch's for-each kernel (its choice on a GPU) rounds as its for-loop kernel does: a slice it stepped replays
    exactly as adamw_torch, with the rate found in each step's interval alone (no rate given)."""
    p = opt_stage._probed(*_probe_rows({"foreach": True}))
    misses = opt_stage.bf16_kernel_misses(p, opt_stage._bf16_intervals(p, 0.9, 0.999, 1e-8, math.inf), 0.9, 0.999,
                                          1e-8, math.inf)
    assert misses["adamw_torch"] == [0] * 5 and sum(misses["adamw_torch_fused"]) > 0, misses


def test_a_fused_decay_that_tips_roundings_still_reads_the_fused_kernel():
    """The fused kernel decays in float32 before it rounds (at lr 1e-3 and decay 0.01 that tips some roundings): the
    replay tries the decays, so the slice still reads as the fused kernel, not as neither."""
    spec = load_spec(DEFAULT_SPEC, ["STEPS=12", "LR=0.001", "ADAM_BETA2=0.999", "MAX_GRAD_NORM=0.0"])
    found = opt_stage.optimizer(*_probe_rows(FUSED, wd=0.01), spec, steps_total=12)
    assert "the fused AdamW kernel" in found.rule and "OPTIM" in found.settles, (found.rule, found.unsettled)


def test_the_stage_reads_the_for_loop_kernel_and_sets_optim():
    """Weights held in bf16 and stepped by torch's for-loop kernel: the optimizer stage sets OPTIM = "adamw_torch"
    (TRL's optim) and settles it; stepped by the fused kernel (the spec's own), it sets nothing and says so."""
    spec = load_spec(DEFAULT_SPEC, ["STEPS=12", "LR=0.001", "ADAM_BETA2=0.999", "MAX_GRAD_NORM=0.0"])
    found = opt_stage.optimizer(*_probe_rows(FOR_LOOP), spec, steps_total=12)
    assert found.settings.get("OPTIM") == "adamw_torch", (found.rule, found.settings)
    assert "OPTIM" in found.settles and "for-loop AdamW kernel" in found.rule, found.rule
    fused = opt_stage.optimizer(*_probe_rows(FUSED), spec, steps_total=12)
    assert "OPTIM" not in fused.settings and "the fused AdamW kernel" in fused.rule, (fused.rule, fused.settings)


def test_a_slice_both_kernels_reproduce_is_said_as_untold():
    """At a rate whose updates round alike under both kernels (few elements move a spacing), the stage claims neither:
    the kernel is what the run could not tell, and OPTIM stays unsettled (the search may try it)."""
    spec = load_spec(DEFAULT_SPEC, ["STEPS=12", "LR=1e-05", "ADAM_BETA2=0.999", "MAX_GRAD_NORM=0.0"])
    found = opt_stage.optimizer(*_probe_rows(FOR_LOOP, n=64, lr=1e-5), spec, steps_total=12)
    assert "OPTIM" not in found.settings and "OPTIM" not in found.settles, (found.rule, found.settings)
    assert any(u.startswith("the AdamW kernel") for u in found.unsettled), found.unsettled


def test_optim_is_translated_and_moved_both_ways():
    """OPTIM is TRL's optim on the TRL side, and a `[trl] optim` override moves into the built-in loop's OPTIM."""
    from harness.diagnose.as_trl import scratch_as_trl
    from trl_runner.translate import translate

    assert translate(load_spec(DEFAULT_SPEC, ['OPTIM="adamw_torch"'])).kwargs["optim"] == "adamw_torch"
    assert translate(load_spec(DEFAULT_SPEC)).kwargs["optim"] == "adamw_torch_fused"
    moved = scratch_as_trl(load_spec(DEFAULT_SPEC, ['trl.optim="adamw_torch"']))
    assert moved.OPTIM == "adamw_torch" and "optim" not in moved.trl, (moved.OPTIM, moved.trl)
    with pytest.raises(SpecError) as err:
        load_spec(DEFAULT_SPEC, ['OPTIM="sgd"'])
    assert err.value.key == "OPTIM" and "must be one of" in str(err.value)


@pytest.mark.slow
def test_lockstep_parity_on_bf16_weights_with_the_for_loop_kernel_on_both_sides(tmp_path):
    """bf16 weights, OPTIM = "adamw_torch" on both sides (TRL: optim = "adamw_torch"): the pair is at parity, and
    each side's kernel acts: against the fused kernel on both sides (the default), each side's gradient norms move
    (its weights after each update), and the built-in loop's stay nearer TRL's with the same kernel than TRL's with
    the other."""
    from harness.runlog.log import read_run

    runs = {}
    for name, sets in (("loop", ['OPTIM="adamw_torch"']), ("fused", [])):
        spec = small_spec("STEPS=4", 'DTYPE="bfloat16"', 'MASTER_WEIGHTS="bfloat16"', *sets)
        doc = M.run_matrix(spec, tmp_path / name, "none", log=lambda *_: None)
        assert doc["cells"][0]["verdict"] == "parity", (name, doc["cells"][0].get("first_divergence"))
        runs[name] = {side: read_run(tmp_path / name / "as-given" / side)["grad_norm"].to_numpy()
                      for side in ("scratch", "trl")}
    loop, fused = runs["loop"], runs["fused"]
    for side in ("scratch", "trl"):
        assert not np.array_equal(loop[side], fused[side]), f"OPTIM does not change the {side} side's steps"
    assert np.abs(loop["scratch"] - loop["trl"]).sum() < np.abs(loop["scratch"] - fused["trl"]).sum(), (loop, fused)
