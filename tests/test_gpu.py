"""GPU: both loops in bf16 (fp32 master weights, autocast) with gradient checkpointing, lockstep, on CUDA.
Runs on the GPU test machine only (marker `gpu`)."""

import pytest

from conftest import small_spec
from harness.diagnose.pairs import run_pair

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("norm", ["sequence", "token_global"])
def test_lockstep_bf16_on_gpu(norm, tmp_path):
    spec = small_spec("STEPS=10", 'DEVICE="cuda"', 'DTYPE="bfloat16"', "GRADIENT_CHECKPOINTING=true",
                      f'LOSS_NORM="{norm}"')
    result = run_pair(spec, tmp_path, "lockstep")
    assert result["dtype"] == "bfloat16"
    assert result["first_divergence"] is None, result["first_divergence"]
    for m in ("loss", "grad_norm", "entropy"):
        assert m in result["metrics"]
    from harness.runlog.log import read_run

    df = read_run(tmp_path / "trl")
    assert df.attrs["manifest"]["device"].startswith("NVIDIA") and df["peak_mem_bytes"].max() > 0


def test_emulated_is_on_gpu(tmp_path):
    spec = small_spec("STEPS=4", 'DEVICE="cuda"', 'DTYPE="bfloat16"', 'sampler.kind="emulated"', "IS_CORRECTION=true")
    result = run_pair(spec, tmp_path, "lockstep")
    assert "sampling/importance_sampling_ratio/mean" in result["metrics"]


def test_emulated_sampler_decodes_on_the_compiled_decoder_on_gpu(monkeypatch):
    """On a GPU (GENERATION auto) the emulated sampler samples through the compiled static-cache decoder, its noise
    drawn there (no trip through the CPU): the same draws for the same (SEED, sync count), the weights moved by
    about the stated scale, and each sampled token's log-prob that of its own noised weights."""
    import torch

    from harness.experiment.models import checkpoint_dir, eos_token_ids, load_model, load_tokenizer
    from harness.rollouts.generate import score_completions
    from harness.rollouts.samplers import EmulatedSampler

    spec = small_spec('DEVICE="cuda"', 'DTYPE="bfloat16"', 'sampler.kind="emulated"', "sampler.noise_scale=0.05")
    ckpt = checkpoint_dir(spec)
    tok, model = load_tokenizer(ckpt), load_model(ckpt, "float32", "cuda")
    eos = eos_token_ids(model.generation_config, tok)
    a, b = (EmulatedSampler(spec, model, eos, tok.pad_token_id, "cuda") for _ in range(2))
    assert a.decoder is not None and a.decoder.compile_step and a.describe().endswith("compiled decode step")
    real_randn, devices = torch.randn, set()

    def randn(*args, **kwargs):
        devices.add(str(kwargs.get("device")))
        return real_randn(*args, **kwargs)

    monkeypatch.setattr(torch, "randn", randn)
    a.sync_weights(model)
    b.sync_weights(model)
    monkeypatch.setattr(torch, "randn", real_randn)
    assert devices == {"cuda:0"}, devices
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    moved = max(((x.float() - w).norm() / w.norm()).item() for x, w in zip(a.model.parameters(), model.parameters()))
    assert 0.01 < moved < 0.2, moved
    prompts = [tok("What is 3 + 4 ?")["input_ids"]] * 8
    completions, logps = a.generate(prompts)
    assert [len(c) for c in completions] == [len(lp) for lp in logps] and all(x <= 0 for lp in logps for x in lp)
    # a plain copy holding the sampler's (noised, bf16) weights scores the same tokens under autocast
    ref = load_model(ckpt, "float32", "cuda")
    with torch.no_grad():
        for p, q in zip(ref.parameters(), a.model.parameters(), strict=True):
            p.copy_(q.float())
    own = score_completions(ref, prompts, completions, pad_id=tok.pad_token_id, temperature=spec.TEMPERATURE,
                            device="cuda", dtype="bfloat16")
    gaps = [abs(x - y) for rx, ry in zip(logps, own) for x, y in zip(rx, ry)]
    assert max(gaps) < 0.1 and sum(gaps) / len(gaps) < 0.01, (max(gaps), sum(gaps) / len(gaps))


def test_deterministic_switch_gives_identical_reruns_on_gpu(tmp_path):
    from harness.runlog.log import TIMING_FIELDS, read_metrics
    from scratch_grpo.train import train

    spec = small_spec("STEPS=4", 'DEVICE="cuda"', 'DTYPE="bfloat16"', "DETERMINISTIC=true")
    train(spec, tmp_path / "a", progress=False)
    train(spec, tmp_path / "b", progress=False)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert strip(read_metrics(tmp_path / "a" / "metrics.jsonl")[0]) == strip(read_metrics(tmp_path / "b" / "metrics.jsonl")[0])


def test_group_statistics_on_the_training_device_on_gpu(tmp_path, monkeypatch):
    """The scratch loop takes rewards, group means and stds where TRL does, on the training device: a group whose
    rewards are all equal has its mean rounded by that device's reduction, and the 1e-4 in the denominator turns a
    one-ulp residual into advantages of ~1e-3 on one side and exactly 0 on the other (an H100 is=sequence_mask
    cell's aligned re-run parted at step 9 on loss and frac_reward_zero_std while the scratch loop did this on
    the CPU). The same formula's bits: tests/test_core.py."""
    from scratch_grpo import core
    from scratch_grpo.train import train

    seen = []
    real = core.group_advantages
    monkeypatch.setattr(core, "group_advantages", lambda rewards, *a, **k: seen.append(rewards.device) or real(
        rewards, *a, **k))
    train(small_spec("STEPS=2", 'DEVICE="cuda"', 'DTYPE="bfloat16"'), tmp_path / "s", progress=False)
    assert seen and all(d.type == "cuda" for d in seen), seen
