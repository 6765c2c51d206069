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


def test_deterministic_switch_gives_identical_reruns_on_gpu(tmp_path):
    from harness.runlog.log import TIMING_FIELDS, read_metrics
    from scratch_grpo.train import train

    spec = small_spec("STEPS=4", 'DEVICE="cuda"', 'DTYPE="bfloat16"', "DETERMINISTIC=true")
    train(spec, tmp_path / "a", progress=False)
    train(spec, tmp_path / "b", progress=False)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert strip(read_metrics(tmp_path / "a" / "metrics.jsonl")[0]) == strip(read_metrics(tmp_path / "b" / "metrics.jsonl")[0])
