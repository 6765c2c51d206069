"""TRL's own tensors along a step's dataflow (read from inside GRPOTrainer by trl_runner.runner.TensorCapture),
saved as the built-in loop saves its own, and the tensor diff between the two.

On the embedded default (lockstep, matched settings, fp32 CPU) TRL's tensors and the built-in loop's agree link by
link; with one known difference, on either side, the diff names the first link that differs and how."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.conftest import DEFAULT_SPEC

STEPS, TENSOR_STEPS = 3, 2


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, private_cache):
    """The built-in loop on the embedded default, recording its rollouts and saving its first steps' tensors."""
    from harness.experiment.models import checkpoint_dir, eos_token_ids, generation_config, load_tokenizer
    from harness.experiment.spec import load_spec
    from harness.rollouts.lockstep import RecordingSource
    from scratch_grpo.train import train

    root = tmp_path_factory.mktemp("trl_tensors")
    spec = load_spec(DEFAULT_SPEC, [f"STEPS={STEPS}"])
    ckpt = checkpoint_dir(spec)
    tok = load_tokenizer(ckpt)
    source = RecordingSource(spec, eos_token_ids(generation_config(ckpt), tok), tok.pad_token_id, "cpu",
                             root / "rollouts.jsonl")
    train(spec, root / "scratch", rollout_source=source, progress=False, tensor_steps=TENSOR_STEPS)
    source.release()
    return spec, source.records, root


def _trl(spec, records, folder, tensor_steps=TENSOR_STEPS):
    from harness.rollouts.lockstep import ReplaySource
    from trl_runner.runner import train

    return train(spec, folder, rollout_source=ReplaySource(records), progress=False, lockstep=True,
                 tensor_steps=tensor_steps)


def test_trl_tensors_match_the_built_in_loop_and_capturing_changes_nothing(recorded, monkeypatch):
    """Matched settings: every link of TRL's chain equals the built-in loop's, in the rollout's order, at each captured
    step; TRL's loss never sees the row index; and TRL with capture on logs and trains exactly as with it off."""
    from trl import GRPOTrainer

    from harness.diagnose.tensordiff import diff_runs
    from harness.runlog.log import read_run
    from harness.runlog.params import SKETCH_FILE
    from harness.runlog.tensors import CHAIN, TENSORS_FILE, read_tensors

    spec, records, root = recorded
    seen_keys = []
    original = GRPOTrainer._compute_loss

    @functools.wraps(original)
    def spy(self, model, inputs):
        seen_keys.append(sorted(inputs))
        return original(self, model, inputs)

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", spy)
    on = _trl(spec, records, root / "trl-on")
    monkeypatch.undo()
    off = _trl(spec, records, root / "trl-off", tensor_steps=0)

    assert seen_keys and not any(k.startswith("harness_") for keys in seen_keys for k in keys)
    mine = read_tensors(on / TENSORS_FILE)
    assert sorted(mine) == list(range(1, TENSOR_STEPS + 1))
    assert set(mine[1]) == set(CHAIN) - {"old_logps", "ref_logps"}  # one pass per round, beta = 0: TRL has neither
    assert not (off / TENSORS_FILE).exists()

    found = diff_runs(spec, on, root / "scratch", records)
    assert found is not None and found["first"] is None, found
    assert [c["status"] for c in found["chain"] if c["tensor"] not in ("old_logps", "ref_logps")] == ["same"] * 7
    assert found["steps"] == [1, 2]

    a, b = read_run(on), read_run(off)
    assert len(a) == STEPS
    for col in ("loss", "grad_norm", "learning_rate", "reward", "entropy"):
        assert a[col].tolist() == b[col].tolist(), col
    assert np.array_equal(np.fromfile(on / SKETCH_FILE, dtype=np.float32),
                          np.fromfile(off / SKETCH_FILE, dtype=np.float32))
    # the captured loss and grad_norm are the ones TRL logs
    assert [mine[s]["loss"] for s in (1, 2)] == a["loss"].tolist()[:2]
    assert [mine[s]["grad_norm"] for s in (1, 2)] == a["grad_norm"].tolist()[:2]


@pytest.mark.parametrize("trl_set, scratch_set, tensor, guess", [
    ('trl.scale_rewards="none"', None, "advantages", {"ADV_SCALE": "none"}),
    ('trl.loss_type="dapo"', None, "loss", {"LOSS_NORM": "token_global"}),
    (None, "STD_EPS=1e-8", "advantages", {"STD_EPS": 1e-4}),
])
def test_one_known_difference_is_named_at_its_first_link(recorded, tmp_path, trl_set, scratch_set, tensor, guess):
    """One difference, on TRL's side or the built-in loop's: the first differing link of TRL's chain against the
    built-in loop's is where that difference acts, at step 1, recomputed exactly (the guess is the setting that
    turns the built-in loop's tensors into TRL's)."""
    from harness.diagnose.tensordiff import diff_runs
    from harness.experiment.spec import load_spec
    from harness.rollouts.lockstep import ReplaySource
    from scratch_grpo.train import train

    spec, records, root = recorded
    trl_spec = load_spec(DEFAULT_SPEC, [f"STEPS={STEPS}"] + ([trl_set] if trl_set else []))
    trl_dir = _trl(trl_spec, records, tmp_path / "trl")
    ref_spec, ref_dir = spec, root / "scratch"
    if scratch_set:
        ref_spec = load_spec(DEFAULT_SPEC, [f"STEPS={STEPS}", scratch_set])
        ref_dir = train(ref_spec, tmp_path / "scratch", rollout_source=ReplaySource(records), progress=False,
                        tensor_steps=TENSOR_STEPS)
    found = diff_runs(ref_spec, trl_dir, ref_dir, records)
    first = found["first"]
    assert (first["step"], first["tensor"]) == (1, tensor), first
    assert first.get("exact") and first["candidates"][0] == guess, first
    assert found["guesses"][0] == guess
    before = [c["status"] for c in found["chain"][:[c["tensor"] for c in found["chain"]].index(tensor)]]
    assert "differs" not in before


def test_cli_runs_trl_with_tensors_and_diffs_them(recorded, tmp_path, capsys):
    """`run trl --rollouts R --tensor-steps N` saves TRL's tensors; `tensordiff` against the built-in loop's: exit 0
    at matched settings, exit 1 naming the aggregated loss when TRL averages over tokens."""
    from harness.cli import main

    spec, records, root = recorded
    base = ["--spec", str(DEFAULT_SPEC), "--rollouts", str(root / "rollouts.jsonl")]
    assert main(["run", "trl", *base, "--steps", str(STEPS), "--tensor-steps", "2", "--quiet",
                 "--out", str(tmp_path / "trl")]) == 0
    assert main(["run", "trl", *base, "--steps", str(STEPS), "--tensor-steps", "2", "--quiet", "--set",
                 'trl.loss_type="dapo"', "--out", str(tmp_path / "dapo")]) == 0
    capsys.readouterr()
    assert main(["tensordiff", str(tmp_path / "trl"), str(root / "scratch"), *base, "--set", f"STEPS={STEPS}"]) == 0
    assert "every tensor both saved agrees at steps [1, 2]" in capsys.readouterr().out
    assert main(["tensordiff", str(tmp_path / "dapo"), str(root / "scratch"), *base, "--set", f"STEPS={STEPS}"]) == 1
    out = capsys.readouterr().out
    assert "the first tensor that differs is the aggregated loss at step 1" in out and "token_global" in out
